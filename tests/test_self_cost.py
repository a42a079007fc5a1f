"""What otel-hicache costs the process: its own CPU as counters (otel_hicache.self_metrics),
and the worker's per-cycle costs (the wake-up, the counters' hand-off to the SDK)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (InMemoryMetricReader,
                                              PeriodicExportingMetricReader)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_hicache import TransferTelemetry, pipeline, sdk_internals, self_metrics
from otel_hicache import semconv as sc
from otel_hicache.pipeline import CompletionPipeline, PipelineSettings, Sinks
from otel_hicache.records import submission

linux_thread_clocks = pytest.mark.skipif(not hasattr(time, "pthread_getcpuclockid"), reason="no per-thread CPU clock")


# -- the worker's wake-up ------------------------------------------------------------------------------------

def test_wake_set_before_wait_is_not_lost_and_is_consumed_once():
    wake = pipeline._Wake()
    assert wake.wait(0.001) is False  # nothing set: times out
    wake.set()
    wake.set()  # already set: no error, still one wake-up
    assert wake.wait(1.0) is True
    assert wake.wait(0.001) is False  # consumed by the wait: no clear() needed


def test_wake_from_another_thread_ends_the_wait_early():
    wake = pipeline._Wake()
    timer = threading.Timer(0.05, wake.set)
    timer.start()
    t0 = time.monotonic()
    assert wake.wait(5.0) is True
    assert time.monotonic() - t0 < 4.0
    timer.join()


# -- the counters' hand-off: at most every _COUNTER_FLUSH_INTERVAL_NS, always on a flush ----------------------

class CountingMetrics:
    def __init__(self) -> None:
        self.flushes = 0
        self.revalidations = 0

    def submitted(self, record: Any) -> None:
        pass

    def completed(self, record: Any, busy: int) -> None:
        pass

    def left_flight(self, record: Any) -> None:
        pass

    def dropped_records(self, reason: str, count: int = 1) -> None:
        pass

    def flush(self, pause: Any = None) -> None:
        self.flushes += 1

    def revalidate(self) -> None:
        self.revalidations += 1


class Manual(CompletionPipeline):
    alive = False

    def _start_worker(self) -> None:
        self._worker = SimpleNamespace(is_alive=lambda: self.alive, join=lambda timeout=None: None)


def _manual(metrics: CountingMetrics) -> Manual:
    spans = SimpleNamespace(begin=lambda record: None, finish=lambda record, state: None)
    log = SimpleNamespace(completed=lambda record, busy: None)
    return Manual(PipelineSettings(poll_interval_s=0.0005), lambda: Sinks(spans, metrics, log), time.time_ns)


def test_counters_are_handed_over_once_per_interval_and_revalidated_every_cycle(monkeypatch):
    monkeypatch.setattr(pipeline, "_COUNTER_FLUSH_INTERVAL_NS", 10**12)  # never due again in this test
    metrics = CountingMetrics()
    p = _manual(metrics)
    for _ in range(5):
        p.queue.append(submission("offload", {"kv": 64}, 4096, 64, submit_ns=time.time_ns()))
        p._cycle()
    assert (metrics.flushes, metrics.revalidations) == (1, 4)  # the first cycle only, then re-checks


def test_a_flush_always_hands_the_counters_over(monkeypatch):
    monkeypatch.setattr(pipeline, "_COUNTER_FLUSH_INTERVAL_NS", 10**12)
    metrics = CountingMetrics()
    p = _manual(metrics)
    p._cycle()
    p.alive = True
    waiter = threading.Thread(target=p.flush, args=(5.0,))
    waiter.start()
    while not p._flush_waiters:
        time.sleep(0.001)
    p.queue.append(submission("offload", {"kv": 64}, 4096, 64, submit_ns=time.time_ns()))
    p._cycle()
    waiter.join(5.0)
    assert metrics.flushes == 2 and not waiter.is_alive()


class SteppedMetrics(CountingMetrics):
    """A hand-off of ``steps`` SDK calls (``flush_steps``), each noted as it runs."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps, self.started, self.ran = steps, 0, []

    def flush_steps(self) -> Any:
        self.started += 1
        for step in range(self.steps):
            self.ran.append(step)
            yield


def test_a_periodic_hand_off_is_spread_over_cycles_a_few_calls_each(monkeypatch):
    monkeypatch.setattr(pipeline, "_COUNTER_FLUSH_INTERVAL_NS", 10**12)  # due at the first cycle only
    metrics = SteppedMetrics(10)
    p = _manual(metrics)
    per_cycle = []
    for _ in range(4):
        before = len(metrics.ran)
        p._cycle()
        per_cycle.append(len(metrics.ran) - before)
    assert per_cycle == [pipeline._FLUSH_STEPS_PER_CYCLE] * 2 + [2, 0]
    assert (metrics.started, metrics.flushes) == (1, 0) and p._flushing is None
    assert metrics.revalidations == 4  # every cycle: the bindings the steps have not reached yet


def test_a_flush_a_stop_or_a_backlog_first_finishes_the_hand_off_in_progress(monkeypatch):
    monkeypatch.setattr(pipeline, "_COUNTER_FLUSH_INTERVAL_NS", 10**12)
    for finish in ("flush", "stop", "backlog"):
        metrics = SteppedMetrics(10)
        p = _manual(metrics)
        p._cycle()  # 4 of the 10 steps
        if finish == "flush":
            p._drain_all = True  # as stop() and flush() make the next cycle hand everything over
            p._cycle()
        elif finish == "backlog":  # a long cycle: values would wait for its next ones
            p.queue.extend([submission("offload", {"kv": 64}, 4096, 64, submit_ns=time.time_ns())
                            for _ in range(pipeline._UNSLICED_BACKLOG + 1)])
            p._cycle()
        else:
            p._cycle_final()
        assert metrics.ran == list(range(10)) and metrics.started == 1
        assert metrics.flushes == 1 and p._flushing is None  # then the whole hand-off, at once


def test_counters_reach_the_sdk_within_the_interval_without_a_flush():
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    tel = TransferTelemetry(TracerProvider(shutdown_on_exit=False), meter_provider, {"tp_rank": 0})
    try:
        now = time.time_ns()
        tel.submit("offload", {"kv": 64}, 4096, 64, expect_ack=False, host_start_ns=now - 1000, host_end_ns=now)
        deadline = time.monotonic() + 5.0
        total = 0.0
        while time.monotonic() < deadline:
            points = [p for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
                      for m in sm.metrics if m.name == sc.TRANSFER_BYTES[0] for p in m.data.data_points]
            total = sum(p.value for p in points)
            if total:
                break
            time.sleep(0.01)
        assert total == 4096
    finally:
        tel.shutdown()
        meter_provider.shutdown()


# -- otel_hicache.worker.cpu_time and otel_hicache.export.cpu_time -------------------------------------------

def _cpu_points(reader: InMemoryMetricReader) -> dict[tuple[str, str | None], tuple[float, dict[str, Any]]]:
    found = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name in (sc.WORKER_CPU_TIME[0], sc.EXPORT_CPU_TIME[0]):
                    assert metric.data.is_monotonic and metric.unit == "s"
                    for point in metric.data.data_points:
                        found[metric.name, point.attributes.get(sc.THREAD)] = (point.value, dict(point.attributes))
    return found


@linux_thread_clocks
def test_the_worker_and_export_threads_cpu_are_counted_per_rank():
    reader = InMemoryMetricReader()
    periodic = PeriodicExportingMetricReader(sdk_internals.discarding_metric_exporter(), export_interval_millis=60_000)
    meter_provider = MeterProvider(metric_readers=[reader, periodic], shutdown_on_exit=False)
    tracer_provider = TracerProvider(shutdown_on_exit=False)
    tracer_provider.add_span_processor(BatchSpanProcessor(InMemorySpanExporter()))
    static = {"tp_rank": 3, "pp_rank": 0}
    tel = TransferTelemetry(tracer_provider, meter_provider, static)
    try:
        for _ in range(200):
            now = time.time_ns()
            tel.submit("onboard", {"kv": 64}, 4096, 64, expect_ack=False, host_start_ns=now - 1000, host_end_ns=now)
        assert tel.force_flush(10.0)
        first = _cpu_points(reader)
        assert set(first) >= {(sc.WORKER_CPU_TIME[0], None), (sc.EXPORT_CPU_TIME[0], sc.THREAD_SPAN_PROCESSOR),
                              (sc.EXPORT_CPU_TIME[0], sc.THREAD_METRIC_READER)}
        for value, attributes in first.values():
            assert value >= 0 and attributes.items() >= static.items()
        assert first[sc.WORKER_CPU_TIME[0], None][0] > 0  # 200 ops took some
        for _ in range(200):
            now = time.time_ns()
            tel.submit("offload", {"kv": 64}, 4096, 64, expect_ack=False, host_start_ns=now - 1000, host_end_ns=now)
        assert tel.force_flush(10.0)
        second = _cpu_points(reader)
        assert all(second[key][0] >= first[key][0] for key in first)  # cumulative, never down
        assert second[sc.WORKER_CPU_TIME[0], None][0] > first[sc.WORKER_CPU_TIME[0], None][0]
    finally:
        tel.shutdown()
        tracer_provider.shutdown()
        meter_provider.shutdown()


@linux_thread_clocks
def test_a_thread_that_ended_stays_counted():
    kind = self_metrics._ThreadKind()
    done = threading.Event()

    def busy() -> None:
        end = time.thread_time() + 0.02
        while time.thread_time() < end:
            pass
        done.wait(5.0)

    thread = threading.Thread(target=busy)
    thread.start()
    time.sleep(0.05)
    while self_metrics.thread_cpu_s(thread) is not None and self_metrics.thread_cpu_s(thread) < 0.015:
        time.sleep(0.01)
    alive = kind.total([thread])
    done.set()
    thread.join()
    assert alive is not None and alive >= 0.015
    assert kind.total([]) == alive  # ended: its last reading kept
    assert self_metrics.thread_cpu_s(thread) is None
    assert self_metrics.thread_cpu_s(SimpleNamespace(ident=1)) is None  # not a thread (a test's stand-in)


def test_export_threads_of_other_providers_are_none():
    found = sdk_internals.export_threads(object(), object())
    assert found == {"span_processor": [], "metric_reader": [], "export_process": []}
