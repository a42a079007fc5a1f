"""Stuck and late transfers: ``hicache.transfer.oldest_inflight_age`` and
``hicache.transfer.oldest_unacked_age``.

Observable gauges per direction, computed at collection time from the
pipeline's state on the clock that stamps ``submit_ns`` (the simulated
device's here), so every value below is exact.

The telemetry runs its real worker: an op is read while it is queued, taken in
or polled, whichever the worker is doing, and the values do not depend on it.
``flush()`` is only called where nothing stays in flight (it waits for that).
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, Callable

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import Gauge, InMemoryMetricReader

from otel_hicache import semconv as sc
from otel_hicache.logs import TransferLog
from otel_hicache.metrics import TransferMetrics
from otel_hicache.pipeline import _ACK_SCAN_INTERVAL_NS, CompletionPipeline, PipelineSettings, Sinks
from otel_hicache.records import S_ACK_NS, submission

INFLIGHT = sc.TRANSFER_OLDEST_INFLIGHT_AGE[0]
UNACKED = sc.TRANSFER_OLDEST_UNACKED_AGE[0]
STATIC = {"tp_rank": 3}


def gauge(reader: InMemoryMetricReader, name: str) -> dict[str, float]:
    """One collection: the gauge's value per direction (each point carries the static attributes)."""
    found: dict[str, float] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name == name:
                    assert isinstance(metric.data, Gauge) and metric.unit == "s"
                    for point in metric.data.data_points:
                        assert dict(point.attributes).items() >= STATIC.items()
                        assert set(point.attributes) == {sc.DIRECTION, *STATIC}
                        found[point.attributes[sc.DIRECTION]] = point.value
    return found


def ages(h: Any) -> tuple[dict[str, float], dict[str, float]]:
    """(oldest in-flight, oldest un-acked) per direction, from one collection each."""
    return gauge(h.reader, INFLIGHT), gauge(h.reader, UNACKED)


ZERO = {"offload": 0.0, "onboard": 0.0}


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def pipeline_of(h: Any) -> CompletionPipeline:
    return h.tel._pipeline  # pylint: disable=protected-access


def stuck_op(h: Any, direction: str) -> list:
    """An op whose finish event never completes, submitted now."""
    start = h.device.event().record()
    finish = h.device.event().never_completes()
    return h.tel.submit(direction, {"kv": 64}, 64 * 4096, 64, start, finish, True)


def quick_op(h: Any, direction: str, expect_ack: bool = True) -> list:
    """An op whose copy runs for the next 1 ms (device time)."""
    start, finish = h.device.copy(h.device.time_ns(), 1.0)
    return h.tel.submit(direction, {"kv": 64}, 64 * 4096, 64, start, finish, True, expect_ack=expect_ack)


@pytest.fixture(autouse=True)
def _short_shutdown(monkeypatch):
    """Ops left stuck at the end of a test would hold shutdown() for its 5 s default."""
    monkeypatch.setenv("OTEL_HICACHE_SHUTDOWN_TIMEOUT_S", "0.2")


def started(harness: Any) -> Any:
    """A harness whose worker has run its first cycle: its sinks, and so the gauges, exist."""
    h = harness(attributes=dict(STATIC))
    assert h.flush()
    return h


@pytest.fixture
def h(harness):
    return started(harness)


# -- start-up ------------------------------------------------------------------------------------

def test_both_directions_report_zero_from_start_up(h):
    assert ages(h) == (ZERO, ZERO)


def test_unbound_metrics_report_zero_and_a_failing_source_reports_nothing(warnings_log):
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    metrics = TransferMetrics(provider, STATIC)
    assert gauge(reader, INFLIGHT) == ZERO and gauge(reader, UNACKED) == ZERO

    def broken() -> dict[str, float]:
        raise ValueError("boom")

    metrics.bind_oldest_ages(broken, lambda: {"offload": 1.5, "onboard": 0.0})
    assert gauge(reader, INFLIGHT) == {}  # unknown, not a healthy-looking 0
    assert gauge(reader, UNACKED) == {"offload": 1.5, "onboard": 0.0}
    assert sum("cannot compute the oldest transfer ages" in r.getMessage() for r in warnings_log.records) == 1
    provider.shutdown()


# -- an op that never completes ------------------------------------------------------------------

def test_stuck_op_ages_with_the_clock_in_its_direction_only(h):
    stuck_op(h, "offload")
    assert ages(h) == (ZERO, ZERO)  # submitted this very nanosecond
    h.device.advance(seconds=2)
    assert ages(h) == ({"offload": 2.0, "onboard": 0.0}, ZERO)  # queued or taken in, the same value
    wait_until(lambda: len(pipeline_of(h)._pending) == 1)  # pylint: disable=protected-access
    h.device.advance(ms=500)
    assert ages(h) == ({"offload": 2.5, "onboard": 0.0}, ZERO)
    h.device.advance(seconds=7.5)
    assert ages(h) == ({"offload": 10.0, "onboard": 0.0}, ZERO)


def test_the_oldest_op_per_direction_counts(h):
    stuck_op(h, "onboard")
    h.device.advance(seconds=1)
    stuck_op(h, "offload")
    h.device.advance(seconds=1)
    stuck_op(h, "onboard")  # younger: the first onboard op is still the oldest
    h.device.advance(seconds=3)
    assert ages(h) == ({"offload": 4.0, "onboard": 5.0}, ZERO)


def test_an_op_counts_from_its_host_start(h):
    """``host_start_ns``, when given, is the op's submit time."""
    start = h.device.event().record()
    finish = h.device.event().never_completes()
    h.tel.submit("onboard", {"kv": 64}, 4096, 64, start, finish, True,
                 host_start_ns=h.device.time_ns() - 1_500_000_000)
    assert ages(h) == ({"offload": 0.0, "onboard": 1.5}, ZERO)
    h.device.advance(seconds=1)
    assert ages(h) == ({"offload": 0.0, "onboard": 2.5}, ZERO)


def test_completion_brings_it_back_to_zero(h):
    start = h.device.event().record()
    finish = h.device.event().record(at_ns=h.device.time_ns() + 3_000_000_000)  # a 3 s copy
    h.tel.submit("onboard", {"kv": 64}, 4096, 64, start, finish, True, expect_ack=False)
    h.device.advance(seconds=2)
    assert ages(h) == ({"offload": 0.0, "onboard": 2.0}, ZERO)
    h.device.advance(seconds=1)
    assert h.flush()  # seen complete: no longer in flight, and no ack expected
    assert ages(h) == (ZERO, ZERO)
    assert len(h.finished()) == 1


def test_transfer_timeout_ends_it(harness, monkeypatch):
    monkeypatch.setenv("OTEL_HICACHE_TRANSFER_TIMEOUT_S", "5")
    h = started(harness)
    stuck_op(h, "offload")
    quick = quick_op(h, "onboard", expect_ack=False)
    assert quick is not None
    h.device.advance(seconds=5)  # not yet over the timeout (it is "more than 5 s")
    wait_until(lambda: len(h.spans.get_finished_spans()) == 1)  # the onboard op, seen complete
    assert ages(h) == ({"offload": 5.0, "onboard": 0.0}, ZERO)
    h.device.advance(ms=1)
    assert h.flush()  # the worker timed it out: reported, its slot freed
    assert ages(h) == (ZERO, ZERO)
    assert h.value(sc.RECORDS_FAILED[0], reason=sc.FAIL_TRANSFER_TIMEOUT) == 1
    errors = [s for s in h.finished() if s.attributes.get(sc.ERROR_TYPE) == sc.FAIL_TRANSFER_TIMEOUT]
    assert len(errors) == 1 and errors[0].name == sc.SPAN_OFFLOAD


# -- an ack that never comes ---------------------------------------------------------------------

def test_missing_ack_ages_from_the_completion(h):
    handle = quick_op(h, "onboard")
    h.device.advance(seconds=2)  # the copy ended 1 ms in; the worker sees it complete at 2 s
    assert h.flush()  # no longer in flight; held for its ack
    assert ages(h) == (ZERO, ZERO)  # waiting since its completion was seen, this nanosecond
    h.device.advance(seconds=4)
    assert ages(h) == (ZERO, {"offload": 0.0, "onboard": 4.0})
    h.device.advance(ms=250)
    assert ages(h) == (ZERO, {"offload": 0.0, "onboard": 4.25})
    h.tel.ack(handle)  # recovery: acked, the same instant counts as 0 already
    assert ages(h) == (ZERO, ZERO)
    assert h.flush()
    assert ages(h) == (ZERO, ZERO)
    (span,) = h.finished()
    assert span.attributes[sc.ACKED] is True


def test_ops_without_an_ack_never_count(h):
    quick_op(h, "offload", expect_ack=False)
    h.device.advance(ms=1)
    assert h.flush()
    h.device.advance(seconds=10)
    assert ages(h) == (ZERO, ZERO)


def test_the_oldest_unacked_op_per_direction_counts(h):
    first = quick_op(h, "offload")
    h.device.advance(seconds=1)
    assert h.flush()
    quick_op(h, "offload")
    quick_op(h, "onboard")
    h.device.advance(seconds=1)
    assert h.flush()
    h.device.advance(seconds=2)
    assert ages(h) == (ZERO, {"offload": 3.0, "onboard": 2.0})
    h.tel.ack(first)  # the next offload op is now the oldest
    assert ages(h) == (ZERO, {"offload": 2.0, "onboard": 2.0})


def test_ack_timeout_ends_it(harness, monkeypatch):
    monkeypatch.setenv("OTEL_HICACHE_ACK_TIMEOUT_S", "10")
    h = started(harness)
    quick_op(h, "offload")
    h.device.advance(ms=1)
    assert h.flush()
    h.device.advance(seconds=10)
    assert ages(h) == (ZERO, {"offload": 10.0, "onboard": 0.0})
    # over the ack timeout, and by a whole ack-scan interval of the worker's clock (the device's
    # here, which stands still between advances): a scan is due whenever the last one ran (with
    # 1 ms, a scan in the last 4 ms before it never came, and the test failed most runs on a
    # loaded machine); the span is emitted with hicache.acked=false
    h.device.advance(ns=_ACK_SCAN_INTERVAL_NS)
    wait_until(lambda: len(h.spans.get_finished_spans()) == 1)
    assert ages(h) == (ZERO, ZERO)
    assert h.finished()[0].attributes[sc.ACKED] is False


def test_both_at_once(h):
    quick_op(h, "offload")
    h.device.advance(ms=1)
    assert h.flush()
    stuck_op(h, "onboard")
    h.device.advance(seconds=3)
    assert ages(h) == ({"offload": 0.0, "onboard": 3.0}, {"offload": 3.0, "onboard": 0.0})


def test_shutdown_leaves_zero(h):
    stuck_op(h, "offload")
    quick_op(h, "onboard")
    h.device.advance(seconds=1)
    h.tel.shutdown()  # the stuck op dropped as shutdown, the un-acked one emitted
    assert ages(h) == (ZERO, ZERO)


# -- the snapshots, cycle by cycle (no worker thread) ----------------------------------------------

class _Clock:
    def __init__(self) -> None:
        self.now = 1_767_225_600_000_000_000

    def __call__(self) -> int:
        return self.now


class _Pipeline(CompletionPipeline):
    def _start_worker(self) -> None:
        self._worker = SimpleNamespace(is_alive=lambda: False, join=lambda timeout=None: None)


class _Spans:
    def begin(self, record: Any) -> None:
        return None

    def finish(self, record: Any, state: Any) -> None:
        pass


class _Done:
    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


@pytest.fixture
def manual():
    """A pipeline whose cycles the test runs, on real TransferMetrics; ``seen`` holds the
    in-flight ages computed from inside ``metrics.submitted()``, i.e. mid-intake."""
    clock = _Clock()
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    seen: list[dict[str, float]] = []
    box: dict[str, CompletionPipeline] = {}

    class Metrics(TransferMetrics):
        def submitted(self, record: Any) -> None:
            seen.append(box["p"].oldest_inflight_ages())
            super().submitted(record)

    def build() -> Sinks:
        return Sinks(_Spans(), Metrics(provider, STATIC), TransferLog())

    p = box["p"] = _Pipeline(PipelineSettings(max_queue_size=8), build, clock)
    rig = SimpleNamespace(p=p, clock=clock, reader=reader, seen=seen)
    yield rig
    provider.shutdown()


def test_a_record_is_in_flight_while_queued_taken_in_and_polled(manual):
    p, clock = manual.p, manual.clock
    done = _Done(False)
    t0 = clock.now
    p.queue.append(submission("onboard", {"kv": 64}, 4096, 64, None, done, False, submit_ns=t0))
    clock.now += 2_000_000_000
    assert p.oldest_inflight_ages() == {"offload": 0.0, "onboard": 2.0}  # queued
    p._cycle()  # pylint: disable=protected-access
    assert manual.seen == [{"offload": 0.0, "onboard": 2.0}]  # popped, not yet pending: the batch
    assert p._intake == () and len(p._pending) == 1  # pylint: disable=protected-access
    clock.now += 1_000_000_000
    assert p.oldest_inflight_ages() == {"offload": 0.0, "onboard": 3.0}  # pending
    assert gauge(manual.reader, INFLIGHT) == {"offload": 0.0, "onboard": 3.0}
    done.done = True
    p._cycle()  # pylint: disable=protected-access
    assert p.oldest_inflight_ages() == {"offload": 0.0, "onboard": 0.0}


def test_acked_but_not_yet_scanned_out_counts_as_acked(manual):
    p, clock = manual.p, manual.clock
    handle = submission("offload", {"kv": 64}, 4096, 64, None, _Done(True), False, expect_ack=True,
                        submit_ns=clock.now)
    p.queue.append(handle)
    p._cycle()  # pylint: disable=protected-access
    clock.now += 7_000_000_000
    assert p.oldest_unacked_ages() == {"offload": 7.0, "onboard": 0.0}
    handle[S_ACK_NS] = clock.now  # ack() stamped it; the worker's next ack scan removes it
    assert len(p._awaiting) == 1  # pylint: disable=protected-access
    assert p.oldest_unacked_ages() == {"offload": 0.0, "onboard": 0.0}


def test_unusable_submit_times_are_skipped(manual):
    p, clock = manual.p, manual.clock
    p.queue.append(submission("offload", {"kv": 64}, 4096, 64, submit_ns="later"))
    p.queue.append(submission("sideways", {"kv": 64}, 4096, 64, submit_ns=clock.now - 10**9))
    p.queue.append(["not", "a", "submission"])
    p.queue.append(submission("offload", {"kv": 64}, 4096, 64, submit_ns=float("nan")))
    assert p.oldest_inflight_ages() == {"offload": 0.0, "onboard": 0.0}
    p.queue.append(submission("offload", {"kv": 64}, 4096, 64, submit_ns=clock.now - 10**9))
    assert p.oldest_inflight_ages() == {"offload": 1.0, "onboard": 0.0}


def test_a_held_intake_lock_delays_a_collection_by_a_bounded_wait_only(manual):
    """The SDK collects holding its own lock, which a worker building its sinks under the
    intake lock may need: the ages never wait for the intake lock without bound."""
    p, clock = manual.p, manual.clock
    p.queue.append(submission("offload", {"kv": 64}, 4096, 64, submit_ns=clock.now - 2 * 10**9))
    with p._lock:  # pylint: disable=protected-access
        began = time.monotonic()
        assert p.oldest_inflight_ages() == {"offload": 2.0, "onboard": 0.0}
        assert time.monotonic() - began < 1.0
