"""The fault matrix, in-process rows: queue overflow, events that raise or never complete,
concurrent submitters, fork and spawn children, shutdown with work in flight.

Each case checks that the caller never sees an exception, that counters stay
exact for everything recorded, that what could not be delivered is counted in a
self-metric and warned about once, and that ``submit()`` never blocks longer
than its normal cost. That cost is measured in the same test without the fault
and compared with ratios, never absolute times (the machine is shared and
noisy): the p99, and the worst case at the same number of calls (a worst case
grows with the number of calls: one OS preemption or garbage collection in a
million). Where ``submit()`` could wait for something long (a worker cycle,
``shutdown()``), even the overall worst case must stay well below its duration.
Each test prints a one-line summary (``pytest -s``); the measured values are
also in the assertion messages.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
from array import array
from pathlib import Path
from typing import Any, Callable, Sequence

import pytest
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import StatusCode

from harness import Harness
from otel_hicache import semconv as sc
from otlp_receiver import HttpReceiver
from otlp_receiver import attributes as otlp_attributes

pytestmark = pytest.mark.slow  # processes, receivers, seconds each: CI's later step (pytest -m slow)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POOLS = {"kv": 64}  # one block per op at page size 64: the blocks counter counts ops
OP_BYTES = 4096


# -- shared utilities ----------------------------------------------------------------------
class CountingSpanExporter(SpanExporter):
    """Counts exported spans by status. With ``keep=True`` it also keeps, per span, its ids and the
    attributes the tests check (never the span itself); without, it holds no memory per span."""

    def __init__(self, keep: bool = False) -> None:
        self.lock = threading.Lock()
        self.ok = 0
        self.errors: dict[str, int] = {}
        self.kept: list[tuple[int, int, Any, int, int, Any]] | None = [] if keep else None

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        with self.lock:
            for span in spans:
                error = span.attributes.get("error.type") if span.status.status_code is StatusCode.ERROR else None
                if error is None:
                    self.ok += 1
                else:
                    self.errors[error] = self.errors.get(error, 0) + 1
                if self.kept is not None:
                    self.kept.append((span.context.span_id, span.context.trace_id, error,
                                      span.attributes.get(sc.BYTES), span.end_time - span.start_time,
                                      span.attributes.get(sc.ACKED)))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


class Rig(Harness):
    """A TransferTelemetry on a simulated device: spans at 100% into ``spans``, metrics on."""

    def __init__(self, spans: SpanExporter | None = None) -> None:
        super().__init__(spans=spans if spans is not None else CountingSpanExporter())
        self.pipeline = self.tel._pipeline  # pylint: disable=protected-access

    def done_copy(self) -> tuple[Any, Any]:
        """A start/finish pair of a 1 ms copy that already completed."""
        return self.device.copy(self.device.time_ns() - 2_000_000, 1.0)

    def flush(self, timeout_s: float = 10.0) -> bool:
        return self.pipeline.flush(timeout_s)

    def points(self, name: str, **attrs: Any) -> list[Any]:
        data = self.reader.get_metrics_data()
        return [p for rm in (data.resource_metrics if data else ()) for sm in rm.scope_metrics for m in sm.metrics
                if m.name == name for p in m.data.data_points
                if all(p.attributes.get(k) == v for k, v in attrs.items())]

    def counter(self, name: str, **attrs: Any) -> float:
        return sum(p.value for p in self.points(name, **attrs))

    def count(self, name: str, **attrs: Any) -> int:
        """Points recorded into a histogram (one per completed op)."""
        return sum(p.count for p in self.points(name, **attrs))


@pytest.fixture
def rig() -> Any:
    created: list[Rig] = []

    def make(**kwargs: Any) -> Rig:
        r = Rig(**kwargs)
        created.append(r)
        return r

    yield make
    for r in created:
        r.close()


def percentile(samples: Sequence[int], q: float) -> int:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def worst_per(samples: Sequence[int], n: int) -> list[int]:
    """The worst case of every ``n`` consecutive calls, sorted (the last is the overall worst)."""
    return sorted(max(samples[i:i + n]) for i in range(0, len(samples) - n + 1, n)) or [max(samples)]


def timing(samples: Sequence[int], chunk: int) -> dict[str, float]:
    """submit() times in us: p50, p99, the overall worst case, and the typical worst case of
    ``chunk`` calls (the median over consecutive chunks). A worst case grows with the number of
    calls (one OS preemption or garbage collection in a million), so runs of different lengths
    are compared on the worst case at the same number of calls."""
    worst = worst_per(samples, chunk)
    return {"p50": percentile(samples, 0.5) / 1e3, "p99": percentile(samples, 0.99) / 1e3,
            "max": max(samples) / 1e3, "worst": worst[len(worst) // 2] / 1e3, "n": len(samples), "chunk": chunk}


def fmt(stats: dict[str, float]) -> str:
    return (f"p50 {stats['p50']:.2f} us, p99 {stats['p99']:.2f} us, worst of {stats['chunk']} "
            f"{stats['worst']:.1f} us, max {stats['max']:.1f} us (n={stats['n']})")


def compare(fault: Sequence[int], base: Sequence[int], chunks: int = 5) -> tuple[dict, dict]:
    """Timing of a faulty run and of its baseline, the worst case at the same number of calls."""
    chunk = max(1, min(len(fault), len(base)) // chunks)
    return timing(fault, chunk), timing(base, chunk)


def assert_no_stall(fault_t: dict, base_t: dict, summary: str, p99: float = 3.0, worst: float = 10.0) -> None:
    """submit() under the fault costs what it costs without it, in the tail and in the worst
    case at the same number of calls (generous ratios, never absolute times)."""
    assert fault_t["p99"] <= p99 * base_t["p99"], summary
    assert fault_t["worst"] <= worst * base_t["worst"], summary


def stalls(fault_t: dict, base_t: dict, p99: float = 3.0, worst: float = 10.0) -> bool:
    """Whether assert_no_stall would fail."""
    return fault_t["p99"] > p99 * base_t["p99"] or fault_t["worst"] > worst * base_t["worst"]


class Timed:
    """Wraps a callable, timing each call (ns) into a list."""

    def __init__(self, func: Callable[..., Any]) -> None:
        self.func = func
        self.ns: list[int] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return self.func(*args, **kwargs)
        finally:
            self.ns.append(time.perf_counter_ns() - t0)


PACE_SLEEP_S = 0.0005


class Samples:
    """submit() times in ns, in an array allocated up front (no allocation while measuring)."""

    def __init__(self, size: int) -> None:
        self.ns = array("q", bytes(8 * size))
        self.n = 0

    def values(self) -> list[int]:
        return list(self.ns[: self.n])


def paced(submit_one: Callable[[], Any], rate: float, duration_s: float, samples: Samples,
          tick: Callable[[], None] | None = None) -> tuple[int, int, float]:
    """Call ``submit_one`` at ``rate`` per second for ``duration_s`` from this thread, in short
    bursts between sleeps (as a scheduler loop would), timing each call.
    Returns (calls, accepted, seconds)."""
    perf = time.perf_counter_ns
    interval_ns = 1e9 / rate
    total = min(int(rate * duration_s), len(samples.ns) - samples.n)
    ns, i = samples.ns, samples.n
    start = perf()
    end = start + int(duration_s * 1e9)
    calls = accepted = 0
    now = start
    while now < end and calls < total:
        due = min(total, int((now - start) / interval_ns) + 1)
        while calls < due:
            t0 = perf()
            handle = submit_one()
            now = perf()
            ns[i] = now - t0
            i += 1
            calls += 1
            if handle is not None:
                accepted += 1
            if now >= end:
                break
        if tick is not None:
            tick()
        time.sleep(PACE_SLEEP_S)
        now = perf()
    samples.n = i
    return calls, accepted, (perf() - start) / 1e9


def sustainable_rate(r: "Rig", submit_one: Callable[[], Any], batch: int, batches: int) -> float:
    """Records/s the worker completes: batches of ``batch`` submitted at once, each flushed."""
    t0 = time.perf_counter()
    for _ in range(batches):
        for _ in range(batch):
            assert submit_one() is not None
        assert r.flush()
    return batch * batches / (time.perf_counter() - t0)


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


# -- 1. queue overflow at 10x the sustainable rate ------------------------------------
OVERFLOW_CAP = 2048


@pytest.fixture
def overflow_env(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setenv("OTEL_HICACHE_MAX_QUEUE_SIZE", str(OVERFLOW_CAP))
    monkeypatch.setenv("OTEL_HICACHE_POLL_INTERVAL_MS", "1")
    return OVERFLOW_CAP


@pytest.fixture
def traced_memory() -> Any:
    """tracemalloc on for the whole test: rates, times and memory all measured under it."""
    tracemalloc.start()
    yield tracemalloc
    tracemalloc.stop()


def test_queue_overflow_at_10x_the_sustainable_rate(rig, overflow_env, warnings_log, traced_memory):
    """Offered 10x what the worker completes, for 2 s: memory bounded by the cap, every refusal
    counted exactly, one warning, and no submit() stall compared with a run below capacity."""
    cap = overflow_env
    r = rig()
    ev0, ev1 = r.done_copy()

    def submit_one() -> Any:
        return r.tel.submit("offload", POOLS, OP_BYTES, page_size=64, start_event=ev0, finish_event=ev1,
                            expect_ack=False)

    for _ in range(200):  # warm-up: attribute sets, aggregations, the anchor
        submit_one()
    assert r.flush()
    batch, batches = cap // 2, 6
    sustainable = sustainable_rate(r, submit_one, batch, batches)

    # The most one held record costs: completed, its span begun, waiting for its ack (the
    # record, its submission list, span context, exemplar context and span attributes).
    base_mem = traced_memory.get_traced_memory()[0]
    handles = [r.tel.submit("offload", POOLS, OP_BYTES, page_size=64, start_event=ev0, finish_event=ev1)
               for _ in range(cap)]
    assert r.flush() and r.pipeline.held == cap
    record_bytes = (traced_memory.get_traced_memory()[0] - base_mem) / cap
    for handle in handles:
        r.tel.ack(handle)
    r.device.advance(ms=10)  # the worker scans acks every 5 ms of its clock
    assert wait_until(lambda: r.flush() and r.pipeline._snapshot()[1] == 0)
    del handles

    over_rate, over_s, base_rate, base_s = 10 * sustainable, 2.0, 0.5 * sustainable, 1.0
    base_samples = Samples(int(base_rate * base_s) + 1)
    over_samples = Samples(int(over_rate * over_s) + 1)

    # below capacity: half the sustainable rate, the worker busy beside the caller
    base_calls, base_accepted, _ = paced(submit_one, base_rate, base_s, base_samples)
    assert r.flush()

    # overflow: 10x the sustainable rate
    held_max = [0]

    def tick() -> None:
        held_max[0] = max(held_max[0], r.pipeline._snapshot()[1])

    traced_memory.reset_peak()
    start_mem = traced_memory.get_traced_memory()[0]
    calls, accepted, seconds = paced(submit_one, over_rate, over_s, over_samples, tick)
    growth = traced_memory.get_traced_memory()[1] - start_mem
    assert r.flush()

    over_t, base_t = compare(over_samples.values(), base_samples.values())
    submitted = 200 + batch * batches + cap + base_calls + calls
    reported = r.count("hicache.transfer.duration", **{"hicache.direction": "offload"})
    dropped = r.counter("otel_hicache.records.dropped", reason="queue_full")
    summary = (f"overflow: sustainable {sustainable:,.0f}/s (tracemalloc on), offered {calls / seconds:,.0f}/s "
               f"({calls / seconds / sustainable:.1f}x) for {seconds:.2f} s: {calls} submits, {accepted} accepted, "
               f"{dropped:.0f} dropped (queue_full), a worker cycle {cap / sustainable * 1e3:.0f} ms; held record "
               f"{record_bytes:.0f} B, peak growth {growth / 1e3:.0f} kB <= cap x record "
               f"{cap * record_bytes / 1e3:.0f} kB, held max {held_max[0]}; "
               f"submit below capacity {fmt(base_t)} | overflow {fmt(over_t)}")
    print("\n" + summary)
    # no stall: a refused submit() costs no more than one below capacity, and not even the
    # overall worst case comes near waiting for a worker cycle (taking in and completing the
    # cap's worth of records: cap / sustainable rate)
    assert_no_stall(over_t, base_t, summary)
    assert over_t["max"] <= 0.5 * cap / sustainable * 1e6, summary
    assert calls / seconds > 5 * sustainable, summary  # really offered far beyond what the worker completes
    assert base_accepted == base_calls, summary  # the baseline never overflowed
    assert dropped > 0 and held_max[0] <= cap, summary
    # exact: every submit() is either reported or counted as dropped
    assert submitted == reported + dropped, summary
    assert accepted == calls - dropped, summary
    assert r.counter("hicache.transfer.blocks", **{"hicache.direction": "offload"}) == reported, summary
    assert r.spans.ok == reported and not r.spans.errors, summary
    assert r.count("hicache.transfer.ack_delay") == cap, summary
    assert r.counter("hicache.transfer.inflight") == 0, summary
    assert len([x for x in warnings_log.records if "queue full" in x.getMessage()]) == 1
    # bounded memory: never more than the cap's worth of held records
    assert growth <= cap * record_bytes, summary


# -- 2. events that raise, never complete, complete out of order; a small cap ------------
SMALL_CAP = 8


@pytest.fixture
def small_cap_env(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setenv("OTEL_HICACHE_MAX_QUEUE_SIZE", str(SMALL_CAP))
    monkeypatch.setenv("OTEL_HICACHE_TRANSFER_TIMEOUT_S", "1")
    monkeypatch.setenv("OTEL_HICACHE_ACK_TIMEOUT_S", "1")
    return SMALL_CAP


FAULTS = ("good", "good_acked", "good_never_acked", "good_host_clock", "raises", "start_raises", "stuck")


class Round:
    """``cap`` ops of the given kinds, in one round on the simulated clock: the good ones finish
    in random order 1-5 ms after submit, the stuck ones never, the raising ones raise from
    ``query()``. Then the acks, then 2 s (past the transfer timeout), then 2 s more (past the
    ack timeout of the completed ones nobody acks)."""

    def __init__(self, r: Rig, kinds: Sequence[str], rng: Any, next_id: Callable[[], int],
                 submit: Callable[..., Any]) -> None:
        self.r, self.kinds, self.rng, self.next_id, self.submit = r, kinds, rng, next_id, submit
        # op bytes (unique) -> (device duration or -1 on the host clock, hicache.acked: True,
        # False when the ack wait timed out, None when no ack was expected)
        self.good: dict[int, tuple[int, bool | None]] = {}
        self.failed = {"event_error": 0, "transfer_timeout": 0}

    def run(self, overflow: bool) -> int:
        """Returns the submits refused (one extra when ``overflow``)."""
        r, device = self.r, self.r.device
        t = device.time_ns()
        to_ack, to_raise = [], []
        for kind in self.kinds:
            op = self.next_id()
            start = t + self.rng.randrange(0, 500_000)
            duration = self.rng.randrange(1_000_000, 4_500_000)
            timing = kind != "good_host_clock"
            ev0, ev1 = device.event(timing).record(at_ns=start), device.event(timing).record(at_ns=start + duration)
            if kind == "raises":
                to_raise.append(ev1)
            elif kind == "start_raises":
                to_raise.append(ev0)
            elif kind == "stuck":
                ev1.never_completes()
            expect_ack = kind in ("good_acked", "good_never_acked")
            handle = self.submit("onboard", POOLS, op, page_size=64, start_event=ev0, finish_event=ev1,
                                 expect_ack=expect_ack)
            assert handle is not None, (kind, r.pipeline._snapshot()[1])  # every slot of the cap usable
            if kind.startswith("good"):
                self.good[op] = (duration if kind != "good_host_clock" else -1,
                                 {"good_acked": True, "good_never_acked": False}.get(kind))
                if kind == "good_acked":
                    to_ack.append(handle)
            else:
                self.failed["event_error" if "raises" in kind else "transfer_timeout"] += 1
        refused = 0
        if overflow:  # the cap is full (nothing completes before the clock moves): refused, never blocked
            refused = int(self.submit("onboard", POOLS, self.next_id(), page_size=64, expect_ack=False) is None)
        for event in to_raise:  # from now on their query() raises (the finish event's at once)
            event.raise_on_query = RuntimeError("CUDA error: an illegal memory access was encountered")
        for _ in range(6):
            device.advance(ms=1)
            time.sleep(0.001)
        for handle in to_ack:
            r.tel.ack(handle)
        device.advance(seconds=2)  # past the transfer timeout
        assert r.flush()  # every completion observed (the clock only moves when told to)
        device.advance(seconds=2)  # past the ack timeout, counted from the completion seen
        assert wait_until(lambda: r.flush() and r.pipeline._snapshot()[1] == 0), r.pipeline._snapshot()[1]  # every slot freed
        return refused


def test_raising_stuck_and_out_of_order_events_mixed_with_good_ops(rig, small_cap_env, warnings_log):
    """Rounds that fill a cap of 8 with good ops (finishing out of order, acked, never acked,
    host-clock fallback), events whose query() raises, and stuck transfers, then one more
    submit: the stuck ones time out as error spans and free their slots (the cap stays fully
    usable, round after round), the good ones are counted exactly with their own durations,
    every failure is counted and warned about once, nothing raises into the caller."""
    cap = small_cap_env
    r = rig(spans=CountingSpanExporter(keep=True))
    rng = random.Random(7)
    ids = itertools.count(1000)
    submit = Timed(r.tel.submit)

    def rounds(n: int, faults: bool) -> tuple[dict, dict, int]:
        good: dict[int, tuple[int, bool | None]] = {}
        failed = {"event_error": 0, "transfer_timeout": 0}
        refused = 0
        for i in range(n):
            if faults:
                kinds = [FAULTS[(i + k) % len(FAULTS)] for k in range(cap)]
                rng.shuffle(kinds)
            else:
                kinds = ["good"] * cap
            one = Round(r, kinds, rng, lambda: next(ids), submit)
            refused += one.run(overflow=faults)
            good.update(one.good)
            for reason, count in one.failed.items():
                failed[reason] += count
        return good, failed, refused

    base_good, _, _ = rounds(30, faults=False)
    base_ns, submit.ns = submit.ns, []
    good, failed, refused = rounds(60, faults=True)
    fault_t, base_t = compare(submit.ns, base_ns)
    good.update(base_good)

    spans = r.spans.kept
    summary = (f"events: {len(good)} good ops, {failed['event_error']} raising, {failed['transfer_timeout']} stuck, "
               f"{refused} refused at a cap of {cap}; submit without faults {fmt(base_t)} | with {fmt(fault_t)}")
    print("\n" + summary)
    assert refused == 60 and all(failed.values()), summary
    assert len({s[0] for s in spans}) == len(spans) == len(good) + sum(failed.values()), summary
    # the good ops: exact, each with its own duration and ack state
    by_op = {s[3]: s for s in spans if s[2] is None}
    assert set(by_op) == set(good), summary
    for op, (duration, acked) in good.items():
        if duration >= 0:
            assert by_op[op][4] == duration, (op, by_op[op], duration)
        assert by_op[op][5] is acked, (op, by_op[op], acked)
    onboard = {"hicache.direction": "onboard"}
    assert r.counter("hicache.transfer.bytes", **onboard) == sum(good), summary
    assert r.counter("hicache.transfer.blocks", **onboard) == len(good), summary
    assert r.count("hicache.transfer.duration", **onboard) == len(good), summary
    assert r.count("hicache.transfer.ack_delay", **onboard) == sum(a is True for _, a in good.values()), summary
    assert r.counter("hicache.transfer.inflight", **onboard) == 0, summary
    # the faulty ones: error spans, counted by reason, and not in the transfer metrics
    assert r.spans.errors == failed, summary
    for reason, count in failed.items():
        assert r.counter("otel_hicache.records.failed", reason=reason) == count, summary
    assert r.counter("otel_hicache.records.dropped", reason="queue_full") == refused, summary
    assert r.counter("otel_hicache.records.dropped") == refused, summary
    messages = [x.getMessage() for x in warnings_log.records]
    for needle in ("event raised", "did not complete within", "queue full"):
        assert len([m for m in messages if needle in m]) == 1, (needle, messages)
    assert_no_stall(fault_t, base_t, summary)


# -- 3. concurrent submitters, acks and flushes ---------------------------------------------
@pytest.fixture
def roomy_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_HICACHE_MAX_QUEUE_SIZE", "65536")  # room for every op: nothing may be dropped


@pytest.fixture
def thread_errors() -> Any:
    """Exceptions raised in any thread during the test (none expected)."""
    errors: list[BaseException] = []
    previous = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)
    yield errors
    threading.excepthook = previous


def submitters(r: Rig, run: int, threads: int, per_thread: int, acks: Any, samples: list[Samples]) -> list[Any]:
    """Threads each submitting ``per_thread`` ops paced in bursts of 25 (op id = bytes, unique
    per ``run``), half of them expecting an ack (their handles go to ``acks``), timing every
    submit(). Device-timed and host-clock ops alternate."""
    ev0, ev1 = r.done_copy()

    def work(t: int) -> None:
        submit, perf = r.tel.submit, time.perf_counter_ns
        timed = samples[t]
        for i in range(per_thread):
            op = run * 100_000_000 + (t + 1) * 1_000_000 + i
            direction = "offload" if i % 2 else "onboard"
            t0 = perf()
            if i % 4 < 2:
                handle = submit(direction, POOLS, op, page_size=64, start_event=ev0, finish_event=ev1,
                                expect_ack=i % 4 == 0)
            else:
                handle = submit(direction, POOLS, op, page_size=64, expect_ack=i % 4 == 2, host_start_ns=0,
                                host_end_ns=1000)
            timed.ns[timed.n] = perf() - t0
            timed.n += 1
            assert handle is not None, op
            if i % 2 == 0:
                acks.append(handle)
            if i % 25 == 24:
                time.sleep(0.005)

    return [threading.Thread(target=work, args=(t,), name=f"submitter-{t}") for t in range(threads)]


def expected_bytes(run: int, threads: int, per_thread: int) -> dict[str, int]:
    expected = {"offload": 0, "onboard": 0}
    for t in range(threads):
        for i in range(per_thread):
            expected["offload" if i % 2 else "onboard"] += run * 100_000_000 + (t + 1) * 1_000_000 + i
    return expected


def test_concurrent_submitters_acks_and_flushes(rig, roomy_env, thread_errors):
    """8 threads x 5000 ops while another thread acks half of them as they come and another
    calls force_flush() (and advances the clock) in a loop: every op reported exactly once (span
    ids and trace ids unique), counters exact, every ack seen, nothing raised in any thread, and
    submit() costs what it costs with the submitters alone."""
    threads, per_thread = 8, 5000
    r = rig(spans=CountingSpanExporter(keep=True))

    # baseline: the same submitters, a quarter of the ops, nothing else running
    base_acks: Any = collections.deque()
    base_samples = [Samples(per_thread // 4) for _ in range(threads)]
    workers = submitters(r, 1, threads, per_thread // 4, base_acks, base_samples)
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for handle in base_acks:
        r.tel.ack(handle)
    r.device.advance(ms=10)
    assert wait_until(lambda: r.flush(1.0) and r.pipeline._snapshot()[1] == 0)
    base_ops = threads * (per_thread // 4)

    acks: Any = collections.deque()
    samples = [Samples(per_thread) for _ in range(threads)]
    workers = submitters(r, 2, threads, per_thread, acks, samples)
    done = threading.Event()
    counts = {"acked": 0, "flushes": 0}

    def acker() -> None:
        while not done.is_set() or acks:
            try:
                handle = acks.popleft()
            except IndexError:
                time.sleep(0.0005)
                continue
            r.tel.ack(handle)
            counts["acked"] += 1

    def flusher() -> None:
        while not done.is_set():
            r.tel.force_flush(5.0)
            counts["flushes"] += 1
            r.device.advance(ms=1)
            time.sleep(0.002)

    others = [threading.Thread(target=acker, name="acker"), threading.Thread(target=flusher, name="flusher")]
    t0 = time.perf_counter()
    for t in others + workers:
        t.start()
    for w in workers:
        w.join()
    submit_s = time.perf_counter() - t0
    done.set()
    for t in others:
        t.join()
    r.device.advance(ms=10)
    assert wait_until(lambda: r.flush(1.0) and r.pipeline._snapshot()[1] == 0, 60), counts  # (a bound: 2 busy cores)
    elapsed = time.perf_counter() - t0

    fault_t, base_t = compare([x for s in samples for x in s.values()], [x for s in base_samples for x in s.values()])
    total = threads * per_thread
    spans = r.spans.kept
    summary = (f"concurrency: {threads} threads x {per_thread} ops in {submit_s:.2f} s (all reported after "
               f"{elapsed:.2f} s), {counts['acked']} acks and {counts['flushes']} force_flush() meanwhile; "
               f"submit alone {fmt(base_t)} | with acks and flushes {fmt(fault_t)}")
    print("\n" + summary)
    assert not thread_errors, (thread_errors, summary)
    assert counts["acked"] == total // 2 and counts["flushes"] > 0, summary
    # every op exactly once: unique span ids, unique trace ids (each op its own root), each op id once
    assert len(spans) == total + base_ops, summary
    assert len({s[0] for s in spans}) == len(spans) and len({s[1] for s in spans}) == len(spans), summary
    ops = [s[3] for s in spans]
    assert len(set(ops)) == len(ops), summary
    assert r.spans.ok == len(spans) and not r.spans.errors, summary
    # counters exact
    expected = expected_bytes(1, threads, per_thread // 4)
    for direction, value in expected_bytes(2, threads, per_thread).items():
        value += expected[direction]
        assert r.counter("hicache.transfer.bytes", **{"hicache.direction": direction}) == value, summary
    assert r.counter("hicache.transfer.blocks") == total + base_ops, summary
    assert r.count("hicache.transfer.duration") == total + base_ops, summary
    acked_ops = (total + base_ops) // 2
    assert r.count("hicache.transfer.ack_delay") == acked_ops, summary
    assert sum(1 for s in spans if s[5]) == acked_ops, summary
    assert r.counter("otel_hicache.records.dropped") == 0 and r.counter("otel_hicache.records.failed") == 0
    assert r.counter("hicache.transfer.inflight") == 0, summary
    assert_no_stall(fault_t, base_t, summary)


# -- 5. shutdown with work in flight ------------------------------------------------------------
SHUTDOWN_TIMEOUT_S = 1.0


@pytest.fixture
def shutdown_env(monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.setenv("OTEL_HICACHE_SHUTDOWN_TIMEOUT_S", str(SHUTDOWN_TIMEOUT_S))
    return SHUTDOWN_TIMEOUT_S


class Submitter(threading.Thread):
    """Submits completed host-clock ops (op id = bytes) in bursts of 10 until stopped,
    keeping the op ids accepted and the submit() times before and after ``mark``."""

    def __init__(self, r: Rig, first_op: int) -> None:
        super().__init__(name="submitter")
        self.r, self.op = r, first_op
        self.accepted: list[int] = []
        self.refused = 0
        self.before: list[int] = []
        self.after: list[int] = []
        self.mark = threading.Event()
        self.stop = threading.Event()

    def run(self) -> None:
        submit, perf = self.r.tel.submit, time.perf_counter_ns
        while not self.stop.is_set():
            samples = self.after if self.mark.is_set() else self.before
            for _ in range(10):
                self.op += 1
                t0 = perf()
                handle = submit("offload", POOLS, self.op, page_size=64, expect_ack=False, host_start_ns=0,
                                host_end_ns=1000)
                samples.append(perf() - t0)
                if handle is None:
                    self.refused += 1
                else:
                    self.accepted.append(self.op)
            time.sleep(0.0005)


def test_shutdown_with_work_in_flight(rig, shutdown_env, warnings_log, thread_errors):
    """shutdown() while ops are in flight, waiting for acks, stuck, and while another thread keeps
    submitting: the ops that complete within OTEL_HICACHE_SHUTDOWN_TIMEOUT_S are reported, those
    waiting for an ack are reported unacked, those that cannot complete are counted as
    dropped{reason=shutdown} and warned about once; shutdown() stays within its bound and
    submit() never waits for it."""
    bound = shutdown_env
    r = rig(spans=CountingSpanExporter(keep=True))
    device = r.device
    t = device.time_ns()
    late = {}  # op -> expects an ack: finish 50 ms (device time) from now, reached only during shutdown
    for op in range(1, 21):
        late[op] = op % 2 == 0
        ev0, ev1 = device.copy(t + 1_000_000, 49.0)
        r.tel.submit("onboard", POOLS, op, page_size=64, start_event=ev0, finish_event=ev1, expect_ack=late[op])
    awaiting = list(range(101, 116))  # completed, waiting for an ack nobody gives
    acked = list(range(201, 211))  # completed and acked
    stuck = list(range(301, 308))  # never complete
    done0, done1 = r.done_copy()
    for op in awaiting:
        r.tel.submit("onboard", POOLS, op, page_size=64, start_event=done0, finish_event=done1)
    handles = [r.tel.submit("onboard", POOLS, op, page_size=64, start_event=done0, finish_event=done1) for op in acked]
    never0, never1 = device.event().record(), device.event().never_completes()
    for op in stuck:
        r.tel.submit("onboard", POOLS, op, page_size=64, start_event=never0, finish_event=never1)
    assert r.flush(0.2) is False  # the late and stuck ones are in flight
    for handle in handles:
        r.tel.ack(handle)

    submitter = Submitter(r, first_op=1_000_000)
    submitter.start()
    time.sleep(0.3)  # the baseline: submit() while nothing shuts down

    def complete_late() -> None:
        time.sleep(0.2 * bound)
        device.advance(ms=60)

    completer = threading.Thread(target=complete_late, name="device")
    submitter.mark.set()
    t0 = time.perf_counter()
    completer.start()
    r.tel.shutdown()
    shutdown_s = time.perf_counter() - t0
    time.sleep(0.1)  # submit() after shutdown
    submitter.stop.set()
    submitter.join()
    completer.join()
    r.tel.ack(handles[0])  # after shutdown: ignored, never raises
    assert r.tel.submit("onboard", POOLS, 1, page_size=64) is None

    fault_t, base_t = compare(submitter.after, submitter.before)
    spans = {s[3]: s for s in r.spans.kept}
    summary = (f"shutdown: {shutdown_s:.3f} s (bound {bound:.1f} s) with {len(late)} ops completing during it, "
               f"{len(awaiting)} awaiting an ack, {len(stuck)} stuck, and {len(submitter.accepted)} accepted / "
               f"{submitter.refused} refused from a concurrent submitter; submit before {fmt(base_t)} | "
               f"during and after shutdown {fmt(fault_t)}")
    print("\n" + summary)
    assert not thread_errors, (thread_errors, summary)
    # bounded, yet it waited for the ops that completed within the bound
    assert shutdown_s <= 1.5 * bound, summary
    for op, expects_ack in late.items():
        assert op in spans and spans[op][2] is None, (op, summary)
        assert spans[op][5] is (False if expects_ack else None), (op, spans[op])
    for op in awaiting:
        assert spans[op][2] is None and spans[op][5] is False, (op, spans[op])
    for op in acked:
        assert spans[op][5] is True, (op, spans[op])
    assert not set(stuck) & set(spans), summary
    # exact: every accepted op reported, the stuck ones counted as dropped
    for op in submitter.accepted:
        assert op in spans, (op, summary)
    reported = set(late) | set(awaiting) | set(acked) | set(submitter.accepted)
    assert set(spans) == reported, summary
    onboard = {"hicache.direction": "onboard"}
    assert r.counter("hicache.transfer.bytes", **onboard) == sum(late) + sum(awaiting) + sum(acked), summary
    assert r.counter("hicache.transfer.bytes", **{"hicache.direction": "offload"}) == sum(submitter.accepted)
    assert r.count("hicache.transfer.duration") == len(reported), summary
    assert r.count("hicache.transfer.ack_delay") == len(acked), summary
    assert r.counter("otel_hicache.records.dropped", reason="shutdown") == len(stuck), summary
    assert r.counter("otel_hicache.records.dropped") == len(stuck), summary
    assert r.counter("hicache.transfer.inflight") == 0, summary
    assert len([x for x in warnings_log.records if "in flight at shutdown" in x.getMessage()]) == 1
    assert submitter.refused > 0, summary  # it kept calling after shutdown
    # submit() never waits for shutdown(): not in the tail, not once
    assert_no_stall(fault_t, base_t, summary)
    assert fault_t["max"] <= 0.25 * shutdown_s * 1e6, summary


def test_shutdown_with_nothing_stuck_returns_without_waiting_for_the_bound(rig, shutdown_env):
    """Nothing in flight that cannot complete: shutdown() reports everything and returns long
    before the bound (it waits for work, not for a timer)."""
    bound = shutdown_env
    r = rig(spans=CountingSpanExporter(keep=True))
    done0, done1 = r.done_copy()
    for op in range(1, 501):
        r.tel.submit("offload", POOLS, op, page_size=64, start_event=done0, finish_event=done1,
                     expect_ack=op % 2 == 0)
    t0 = time.perf_counter()
    r.tel.shutdown()
    shutdown_s = time.perf_counter() - t0
    print(f"\nshutdown: {shutdown_s * 1e3:.1f} ms for 500 queued ops, nothing stuck (bound {bound:.1f} s)")
    assert r.spans.ok == 500 and sum(1 for s in r.spans.kept if s[5] is False) == 250
    assert r.counter("hicache.transfer.bytes") == sum(range(1, 501))
    assert r.counter("otel_hicache.records.dropped") == 0
    assert shutdown_s <= 0.5 * bound, shutdown_s


# -- 4. fork and spawn children, each exporting its own over OTLP --------------------------------
CHILD_INTERVAL_MS = 100
PHASE_OPS = 1000
TAIL_OPS = 10
PROCESS_SCRIPT = textwrap.dedent(
    """
    import json, multiprocessing, os, sys, time
    import otel_hicache
    from otel_hicache import TransferTelemetry
    OUT = sys.argv[1]
    INTERVAL_MS = int(sys.argv[2])
    OPS = int(sys.argv[3])
    TAIL = int(sys.argv[4])
    TIMES = {}  # submit() times (ns) by phase

    def report(tel, n, nbytes, phase):
        times = TIMES.setdefault(phase, [])
        for i in range(n):
            t0 = time.perf_counter_ns()
            handle = tel.submit("offload", {"kv": 64}, nbytes, page_size=64, expect_ack=False, host_start_ns=0,
                                host_end_ns=1000)
            times.append(time.perf_counter_ns() - t0)
            assert handle is not None
            if i % 10 == 9:
                time.sleep(0.0005)  # in bursts, as a scheduler loop submits

    def phases(tel, nbytes):
        # two phases, each followed by eight export intervals: periodic exports must show the
        # cumulative counter at the first phase's total, then at both phases' total; then a tail
        # of ops submitted just before the process ends: only its shutdown can deliver those.
        # (Each phase flushed first: a telemetry process that has just started, niced, on 2 busy
        # cores, may take longer than the intervals to read the phase.)
        report(tel, OPS, nbytes, "first")  # right after the fork or spawn
        assert tel.force_flush(30)
        time.sleep(8 * INTERVAL_MS / 1e3)
        report(tel, OPS, nbytes, "second")  # settled
        assert tel.force_flush(30)
        time.sleep(8 * INTERVAL_MS / 1e3)
        report(tel, TAIL, nbytes, "tail")

    def save(role, **extra):
        with open(os.path.join(OUT, role + ".json"), "w") as f:
            json.dump(dict(pid=os.getpid(), submit_ns=TIMES, **extra), f)

    def fork_child(nbytes):
        # the parent's TransferTelemetry, inherited: its worker and exporters are rebuilt here.
        # Shut down by hand: multiprocessing drops the exit hooks a forked child inherited.
        TIMES.clear()
        phases(TEL, nbytes)
        save("fork")
        TEL.shutdown()
        otel_hicache.shutdown()

    def spawn_child(nbytes):
        # its own configure() and TransferTelemetry; the tail is left to the exit hooks
        os.environ["OTEL_RESOURCE_ATTRIBUTES"] = "role=spawn"
        otel_hicache.configure()
        tel = TransferTelemetry(attributes={"tp_rank": 1})
        phases(tel, nbytes)
        save("spawn")

    if __name__ == "__main__":
        os.environ["OTEL_RESOURCE_ATTRIBUTES"] = "role=parent"
        otel_hicache.configure()
        TEL = TransferTelemetry(attributes={"tp_rank": 0})
        report(TEL, OPS, 10, "before")
        assert TEL.force_flush(5)
        report(TEL, OPS, 10, "before")     # in flight at the fork: the parent's, never the child's
        os.environ["OTEL_RESOURCE_ATTRIBUTES"] = "role=fork"  # read by the child's configure()
        fork = multiprocessing.get_context("fork").Process(target=fork_child, args=(7,))
        fork.start()
        os.environ["OTEL_RESOURCE_ATTRIBUTES"] = "role=parent"
        spawn = multiprocessing.get_context("spawn").Process(target=spawn_child, args=(3,))
        spawn.start()
        report(TEL, OPS, 10, "during")     # the parent keeps advancing after the fork
        fork.join(60)
        spawn.join(60)
        report(TEL, OPS, 10, "after")
        TEL.shutdown()
        otel_hicache.shutdown()
        save("parent", exitcodes=[fork.exitcode, spawn.exitcode])
    """
)


@pytest.fixture
def otlp_http() -> Any:
    """The in-process OTLP receiver (HTTP/protobuf: no gRPC channel crosses a fork)."""
    receiver = HttpReceiver()
    yield receiver
    receiver.stop()


def _by_role(received: Any) -> tuple[dict[str, list[Any]], dict[str, list[float]]]:
    """Spans per resource ``role``, and the offload bytes counter of each metric export per role,
    in the order of collection (the points' time, whichever process sent them and whenever)."""
    spans: dict[str, list[Any]] = {}
    for resource, span in received.spans():
        spans.setdefault(otlp_attributes(resource.attributes).get("role"), []).append(span)
    series: dict[str, list[float]] = {}
    with received.lock:
        requests = list(received.metrics)
    for request in requests:
        for rm in request.resource_metrics:
            role = otlp_attributes(rm.resource.attributes).get("role")
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    if m.name == "hicache.transfer.bytes":
                        points = [p for p in m.sum.data_points
                                  if otlp_attributes(p.attributes).get("hicache.direction") == "offload"]
                        series.setdefault(role, []).append(
                            (max(p.time_unix_nano for p in points), sum(p.as_int for p in points)))
    return spans, {role: [value for _, value in sorted(values)] for role, values in series.items()}


def test_fork_and_spawn_children_export_their_own_over_otlp(tmp_path, otlp_http):
    """A parent with work in flight forks a child (which keeps the parent's TransferTelemetry)
    and spawns one (which configures its own), all exporting over OTLP to one receiver: no
    duplicate span or trace id anywhere, each child's counters hold only its own ops and advance
    across export intervals, the parent's advance after the fork, and nobody re-exports the
    parent's pre-fork points."""
    t0 = time.perf_counter()
    results = _run_parent_and_children(tmp_path, otlp_http.endpoint)
    elapsed = time.perf_counter() - t0

    spans, series = _by_role(otlp_http.received)
    phase = PHASE_OPS
    counts = {role: len(s) for role, s in spans.items()}
    times = _submit_times(results)
    summary = (f"processes: {elapsed:.1f} s; spans {counts}; offload bytes per metric export {series}; "
               + "; ".join(f"submit in the {role} {fmt(t[1])} | {label} {fmt(t[0])}" for (role, t), label in
                           zip(times.items(), ("while its children start", "right after the fork",
                                               "right after the spawn"))))
    print("\n" + summary)
    # each process exported its own spans, once: unique span ids and trace ids across all three
    child_ops = 2 * phase + TAIL_OPS
    assert counts == {"parent": 4 * phase, "fork": child_ops, "spawn": child_ops}, summary
    every = [s for role in spans for s in spans[role]]
    assert len({s.span_id for s in every}) == len(every), summary
    assert len({s.trace_id for s in every}) == len(every), summary
    for role, nbytes in (("parent", 10), ("fork", 7), ("spawn", 3)):
        assert {otlp_attributes(s.attributes)["hicache.bytes"] for s in spans[role]} == {nbytes}, summary
    # the parent: advancing after the fork (two batches before it, one while the children run, one
    # after), never back: a child exporting the parent's copy (its reader thread restarted by the
    # SDK after the fork) would put a pre-fork total after a later one, in collection order
    parent, batch = series["parent"], phase * 10
    assert parent == sorted(parent) and parent[-1] == 4 * batch and 3 * batch in parent, summary
    assert set(parent) <= set(range(0, 4 * batch + 1, 10)), summary
    # each child: only its own ops, advancing across export intervals, never frozen
    for role, nbytes in (("fork", 7), ("spawn", 3)):
        values = series[role]
        assert values == sorted(values) and values[-1] == child_ops * nbytes, (role, summary)
        assert set(values) <= set(range(0, child_ops * nbytes + 1, nbytes)), (role, summary)
        # periodic exports after each phase: the counter advances between export intervals
        assert values.count(phase * nbytes) >= 2 and values.count(2 * phase * nbytes) >= 2, (role, summary)
    if any(stalls(*t) for t in times.values()):
        # On 2 cores the two starting interpreters preempt the parent mid-submit at times (its
        # p99 over 3x its own before the fork in 2 of 8 runs beside a CPU burner, once in CI):
        # a stall of ours recurs, a preemption does not. The timing, once more:
        again = tmp_path / "again"
        again.mkdir()
        times = _submit_times(_run_parent_and_children(again, otlp_http.endpoint))
        summary += "; again: " + "; ".join(f"{role} {fmt(t[0])} vs {fmt(t[1])}" for role, t in times.items())
    for fault_t, base_t in times.values():
        assert_no_stall(fault_t, base_t, summary)


def _run_parent_and_children(tmp_path: Path, endpoint: str) -> dict[str, Any]:
    """PROCESS_SCRIPT in a fresh interpreter, exporting to ``endpoint``: each role's results."""
    script = tmp_path / "app.py"
    script.write_text(PROCESS_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_SERVICE_NAME="fault-matrix", OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
               OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf", OTEL_HICACHE_POLL_INTERVAL_MS="1",
               OTEL_METRIC_EXPORT_INTERVAL=str(CHILD_INTERVAL_MS),
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, str(script), str(tmp_path), str(CHILD_INTERVAL_MS), str(PHASE_OPS),
                           str(TAIL_OPS)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    results = {role: json.loads((tmp_path / f"{role}.json").read_text()) for role in ("parent", "fork", "spawn")}
    assert results["parent"]["exitcodes"] == [0, 0], done.stderr
    assert len({r["pid"] for r in results.values()}) == 3
    return results


def _submit_times(results: dict[str, Any]) -> dict[str, tuple[dict, dict]]:
    """submit() right after the fork or spawn (the worker and exporters being rebuilt) against the
    same process settled; the parent's while its children start against its own before the fork."""
    return {role: compare(results[role]["submit_ns"][fault], results[role]["submit_ns"][base])
            for role, fault, base in (("parent", "during", "before"), ("fork", "first", "second"),
                                      ("spawn", "first", "second"))}


FORK_EXIT_SCRIPT = textwrap.dedent(
    """
    import multiprocessing
    import otel_hicache
    from otel_hicache import TransferTelemetry
    def child():
        for _ in range(5):
            assert TEL.submit("offload", {"kv": 64}, 7, page_size=64, expect_ack=False, host_start_ns=0,
                              host_end_ns=1000)
        # no shutdown by hand: left to the exit hooks, as in a spawned child

    if __name__ == "__main__":
        otel_hicache.configure()
        TEL = TransferTelemetry()
        process = multiprocessing.get_context("fork").Process(target=child)
        process.start()
        process.join(60)
        assert process.exitcode == 0
        TEL.shutdown()
    """
)


def test_a_forked_multiprocessing_child_exports_at_exit(tmp_path, otlp_http):
    """multiprocessing clears the exit hooks (``multiprocessing.util`` finalizers) a
    forked child inherited; otel_hicache.capture.process_exit registers them again from
    multiprocessing's after-fork callbacks, so the child's last spans leave at exit."""
    script = tmp_path / "app.py"
    script.write_text(FORK_EXIT_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_EXPORTER_OTLP_ENDPOINT=otlp_http.endpoint, OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    spans = [otlp_attributes(span.attributes)["hicache.bytes"] for _, span in otlp_http.received.spans()]
    assert spans.count(7) == 5, spans
