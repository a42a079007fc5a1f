"""Scheduler-thread cost the SGLang adapter adds per merged HiCache op, on the real SGLang objects.

The ops are SGLang 0.5.23's own: a ``HiCacheController`` over a float16 MHA device
pool and its host pool (``io_backend="direct"``, ``layer_first``, ``write_through``),
run on CPU by ``instrumentation/otel-hicache-sglang/tests/sglang_cpu.py`` (a pure-torch
copy kernel, ``torch.cpu`` events: the copy runs inside the submit call). One op is one
merged op, timed alone on the caller (scheduler) thread with ``perf_counter_ns`` (wall)
and ``thread_time_ns`` (the caller thread's CPU), directions alternating, one op every
``--interval-us``; between ops the caller sleeps, releasing the GIL as a scheduler
waiting on its device does (a busy wait would starve otel-hicache's worker):

* offload: ``controller.write(device_indices, node_id=...)`` (which calls
  ``start_writing()``) + pop the ack from ``ack_write_queue``;
* onboard: ``controller.load(host_indices, node_id=...)`` + ``start_loading()`` + pop
  the ack from ``ack_load_queue``.

Between ops (untimed) the loaded device slots and the host slots are freed
(``allocator.free``, ``mem_pool_host.free``), so both pools stay at steady state; the
same device slots are offloaded again and again.

Variants:

a. ``sglang``        uninstrumented SGLang;
b. ``disabled``      ``SGLangHiCacheInstrumentor().instrument()`` with ``OTEL_HICACHE_ENABLED=false``
                     (patches nothing: expect the same as a);
c. ``instrumented``  ``SGLangHiCacheInstrumentor().instrument(tracer_provider=..., meter_provider=...)``:
                     an SDK TracerProvider (default sampler, 100%) with a BatchSpanProcessor into a
                     counting exporter, and a MeterProvider with an InMemoryMetricReader (providers
                     passed: the sinks run embedded); spans and metrics are really made, on
                     otel-hicache's poller thread;
d. ``paused``        c with otel-hicache's poller paused while the ops are timed (a diagnostic: the
                     adapter's and ``submit()``'s own cost on the scheduler thread, without the
                     poller running beside it); it resumes before the flush, so d is checked too.

Variants take turns in rounds (rotating order) so machine drift spreads evenly over
them. A second, paired measurement (``--paired-ops``, per size) isolates the adapter's own
scheduler-thread cost more precisely: one instrumented controller, otel-hicache's worker
paused, and the four per-op methods (``start_writing``, ``start_loading``, the engine's
``submit_*``) switched between SGLang's originals and the adapter's wrappers op by op
(pairs of ops alternating, in a fixed shuffled pattern), so both halves share every
moment of the machine's noise; it reports the median wall and caller-CPU difference. The
wrapped half queues each op inside a cause site (``causes.QueuedCauses.site``), as
SGLang's cache methods queue theirs, so its figure is the adapter's whole cost per op; a
third variant leaves out transfer causes (the op queued outside a site, no deferred lookup from
``start_*``), a fourth also ``submit()`` (a no-op of its signature), a fifth is pass-through
wrappers (plain functions calling SGLang's originals): the adapter's cost in parts,
interception, its own logic, ``submit()`` and transfer causes. A last, warm measurement (``--cause-rounds``) resolves transfer causes' cost to a
tenth of a microsecond: the same wrappers on stand-in objects that do nearly nothing else.

Each turn instruments (b, c), builds a fresh controller (the adapter starts its
telemetry when a ``HiCacheController`` is created, as in a scheduler), warms up, times
its ops, then (c) ``force_flush()``es and checks that it exported one span per op and
that ``hicache.transfer.tokens`` / ``hicache.transfer.bytes`` sum to what SGLang's own
acks say was moved, and uninstruments. Each turn of c has its own providers; the CPU
its worker and span-processor threads spent is reported per timed op, from after the
warm-up and a flush (the worker's first cycle builds the providers' instruments, once per
process in a server: reported apart as its start-up). Each round also runs the core
benchmark's op (``overhead.py``'s c: direct ``submit()`` + ``ack()``) in this process,
paced as the real path is and flat out, and the report gives the real path's worker CPU
per op over the core's flat-out figure (the goal: within 1.5x). The objects SGLang
and torch left after import are frozen (``gc.freeze()``) so collections stay short.

Last, the serving process's CPU per merged op on this real path, the telemetry process
against embedded, side by side (``--cpu-rounds``, ``--cpu-ops``, ``--cpu-interval-us``: one
op every 1,000 us by default, the 1,000 ops/s of the design's goal). Each turn is configured
as a user's scheduler is, by ``OTEL_*`` only: ``configure()`` (spans at 100%, OTLP/HTTP to a
receiver in another process, ``gil_impact.py``'s, which counts the spans it got) and the
instrumentor without providers; ``embedded`` with ``OTEL_HICACHE_TELEMETRY_PROCESS=false``,
``telemetry process`` by default (the capture here, the sinks and export in
``python -m otel_hicache.sinks.process``), ``sglang`` uninstrumented as the floor, in rotating
order per round. After a warm-up and a flush, the window is the timed ops and the
``force_flush()`` after them (every span exported): the CPU of this whole process over it
(all threads, ``time.process_time``) minus the floor's of the same round, per op; the
poller's and the SDK's threads here; the telemetry process's CPU (``/proc``, by the channel's
pid), and the two together.

Usage::

    python benchmarks/sglang_overhead.py            # full run, ~5 min on 2 cores
    python benchmarks/sglang_overhead.py --quick    # CI size, about a minute (6 s of it importing SGLang)
    python benchmarks/sglang_overhead.py --json results.json

Absolute times depend on the machine (and here include SGLang's own CPU copy);
nothing asserts them. Only the ratios and differences of one run mean anything. The
exit status is 0 unless a run fails outright or the counts are not exact.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

# a sibling module: this script's folder is first on sys.path
from bench_common import SdkProviders, env, machine, percentile, table, thread_cpu, wait_until

ROOT = Path(__file__).resolve().parents[1]
SGLANG_TESTS = ROOT / "instrumentation" / "otel-hicache-sglang" / "tests"
if str(SGLANG_TESTS) not in sys.path:
    sys.path.insert(0, str(SGLANG_TESTS))

import sglang_cpu  # noqa: E402  (the CPU support for SGLang's HiCache code)

PAGE_SIZE = 4
LAYERS = 3
VARIANTS = ("sglang", "disabled", "instrumented", "paused")
LABELS = {"sglang": "a. sglang", "disabled": "b. disabled", "instrumented": "c. instrumented",
          "paused": "d. worker paused"}
INSTRUMENTED = ("instrumented", "paused")
TOKENS_METRIC = "hicache.transfer.tokens"
BYTES_METRIC = "hicache.transfer.bytes"


def is_patched() -> bool:
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.l2_transfer import L2TransferEngine

    return any(hasattr(f, "__wrapped__") for f in (
        HiCacheController.start_writing, HiCacheController.start_loading,
        L2TransferEngine.submit_device_to_host, L2TransferEngine.submit_host_to_device))


def off_thread_cpu() -> dict[str, float]:
    """CPU seconds of the other live threads: the otel-hicache completion worker and
    the rest (the BatchSpanProcessor's thread)."""
    cpu = {"worker": 0.0, "span_processor": 0.0}
    for name, seconds in thread_cpu().items():
        if name != "caller":
            cpu["worker" if name.startswith("otel-hicache") else "span_processor"] += seconds
    return cpu


# --------------------------------------------------------------------------------------
# One turn of one variant
# --------------------------------------------------------------------------------------


def drive(controller: Any, allocator: Any, device_indices: Any, n_ops: int, warmup: int, interval_ns: int,
          samples: dict[str, list[int]]) -> tuple[int, int]:
    """``warmup + n_ops`` merged ops, alternating offload/onboard (an even count), the
    last ``n_ops`` timed alone: wall ns into ``samples["offload"|"onboard"]``, the
    caller thread's CPU ns into ``samples["cpu"]``. Returns (tokens, bytes) moved,
    from SGLang's own acks."""
    clock = time.perf_counter_ns
    cpu_clock = time.thread_time_ns
    offload, onboard, cpu = samples["offload"], samples["onboard"], samples["cpu"]
    host_pool = controller.mem_pool_host
    tokens = nbytes = 0
    host = None
    deadline = clock() + interval_ns
    for i in range(warmup + n_ops):
        # sleep, no spin: the worker and the span processor run between ops, as in a scheduler
        deadline = wait_until(deadline) + interval_ns
        # a pool that ran out makes write()/load() return None and queue nothing: pop(0) raises
        if not i & 1:
            c0 = cpu_clock()
            t0 = clock()
            host = controller.write(device_indices, node_id=i)
            ack = controller.ack_write_queue.pop(0)
            t1 = clock()
            c1 = cpu_clock()
            if i >= warmup:
                offload.append(t1 - t0)
        else:
            c0 = cpu_clock()
            t0 = clock()
            loaded = controller.load(host, node_id=i)
            controller.start_loading()
            ack = controller.ack_load_queue.pop(0)
            t1 = clock()
            c1 = cpu_clock()
            allocator.free(loaded)
            host_pool.free(host)
            if i >= warmup:
                onboard.append(t1 - t0)
        if i >= warmup:
            cpu.append(c1 - c0)
        tokens += ack.num_tokens
        nbytes += ack.num_bytes
    return tokens, nbytes


def run_turn(variant: str, tokens_per_op: int, n_ops: int, warmup: int, interval_ns: int,
             samples: dict[str, list[int]]) -> dict[str, Any]:
    """Set up ``variant``, build a controller, drive it, check and tear down."""
    from otel_hicache_sglang import SGLangHiCacheInstrumentor

    providers = SdkProviders(shutdown_on_exit=False) if variant in INSTRUMENTED else None
    instrumentor = SGLangHiCacheInstrumentor() if variant != "sglang" else None
    settings = {"OTEL_HICACHE_ENABLED": "false" if variant == "disabled" else "true"}
    result: dict[str, Any] = {"ops": warmup + n_ops}
    try:
        with env(**settings):  # read by instrument() and by the telemetry the controller starts
            if instrumentor is not None:
                if providers is not None:
                    instrumentor.instrument(tracer_provider=providers.tracer_provider,
                                            meter_provider=providers.meter_provider)
                else:
                    instrumentor.instrument()
            controller, _kv, allocator = sglang_cpu.build_controller(
                PAGE_SIZE, LAYERS, kv_size=max(64, 4 * tokens_per_op))
        if is_patched() != (variant in INSTRUMENTED):
            raise RuntimeError(f"{variant}: SGLang patched={is_patched()}")
        telemetry = instrumentor.telemetry if instrumentor is not None else None
        if (telemetry is not None and telemetry.enabled) != (variant in INSTRUMENTED):
            raise RuntimeError(f"{variant}: telemetry {telemetry!r} (OTEL_SDK_DISABLED set?)")
        device_free0, host_free0 = allocator.available_size(), controller.mem_pool_host.available_size()
        device_indices = allocator.alloc(tokens_per_op)
        gc.collect()
        threads0 = off_thread_cpu()
        # the warm-up, then (instrumented) a flush: the worker's first cycle builds its providers'
        # instruments and zero series, once per process in a server (here once per turn): its
        # CPU is reported apart ("startup_cpu_s"), as overhead.py's flat-out figure leaves it out
        warm_tokens, warm_bytes = drive(controller, allocator, device_indices, 0, warmup, interval_ns, samples)
        if telemetry is not None:
            result["warm_flushed"] = telemetry.force_flush(timeout_s=60.0)
            threads_warm = off_thread_cpu()
            result["startup_cpu_s"] = {k: threads_warm[k] - threads0[k] for k in threads_warm}
            threads0 = threads_warm
        pipeline = telemetry._pipeline if variant == "paused" else None  # pylint: disable=protected-access
        if pipeline is not None:
            pipeline._cycle = lambda: None  # the worker wakes and does nothing; records stay queued
        try:
            moved_tokens, moved_bytes = drive(controller, allocator, device_indices, n_ops, 0, interval_ns, samples)
        finally:
            if pipeline is not None:
                del pipeline._cycle  # resume: the flush below processes everything
        allocator.free(device_indices)
        result["tokens"], result["bytes"] = warm_tokens + moved_tokens, warm_bytes + moved_bytes
        result["timed_ops"] = n_ops
        result["steady"] = (
            (allocator.available_size(), controller.mem_pool_host.available_size()) == (device_free0, host_free0)
            and not (controller.write_queue or controller.load_queue
                     or controller.ack_write_queue or controller.ack_load_queue))
        if providers is not None:
            result["flushed"] = telemetry.force_flush(timeout_s=60.0) and result["warm_flushed"]
            threads1 = off_thread_cpu()
            result["off_thread_cpu_s"] = {k: threads1[k] - threads0[k] for k in threads1}
            result["spans"] = providers.exporter.count
            result["metric_tokens"] = providers.metric_sum(TOKENS_METRIC)
            result["metric_bytes"] = providers.metric_sum(BYTES_METRIC)
    finally:
        if instrumentor is not None and instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.uninstrument()
        if providers is not None:
            providers.shutdown()
    if is_patched():
        raise RuntimeError("SGLang still patched after uninstrument()")
    return result


# --------------------------------------------------------------------------------------
# Rounds
# --------------------------------------------------------------------------------------


def rss_mb() -> float:
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        return float("nan")


# per pair of ops: A SGLang's originals, B the adapter's wrappers (default settings: host
# residence on) with each op queued inside a cause site, as SGLang's flows queue them, C the
# wrappers without transfer causes (no site, and start_* sees no site call logged, so it hands
# the worker no deferred lookup): B - C is what the causes cost per op
PAIRED_PATTERN = "ABCCBABCAACBCABBAC"
# run_paired's, with two more: P pass-through wrappers (a plain function that calls SGLang's
# original, as patching.Method installs them: the price of intercepting the calls), N the
# wrappers of C with submit() a no-op of the same signature. P - A, N - P, C - N and B - C add
# up to B - A: interception, the adapter's own logic, submit(), transfer causes. Each letter
# 6 times, in a fixed shuffled order (random.Random(5).shuffle).
ADAPTER_PATTERN = "PBNCAPPPCCNBANBNABCPABACCABNNP"


def _passthrough(original: Any) -> Any:
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return original(self, *args, **kwargs)

    return functools.wraps(original)(call)


def _submit_stub(direction: str, tokens_by_pool: Any = None, num_bytes: int = 0, page_size: int = 1,
                 start_event: Any = None, finish_event: Any = None, timing_enabled: bool = False,
                 io_backend: Any = None, attributes: Any = None, *, expect_ack: bool = True,
                 host_start_ns: Any = None, host_end_ns: Any = None, ack_watch: Any = None, cause: Any = None,
                 host_slots: Any = None, requests: Any = None) -> None:
    """``TransferTelemetry.submit``'s signature, doing nothing (variant N)."""
    return None


def run_paired(tokens_per_op: int, ops: int, warmup: int, interval_us: float) -> dict[str, Any]:
    """The adapter's own cost per merged op, originals and wrappers interleaved op by op."""
    from otel_hicache_sglang import SGLangHiCacheInstrumentor
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.l2_transfer import L2TransferEngine

    names = [(HiCacheController, "start_writing"), (HiCacheController, "start_loading"),
             (L2TransferEngine, "submit_device_to_host"), (L2TransferEngine, "submit_host_to_device")]
    originals = {n: vars(c)[n] for c, n in names}
    providers = SdkProviders(shutdown_on_exit=False)
    instrumentor = SGLangHiCacheInstrumentor()
    with env(OTEL_HICACHE_ENABLED="true"):
        instrumentor.instrument(tracer_provider=providers.tracer_provider, meter_provider=providers.meter_provider)
        controller, _kv, allocator = sglang_cpu.build_controller(PAGE_SIZE, LAYERS, kv_size=max(64, 4 * tokens_per_op))
    wrappers = {n: vars(c)[n] for c, n in names}
    observer = instrumentor._observer  # pylint: disable=protected-access
    queued_causes = observer.causes
    from otel_hicache_sglang.causes import Site

    # B queues each op inside a cause site (SGLang's sites are its cache's methods, which these
    # ops bypass): the site records the op's id, so start_* finds its cause as in SGLang's flows
    in_site = {cause: queued_causes.site(Site("bench", "queue", cause, lambda ctl: ctl)).make(
        lambda ctl, queue, *args, **kwargs: queue(*args, **kwargs)) for cause in ("write_through", "prefix_hit")}
    info = observer._controller_info(controller)  # pylint: disable=protected-access
    host_residence = info.host_pool is not None  # as by default (on, with NumPy): B is the default adapter
    telemetry = instrumentor.telemetry
    pipeline = telemetry._pipeline  # pylint: disable=protected-access
    pipeline._cycle = lambda: None  # paused: the records stay queued (dropped below, never reported)
    samples: dict[str, dict[str, list[int]]] = {k: {"wall": [], "cpu": []} for k in "ABCNP"}
    installed = {"A": originals, "P": {n: _passthrough(f) for n, f in originals.items()}}
    clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
    interval_ns = int(interval_us * 1000)
    device_indices = allocator.alloc(tokens_per_op)
    sglang_host = controller.mem_pool_host
    host = None
    try:
        deadline = clock() + interval_ns
        for i in range(warmup + 2 * ops):
            which = ADAPTER_PATTERN[(i >> 1) % len(ADAPTER_PATTERN)]
            for cls, name in names:
                setattr(cls, name, installed.get(which, wrappers)[name])
            if which == "N":
                telemetry.submit = _submit_stub  # the instance's: what the wrappers call
            else:
                vars(telemetry).pop("submit", None)
            if which in "CN":  # start_* sees no site call logged, and none handed over before
                queued_causes.log, queued_causes.handed = [], False
            deadline = wait_until(deadline) + interval_ns
            if not i & 1:
                c0, t0 = cpu_clock(), clock()
                if which != "B":
                    host = controller.write(device_indices, node_id=i)
                else:
                    host = in_site["write_through"](controller, controller.write, device_indices, node_id=i)
                controller.ack_write_queue.pop(0)
                t1, c1 = clock(), cpu_clock()
            else:
                c0, t0 = cpu_clock(), clock()
                if which != "B":
                    loaded = controller.load(host, node_id=i)
                else:
                    loaded = in_site["prefix_hit"](controller, controller.load, host, node_id=i)
                controller.start_loading()
                controller.ack_load_queue.pop(0)
                t1, c1 = clock(), cpu_clock()
                allocator.free(loaded)
                sglang_host.free(host)
            if i >= warmup:
                samples[which]["wall"].append(t1 - t0)
                samples[which]["cpu"].append(c1 - c0)
            if len(pipeline.queue) > 4096:
                pipeline.queue.clear()
    finally:
        for cls, name in names:
            setattr(cls, name, wrappers[name])
        vars(telemetry).pop("submit", None)
        queued_causes.log = []
        pipeline.queue.clear()
        del pipeline._cycle
        allocator.free(device_indices)
        instrumentor.uninstrument()
        providers.shutdown()
    med = {k: {m: statistics.median(v[m]) / 1e3 for m in v} for k, v in samples.items()}
    parts = {part: {m: med[hi][m] - med[lo][m] for m in ("wall", "cpu")}
             for part, (hi, lo) in PAIRED_PARTS.items()}
    return {"tokens_per_op": tokens_per_op, "n": len(samples["B"]["wall"]),
            "sglang_median_us": med["A"]["wall"], "added_wall_us": med["B"]["wall"] - med["A"]["wall"],
            "added_cpu_us": med["B"]["cpu"] - med["A"]["cpu"],
            "cause_wall_us": parts["causes"]["wall"], "cause_cpu_us": parts["causes"]["cpu"], "parts_us": parts,
            "host_residence": host_residence}


# the adapter's cost per merged op in parts: (variant, the variant it is measured against)
PAIRED_PARTS = {"interception": ("P", "A"), "adapter logic": ("N", "P"), "submit()": ("C", "N"), "causes": ("B", "C")}


def run_cause_site(ops: int, warmup: int, interval_us: float) -> dict[str, Any]:
    """A cause site's own cost per call (``causes.py``) on the real UnifiedRadixCache:
    ``_execute_and_commit_kv_backup`` of an empty ``BackupKV`` (SGLang returns at once, so
    the call is nearly all wrapper), the wrapped method and SGLang's original alternating
    in pairs, paced like the ops."""
    from otel_hicache_sglang import SGLangHiCacheInstrumentor
    from sglang.srt.mem_cache.unified_radix_cache import BackupKV, UnifiedRadixCache

    providers = SdkProviders(shutdown_on_exit=False)
    instrumentor = SGLangHiCacheInstrumentor()
    with env(OTEL_HICACHE_ENABLED="true"):
        instrumentor.instrument(tracer_provider=providers.tracer_provider, meter_provider=providers.meter_provider)
        stack = sglang_cpu.build_stack("write_through")
    wrapped = UnifiedRadixCache._execute_and_commit_kv_backup  # pylint: disable=protected-access
    calls = {"A": wrapped.__wrapped__, "B": wrapped}
    samples: dict[str, list[int]] = {"A": [], "B": []}
    clock, interval_ns = time.perf_counter_ns, int(interval_us * 1000)
    action = BackupKV(node_ids=[])
    try:
        deadline = clock() + interval_ns
        for i in range(warmup + 2 * ops):
            which = PAIRED_PATTERN[(i >> 1) % len(PAIRED_PATTERN)].replace("C", "A")
            call = calls[which]
            deadline = wait_until(deadline) + interval_ns
            t0 = clock()
            call(stack.cache, action)
            t1 = clock()
            if i >= warmup:
                samples[which].append(t1 - t0)
    finally:
        instrumentor.uninstrument()
        providers.shutdown()
    med = {k: statistics.median(v) / 1e3 for k, v in samples.items()}
    return {"n": len(samples["B"]), "sglang_median_us": med["A"], "added_wall_us": med["B"] - med["A"]}


class _Op:
    """SGLang's ``CacheOperation``, as far as transfer causes read it: numbered in creation order."""

    counter = 0
    __slots__ = ("id",)

    def __init__(self) -> None:
        self.id = _Op.counter
        _Op.counter += 1


class _Event:
    """A device event that has completed (the worker is paused: never read)."""

    @staticmethod
    def query() -> bool:
        return True

    @staticmethod
    def elapsed_time(other: Any) -> float:
        return 0.0


class _Completion:
    __slots__ = ("start_event", "finish_event", "timing_enabled")

    def __init__(self) -> None:
        self.start_event, self.finish_event, self.timing_enabled = _Event(), _Event(), True


class _Ack:
    __slots__ = ("start_event", "finish_event", "timing_enabled", "num_tokens_by_pool", "num_tokens", "num_bytes")

    def __init__(self, completion: _Completion, tokens: int) -> None:
        self.start_event, self.finish_event = completion.start_event, completion.finish_event
        self.timing_enabled, self.num_tokens_by_pool = True, {"kv": tokens}
        self.num_tokens, self.num_bytes = tokens, tokens * 1024


class _Engine:
    io_backend = "direct"

    def submit_device_to_host(self, transfers: Any) -> _Completion:
        return _Completion()


class _Controller:
    """``HiCacheController``'s shape as the adapter sees it: queues, an engine, acks."""

    def __init__(self) -> None:
        self.write_queue: list[_Op] = []
        self.load_queue: list[_Op] = []
        self.ack_write_queue: list[_Ack] = []
        self.l2_transfer_engine = _Engine()
        self.page_size = PAGE_SIZE

    def write(self) -> None:
        self.write_queue.append(_Op())

    def start_writing(self) -> None:
        if not self.write_queue:
            return
        completion = self.l2_transfer_engine.submit_device_to_host(self.write_queue)
        self.write_queue.clear()
        self.ack_write_queue.append(_Ack(completion, 2 * PAGE_SIZE))


class _Cache:
    def __init__(self, controller: _Controller) -> None:
        self.cache_controller = controller

    def backup(self) -> None:
        self.cache_controller.write()


def run_cause_warm(rounds: int, ops: int) -> dict[str, Any]:
    """Transfer causes' scheduler-thread cost per merged op, warm, to a tenth of a microsecond:
    the adapter's real wrappers (``start_writing``, the engine's ``submit_device_to_host``, a
    cause site) on stand-in objects that do nearly nothing else (``_Controller``), in a tight
    loop, otel-hicache's worker paused. One op: a cache method queues one op, then
    ``start_writing()`` merges it (one copy, one ack) and the ack is popped. A: SGLang-shaped
    originals; B: the wrappers, the op queued inside a cause site; C: the wrappers, the op
    queued outside one (no site call logged: no deferred lookup). Variants take turns, and each
    one's fastest round counts (the least disturbed by the machine); B - C is what transfer
    causes add on the scheduler thread. The worker's share, each B op's deferred lookup, is
    timed apart after its round."""
    from otel_hicache import TransferTelemetry
    from otel_hicache.capture.records import SUBMISSION_FIELDS
    from otel_hicache_sglang.causes import QueuedCauses, Site
    from otel_hicache_sglang.transfers import TransferObserver

    providers = SdkProviders(shutdown_on_exit=False)
    with env(OTEL_HICACHE_ENABLED="true", OTEL_HICACHE_POLL_INTERVAL_MS="60000"):  # no wake-up beside the loop
        telemetry = TransferTelemetry(providers.tracer_provider, providers.meter_provider)
    observer = TransferObserver(lambda attributes: telemetry)
    observer.causes = queued_causes = QueuedCauses(observer._local, operations=_Op)  # pylint: disable=protected-access
    originals = {"start_writing": _Controller.start_writing, "submit": _Engine.submit_device_to_host}
    wrapped_start = observer.start_wrapper("offload", "write_queue", "ack_write_queue").make(_Controller.start_writing)
    wrapped_submit = observer.submit_wrapper("offload").make(_Engine.submit_device_to_host)
    in_site = queued_causes.site(Site("bench", "_Cache.backup", "write_through", lambda cache: cache.cache_controller)
                                 ).make(_Cache.backup)
    controller = _Controller()
    cache = _Cache(controller)
    observer.controller_created(controller)
    assert telemetry.force_flush(30.0)  # the worker's first cycle (it builds the sinks) is over
    pipeline = telemetry._pipeline  # pylint: disable=protected-access
    pipeline._cycle = lambda: None  # paused: the records stay queued (cleared below, never reported)
    clock = time.perf_counter_ns
    best = {"A": float("inf"), "B": float("inf"), "C": float("inf"), "worker": float("inf")}
    cause_field = SUBMISSION_FIELDS.index("cause")

    def one_round(which: str) -> float:
        _Controller.start_writing = originals["start_writing"] if which == "A" else wrapped_start
        _Engine.submit_device_to_host = originals["submit"] if which == "A" else wrapped_submit
        queue_op = in_site if which == "B" else _Cache.backup
        queued_causes.log, queued_causes.handed = [], False  # C: no site call logged, none handed over before
        acks, start_writing = controller.ack_write_queue, controller.start_writing
        t0 = clock()
        for _ in range(ops):
            queue_op(cache)
            start_writing()
            acks.pop()
        t1 = clock()
        if which == "B":  # what the worker does for them at intake, timed apart
            deferred = [record[cause_field] for record in pipeline.queue if type(record[cause_field]) is tuple]
            t2 = clock()
            for cause in deferred:
                cause[0](*cause[1:])
            if deferred:
                best["worker"] = min(best["worker"], (clock() - t2) / len(deferred) / 1e3)
        pipeline.queue.clear()  # the paused worker never resolves them
        return (t1 - t0) / ops / 1e3

    try:
        gc.disable()
        for r in range(rounds + 1):
            for which in ("ABC", "BCA", "CAB")[r % 3]:
                us = one_round(which)
                if r:  # the first round warms up
                    best[which] = min(best[which], us)
    finally:
        gc.enable()
        _Controller.start_writing, _Engine.submit_device_to_host = originals["start_writing"], originals["submit"]
        pipeline.queue.clear()
        del pipeline._cycle
        telemetry.shutdown()
        providers.shutdown()
    return {"rounds": rounds, "ops_per_round": ops, "original_us": best["A"], "wrapped_us": best["B"],
            "without_causes_us": best["C"], "adapter_us": best["B"] - best["A"], "causes_us": best["B"] - best["C"],
            "worker_resolve_us": best["worker"]}


def off_thread_us_per_op(turns: list[dict[str, Any]], thread: str) -> float:
    """CPU of ``thread`` ("worker" or "span_processor") per timed op over ``turns`` (the warm-up
    and the start-up before it left out), in microseconds."""
    return sum(t["off_thread_cpu_s"][thread] for t in turns) * 1e6 / sum(t["timed_ops"] for t in turns)


def run_core(ops: int, warmup: int, interval_ns: int) -> dict[str, Any]:
    """The core benchmark's op (``overhead.py``'s c: direct ``submit()`` + ``ack()``, completed
    host events, an SDK provider into a counting exporter) in this process, beside the real path:
    ``interval_ns`` > 0 paced as the real path is (a sleep between ops), 0 flat out. The worker's
    CPU per op after a warm-up and a flush, as the real path's is measured."""
    import overhead  # a sibling script, imported after SGLang's CPU support is installed

    prep = overhead.make_prep()
    variant = overhead.HiCacheVariant(enabled=True)
    submit, ack = variant.tel.submit, variant.tel.ack
    num_bytes, page_size, io_backend = overhead.NUM_BYTES, overhead.PAGE_SIZE, overhead.IO_BACKEND

    def loop(n: int, interval: int) -> None:
        deadline = time.perf_counter_ns() + interval
        for i in range(n):
            direction, pools, start, finish = prep(i)
            if interval:
                deadline = wait_until(deadline) + interval
            ack(submit(direction, tokens_by_pool=pools, num_bytes=num_bytes, page_size=page_size, start_event=start,
                       finish_event=finish, timing_enabled=True, io_backend=io_backend))

    try:
        loop(warmup, 0)
        variant.flush()
        spans0 = variant.spans() or 0
        gc.collect()
        threads0 = off_thread_cpu()
        loop(ops, interval_ns)
        variant.flush()
        threads1 = off_thread_cpu()
        spans = (variant.spans() or 0) - spans0
    finally:
        variant.close()
    return {"timed_ops": ops, "spans": spans, "off_thread_cpu_s": {k: threads1[k] - threads0[k] for k in threads1}}


def run_row(tokens_per_op: int, rounds: int, ops: int, warmup: int, interval_us: float,
            variants: Sequence[str] = VARIANTS, core_flat_ops: int = 0) -> dict[str, Any]:
    """``variants`` for one op size, interleaved in ``rounds`` rounds of ``ops`` timed ops each;
    with ``core_flat_ops``, each round also runs the core's op paced (``ops``) and flat out
    (``core_flat_ops``): :func:`run_core`."""
    variants = tuple(variants)
    interval_ns = int(interval_us * 1000)
    samples: dict[str, dict[str, list[int]]] = {v: {"offload": [], "onboard": [], "cpu": []} for v in variants}
    per_round: dict[str, list[float]] = {v: [] for v in variants}
    turns: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    rss = [rss_mb()]
    t0 = time.perf_counter()
    for r in range(rounds):
        for v in variants[r % len(variants):] + variants[: r % len(variants)]:
            off, on = samples[v]["offload"], samples[v]["onboard"]
            n_off, n_on = len(off), len(on)
            turns[v].append(run_turn(v, tokens_per_op, ops, warmup, interval_ns, samples[v]))
            per_round[v].append(statistics.median(off[n_off:] + on[n_on:]))
        if core_flat_ops:
            for kind in ("core paced", "core flat")[::1 if r & 1 else -1]:
                turns.setdefault(kind, []).append(
                    run_core(ops, warmup, interval_ns) if kind == "core paced" else run_core(core_flat_ops, warmup, 0))
        rss.append(rss_mb())
    row: dict[str, Any] = {"tokens_per_op": tokens_per_op, "elapsed_s": time.perf_counter() - t0,
                           "rss_mb": rss, "variants": {}}
    for v in variants:
        every = sorted(samples[v]["offload"] + samples[v]["onboard"])
        row["variants"][v] = {
            "n": len(every),
            "offload_median_us": statistics.median(samples[v]["offload"]) / 1e3,
            "onboard_median_us": statistics.median(samples[v]["onboard"]) / 1e3,
            "median_us": statistics.median(every) / 1e3,
            "p99_us": percentile(every, 0.99) / 1e3,
            "over_1ms_pct": 100.0 * sum(1 for x in every if x > 1_000_000) / len(every),
            "cpu_median_us": statistics.median(samples[v]["cpu"]) / 1e3,
            "cpu_p99_us": percentile(sorted(samples[v]["cpu"]), 0.99) / 1e3,
            "per_round_median_us": [x / 1e3 for x in per_round[v]],
            "steady": all(t["steady"] for t in turns[v]),
        }
    base = row["variants"]["sglang"]
    for v in variants:
        res = row["variants"][v]
        res["added_us"] = res["median_us"] - base["median_us"]
        res["ratio"] = res["median_us"] / base["median_us"]
        res["added_cpu_us"] = res["cpu_median_us"] - base["cpu_median_us"]
        res["per_round_added_us"] = [a - b for a, b in zip(res["per_round_median_us"], base["per_round_median_us"])]
        paired = sorted(res["per_round_added_us"])
        res["paired_added_us"] = {"median": statistics.median(paired), "p25": percentile(paired, 0.25),
                                  "p75": percentile(paired, 0.75)}
    inst = turns["instrumented"] + turns["paused"]
    check = {
        "ops": sum(t["ops"] for t in inst),
        "spans": sum(t["spans"] for t in inst),
        "tokens": sum(t["tokens"] for t in inst),
        "metric_tokens": sum(t["metric_tokens"] for t in inst),
        "bytes": sum(t["bytes"] for t in inst),
        "metric_bytes": sum(t["metric_bytes"] for t in inst),
        "flushed": all(t["flushed"] for t in inst),
        "worker_cpu_us_per_op": off_thread_us_per_op(turns["instrumented"], "worker"),
        "span_processor_cpu_us_per_op": off_thread_us_per_op(turns["instrumented"], "span_processor"),
    }
    check["startup_worker_ms_per_turn"] = statistics.fmean(
        t["startup_cpu_s"]["worker"] for t in turns["instrumented"]) * 1e3
    if core_flat_ops:
        core = turns["core paced"] + turns["core flat"]
        row["core"] = {kind: {"worker_cpu_us_per_op": off_thread_us_per_op(turns[kind], "worker"),
                              "span_processor_cpu_us_per_op": off_thread_us_per_op(turns[kind], "span_processor"),
                              "ops": sum(t["timed_ops"] for t in turns[kind])}
                       for kind in ("core paced", "core flat")}
        row["core"]["exact"] = all(t["spans"] == t["timed_ops"] for t in core)
        real = check["worker_cpu_us_per_op"]
        paced = row["core"]["core paced"]["worker_cpu_us_per_op"]
        flat = row["core"]["core flat"]["worker_cpu_us_per_op"]
        row["worker_ratio"] = {"real_path_us": real, "core_paced_us": paced, "core_flat_us": flat,
                               "real_over_core_flat": real / flat, "real_over_core_paced": real / paced}
    check["exact"] = (check["flushed"] and check["spans"] == check["ops"]
                      and check["metric_tokens"] == check["tokens"] and check["metric_bytes"] == check["bytes"])
    row["check"] = check
    return row


# --------------------------------------------------------------------------------------
# Serving-process CPU per merged op: the telemetry process against embedded
# --------------------------------------------------------------------------------------

# OTEL_HICACHE_TELEMETRY_PROCESS of each variant: None, SGLang uninstrumented (the floor); "false",
# the sinks embedded in this process; "" (unset), configure()'s default for an OTLP exporter, the
# telemetry process
SERVING_VARIANTS: dict[str, str | None] = {"sglang": None, "embedded": "false", "telemetry process": ""}
SERVING_INSTRUMENTED = ("embedded", "telemetry process")
POLLER_THREAD = "otel-hicache-poller"
# the telemetry-process design's goals on the core's op (serving_cpu.py), shown here on the real path
GOAL_SHARE_OF_EMBEDDED = 1 / 8
GOAL_SERVING_US = 20.0


def run_serving_turn(variant: str, tokens_per_op: int, n_ops: int, warmup: int, interval_ns: int,
                     endpoint: str) -> dict[str, Any]:
    """One turn of :func:`run_serving_cpu`: configured as a user's scheduler process is, by
    ``OTEL_*`` only (``configure()`` from them: spans at 100%, OTLP/HTTP to ``endpoint``; the
    instrumentor without providers), a fresh controller, the warm-up and a flush (the telemetry
    process started and its exporters connected), then the window: ``n_ops`` ops and the
    ``force_flush()`` after them (every span of the window exported). Measured over the window:
    the CPU of this whole process (``time.process_time_ns``: every thread), of otel-hicache's
    poller thread and the SDK's threads here, and of the telemetry process (``/proc``, by the
    channel's pid)."""
    from otel_hicache import configuration
    from otel_hicache_sglang import SGLangHiCacheInstrumentor

    from bench_common import process_cpu_s

    mode = SERVING_VARIANTS[variant]
    settings = {"OTEL_SERVICE_NAME": "sglang-overhead", "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_METRICS_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_MAX_QUEUE_SIZE": "65536",
                "OTEL_HICACHE_ENABLED": "true", "OTEL_HICACHE_TELEMETRY_PROCESS": mode or ""}
    scratch: dict[str, list[int]] = {"offload": [], "onboard": [], "cpu": []}
    instrumentor = SGLangHiCacheInstrumentor() if mode is not None else None
    result: dict[str, Any] = {"variant": variant, "timed_ops": n_ops, "ops": warmup + n_ops, "flushed": True}
    with env(**settings):  # the whole turn: the telemetry process is started with this environment
        try:
            if instrumentor is not None:
                conf = configuration.configure(force=True)
                if conf.telemetry_process != (variant == "telemetry process"):
                    raise RuntimeError(f"{variant}: configure() chose the {conf.channel} channel")
                instrumentor.instrument()  # no providers: configure()'s, as in a server
            controller, _kv, allocator = sglang_cpu.build_controller(
                PAGE_SIZE, LAYERS, kv_size=max(64, 4 * tokens_per_op))
            if is_patched() != (instrumentor is not None):
                raise RuntimeError(f"{variant}: SGLang patched={is_patched()}")
            telemetry = instrumentor.telemetry if instrumentor is not None else None
            if (telemetry is not None and telemetry.enabled) != (instrumentor is not None):
                raise RuntimeError(f"{variant}: telemetry {telemetry!r} (OTEL_SDK_DISABLED set?)")
            device_indices = allocator.alloc(tokens_per_op)
            drive(controller, allocator, device_indices, 0, warmup, interval_ns, scratch)
            pid = None
            if telemetry is not None:
                result["flushed"] = telemetry.force_flush(timeout_s=60.0)
                process = getattr(telemetry.channel, "process", None)
                if (process is not None) != (variant == "telemetry process"):
                    raise RuntimeError(f"{variant}: channel {type(telemetry.channel).__name__}")
                pid = process.pid if process is not None else None
            gc.collect()
            other0 = process_cpu_s(pid) if pid is not None else None
            threads0 = thread_cpu()
            cpu0, wall0 = time.process_time_ns(), time.perf_counter_ns()
            drive(controller, allocator, device_indices, n_ops, 0, interval_ns, scratch)
            loop_s = (time.perf_counter_ns() - wall0) / 1e9
            if telemetry is not None:
                result["flushed"] = telemetry.force_flush(timeout_s=60.0) and result["flushed"]
            cpu1, wall1 = time.process_time_ns(), time.perf_counter_ns()
            threads1 = thread_cpu()
            other1 = process_cpu_s(pid) if pid is not None else None
            allocator.free(device_indices)
        finally:
            if instrumentor is not None:
                if instrumentor.is_instrumented_by_opentelemetry:
                    instrumentor.uninstrument()  # the telemetry shut down: the telemetry process ends
                configuration.shutdown(10.0)
    if is_patched():
        raise RuntimeError("SGLang still patched after uninstrument()")
    delta = {name: seconds - threads0.get(name, 0.0) for name, seconds in threads1.items()}
    result.update({
        "loop_s": loop_s, "window_s": (wall1 - wall0) / 1e9, "process_cpu_s": (cpu1 - cpu0) / 1e9,
        "poller_cpu_s": delta.get(POLLER_THREAD, 0.0),
        "sdk_threads_cpu_s": sum(v for name, v in delta.items() if name not in ("caller", POLLER_THREAD)),
        "telemetry_process_cpu_s": None if other0 is None or other1 is None else other1 - other0,
    })
    return result


def _spread(values: Sequence[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": list(values)}


def run_serving_cpu(sizes: Sequence[int], rounds: int, ops: int, warmup: int, interval_us: float) -> dict[str, Any]:
    """Serving-process CPU per merged op on the real path, the telemetry process against embedded
    (:func:`run_serving_turn`), against one OTLP/HTTP receiver in another process
    (``gil_impact.py``'s, which counts the spans it got): per size, ``rounds`` rounds of the
    three variants in rotating order; per round, each variant's CPU per op minus SGLang's alone."""
    from gil_impact import Receiver  # a sibling script

    interval_ns = int(interval_us * 1000)
    names = list(SERVING_VARIANTS)
    receiver = Receiver()
    endpoint = f"http://127.0.0.1:{receiver.port}"
    t0 = time.perf_counter()
    turns: dict[int, dict[str, list[dict[str, Any]]]] = {n: {v: [] for v in names} for n in sizes}
    try:
        for tokens_per_op in sizes:
            for r in range(rounds):
                for variant in names[r % len(names):] + names[:r % len(names)]:
                    turns[tokens_per_op][variant].append(
                        run_serving_turn(variant, tokens_per_op, ops, warmup, interval_ns, endpoint))
    finally:
        received = receiver.close()
    rows = []
    for tokens_per_op in sizes:
        by = turns[tokens_per_op]
        control = [t["process_cpu_s"] / t["timed_ops"] * 1e6 for t in by["sglang"]]
        row: dict[str, Any] = {"tokens_per_op": tokens_per_op, "variants": {}}
        for variant in names:
            ts = by[variant]
            raw = [t["process_cpu_s"] / t["timed_ops"] * 1e6 for t in ts]
            fig: dict[str, Any] = {"ops_per_s": statistics.median(t["timed_ops"] / t["loop_s"] for t in ts),
                                   "process_cpu_us_per_op": _spread(raw), "flushed": all(t["flushed"] for t in ts),
                                   "ops": sum(t["ops"] for t in ts)}
            if variant != "sglang":
                net = [x - c for x, c in zip(raw, control)]
                other = [t["telemetry_process_cpu_s"] / t["timed_ops"] * 1e6 for t in ts
                         if t["telemetry_process_cpu_s"] is not None]
                fig.update({
                    "serving_cpu_us_per_op": _spread(net),
                    "poller_cpu_us_per_op": statistics.median(t["poller_cpu_s"] / t["timed_ops"] * 1e6 for t in ts),
                    "sdk_threads_cpu_us_per_op": statistics.median(
                        t["sdk_threads_cpu_s"] / t["timed_ops"] * 1e6 for t in ts),
                    "telemetry_process_cpu_us_per_op": _spread(other) if other else None,
                    "total_cpu_us_per_op": _spread([n + o for n, o in zip(net, other or [0.0] * len(net))]),
                })
            row["variants"][variant] = fig
        embedded = row["variants"]["embedded"]["serving_cpu_us_per_op"]["median"]
        served = row["variants"]["telemetry process"]["serving_cpu_us_per_op"]["median"]
        row["telemetry_process_over_embedded"] = served / embedded if embedded > 0 else None
        rows.append(row)
    submitted = sum(row["variants"][v]["ops"] for row in rows for v in SERVING_INSTRUMENTED)
    flushed = all(row["variants"][v]["flushed"] for row in rows for v in SERVING_INSTRUMENTED)
    return {"rounds": rounds, "ops_per_turn": ops, "interval_us": interval_us, "rows": rows,
            "received_spans": received, "submitted_ops": submitted, "flushed": flushed,
            "complete": flushed and received >= submitted, "elapsed_s": time.perf_counter() - t0}


def print_serving_cpu(serving: dict[str, Any]) -> None:
    def span_of(fig: dict[str, Any] | None) -> str:
        return "" if not fig else f"{fig['median']:.1f} [{fig['min']:.1f}-{fig['max']:.1f}]"

    print(f"\n## Serving-process CPU per merged op on the real path: telemetry process vs embedded "
          f"(us, median [min-max] over {serving['rounds']} rounds)\n")
    out = []
    for row in serving["rows"]:
        for variant, fig in row["variants"].items():
            instrumented = variant != "sglang"
            out.append([str(row["tokens_per_op"]), variant, f"{fig['ops_per_s']:.0f}",
                        span_of(fig["process_cpu_us_per_op"]), span_of(fig.get("serving_cpu_us_per_op")),
                        f"{fig['poller_cpu_us_per_op']:.1f}" if instrumented else "",
                        f"{fig['sdk_threads_cpu_us_per_op']:.1f}" if instrumented else "",
                        span_of(fig.get("telemetry_process_cpu_us_per_op")),
                        span_of(fig.get("total_cpu_us_per_op"))])
    print(table(out, ["tokens", "variant", "ops/s", "serving process", "serving (net)", "poller thread",
                      "SDK threads", "telemetry process", "total (net)"], left=2))
    print(f"SGLang's merged ops (as above), one every {serving['interval_us']:.0f} us, {serving['ops_per_turn']} per "
          f"turn after a warm-up and a flush, acks popped from SGLang's\nack queues; configured by OTEL_* only "
          f"(configure(), spans at 100%, OTLP/HTTP to a receiver in another process): embedded =\n"
          f"OTEL_HICACHE_TELEMETRY_PROCESS=false, telemetry process = the default. serving process = the CPU of "
          f"this whole\nprocess (all threads) over the window (the ops and the force_flush() after them), per op; "
          f"net = minus sglang's of the\nsame round (SGLang uninstrumented, the same loop); poller thread, SDK "
          f"threads: their CPU clocks in this process\n(medians); telemetry process = its CPU (/proc, clock ticks) "
          f"per op; total = serving (net) + telemetry process.")
    for row in serving["rows"]:
        ratio = row["telemetry_process_over_embedded"]
        served = row["variants"]["telemetry process"]["serving_cpu_us_per_op"]["median"]
        print(f"{row['tokens_per_op']} tokens/op: serving-process CPU per op, telemetry process / embedded: "
              + ("n/a" if ratio is None else f"{ratio:.3f}x") + f" ({served:.1f} us); the design's goals (on the "
              f"core's op): <= {GOAL_SHARE_OF_EMBEDDED:g}x: "
              + ("n/a" if ratio is None else ("met" if ratio <= GOAL_SHARE_OF_EMBEDDED else "NOT met"))
              + f", <= {GOAL_SERVING_US:.0f} us: {'met' if served <= GOAL_SERVING_US else 'NOT met'}")
    print(f"spans at the receiver: {serving['received_spans']} of {serving['submitted_ops']} ops instrumented "
          f"(warm-up included): {'all' if serving['complete'] else 'MISSING'}")


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------

WORKER_GOAL = 1.5  # the real path's worker CPU per op over the core's, flat out (issue: health at a glance, 3)


def control_after_poll(interval_us: float) -> dict[str, Any]:
    """This machine's part: the thread CPU of a fixed piece of pure Python (``wait_cost.py``'s
    control, no otel-hicache) back to back, and after a sleep of the worker's poll interval, alone
    and in bursts of the records one paced cycle takes in."""
    from wait_cost import after_sleep  # a sibling script

    from otel_hicache import environment_variables as ev
    from otel_hicache.settings import env_float

    poll_ms = env_float(ev.OTEL_HICACHE_POLL_INTERVAL_MS)
    burst = max(1, round(poll_ms * 1e3 / interval_us))
    after_sleep(0.0, 1, 2000)  # warm-up
    return {"poll_ms": poll_ms, "burst": burst, "back_to_back_us": after_sleep(0.0, 1, 2000),
            "after_poll_us": after_sleep(poll_ms / 1e3, 1, 500),
            "after_poll_burst_us": after_sleep(poll_ms / 1e3, burst, 500 * burst)}


def print_worker_ratio(rows: Sequence[dict[str, Any]], interval_us: float, control: dict[str, Any]) -> None:
    """The worker's CPU per op on the real path (c) against the core's op in the same run."""
    print("\n## The otel-hicache worker's CPU per op: the real path against the core's op, same run\n")
    out = []
    for row in rows:
        r = row["worker_ratio"]
        out.append([str(row["tokens_per_op"]), f"{r['real_path_us']:.1f}", f"{r['core_paced_us']:.1f}",
                    f"{r['core_flat_us']:.1f}", f"{r['real_over_core_flat']:.2f}x", f"{r['real_over_core_paced']:.2f}x"])
    print(table(out, ["tokens", "real path (c) us/op", "core, paced us/op", "core, flat out us/op",
                      "real / core flat", "real / core paced"], left=2))
    print(f"the otel-hicache worker thread's CPU clock, from after each turn's warm-up and flush until its last\n"
          f"flush. real path: c, SGLang's ops one every {interval_us:.0f} us, acks watched in SGLang's ack queues;\n"
          f"core: overhead.py's op (direct submit() + ack(), completed host events), paced the same way, and\n"
          f"flat out (the core benchmark's figure); each round runs both beside the real path's turns.")
    c = control
    print(f"this machine, the same pure Python without otel-hicache (wait_cost.py's control): "
          f"{c['back_to_back_us']:.1f} us of CPU\nback to back, {c['after_poll_us']:.1f} us after a "
          f"{c['poll_ms']:g} ms sleep (the worker's poll interval: "
          f"{c['after_poll_us'] / c['back_to_back_us']:.2f}x), {c['after_poll_burst_us']:.1f} us a call in bursts "
          f"of {c['burst']} after it\n({c['after_poll_burst_us'] / c['back_to_back_us']:.2f}x; "
          f"{c['burst']}: the records a paced cycle takes in). core paced / core flat out: "
          + ", ".join(f"{row['worker_ratio']['core_paced_us'] / row['worker_ratio']['core_flat_us']:.2f}x"
                      for row in rows) + ".")
    for row in rows:
        ratio = row["worker_ratio"]["real_over_core_flat"]
        print(f"goal: the real path's worker CPU per op within {WORKER_GOAL:g}x of the core's flat-out figure, "
              f"{row['tokens_per_op']} tokens/op: {ratio:.2f}x: {'PASS' if ratio <= WORKER_GOAL else 'FAIL'}")


def sglang_machine() -> dict[str, Any]:
    """``machine()`` with the adapter's, SGLang's and torch's versions."""
    from importlib.metadata import version

    import torch

    return machine("otel_hicache_sglang", version("otel-hicache-sglang"), sglang=version("sglang"),
                   torch=torch.__version__)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small N, for CI (about a minute)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2 * PAGE_SIZE, 256],
                        help=f"tokens per op, one table row group each (multiples of the page size {PAGE_SIZE})")
    parser.add_argument("--rounds", type=int, help="rounds; each variant takes one turn per round")
    parser.add_argument("--ops", type=int, help="timed ops per turn (even: offload/onboard pairs)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed ops at the start of each turn")
    parser.add_argument("--interval-us", type=float, default=200.0, help="one op every this many us")
    parser.add_argument("--paired-ops", type=int, help="paired measurement: ops per half (0: skip)")
    parser.add_argument("--cause-rounds", type=int, help="warm transfer-causes measurement: rounds (0: skip)")
    parser.add_argument("--core-flat-ops", type=int,
                        help="ops of each round's core flat-out turn (0: no core turns, no worker ratio)")
    parser.add_argument("--cpu-rounds", type=int,
                        help="serving-process CPU, telemetry process vs embedded: rounds per size (0: skip)")
    parser.add_argument("--cpu-ops", type=int, help="serving-process CPU: timed ops per turn")
    parser.add_argument("--cpu-interval-us", type=float, default=1000.0,
                        help="serving-process CPU: one op every this many us (1000: the goal's 1,000 ops/s)")
    parser.add_argument("--json", metavar="PATH", help="write all results as JSON")
    args = parser.parse_args(argv)

    quick = args.quick
    rounds = args.rounds or (10 if quick else 30)
    ops = args.ops or (160 if quick else 600)
    ops += ops & 1
    warmup = args.warmup + (args.warmup & 1)
    if any(n <= 0 or n % PAGE_SIZE for n in args.sizes):
        parser.error(f"--sizes must be positive multiples of {PAGE_SIZE}")

    t_start = time.perf_counter()
    sglang_cpu.install_cpu_support()  # before anything imports SGLang or the adapter
    gc.collect()
    gc.freeze()  # SGLang + torch: a full collection would otherwise scan them (~0.3 s a turn, and in the loop)
    results: dict[str, Any] = {"machine": sglang_machine(), "quick": quick,
                               "params": {"sizes": args.sizes, "rounds": rounds, "ops_per_turn": ops,
                                          "warmup": warmup, "interval_us": args.interval_us,
                                          "page_size": PAGE_SIZE, "layers": LAYERS}}
    m = results["machine"]
    print(f"# otel-hicache-sglang {m['otel_hicache_sglang']} caller overhead on SGLang {m['sglang']} "
          f"({'quick' if quick else 'full'} run)")
    print(f"{m['python']}, torch {m['torch']}, opentelemetry-sdk {m['opentelemetry_sdk']}, {m['cpus']} CPUs "
          f"({m['processor']}), {m['platform']}")
    print(f"op: one merged op on SGLang's HiCacheController (CPU: io_backend=direct, layer_first, write_through), "
          f"float16 MHA, page_size {PAGE_SIZE}, {LAYERS} layers; offload = write() + pop ack, onboard = load() + "
          f"start_loading() + pop ack; directions alternating, one op every {args.interval_us:.0f} us")
    print(f"{rounds} rounds x {ops} timed ops per variant per size (+{warmup} warm-up), variants interleaved "
          f"in rotating order; spans sampled at 100%")

    variants = list(VARIANTS)
    core_flat_ops = args.core_flat_ops if args.core_flat_ops is not None else (2000 if quick else 5000)
    rows = [run_row(n, rounds, ops, warmup, args.interval_us, variants, core_flat_ops)
            for n in args.sizes]
    if core_flat_ops:
        results["control"] = control_after_poll(args.interval_us)
    results["rows"] = rows
    paired_ops = args.paired_ops if args.paired_ops is not None else (2500 if quick else 10000)
    paired_rows = [run_paired(n, paired_ops, warmup, args.interval_us) for n in args.sizes] if paired_ops else []
    results["paired"] = paired_rows
    results["cause_site"] = run_cause_site(paired_ops, warmup, args.interval_us) if paired_ops else None
    cause_rounds = args.cause_rounds if args.cause_rounds is not None else (40 if quick else 60)
    results["cause_warm"] = run_cause_warm(cause_rounds, 2000 if quick else 5000) if cause_rounds else None
    cpu_rounds = args.cpu_rounds if args.cpu_rounds is not None else (3 if quick else 5)
    cpu_ops = args.cpu_ops or (600 if quick else 3000)
    cpu_ops += cpu_ops & 1
    serving = (run_serving_cpu(args.sizes, cpu_rounds, cpu_ops, warmup, args.cpu_interval_us)
               if cpu_rounds else None)
    results["serving_cpu"] = serving

    print("\n## Caller (scheduler) thread cost per merged op, each op timed alone\n")
    out = []
    for row in rows:
        for v in variants:
            res = row["variants"][v]
            paired = res["paired_added_us"]
            rel = v != "sglang"
            out.append([str(row["tokens_per_op"]), LABELS[v], f"{res['median_us']:.2f}", f"{res['p99_us']:.1f}",
                        f"{res['over_1ms_pct']:.2f}", f"{res['added_us']:+.2f}" if rel else "",
                        f"{res['ratio']:.3f}" if rel else "",
                        f"{paired['median']:+.1f} [{paired['p25']:+.1f} .. {paired['p75']:+.1f}]" if rel else "",
                        f"{res['cpu_median_us']:.2f}", f"{res['added_cpu_us']:+.2f}" if rel else ""])
    print(table(out, ["tokens", "variant", "median us", "p99 us", "% > 1 ms", "added us", "ratio",
                      "paired added us", "CPU median us", "added CPU us"], left=2))
    print("wall (perf_counter_ns): added = median(variant) - median(a) over all rounds, ratio = median(variant) /\n"
          "median(a); paired = added within each round, median [p25 .. p75] over rounds. CPU = the caller thread's\n"
          "CPU time (thread_time_ns) in the same window; wall minus CPU is waiting, mostly for the GIL (SGLang's\n"
          "torch calls release it, otel-hicache's worker takes it). The CPU copy itself runs inside the timed\n"
          "call. b vs a is the noise floor; d vs a is the adapter's own cost without the worker running beside it.")

    if paired_rows:
        print("\n## The adapter's own cost, paired op by op (worker paused)\n")
        print(table([[str(p["tokens_per_op"]), str(p["n"]), f"{p['sglang_median_us']:.2f}",
                      f"{p['added_wall_us']:+.2f}", f"{p['added_cpu_us']:+.2f}"]
                     + [f"{p['parts_us'][part]['wall']:+.2f} / {p['parts_us'][part]['cpu']:+.2f}"
                        for part in PAIRED_PARTS] for p in paired_rows],
                    ["tokens", "ops per variant", "sglang median us", "added wall us", "added caller CPU us"]
                    + [f"{part}, wall / CPU" for part in PAIRED_PARTS]))
        print("SGLang's originals and the adapter's wrappers switched op by op on one instrumented controller\n"
              "(otel-hicache's worker paused), each wrapped op queued inside a cause site as in SGLang's flows:\n"
              "median(wrapped) - median(originals), wall and the caller thread's CPU. In parts, each the\n"
              "difference of two medians of variants taking the same turns: interception = pass-through\n"
              "wrappers (a plain function calling SGLang's original) - originals; adapter logic = the wrappers\n"
              "with submit() a no-op - pass-through; submit() = the wrappers - the same with submit() a no-op;\n"
              "causes = the op queued in a cause site - outside one (start_* then hands the worker no lookup).\n"
              "Host residence: " + ("on (the default): the wrappers pass each op's host slots."
                                    if all(p["host_residence"] for p in paired_rows)
                                    else "off (OTEL_HICACHE_HOST_RESIDENCE=false, or no NumPy)."))
        site = results["cause_site"]
        print(f"  a cause site (UnifiedRadixCache._execute_and_commit_kv_backup, empty action), paired with SGLang's\n"
              f"  original, {site['n']} calls each: original {site['sglang_median_us']:.2f} us, added "
              f"{site['added_wall_us']:+.2f} us wall per call")

    warm = results["cause_warm"]
    if warm:
        print("\n## Transfer causes on the scheduler thread, warm (stand-in objects, worker paused)\n")
        print(table([[f"{warm['original_us']:.3f}", f"{warm['without_causes_us']:.3f}", f"{warm['wrapped_us']:.3f}",
                      f"{warm['adapter_us']:+.3f}", f"{warm['causes_us']:+.3f}", f"{warm['worker_resolve_us']:.3f}"]],
                    ["A. originals us", "C. wrappers, no cause site us", "B. wrappers, op queued in a site us",
                     "B - A (adapter)", "B - C (transfer causes)", "worker: resolving B's causes us"]))
        print(f"per op: a cache method queues one op, start_writing() merges it (one copy, one ack), the ack is\n"
              f"popped; the adapter's real wrappers on objects that do nearly nothing else; the fastest of "
              f"{warm['rounds']} rounds\nof {warm['ops_per_round']} ops per variant, variants taking turns. The "
              f"worker's share (sorting B's site calls in, finding each\nop's range) is timed apart, after each B "
              f"round. Paced between SGLang's own ops, each costs several times\nits warm figure (cold caches): "
              f"the paired measurement above.")

    print("\n## Correctness of the instrumented turns, c and d (after force_flush; ground truth = SGLang's acks)\n")
    exact_all = True
    for row in rows:
        c = row["check"]
        exact_all &= c["exact"]
        print(f"  {row['tokens_per_op']:>4} tokens/op: {c['ops']} ops -> {c['spans']} spans; "
              f"{TOKENS_METRIC} {c['metric_tokens']:.0f} vs {c['tokens']} moved; {BYTES_METRIC} "
              f"{c['metric_bytes']:.0f} vs {c['bytes']}; exact: {'yes' if c['exact'] else 'no'}")
    print("  off-thread CPU per timed op of c (from after the warm-up and a flush until flushed): " + "; ".join(
        f"{row['tokens_per_op']} tokens/op: otel-hicache worker {row['check']['worker_cpu_us_per_op']:.1f} us, "
        f"span processor {row['check']['span_processor_cpu_us_per_op']:.1f} us" for row in rows))
    print("  the worker's start-up per turn of c (its first cycle builds the providers' instruments and zero "
          "series;\n  once per process in a server; left out of every per-op figure): " + "; ".join(
              f"{row['tokens_per_op']} tokens/op: {row['check']['startup_worker_ms_per_turn']:.1f} ms" for row in rows))
    if all("core" in row for row in rows):
        exact_all &= all(row["core"]["exact"] for row in rows)
        print(f"  the core's turns (below): every op one span: {'yes' if all(r['core']['exact'] for r in rows) else 'NO'}")
    print(f"exact: {'yes' if exact_all else 'no'}")

    if all("core" in row for row in rows):
        print_worker_ratio(rows, args.interval_us, results["control"])

    if serving is not None:
        print_serving_cpu(serving)
        exact_all &= serving["complete"]

    steady = all(row["variants"][v]["steady"] for row in rows for v in variants)
    rss = [x for row in rows for x in row["rss_mb"]]
    print(f"\nSGLang state after every turn: pools back to their free sizes, queues and ack queues empty: "
          f"{'yes' if steady else 'NO'} (no reset needed)")
    print("process RSS (start, after round 1, at the end): " + "; ".join(
        f"{row['tokens_per_op']} tokens/op {row['rss_mb'][0]:.1f}, {row['rss_mb'][1]:.1f}, {row['rss_mb'][-1]:.1f} MB"
        for row in rows) + f"; growth after the first round {rss[-1] - rows[0]['rss_mb'][1]:+.1f} MB")
    results["exact"] = exact_all
    results["steady"] = steady
    results["elapsed_s"] = time.perf_counter() - t_start
    print(f"\n(run took {results['elapsed_s']:.0f} s, SGLang import included)")

    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=2, default=str)
    return 0 if exact_all and steady else 1


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
