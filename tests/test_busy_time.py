import random
import time

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_hicache import TransferTelemetry
from otel_hicache.sinks import busy_time
from otel_hicache.sinks.busy_time import BusyTimeTracker
from otel_hicache.capture.device import anchor_factory_for
from simulated import DuckEvent, SimulatedDevice


def test_overlapping_intervals_count_once():
    tracker = BusyTimeTracker()
    assert tracker.add(0, 10) == 10
    assert tracker.add(5, 15) == 5
    assert tracker.add(20, 30) == 10
    assert tracker.add(0, 40) == 15  # fills the gaps [15,20) and [30,40)
    assert tracker.add(1, 2) == 0
    assert len(tracker._ends) == 1


def test_out_of_order_arrival_matches_a_brute_force_union():
    rng = random.Random(7)
    tracker = BusyTimeTracker()
    intervals = []
    total = 0
    for _ in range(500):
        start = rng.randrange(0, 10_000)
        end = start + rng.randrange(0, 300)
        intervals.append((start, end))
        total += tracker.add(start, end)
    covered = set()
    for start, end in intervals:
        covered.update(range(start, end))
    assert total == len(covered)


def test_empty_and_reversed_intervals_add_nothing():
    tracker = BusyTimeTracker()
    assert tracker.add(5, 5) == 0
    assert tracker.add(9, 3) == 0
    assert len(tracker._ends) == 0


def test_old_intervals_are_forgotten_beyond_the_horizon(monkeypatch):
    monkeypatch.setattr(busy_time, "HORIZON_NS", 100)
    tracker = BusyTimeTracker()
    tracker.add(0, 10)
    tracker.add(1000, 1010)
    assert len(tracker._ends) == 1


def test_forget_before_is_lazy_and_bulk():
    tracker = BusyTimeTracker()
    for i in range(3000):
        tracker.add(i * 10, i * 10 + 5)
    tracker.forget_before(10 * 500)  # 500 expired of 3000: kept until they are half the list or 1024
    assert len(tracker._ends) == 3000
    tracker.forget_before(10 * 1024)
    assert len(tracker._ends) == 3000 - 1024
    assert tracker.add(0, 5) == 5  # forgotten: an interval overlapping them counts in full
    assert tracker.add(20_000, 20_005) == 0  # still known: no double count


def test_a_long_lived_tracker_forgets_in_bulk(monkeypatch):
    """A long-lived tracker used to delete one interval at a time from the front of its lists on
    every add (its cost grew with its history): forgetting is counted here, not timed."""
    from otel_hicache.sinks.busy_time import _BULK

    monkeypatch.setattr(busy_time, "HORIZON_NS", 12_000_000)
    tracker, adds, spacing = BusyTimeTracker(), 204_000, 588
    sizes = []
    for i in range(adds):
        tracker.add(i * spacing, i * spacing + 60)
        sizes.append(len(tracker._ends))
    deletions = sum(after < before for before, after in zip(sizes, sizes[1:]))
    assert max(sizes) <= 12_000_000 // spacing + 1 + _BULK  # the horizon's intervals, and a bulk waiting
    assert 0 < deletions <= adds // _BULK  # ~180 deletions of 1,024, not ~180,000 of one


# -- busy time without a wall-clock anchor: ops placed from their own events ---------------------

MS = 1_000_000


@pytest.fixture
def unanchored():
    """A TransferTelemetry on a simulated clock with no anchor factory (as for events it cannot derive one from)."""
    device = SimulatedDevice()
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider(shutdown_on_exit=False)
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    tel = TransferTelemetry(tracer_provider, meter_provider, {"tp_rank": 0}, clock=device.time_ns)

    class Rig:
        pass

    rig = Rig()
    rig.device, rig.tel, rig.spans = device, tel, spans

    def submit(start_ms, duration_ms, cls=DuckEvent, **kw):
        start, finish = device.copy(device.time_ns() + start_ms * MS, duration_ms)
        start, finish = cls(start, **kw), cls(finish, **kw)
        assert anchor_factory_for(start) is None
        tel.submit("onboard", {"kv": 64}, 4096, page_size=64, start_event=start, finish_event=finish,
                   expect_ack=False)

    def busy_s():
        assert tel._pipeline.flush(5.0)  # pylint: disable=protected-access
        points = [p for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
                  for m in sm.metrics if m.name == "hicache.transfer.busy_time" for p in m.data.data_points
                  if p.attributes["hicache.direction"] == "onboard"]
        return sum(p.value for p in points)

    def finished():
        assert tel._pipeline.flush(5.0)  # pylint: disable=protected-access
        return sorted(spans.get_finished_spans(), key=lambda s: s.start_time)

    def wait_spans(count):
        """Until the worker emitted ``count`` spans (flush() would wait for the ops still in flight)."""
        deadline = time.monotonic() + 5.0
        while len(spans.get_finished_spans()) < count and time.monotonic() < deadline:
            time.sleep(0.001)
        return sorted(spans.get_finished_spans(), key=lambda s: s.start_time)

    rig.submit, rig.busy_s, rig.finished, rig.wait_spans = submit, busy_s, finished, wait_spans
    yield rig
    tel.shutdown()
    tracer_provider.shutdown()
    meter_provider.shutdown()


def _placement(span):
    return span.attributes["hicache.timing_source"], span.attributes["hicache.placement_source"]


def test_overlapping_ops_without_an_anchor_count_their_union_exactly(unanchored):
    t0 = unanchored.device.time_ns()
    unanchored.submit(0, 10)
    unanchored.submit(5, 10)
    unanchored.device.advance(ms=10)
    first = unanchored.wait_spans(1)  # the first one seen as it ended, the second still in flight
    unanchored.device.advance(ms=5)
    assert unanchored.busy_s() == pytest.approx(0.015)
    a, b = unanchored.finished()
    assert first == [a]
    assert (a.start_time - t0, a.end_time - t0, b.start_time - t0, b.end_time - t0) == (0, 10 * MS, 5 * MS, 15 * MS)
    assert [_placement(s) for s in (a, b)] == [("device_event", "host_completion"), ("device_event", "relative")]
    assert "hicache.queue_wait_us" not in a.attributes and "hicache.queue_wait_us" not in b.attributes


def test_completions_seen_late_still_give_exact_overlap(unanchored):
    t0 = unanchored.device.time_ns()
    unanchored.submit(0, 10)
    unanchored.submit(5, 10)
    unanchored.device.advance(ms=100)  # the worker sees both complete at 100 ms
    assert unanchored.busy_s() == pytest.approx(0.015)  # was 0.010: both placed to end at 100 ms
    a, b = unanchored.finished()
    assert (a.start_time - t0, a.end_time - t0) == (90 * MS, 100 * MS)  # ends when seen to end
    assert (b.start_time - a.start_time, b.end_time - b.start_time) == (5 * MS, 10 * MS)  # exact relative to it
    assert [_placement(s) for s in (a, b)] == [("device_event", "host_completion"), ("device_event", "relative")]


def test_events_that_cannot_be_compared_fall_back_to_host_completion_and_say_so(unanchored):
    t0 = unanchored.device.time_ns()
    unanchored.submit(0, 10, DuckEvent, stream=1)
    unanchored.submit(5, 10, DuckEvent, stream=2)
    unanchored.device.advance(ms=100)
    assert unanchored.busy_s() == pytest.approx(0.010)  # both end when seen: the overlap is not known
    a, b = unanchored.finished()
    assert (a.start_time - t0, a.end_time - t0, b.start_time - t0, b.end_time - t0) == (90 * MS, 100 * MS) * 2
    assert [_placement(s) for s in (a, b)] == [("device_event", "host_completion")] * 2
    unanchored.submit(-2, 10, DuckEvent, stream=2)  # [98, 108] on stream 2: relative to its own stream's op
    unanchored.device.advance(ms=20)
    assert _placement(unanchored.finished()[-1]) == ("device_event", "relative")
