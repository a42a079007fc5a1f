"""submit()/ack() on the caller's thread: no OTel SDK call, no device call, never raise."""

from __future__ import annotations

import threading

import pytest
from opentelemetry.sdk.metrics._internal import aggregation as sdk_aggregation
from opentelemetry.sdk.metrics._internal import measurement_consumer
from opentelemetry.sdk.trace import SpanProcessor

from simulated import SimulatedEvent


class ThreadLog:
    def __init__(self) -> None:
        self.threads: list[tuple[str, str]] = []

    def note(self, what: str) -> None:
        self.threads.append((what, threading.current_thread().name))


class SpyEvent(SimulatedEvent):
    log: ThreadLog

    def query(self):
        self.log.note("query")
        return super().query()

    def synchronize(self):
        self.log.note("synchronize")
        return super().synchronize()

    def elapsed_time(self, end):
        self.log.note("elapsed_time")
        return super().elapsed_time(end)


class SpyProcessor(SpanProcessor):
    def __init__(self, log: ThreadLog) -> None:
        self.log = log

    def on_end(self, span) -> None:
        self.log.note("span.on_end")


@pytest.fixture
def spy(monkeypatch):
    log = ThreadLog()
    SpyEvent.log = log
    consume = measurement_consumer.SynchronousMeasurementConsumer.consume_measurement

    def spy_consume(self, measurement):
        log.note("metrics.consume_measurement")
        return consume(self, measurement)

    monkeypatch.setattr(measurement_consumer.SynchronousMeasurementConsumer, "consume_measurement", spy_consume)
    for cls in (sdk_aggregation._ExplicitBucketHistogramAggregation, sdk_aggregation._SumAggregation):
        original = cls.aggregate

        def spy_aggregate(self, measurement, should_sample_exemplar=True, _original=original):
            log.note("metrics.aggregate")
            return _original(self, measurement, should_sample_exemplar)

        monkeypatch.setattr(cls, "aggregate", spy_aggregate)
    return log


def test_caller_thread_makes_no_sdk_and_no_device_call(harness, spy):
    h = harness()
    h.tracer_provider.add_span_processor(SpyProcessor(spy))
    spy.threads.clear()  # start-up (zero series) happened on the poller anyway
    caller = threading.current_thread().name
    handles = []
    for i in range(50):
        start = SpyEvent(h.device).record(at_ns=h.device.time_ns())
        finish = SpyEvent(h.device).record(at_ns=h.device.time_ns() + 1_000_000)
        handles.append(h.tel.submit("offload" if i % 2 else "onboard", {"kv": 640}, 640, page_size=64,
                                    start_event=start, finish_event=finish))
        h.device.advance(ms=2)
    for handle in handles:
        h.tel.ack(handle)
    # all of the work happened, and none of it on the caller's thread
    assert len(h.finished()) == 50
    kinds = {what for what, _ in spy.threads}
    assert {"query", "elapsed_time", "span.on_end", "metrics.aggregate"} <= kinds
    on_caller = [what for what, thread in spy.threads if thread == caller]
    assert on_caller == [], on_caller
    assert "synchronize" not in kinds  # completion is polled, never waited for


def test_a_broken_mapping_never_raises_into_the_caller(harness):
    class Hostile(dict):
        def items(self):
            raise RuntimeError("boom")

    h = harness()
    assert h.tel.submit("offload", Hostile(kv=1), 1, page_size=64) is not None  # read on the poller, not here
    h.tel.submit("offload", {"kv": 64}, 10, page_size=64, expect_ack=False, host_start_ns=0, host_end_ns=5)
    assert h.value("otel_hicache.records.dropped", reason="invalid_input") == 1
    assert len(h.finished()) == 1


def test_a_failing_sink_drops_that_record_once_and_the_poller_goes_on(harness, monkeypatch, warnings_log):
    h = harness()
    assert h.flush()  # the channel is open
    sinks = h.tel.channel.consumer
    original = sinks.spans.begin
    calls = {"n": 0}

    def flaky(record):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("span processor exploded")
        return original(record)

    monkeypatch.setattr(sinks.spans, "begin", flaky)
    for _ in range(3):
        h.tel.submit("offload", {"kv": 64}, 10, page_size=64, expect_ack=False, host_start_ns=0, host_end_ns=5)
    assert len(h.finished()) == 2
    assert h.value("otel_hicache.records.dropped", reason="internal_error") == 1
    assert calls["n"] == 3  # the failed record was not retried
    assert h.value("hicache.transfer.inflight", **{"hicache.direction": "offload"}) == 0
    assert "span processor exploded" in warnings_log.text


def test_a_record_the_intake_fails_on_is_counted_and_the_rest_of_its_batch_goes_on(harness, monkeypatch,
                                                                                    warnings_log):
    from otel_hicache.capture import poller as poller_module

    h = harness()
    pipeline = h.tel._pipeline  # pylint: disable=protected-access
    original = poller_module.TransferRecord
    calls = {"n": 0}

    def flaky(item):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("intake exploded")
        return original(item)

    monkeypatch.setattr(poller_module, "TransferRecord", flaky)
    with pipeline._lock:  # pylint: disable=protected-access  # the poller takes all three in one batch
        for _ in range(3):
            h.tel.submit("offload", {"kv": 64}, 10, page_size=64, expect_ack=False, host_start_ns=0, host_end_ns=5)
    assert len(h.finished()) == 2
    assert calls["n"] == 3  # the batch went on past the failed record
    assert h.value("otel_hicache.records.dropped", reason="internal_error") == 1
    assert h.value("hicache.transfer.inflight", **{"hicache.direction": "offload"}) == 0
    assert pipeline._snapshot()[1] == 0  # pylint: disable=protected-access
    assert "intake exploded" in warnings_log.text
