"""What otel-hicache costs the serving process, and how it says so.

* The poller's wake-up (``poller._Wake``): one C call per wait, a ``set()`` never lost; idle, the
  poller waits with no timeout until a submit() wakes it.
* What the poller and the sinks cost per op is a benchmark's to report, side by side in one
  run (benchmarks/serving_cpu.py, benchmarks/sinks_cpu.py), never a unit test's to assert.
* The sinks' counters (``sinks.metrics``): totals read at each collection, no SDK call per op.
* Its CPU as counters (``sinks.metrics``): ``otel_hicache.poller.cpu_time``, the poller
  thread's CPU clock as sent in its STATE, and ``otel_hicache.export.cpu_time``, the whole
  telemetry process's (none when the sinks are embedded).
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_hicache import TransferTelemetry
from otel_hicache import record as rec
from otel_hicache import semconv as sc
from otel_hicache.capture import poller
from otel_hicache.capture.poller import PollerSettings, Poller
from otel_hicache.sinks.consumer import Consumer


@pytest.fixture(autouse=True)
def _write_every_cycle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cycles driven by hand do all their work and write it at once (the poller's write interval
    and cycle budget are real time: test_pipeline.py checks them apart)."""
    from otel_hicache.capture import poller as poller_module

    monkeypatch.setattr(poller_module, "_WRITE_INTERVAL_NS", 0)
    monkeypatch.setattr(poller_module, "CYCLE_BUDGET_NS", 1 << 60)

STATIC = {"tp_rank": 3, "pp_rank": 0}


# -- the poller's wake-up ------------------------------------------------------------------------------------

def test_wake_set_before_wait_is_not_lost_and_is_consumed_once():
    wake = poller._Wake()
    assert wake.wait(0.001) is False  # nothing set: times out
    wake.set()
    wake.set()  # already set: no error, still one wake-up
    assert wake.wait(1.0) is True
    assert wake.wait(0.001) is False  # consumed by the wait: no clear() needed


def test_wake_from_another_thread_ends_the_wait_early():
    wake = poller._Wake()
    timer = threading.Timer(0.05, wake.set)
    timer.start()
    t0 = time.monotonic()
    assert wake.wait(5.0) is True
    assert time.monotonic() - t0 < 4.0
    timer.join()


class _RecordedWake(poller._Wake):
    __slots__ = ("timeouts",)

    def __init__(self) -> None:
        super().__init__()
        self.timeouts: list[float | None] = []

    def wait(self, timeout: float | None) -> bool:
        self.timeouts.append(timeout)
        return super().wait(timeout)


def _wait_until(condition: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_an_idle_poller_waits_without_a_timeout_until_a_submit_wakes_it(harness):
    """Nothing in flight, nothing held back: the poller blocks with no timeout (no wake-up at all);
    the next submit() wakes it (no flush() here, which would wake it too)."""
    h = harness()
    p = h.tel._pipeline  # pylint: disable=protected-access
    _wait_until(lambda: p.idle)
    old, p._wake = p._wake, _RecordedWake()  # pylint: disable=protected-access
    old.set()  # its wait ends: the next ones are recorded
    _wait_until(lambda: p.idle and p._wake.timeouts and p._wake.timeouts[-1] is None)
    taken = p._taken  # pylint: disable=protected-access
    h.tel.submit("offload", {"kv": 64}, 10, page_size=64, expect_ack=False, host_start_ns=1, host_end_ns=5)
    _wait_until(lambda: p._taken == taken + 1)  # pylint: disable=protected-access
    _wait_until(lambda: p.idle and p._wake.timeouts[-1] is None)  # and back to sleep once it is handed over
    assert len(h.finished()) == 1


# -- the poller's own CPU per op ------------------------------------------------------------------------------

class Manual(Poller):
    """No thread: the cycles run on the test's thread, whose CPU clock measures them."""

    def _start_thread(self) -> None:
        self.thread = SimpleNamespace(is_alive=lambda: False, join=lambda timeout=None: None, ident=None)


class NullChannel:
    def __init__(self) -> None:
        self.ops = 0

    def write(self, batch: list[Any], ops: int) -> None:
        self.ops += ops

    def stop(self, timeout_s: float, export_s: float | None = None) -> bool:
        return True


def _providers() -> tuple[TracerProvider, MeterProvider]:
    tracer_provider = TracerProvider(shutdown_on_exit=False)
    tracer_provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    return tracer_provider, MeterProvider(metric_readers=[InMemoryMetricReader()], shutdown_on_exit=False)


# -- the sinks' counters ------------------------------------------------------------------------------

def _op(seq: int, num_bytes: int = 4096, **overrides: Any) -> tuple[Any, ...]:
    """An OP message of a direct, host-timed offload of 64 tokens."""
    now = time.time_ns()
    values = dict.fromkeys(rec.OP_FIELDS)
    values.update(seq=seq, direction=rec.OFFLOAD, origin=rec.DIRECT, cause=sc.CAUSE_OTHER, tokens=64, blocks=1,
                  pool_names=("kv",), pool_tokens=(64,), num_bytes=num_bytes, page_size=64,
                  timing_source=rec.HOST_CLOCK, start_ns=now - 1000, end_ns=now, duration_ns=1000, submit_ns=now - 1000,
                  expect_ack=False, request_links=(), request_links_dropped=0)
    values.update(overrides)
    return (rec.OP, *(values[name] for name in rec.OP_FIELDS))


class Sinks:
    def __init__(self, hello: dict[str, Any] | None = None) -> None:
        self.tracer_provider, _ = _providers()
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader], shutdown_on_exit=False)
        self.consumer = Consumer(self.tracer_provider, self.meter_provider,
                                 hello if hello is not None else {"attributes": STATIC, "embedded": True})

    def points(self, name: str) -> list[Any]:
        data = self.reader.get_metrics_data()
        return [p for rm in (data.resource_metrics if data else ()) for sm in rm.scope_metrics for m in sm.metrics
                if m.name == name for p in m.data.data_points]

    def bytes(self) -> float:
        return sum(p.value for p in self.points(sc.TRANSFER_BYTES[0]))

    def close(self) -> None:
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


@pytest.fixture
def sinks():
    made: list[Sinks] = []

    def make(**kwargs: Any) -> Sinks:
        made.append(Sinks(**kwargs))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_counters_are_exact_at_every_collection_without_a_flush(sinks, monkeypatch):
    """Observable counters: each collection reads the totals of every op taken in so far, and no
    SDK call is made per op for them."""
    s = sinks()
    calls = []
    monkeypatch.setattr(s.consumer.metrics.duration, "record", lambda *a, **k: calls.append("duration"))
    for seq in range(5):
        s.consumer.apply([_op(seq)])
        assert s.bytes() == (seq + 1) * 4096
    assert calls == ["duration"] * 5  # (and bandwidth: histograms are per op; counters are not)
    s.consumer.close()
    assert s.bytes() == 5 * 4096


# -- otel_hicache.poller.cpu_time and otel_hicache.export.cpu_time -------------------------------------------

def _cpu_points(reader: InMemoryMetricReader) -> dict[tuple[str, str | None], tuple[float, dict[str, Any]]]:
    found = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name in (sc.POLLER_CPU_TIME[0], sc.EXPORT_CPU_TIME[0]):
                    assert metric.data.is_monotonic and metric.unit == "s"
                    for point in metric.data.data_points:
                        found[metric.name, point.attributes.get(sc.THREAD)] = (point.value, dict(point.attributes))
    return found


def test_the_pollers_cpu_is_counted_per_rank_and_embedded_sinks_report_no_export_cpu():
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    tracer_provider, _ = _providers()
    tel = TransferTelemetry(tracer_provider, meter_provider, STATIC)
    try:
        for _ in range(200):
            now = time.time_ns()
            tel.submit("onboard", {"kv": 64}, 4096, page_size=64, expect_ack=False, host_start_ns=now - 1000,
                       host_end_ns=now)
        assert tel.force_flush(10.0)
        first = _cpu_points(reader)
        assert set(first) == {(sc.POLLER_CPU_TIME[0], None)}  # embedded: no telemetry process to count
        value, attributes = first[sc.POLLER_CPU_TIME[0], None]
        assert value > 0 and attributes == STATIC  # 200 ops took some
        for _ in range(200):
            now = time.time_ns()
            tel.submit("offload", {"kv": 64}, 4096, page_size=64, expect_ack=False, host_start_ns=now - 1000,
                       host_end_ns=now)
        assert tel.force_flush(10.0)
        second = _cpu_points(reader)
        assert second[sc.POLLER_CPU_TIME[0], None][0] > value  # cumulative, and it grew
    finally:
        tel.shutdown()
        tracer_provider.shutdown()
        meter_provider.shutdown()


def test_the_poller_cpu_is_its_own_thread_only():
    """The STATE's CPU seconds are the poller thread's: CPU burnt by another thread of the
    process meanwhile is not in them."""
    states: list[tuple[Any, ...]] = []

    class Channel(NullChannel):
        def write(self, batch: list[Any], ops: int) -> None:
            states.extend(m for m in batch if m[0] == rec.STATE)

    settings = PollerSettings()
    settings.poll_interval_s = 0.0005
    p = Poller(settings, Channel, time.time_ns)
    try:
        assert p.flush(5.0)
        before = states[-1][5]
        burnt_from = time.thread_time()
        while time.thread_time() - burnt_from < 0.3:  # the test's thread, not the poller's
            pass
        burnt = time.thread_time() - burnt_from
        assert p.flush(5.0)
        poller_cpu = states[-1][5] - before
        assert 0 <= poller_cpu < 0.5 * burnt, (poller_cpu, burnt)
    finally:
        p.stop(1.0)


def test_a_telemetry_process_counts_its_whole_cpu(sinks):
    s = sinks(hello={"attributes": STATIC})  # not embedded: the consumer of a telemetry process
    s.consumer.apply([(rec.STATE, {"offload": 0, "onboard": 0}, {"offload": None, "onboard": None},
                       {"offload": None, "onboard": None}, 0, 0.25, None)])
    points = _cpu_points(s.reader)
    assert set(points) == {(sc.POLLER_CPU_TIME[0], None), (sc.EXPORT_CPU_TIME[0], sc.THREAD_TELEMETRY_PROCESS)}
    assert points[sc.POLLER_CPU_TIME[0], None] == (0.25, STATIC)  # what the poller sent
    value, attributes = points[sc.EXPORT_CPU_TIME[0], sc.THREAD_TELEMETRY_PROCESS]
    assert 0 < value <= time.process_time() and attributes == {**STATIC, sc.THREAD: sc.THREAD_TELEMETRY_PROCESS}
