"""Validate otel-hicache's device timing on a real GPU, against independent measurements.

Pinned host <-> device copies from 1 MiB to 1 GiB on a side stream, in both directions
(``offload``: device -> pinned host, write-back; ``onboard``: pinned host -> device,
load-back), each reported through a real ``TransferTelemetry`` (private SDK providers,
spans at 100%, the real completion worker and wall-clock anchor). Checks:

1. duration: each span's device duration (exported span end - start) against an
   independent measurement of the same copy: a second, separately created event pair
   bracketing the telemetry's events on the same stream, the device synchronized before
   and after (the copy runs alone); and ``triton.testing.do_bench`` of the same copy
   (repeated copies, median) when triton imports. Target: within 2% of the
   event-bracketed reference for copies >= 16 MiB;
2. bandwidth: span-derived GB/s per size against the best bandwidth measured
   independently per direction (the link's measured peak); reported, no target;
3. wall-clock anchor error: the span's start against the host clock read just before the
   start event was recorded on an idle stream (synchronized copy). Target < 50 us,
   median and max;
4. caller overhead: ``submit()`` timed alone with real, recorded events while the
   worker runs as in production, against an empty call. Target <= 5 us median (net);
5. late ack: ops submitted with ``expect_ack=True`` and acked 50 ms after the copy
   finished: duration unchanged against the independent measurement, the span shows
   the ack;
6. wiring: one span per op, ``hicache.timing_source=device_event``, placed through the
   anchor, span durations equal to what the events themselves say, the duration
   histogram and byte counter equal to the spans, results written.

Without CUDA (or with ``--dry``) it runs in a dry mode: the same code path with a
stand-in backend (real CPU torch copies, timing events on the host's monotonic clock).
The targets are computed and printed but labelled "dry (not a GPU measurement)"; the exit
status then reflects only the wiring rows and checks that raised.

Usage::

    python benchmarks/gpu_validate.py --out docs/gpu-results/<date>-<gpu>.json   # CUDA
    python benchmarks/gpu_validate.py --dry --out /tmp/r.json                     # CPU, seconds

A short table is printed last; full per-copy results and the environment go to ``--out``
(default ``gpu_validate_results.json``), rewritten after every phase so a run that dies
half-way leaves what it measured. Exit status: 1 if a check fails (CUDA mode: wiring and
targets; dry mode: wiring and checks that raised), 2 for usage errors.
"""

from __future__ import annotations

import time

_STARTED = time.perf_counter()  # the run's runtime counts the imports too (torch, triton)

import argparse  # noqa: E402
import datetime
import faulthandler
import importlib.metadata
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # imported from elsewhere (tests): bench_common is a sibling
    sys.path.insert(0, str(HERE))

try:
    import otel_hicache
except ImportError:  # a checkout that was not installed
    sys.path.insert(0, str(HERE.parent))
    import otel_hicache

import torch
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON

from otel_hicache import TransferTelemetry
from otel_hicache import semconv as sc
import bench_common  # noqa: E402  (this script's folder, see above)

MIB = 1 << 20
BYTES_PER_TOKEN = 114_688  # Qwen3-0.6B-like KV: 28 layers x 8 heads x 128 dims x 2 (K, V) x bf16
PAGE_SIZE = 64
DIRECTIONS = ("offload", "onboard")  # device -> pinned host, pinned host -> device
ATTR_ID = "gpu_validate.id"
WORKER_THREAD = "otel-hicache-poller"

CUDA_SIZES_MIB = (1, 4, 16, 64, 256, 1024)
DRY_SIZES_MIB = (1, 4, 16)
TARGET_RATIO = 0.02  # span duration within 2% of the independent measurement...
TARGET_MIN_MIB = 16  # ...for copies of at least this size
TARGET_ANCHOR_US = 50.0
TARGET_OVERHEAD_US = 5.0
TARGET_RUNTIME_S = 300.0
TRUTH_TOLERANCE_NS = 1_000  # span duration vs the events' own reading (float ms -> ns rounding)
METRIC_SUM_TOLERANCE_S = 1e-6
DRY_LABEL = "dry (not a GPU measurement)"


# --------------------------------------------------------------------------------------
# Backends: the only part that differs between a GPU run and the dry run
# --------------------------------------------------------------------------------------


class CudaBackend:
    """Real CUDA: side streams, ``torch.cuda.Event(enable_timing=True)``, pinned host buffers."""

    name = "cuda"
    dry = False

    def __init__(self) -> None:
        self._device: Any = None  # resolved on first use, inside the run's error handling

    @property
    def device(self) -> Any:
        if self._device is None:
            torch.cuda.init()
            self._device = torch.device("cuda", torch.cuda.current_device())
        return self._device

    def stream(self) -> Any:
        return torch.cuda.Stream(device=self.device)

    def event(self) -> Any:
        return torch.cuda.Event(enable_timing=True)

    def buffers(self, nbytes: int) -> tuple[Any, Any]:
        """(device buffer, pinned host buffer) of ``nbytes``; the device is synchronized after."""
        dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        torch.cuda.synchronize(self.device)
        return dev, host

    def copy(self, dst: Any, src: Any, stream: Any) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def truth_ns(self, start: Any, finish: Any) -> int:
        """What the two events say, read here after a device synchronize (both completed)."""
        return int(round(start.elapsed_time(finish) * 1e6))

    def free(self) -> None:
        """Give cached device and pinned host memory back between sizes (best effort)."""
        torch.cuda.synchronize(self.device)
        try:
            torch.cuda.empty_cache()
            host_empty = getattr(torch._C, "_host_emptyCache", None)  # pylint: disable=protected-access
            if callable(host_empty):
                host_empty()
        except Exception as exc:  # only memory held longer; never a reason to stop
            print(f"[gpu_validate] freeing cached memory: {exc!r} (ignored)", flush=True)

    def bench(self, fn: Callable[[], Any], stream: Any) -> dict[str, Any]:
        """``triton.testing.do_bench`` of ``fn`` on ``stream`` (median ms), if triton imports."""
        try:
            from triton.testing import do_bench
        except Exception as exc:  # not installed, or no usable driver
            return {"skipped": f"triton not importable: {exc!r}"}
        with torch.cuda.stream(stream):  # do_bench records its events on the current stream
            try:
                ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                method = "triton.testing.do_bench(warmup=25, rep=100, return_mode='median')"
            except TypeError:  # an older triton without return_mode: its default (mean)
                ms = do_bench(fn, warmup=25, rep=100)
                method = "triton.testing.do_bench(warmup=25, rep=100) (mean)"
        torch.cuda.synchronize(self.device)
        if isinstance(ms, (list, tuple)):
            ms = ms[0]
        return {"method": method, "ms": float(ms)}

    def environment(self) -> dict[str, Any]:
        props = torch.cuda.get_device_properties(self.device)
        env: dict[str, Any] = {
            "backend": "cuda",
            "device_name": torch.cuda.get_device_name(self.device),
            "device_index": self.device.index,
            "device_count": torch.cuda.device_count(),
            "compute_capability": f"{props.major}.{props.minor}",
            "device_memory_gib": round(props.total_memory / (1 << 30), 1),
            "torch_cuda": torch.version.cuda,
        }
        fields = ("name,driver_version,pci.bus_id,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,"
                  "pcie.link.width.max")
        try:
            out = subprocess.run(
                ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader", "-i", str(self.device.index)],
                capture_output=True, text=True, timeout=20, check=True,
            ).stdout.strip()
            env["nvidia_smi"] = dict(zip(fields.split(","), (x.strip() for x in out.split(","))))
            env["driver_version"] = env["nvidia_smi"].get("driver_version")
        except (OSError, subprocess.SubprocessError) as exc:
            env["nvidia_smi"] = f"unavailable: {exc!r}"
        return env


class StandInEvent:
    """Duck-typed like ``torch.cuda.Event(enable_timing=True)``, for the dry run.

    Its "device clock" is the host's monotonic clock (``perf_counter_ns``), a different
    clock from the wall clock, so otel-hicache's wall-clock anchor really maps one to the
    other. CPU copies are synchronous, so an event is complete once recorded."""

    def __init__(self) -> None:
        self.at_ns: int | None = None

    def record(self, stream: Any = None) -> None:
        self.at_ns = time.perf_counter_ns()

    def query(self) -> bool:
        return self.at_ns is not None

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "StandInEvent") -> float:
        if self.at_ns is None or end.at_ns is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end.at_ns - self.at_ns) / 1e6

    def anchor_factory(self) -> Callable[[], "StandInEvent"]:
        return _stand_in_anchor


def _stand_in_anchor() -> StandInEvent:
    event = StandInEvent()
    event.record()
    return event


class DryBackend:
    """CPU stand-in: real torch copies between two CPU buffers, :class:`StandInEvent` timing."""

    name = "dry"
    dry = True

    def stream(self) -> Any:
        return None  # CPU copies are synchronous: no stream

    def event(self) -> Any:
        return StandInEvent()

    def buffers(self, nbytes: int) -> tuple[Any, Any]:
        return torch.zeros(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)

    def copy(self, dst: Any, src: Any, stream: Any) -> None:
        dst.copy_(src)

    def synchronize(self) -> None:
        pass

    def truth_ns(self, start: Any, finish: Any) -> int:
        """The stand-in's own timeline, not ``elapsed_time()``: a lying event is caught."""
        return int(finish.at_ns - start.at_ns)

    def free(self) -> None:
        pass

    def bench(self, fn: Callable[[], Any], stream: Any) -> dict[str, Any]:
        """Stand-in for do_bench (which needs a GPU): median of event-bracketed repeats."""
        fn()
        times = []
        for _ in range(5):
            start, end = self.event(), self.event()
            start.record(stream)
            fn()
            end.record(stream)
            self.synchronize()
            times.append(start.elapsed_time(end))
        return {"method": "stand-in: median of 5 event-bracketed repeats (dry; do_bench needs a GPU)",
                "ms": statistics.median(times)}

    def environment(self) -> dict[str, Any]:
        return {"backend": "dry", "device_name": "none (CPU stand-in)",
                "cuda_available": torch.cuda.is_available()}


# --------------------------------------------------------------------------------------
# Report: rows of the final table, errors, exit status
# --------------------------------------------------------------------------------------


class Report:
    """Check rows: ``wiring`` (always decide the exit), ``target`` (decide it on CUDA),
    ``info`` (never). A check that raised is an ERROR row, which decides it in both modes."""

    def __init__(self, dry: bool) -> None:
        self.dry = dry
        self.rows: list[dict[str, Any]] = []
        self.errors: list[dict[str, Any]] = []

    def add(self, check: str, kind: str, measured: str, target: str, ok: bool | None) -> None:
        status = "INFO" if ok is None else ("PASS" if ok else "FAIL")
        if self.dry and kind != "wiring":
            status += f", {DRY_LABEL}"
        self.rows.append({"check": check, "kind": kind, "measured": measured, "target": target, "status": status})

    def skip(self, check: str, kind: str, why: str, target: str = "") -> None:
        self.rows.append({"check": check, "kind": kind, "measured": why, "target": target, "status": "SKIP"})

    def error(self, where: str, exc: BaseException, kind: str = "wiring", target: str = "") -> None:
        self.errors.append({"where": where, "error": repr(exc), "traceback": traceback.format_exc()})
        self.rows.append({"check": where, "kind": kind, "measured": f"raised {type(exc).__name__}: {exc}"[:160],
                          "target": target, "status": "ERROR"})

    @contextmanager
    def guard(self, where: str, kind: str = "wiring", target: str = "") -> Iterator[None]:
        """Run a check; if it raises, record an ERROR row and carry on with the next one."""
        try:
            yield
        except Exception as exc:  # one failing check must not hide the others
            print(f"[gpu_validate] {where}: raised {exc!r}", flush=True)
            self.error(where, exc, kind, target)

    def failures(self) -> list[dict[str, Any]]:
        bad = []
        for row in self.rows:
            status = row["status"]
            if status == "ERROR":
                bad.append(row)
            elif status.startswith("FAIL") and (row["kind"] == "wiring" or not self.dry):
                bad.append(row)
        return bad


# --------------------------------------------------------------------------------------
# Statistics helpers
# --------------------------------------------------------------------------------------


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def _pct(values: Sequence[float], q: float) -> float:
    return bench_common.percentile(sorted(values), q) if values else float("nan")


def _gbs(nbytes: int, ns: float) -> float:
    return nbytes / ns if ns and ns > 0 else float("nan")  # bytes per ns == GB/s


def _mib(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // 1024} KiB"


def _finite(value: Any) -> Any:
    """JSON-safe: NaN/inf become None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float):
        return _finite(obj)
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    return repr(obj)


# --------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------


class Validation:
    """One run: a telemetry instance on private SDK providers, the phases, the checks."""

    def __init__(self, backend: Any, args: argparse.Namespace, report: Report) -> None:
        self.backend = backend
        self.args = args
        self.report = report
        self.sizes = [int(m * MIB) for m in args.sizes]
        self.ops: list[dict[str, Any]] = []  # every submit, by id
        self._events: dict[int, tuple[Any, Any]] = {}
        self.bench: list[dict[str, Any]] = []
        self.overhead: dict[str, Any] = {}
        self.analysis: dict[str, Any] = {}
        self.worker_seen = False
        self.stream = backend.stream()  # first: if the device is unusable, nothing else was started
        self.exporter = InMemorySpanExporter()
        self.tracer_provider = TracerProvider(sampler=ALWAYS_ON, shutdown_on_exit=False)
        self.tracer_provider.add_span_processor(
            BatchSpanProcessor(self.exporter, max_queue_size=1 << 17, max_export_batch_size=512))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader], shutdown_on_exit=False)
        # whatever the caller's environment says: enabled, SDK on (spans at 100% by the sampler)
        with bench_common.env(OTEL_HICACHE_ENABLED="true", OTEL_SDK_DISABLED="false"):
            self.tel = TransferTelemetry(self.tracer_provider, self.meter_provider,
                                         {"tp_rank": 0, "gpu_validate.backend": backend.name})

    # -- helpers -----------------------------------------------------------------------
    def _check_worker(self) -> None:
        if any(t.name == WORKER_THREAD and t.is_alive() for t in threading.enumerate()):
            self.worker_seen = True

    def _register(self, phase: str, direction: str, nbytes: int, start: Any, finish: Any,
                  expect_ack: bool = False) -> dict[str, Any]:
        op = {"id": len(self.ops), "phase": phase, "direction": direction, "bytes": nbytes,
              "expect_ack": expect_ack}
        self.ops.append(op)
        self._events[op["id"]] = (start, finish)
        return op

    def _submit(self, op: dict[str, Any], start: Any, finish: Any) -> Any:
        return self.tel.submit(op["direction"], {"kv": max(1, op["bytes"] // BYTES_PER_TOKEN)}, op["bytes"],
                               PAGE_SIZE, start, finish, True, "direct", {ATTR_ID: op["id"]},
                               expect_ack=op["expect_ack"])

    def _read_truth(self) -> None:
        """After a device synchronize: what each op's own events say (dry: the stand-in's timeline)."""
        self.backend.synchronize()
        for ident, (start, finish) in list(self._events.items()):
            self.ops[ident]["events_ns"] = self.backend.truth_ns(start, finish)
            del self._events[ident]

    def quiesce(self) -> None:
        """Let the worker report what it has (so it is idle while a host stamp is taken)."""
        self.tel.force_flush(5.0)

    def _timed_copy(self, phase: str, direction: str, nbytes: int, dst: Any, src: Any,
                    expect_ack: bool = False) -> tuple[dict[str, Any], Any]:
        """One copy alone on the side stream: independent events outside the telemetry's,
        host stamps around it; the device synchronized before and after."""
        backend, stream = self.backend, self.stream
        ref0, ev0, ev1, ref1 = backend.event(), backend.event(), backend.event(), backend.event()
        self.quiesce()
        backend.synchronize()
        ref0.record(stream)
        host_before = time.time_ns()
        ev0.record(stream)
        host_launch = time.time_ns()
        backend.copy(dst, src, stream)
        ev1.record(stream)
        ref1.record(stream)
        op = self._register(phase, direction, nbytes, ev0, ev1, expect_ack)
        handle = self._submit(op, ev0, ev1)
        backend.synchronize()
        host_after = time.time_ns()
        op.update(host_before_ns=host_before, host_launch_ns=host_launch, host_after_ns=host_after,
                  host_ns=host_after - host_before, ref_ns=backend.truth_ns(ref0, ref1),
                  events_ns=backend.truth_ns(ev0, ev1), submitted=handle is not None)
        self._events.pop(op["id"], None)
        return op, handle

    # -- phases ------------------------------------------------------------------------
    def phase_copies(self) -> None:
        backend, args = self.backend, self.args
        for nbytes in self.sizes:
            print(f"[gpu_validate] copies: {_mib(nbytes)} x {args.reps} per direction", flush=True)
            with self.report.guard(f"phase: copies, {_mib(nbytes)}"):  # one size failing: the others still run
                self._copies_of_size(nbytes)

    def _copies_of_size(self, nbytes: int) -> None:
        backend, args = self.backend, self.args
        dev, host = backend.buffers(nbytes)
        try:
            for direction in DIRECTIONS:
                dst, src = (host, dev) if direction == "offload" else (dev, host)
                for _ in range(2):  # warm-up, not reported
                    backend.copy(dst, src, self.stream)
                    backend.synchronize()
                for rep in range(args.reps):
                    op, _handle = self._timed_copy("copies", direction, nbytes, dst, src)
                    op["rep"] = rep
                    self._check_worker()
                if not args.no_bench:
                    self._bench(direction, nbytes, dst, src)
        finally:
            del dev, host
            dst = src = None
            backend.free()

    def _bench(self, direction: str, nbytes: int, dst: Any, src: Any) -> None:
        entry: dict[str, Any] = {"direction": direction, "bytes": nbytes}
        try:
            non_blocking = not self.backend.dry
            entry.update(self.backend.bench(lambda: dst.copy_(src, non_blocking=non_blocking), self.stream))
        except Exception as exc:  # reported, never fatal: the 2% target uses the event reference
            entry["error"] = repr(exc)
            self.report.errors.append({"where": f"do_bench {direction} {_mib(nbytes)}", "error": repr(exc),
                                       "traceback": traceback.format_exc()})
        self.bench.append(entry)

    def late_ack_size(self) -> int:
        big = [s for s in self.sizes if s >= TARGET_MIN_MIB * MIB]
        return min((s for s in big if s >= 64 * MIB), default=max(big or self.sizes))

    def phase_late_ack(self) -> None:
        nbytes = self.late_ack_size()
        delay_s = self.args.ack_delay_ms / 1e3
        print(f"[gpu_validate] late ack: {_mib(nbytes)}, acked {self.args.ack_delay_ms:g} ms after the copy, "
              f"x {self.args.ack_reps} per direction", flush=True)
        dev, host = self.backend.buffers(nbytes)
        try:
            for direction in DIRECTIONS:
                dst, src = (host, dev) if direction == "offload" else (dev, host)
                self.backend.copy(dst, src, self.stream)  # warm-up
                self.backend.synchronize()
                for _ in range(self.args.ack_reps):
                    op, handle = self._timed_copy("late_ack", direction, nbytes, dst, src, expect_ack=True)
                    time.sleep(delay_s)  # the copy finished at host_after at the latest
                    op["ack_host_ns"] = time.time_ns()
                    self.tel.ack(handle)
                    self._check_worker()
        finally:
            del dev, host
            dst = src = None
            self.backend.free()

    def phase_overhead(self) -> None:
        """``submit()`` alone, timed with perf_counter_ns, with real recorded events and a small
        copy in flight on the side stream, one op every ``--interval-us`` (the worker runs
        between ops, as in production); against an empty call with the same arguments."""
        backend, stream, tel = self.backend, self.stream, self.tel
        n, nbytes = self.args.overhead_ops, 64 * 1024
        print(f"[gpu_validate] caller overhead: {n} submit() calls, one every {self.args.interval_us} us", flush=True)
        dev, host = backend.buffers(nbytes)
        events = [(backend.event(), backend.event()) for _ in range(n)]
        tokens = {"kv": 1}

        def empty(*_args: Any, **_kwargs: Any) -> None:
            return None

        submit_ns: list[int] = []
        empty_ns: list[int] = []
        interval = int(self.args.interval_us * 1000)
        perf = time.perf_counter_ns
        self.quiesce()
        deadline = perf()
        for i in range(n):
            direction = DIRECTIONS[i % 2]
            dst, src = (host, dev) if direction == "offload" else (dev, host)
            ev0, ev1 = events[i]
            op = self._register("overhead", direction, nbytes, ev0, ev1)
            attrs = {ATTR_ID: op["id"]}
            deadline = bench_common.wait_until(deadline + interval, spin_ns=20_000)
            ev0.record(stream)
            backend.copy(dst, src, stream)
            ev1.record(stream)
            if i % 2:  # alternate which call goes first
                t0 = perf()
                empty(direction, tokens, nbytes, PAGE_SIZE, ev0, ev1, True, "direct", attrs, expect_ack=False)
                t1 = perf()
                handle = tel.submit(direction, tokens, nbytes, PAGE_SIZE, ev0, ev1, True, "direct", attrs,
                                    expect_ack=False)
                t2 = perf()
                empty_ns.append(t1 - t0)
                submit_ns.append(t2 - t1)
            else:
                t0 = perf()
                handle = tel.submit(direction, tokens, nbytes, PAGE_SIZE, ev0, ev1, True, "direct", attrs,
                                    expect_ack=False)
                t1 = perf()
                empty(direction, tokens, nbytes, PAGE_SIZE, ev0, ev1, True, "direct", attrs, expect_ack=False)
                t2 = perf()
                submit_ns.append(t1 - t0)
                empty_ns.append(t2 - t1)
            op["submitted"] = handle is not None
            if i % 256 == 0:
                self._check_worker()
        self._read_truth()
        del dev, host
        backend.free()
        self.overhead = {"ops": n, "copy_bytes": nbytes, "interval_us": self.args.interval_us,
                         "submit_ns": submit_ns, "empty_call_ns": empty_ns}

    def collect(self) -> list[Any]:
        """Flush until every op's span is exported (or the deadline); the spans."""
        deadline = time.monotonic() + 30.0
        want = {op["id"] for op in self.ops if op.get("submitted")}
        while True:
            self.tel.force_flush(10.0)
            spans = list(self.exporter.get_finished_spans())
            have = {s.attributes.get(ATTR_ID) for s in spans}
            if want <= have or time.monotonic() > deadline:
                return spans
            time.sleep(0.05)

    def metric_points(self) -> dict[str, list[Any]]:
        found: dict[str, list[Any]] = {}
        data = self.reader.get_metrics_data()
        for rm in data.resource_metrics if data else ():
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    found.setdefault(metric.name, []).extend(metric.data.data_points)
        return found

    def close(self) -> None:
        try:
            self.tel.shutdown()
        finally:
            self.tracer_provider.shutdown()
            self.meter_provider.shutdown()

    # -- analysis and checks -------------------------------------------------------------
    def attach_spans(self, spans: list[Any]) -> dict[str, Any]:
        by_id: dict[Any, list[Any]] = {}
        for span in spans:
            by_id.setdefault(span.attributes.get(ATTR_ID), []).append(span)
        for op in self.ops:
            found = by_id.get(op["id"], [])
            op["spans"] = len(found)
            if not found:
                continue
            span = found[0]
            attrs = span.attributes
            op["span_start_ns"] = span.start_time
            op["span_end_ns"] = span.end_time
            op["span_ns"] = span.end_time - span.start_time
            op["timing_source"] = attrs.get(sc.TIMING_SOURCE)
            op["origin"] = attrs.get(sc.ORIGIN)
            op["anchored"] = sc.QUEUE_WAIT_US in attrs  # set only when the anchor placed the span
            op["acked"] = attrs.get(sc.ACKED)
            op["ack_delay_us"] = attrs.get(sc.ACK_DELAY_US)
            op["error"] = attrs.get(sc.ERROR_TYPE)  # error spans are not in the transfer metrics
            op["span_events"] = [e.name for e in span.events]
            if op.get("events_ns"):
                op["ratio_events"] = op["span_ns"] / op["events_ns"]
            if op.get("ref_ns"):
                op["ratio_ref"] = op["span_ns"] / op["ref_ns"]
                op["gbs_ref"] = _gbs(op["bytes"], op["ref_ns"])
            if op["span_ns"] > 0:
                op["gbs_span"] = _gbs(op["bytes"], op["span_ns"])
            if "host_before_ns" in op:
                op["anchor_error_ns"] = op["span_start_ns"] - op["host_before_ns"]
        return by_id

    def check_spans(self, by_id: dict[Any, list[Any]], spans: list[Any]) -> None:
        submitted = [op for op in self.ops if op.get("submitted")]
        missing = [op["id"] for op in self.ops if op["spans"] == 0]
        dupes = [op["id"] for op in self.ops if op["spans"] > 1]
        stray = len([s for s in spans if s.attributes.get(ATTR_ID) not in {op["id"] for op in self.ops}])
        seen = [op for op in self.ops if op["spans"]]
        not_device = [op["id"] for op in seen if op.get("timing_source") != "device_event"]
        not_anchored = [op["id"] for op in seen if not op.get("anchored")]
        ok = (bool(self.ops) and len(submitted) == len(self.ops) and not missing and not dupes and not stray
              and not not_device and not not_anchored)
        self.report.add(
            "spans: one per op, device_event, anchored", "wiring",
            f"{len(seen)}/{len(self.ops)} ops; refused {len(self.ops) - len(submitted)}, dup {len(dupes)}, "
            f"stray {stray}, not device_event {len(not_device)}, not anchored {len(not_anchored)}",
            "one per op, all", ok)
        self.analysis["spans"] = {"ops": len(self.ops), "spans": len(spans), "missing": missing[:50],
                                  "duplicated": dupes[:50], "not_device_event": not_device[:50],
                                  "not_anchored": not_anchored[:50]}

    def check_truth(self) -> None:
        pairs = [op for op in self.ops if op["spans"] and op.get("events_ns") is not None]
        diffs = [abs(op["span_ns"] - op["events_ns"]) for op in pairs]
        worst = max(diffs, default=float("nan"))
        what = "stand-in truth" if self.backend.dry else "its own events (read back)"
        ok = bool(pairs) and len(pairs) == len(self.ops) and worst <= TRUTH_TOLERANCE_NS
        self.report.add(f"span duration == {what}", "wiring",
                        f"max |diff| {worst:.0f} ns over {len(pairs)}/{len(self.ops)} ops",
                        f"<= {TRUTH_TOLERANCE_NS} ns, all ops", ok)

    def check_metrics(self) -> None:
        points = self.metric_points()
        spans: dict[tuple[Any, Any], list[int]] = {}
        for op in self.ops:
            if op["spans"] and op.get("error") is None:
                spans.setdefault((op["direction"], op.get("timing_source")), []).append(op["span_ns"])
        hist: dict[tuple[Any, Any], list[float]] = {}
        for p in points.get(sc.TRANSFER_DURATION[0], []):
            key = (p.attributes.get(sc.DIRECTION), p.attributes.get(sc.TIMING_SOURCE))
            acc = hist.setdefault(key, [0, 0.0])
            acc[0] += p.count
            acc[1] += p.sum
        problems = []
        for key in set(spans) | {k for k, v in hist.items() if v[0]}:
            count, total = hist.get(key, [0, 0.0])
            want = spans.get(key, [])
            if count != len(want) or abs(total - sum(want) / 1e9) > METRIC_SUM_TOLERANCE_S:
                problems.append(f"{key}: histogram {count} / {total:.6f} s vs spans {len(want)} / {sum(want) / 1e9:.6f} s")
        bytes_by_dir: dict[Any, int] = {}
        for p in points.get(sc.TRANSFER_BYTES[0], []):
            d = p.attributes.get(sc.DIRECTION)
            bytes_by_dir[d] = bytes_by_dir.get(d, 0) + int(p.value)
        for d in DIRECTIONS:
            want_bytes = sum(op["bytes"] for op in self.ops
                             if op["spans"] and op.get("error") is None and op["direction"] == d)
            if bytes_by_dir.get(d, 0) != want_bytes:
                problems.append(f"{d}: bytes counter {bytes_by_dir.get(d, 0)} vs spans {want_bytes}")
        n = sum(len(v) for v in spans.values())
        self.analysis["metrics"] = {"duration_histogram": {f"{k[0]}/{k[1]}": v for k, v in hist.items()},
                                    "bytes": bytes_by_dir, "problems": problems}
        self.report.add("metrics: duration histogram, bytes == spans", "wiring",
                        f"{n} spans without error: " + ("count, sum and bytes equal" if not problems else
                                                        f"{len(problems)} differ (JSON: analysis.metrics)"),
                        "equal", bool(n) and not problems)

    def _groups(self) -> dict[tuple[str, int], list[dict[str, Any]]]:
        groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for op in self.ops:
            if op["phase"] == "copies" and op.get("ratio_ref") is not None:
                groups.setdefault((op["direction"], op["bytes"]), []).append(op)
        return groups

    def check_durations(self) -> None:
        groups = self._groups()
        per_size = []
        for (direction, nbytes), ops in sorted(groups.items()):
            ratios = [op["ratio_ref"] for op in ops]
            per_size.append({"direction": direction, "bytes": nbytes, "n": len(ops),
                             "ratio_ref_median": _median(ratios), "ratio_ref_min": min(ratios),
                             "ratio_ref_max": max(ratios),
                             "span_ms_median": _median([op["span_ns"] for op in ops]) / 1e6,
                             "ref_ms_median": _median([op["ref_ns"] for op in ops]) / 1e6,
                             "host_ms_median": _median([op["host_ns"] for op in ops]) / 1e6})
        self.analysis["durations"] = per_size
        target = f"within {TARGET_RATIO:.0%} (>= {TARGET_MIN_MIB} MiB)"
        for direction in DIRECTIONS:
            big = [op["ratio_ref"] for (d, b), ops in groups.items() if d == direction and b >= TARGET_MIN_MIB * MIB
                   for op in ops]
            small = [op["ratio_ref"] for (d, b), ops in groups.items() if d == direction and b < TARGET_MIN_MIB * MIB
                     for op in ops]
            if big:
                worst = max(big, key=lambda r: abs(r - 1.0))
                self.report.add(f"duration / independent, {direction}", "target",
                                f"median {_median(big):.4f}, worst {worst:.4f} (n={len(big)})", target,
                                all(abs(r - 1.0) <= TARGET_RATIO for r in big))
            else:
                self.report.skip(f"duration / independent, {direction}", "target",
                                 f"no copies >= {TARGET_MIN_MIB} MiB (--sizes)", target)
            gaps = [(op["ref_ns"] - op["span_ns"]) / 1e3 for (d, _), ops in groups.items() if d == direction
                    for op in ops]
            if gaps:  # the bracket's own cost: constant over sizes, or the spans miss part of the copy
                self.report.add(f"independent - span, {direction}, all sizes", "info",
                                f"median {_median(gaps):.1f} us, max {max(gaps):.1f} us (n={len(gaps)})", "report", None)
            if small:
                worst = max(small, key=lambda r: abs(r - 1.0))
                self.report.add(f"duration / independent, {direction}, < {TARGET_MIN_MIB} MiB", "info",
                                f"median {_median(small):.4f}, worst {worst:.4f} (n={len(small)})", "report", None)

    def check_host_clock(self) -> None:
        groups = self._groups()
        smallest = min((b for _d, b in groups), default=None)
        if smallest is None:
            raise RuntimeError("no copies with a span")
        parts = []
        for direction in DIRECTIONS:
            ops = groups.get((direction, smallest), [])
            if ops:
                parts.append(f"{direction} {_median([op['host_ns'] for op in ops]) / _median([op['ref_ns'] for op in ops]):.2f}x")
        self.report.add(f"host clock around a synchronized copy / device, {_mib(smallest)}", "info",
                        ", ".join(parts), "report (why device events)", None)

    def check_bench_and_bandwidth(self) -> None:
        groups = self._groups()
        peak: dict[str, float] = {}
        table = []
        bench = {(b["direction"], b["bytes"]): b for b in self.bench}
        for (direction, nbytes), ops in sorted(groups.items()):
            row = {"direction": direction, "bytes": nbytes,
                   "gbs_span": _gbs(nbytes, _median([op["span_ns"] for op in ops])),
                   "gbs_ref": _gbs(nbytes, _median([op["ref_ns"] for op in ops]))}
            b = bench.get((direction, nbytes))
            if b and b.get("ms"):
                row["gbs_bench"] = _gbs(nbytes, b["ms"] * 1e6)
                row["span_over_bench"] = _median([op["span_ns"] for op in ops]) / (b["ms"] * 1e6)
            for key in ("gbs_ref", "gbs_bench"):
                if math.isfinite(row.get(key, float("nan"))):
                    peak[direction] = max(peak.get(direction, 0.0), row[key])
            table.append(row)
        for row in table:
            if peak.get(row["direction"]):
                row["span_of_peak"] = row["gbs_span"] / peak[row["direction"]]
        self.analysis["bandwidth"] = {"peak_gbs": peak, "per_size": table}
        for direction in DIRECTIONS:
            rows = [r for r in table if r["direction"] == direction]
            if not rows:
                continue
            last = rows[-1]
            self.report.add(f"bandwidth {direction}, {_mib(last['bytes'])} (span)", "info",
                            f"{last['gbs_span']:.2f} GB/s = {last.get('span_of_peak', float('nan')):.1%} "
                            f"of measured peak {peak.get(direction, float('nan')):.2f} GB/s", "report", None)
            ratios = [r["span_over_bench"] for r in rows if "span_over_bench" in r]
            benches = [b for b in self.bench if b["direction"] == direction]
            if ratios:
                self.report.add(f"duration / do_bench, {direction}", "info",
                                f"{ratios[-1]:.4f} at {_mib(rows[-1]['bytes'])}; "
                                f"{min(ratios):.3f}..{max(ratios):.3f} over sizes", "report", None)
            elif benches:
                why = benches[0].get("skipped") or benches[0].get("error") or "no result"
                self.report.skip(f"duration / do_bench, {direction}", "info", str(why)[:120], "report")

    def check_anchor(self) -> None:
        ops = [op for op in self.ops if op["phase"] == "copies" and op.get("anchor_error_ns") is not None]
        if not ops:
            raise RuntimeError("no copies with a span")
        errors_us = [abs(op["anchor_error_ns"]) / 1e3 for op in ops]
        tol = TARGET_ANCHOR_US * 1e3
        inside = [op for op in ops
                  if op["host_before_ns"] - tol <= op["span_start_ns"] <= op["host_after_ns"]]
        worst = max(ops, key=lambda op: abs(op["anchor_error_ns"]))
        launch_us = [(op["host_launch_ns"] - op["host_before_ns"]) / 1e3 for op in ops]
        self.analysis["anchor"] = {
            "n": len(ops), "abs_error_us_median": _median(errors_us), "abs_error_us_p99": _pct(errors_us, 0.99),
            "abs_error_us_max": max(errors_us),
            "signed_error_us_median": _median([op["anchor_error_ns"] / 1e3 for op in ops]),
            "inside_bracket": len(inside), "worst_op": worst["id"],
            "host_launch_us_median": _median(launch_us), "host_launch_us_max": max(launch_us),
        }
        self.report.add("anchor error, median |span start - host before|", "target",
                        f"{_median(errors_us):.2f} us (signed {self.analysis['anchor']['signed_error_us_median']:+.2f},"
                        f" n={len(ops)})", f"< {TARGET_ANCHOR_US:g} us", _median(errors_us) < TARGET_ANCHOR_US)
        self.report.add("anchor error, max", "target",
                        f"{max(errors_us):.2f} us (p99 {_pct(errors_us, 0.99):.2f}); {len(inside)}/{len(ops)} inside "
                        f"[before - {TARGET_ANCHOR_US:g} us, after]", f"< {TARGET_ANCHOR_US:g} us, all inside",
                        max(errors_us) < TARGET_ANCHOR_US and len(inside) == len(ops))

    def check_overhead(self) -> None:
        o = self.overhead
        if not o.get("submit_ns"):
            raise RuntimeError("the overhead phase did not run")
        sub_us = [x / 1e3 for x in o["submit_ns"]]
        emp_us = [x / 1e3 for x in o["empty_call_ns"]]
        net = _median(sub_us) - _median(emp_us)
        o.update(submit_us_median=_median(sub_us), submit_us_p99=_pct(sub_us, 0.99),
                 empty_call_us_median=_median(emp_us), net_us_median=net,
                 net_us_p99=_pct(sub_us, 0.99) - _median(emp_us), worker_alive=self.worker_seen)
        self.report.add("caller: submit() per op, real events, net", "target",
                        f"median {net:.2f} us (submit {_median(sub_us):.2f}, empty call {_median(emp_us):.2f}),"
                        f" p99 {_pct(sub_us, 0.99):.2f} us, n={len(sub_us)}", f"<= {TARGET_OVERHEAD_US:g} us median",
                        net <= TARGET_OVERHEAD_US)

    def check_worker(self) -> None:
        self.report.add("poller running during the run", "wiring",
                        "yes" if self.worker_seen else f"no {WORKER_THREAD} thread seen", "yes", self.worker_seen)

    def check_late_ack(self) -> None:
        ops = [op for op in self.ops if op["phase"] == "late_ack"]
        if not ops:
            raise RuntimeError("the late-ack phase did not run")
        delay_us = self.args.ack_delay_ms * 1e3
        ok_ops = []
        for op in ops:
            good = (op["spans"] == 1 and op.get("ratio_ref") is not None
                    and abs(op["ratio_ref"] - 1.0) <= TARGET_RATIO and op.get("acked") is True
                    and op.get("origin") == "merged_op" and "acked" in op.get("span_events", ())
                    and op.get("ack_delay_us") is not None and op["ack_delay_us"] >= delay_us - TARGET_ANCHOR_US)
            op["late_ack_ok"] = good
            if good:
                ok_ops.append(op)
        ratios = [op["ratio_ref"] for op in ops if op.get("ratio_ref") is not None]
        delays = [op["ack_delay_us"] / 1e3 for op in ops if op.get("ack_delay_us") is not None]
        span_ms = [op["span_ns"] / 1e6 for op in ops if op.get("span_ns") is not None]
        measured = (f"{len(ok_ops)}/{len(ops)} ok; duration/independent "
                    f"{min(ratios, default=float('nan')):.4f}..{max(ratios, default=float('nan')):.4f}, "
                    f"span {_median(span_ms):.3f} ms, ack_delay {min(delays, default=float('nan')):.1f}.."
                    f"{max(delays, default=float('nan')):.1f} ms")
        self.report.add(f"late ack ({self.args.ack_delay_ms:g} ms, {_mib(ops[0]['bytes'])}): duration unchanged",
                        "target", measured, f"within {TARGET_RATIO:.0%}, acked, delay >= {self.args.ack_delay_ms:g} ms",
                        len(ok_ops) == len(ops))


# --------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------


def _sizes(text: str) -> list[float]:
    sizes = [float(x) for x in text.split(",") if x.strip()]
    if not sizes or any(s <= 0 for s in sizes):
        raise argparse.ArgumentTypeError("sizes: comma-separated positive MiB values, e.g. 1,4,16")
    return sizes


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry", action="store_true",
                        help="CPU stand-in backend (automatic when torch.cuda.is_available() is False)")
    parser.add_argument("--require-cuda", action="store_true",
                        help="exit 2 instead of falling back to the dry mode when CUDA is not available")
    parser.add_argument("--sizes", type=_sizes, default=None,
                        help=f"copy sizes in MiB (default {','.join(map(str, CUDA_SIZES_MIB))}; "
                             f"dry {','.join(map(str, DRY_SIZES_MIB))})")
    parser.add_argument("--reps", type=int, default=None, help="copies per size and direction (default 20; dry 3)")
    parser.add_argument("--overhead-ops", type=int, default=None, help="submit() calls timed (default 2000; dry 400)")
    parser.add_argument("--interval-us", type=float, default=200.0, help="pacing of the overhead ops (default 200)")
    parser.add_argument("--ack-delay-ms", type=float, default=50.0, help="late ack delay (default 50)")
    parser.add_argument("--ack-reps", type=int, default=None, help="late-ack ops per direction (default 3; dry 2)")
    parser.add_argument("--no-bench", action="store_true", help="skip triton.testing.do_bench")
    parser.add_argument("--out", default="gpu_validate_results.json", help="full results (JSON)")
    parser.add_argument("--watchdog-s", type=float, default=420.0,
                        help="dump every thread's stack and exit if the run takes longer (0: off)")
    args = parser.parse_args(argv)
    for name in ("reps", "overhead_ops", "ack_reps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def _defaults(args: argparse.Namespace, dry: bool) -> None:
    if args.sizes is None:
        args.sizes = list(DRY_SIZES_MIB if dry else CUDA_SIZES_MIB)
    if args.reps is None:
        args.reps = 3 if dry else 20
    if args.overhead_ops is None:
        args.overhead_ops = 400 if dry else 2000
    if args.ack_reps is None:
        args.ack_reps = 2 if dry else 3


def environment(backend: Any) -> dict[str, Any]:
    """What ran. A backend that cannot describe itself leaves ``backend_environment_error``."""
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = "not installed"
    env = bench_common.machine("otel_hicache", otel_hicache.__version__, torch=torch.__version__,
                               triton=triton_version)
    env["timestamp_utc"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    # OTEL_HICACHE_* values (they tune the pipeline); other OTEL_* names only (headers may hold secrets)
    env["otel_hicache_variables"] = {k: v for k, v in os.environ.items() if k.startswith("OTEL_HICACHE_")}
    env["other_otel_variables_set"] = sorted(k for k in os.environ
                                             if k.startswith("OTEL_") and not k.startswith("OTEL_HICACHE_"))
    try:
        env.update(backend.environment())
    except Exception as exc:  # the facts above are still worth having
        env["backend_environment_error"] = repr(exc)
    return env


def _write(path: Path, results: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_jsonable(results), indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def main(argv: Sequence[str] | None = None, backend: Any = None, started: float | None = None) -> int:
    """Run everything; returns the exit status. ``backend``: a stand-in for tests (default:
    CUDA if available, else the dry backend). ``started``: ``perf_counter()`` at process start."""
    args = parse_args(argv)
    began = time.perf_counter() if started is None else started
    note = ""
    if backend is None:
        if args.dry:
            backend, note = DryBackend(), "--dry"
        elif torch.cuda.is_available():
            backend = CudaBackend()
        elif args.require_cuda:
            print("gpu_validate: --require-cuda, but torch.cuda.is_available() is False", file=sys.stderr)
            return 2
        else:
            backend, note = DryBackend(), "torch.cuda.is_available() is False"
    _defaults(args, backend.dry)
    if args.watchdog_s > 0:
        faulthandler.dump_traceback_later(args.watchdog_s, exit=True)
    if backend.dry:
        print(f"[gpu_validate] DRY MODE ({note or 'stand-in backend'}): stand-in events on the CPU; "
              f"targets are printed but are not a GPU measurement; only the wiring decides the exit status",
              flush=True)
    report = Report(backend.dry)
    out = Path(args.out)
    results: dict[str, Any] = {
        "tool": "benchmarks/gpu_validate.py",
        "mode": "dry" if backend.dry else "cuda",
        "dry_reason": note or None,
        "complete": False,
        "settings": {k: v for k, v in vars(args).items()},
        "targets": {"duration_ratio_within": TARGET_RATIO, "duration_ratio_min_bytes": TARGET_MIN_MIB * MIB,
                    "anchor_error_us": TARGET_ANCHOR_US, "caller_overhead_us_median": TARGET_OVERHEAD_US,
                    "runtime_s": TARGET_RUNTIME_S},
    }
    validation: Validation | None = None
    try:
        with report.guard("environment", "info"):
            results["environment"] = environment(backend)
            if "backend_environment_error" in results["environment"]:
                report.add("environment", "info", results["environment"]["backend_environment_error"][:120],
                           "device facts", False)
        with report.guard("set-up"):
            validation = Validation(backend, args, report)
        if validation is not None:
            v = validation

            def save() -> None:
                results.update(ops=v.ops, do_bench=v.bench, overhead=v.overhead, analysis=v.analysis,
                               checks=report.rows, errors=report.errors)
                try:
                    _write(out, results)
                except Exception as exc:  # the final write reports it in the table
                    print(f"[gpu_validate] cannot write {out}: {exc!r}", flush=True)

            for name, phase in (("phase: copies", v.phase_copies), ("phase: late ack", v.phase_late_ack),
                                ("phase: caller overhead", v.phase_overhead)):
                with report.guard(name):
                    phase()
                save()
            spans: list[Any] = []
            by_id: dict[Any, list[Any]] = {}
            with report.guard("collect spans"):
                spans = v.collect()
                by_id = v.attach_spans(spans)
            for name, check, kind, target in (
                ("check: spans", lambda: v.check_spans(by_id, spans), "wiring", ""),
                ("check: durations vs events", v.check_truth, "wiring", ""),
                ("check: metrics", v.check_metrics, "wiring", ""),
                ("check: duration vs independent", v.check_durations, "target", f"within {TARGET_RATIO:.0%}"),
                ("check: host clock", v.check_host_clock, "info", ""),
                ("check: do_bench, bandwidth", v.check_bench_and_bandwidth, "info", ""),
                ("check: anchor error", v.check_anchor, "target", f"< {TARGET_ANCHOR_US:g} us"),
                ("check: caller overhead", v.check_overhead, "target", f"<= {TARGET_OVERHEAD_US:g} us median"),
                ("check: worker", v.check_worker, "wiring", ""),
                ("check: late ack", v.check_late_ack, "target", f"within {TARGET_RATIO:.0%}"),
            ):
                with report.guard(name, kind, target):
                    check()
            save()
    finally:
        if validation is not None:
            with report.guard("shutdown"):
                validation.close()
        runtime = time.perf_counter() - began
        report.add("runtime", "target", f"{runtime:.1f} s", f"< {TARGET_RUNTIME_S:g} s", runtime < TARGET_RUNTIME_S)
        results.update(runtime_s=runtime, checks=report.rows, errors=report.errors)
        if validation is not None:
            results.update(ops=validation.ops, do_bench=validation.bench, overhead=validation.overhead,
                           analysis=validation.analysis)
        # the results file: written, then read back
        try:
            _write(out, results)
            back = json.loads(out.read_text(encoding="utf-8"))
            n_ops = len(back.get("ops") or [])
            report.add("results json", "wiring", f"{out} ({n_ops} ops), read back", "written", n_ops > 0)
        except Exception as exc:  # pylint: disable=broad-except
            report.error("results json", exc)
        failures = report.failures()
        decided = "wiring and checks that raised" if backend.dry else "wiring and targets"
        report.rows.append({"check": "overall", "kind": "wiring",
                            "measured": f"{len(failures)} failing ({decided})",
                            "target": "none failing", "status": "FAIL" if failures else "PASS"})
        results.update(complete=True, checks=report.rows, exit_status=1 if failures else 0)
        try:
            _write(out, results)
        except Exception as exc:  # pylint: disable=broad-except
            print(f"[gpu_validate] cannot write {out}: {exc!r}", flush=True)
        if args.watchdog_s > 0:
            faulthandler.cancel_dump_traceback_later()
        env = results.get("environment") or {}
        print(flush=True)
        print(f"== gpu_validate, {'DRY MODE, ' + DRY_LABEL if backend.dry else 'CUDA'}: "
              f"{env.get('device_name', '?')}, torch {torch.__version__}, CUDA {env.get('torch_cuda', '-')}, "
              f"driver {env.get('driver_version', '-')}, otel-hicache {otel_hicache.__version__}; "
              f"full results: {out}", flush=True)
        print(bench_common.table([[r["check"], r["measured"], r["target"], r["status"]] for r in report.rows],
                                 ["check", "measured", "target", "result"], left=4), flush=True)
    return results["exit_status"]


if __name__ == "__main__":
    status = main(started=_STARTED)
    # The table stays the last thing printed: leave without interpreter teardown, where
    # extension modules (triton's nanobind) may print notices. Everything was shut down,
    # flushed and written by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
