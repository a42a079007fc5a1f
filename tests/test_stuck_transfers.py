"""Stuck and late transfers: ``hicache.transfer.oldest_inflight_age`` and
``hicache.transfer.oldest_unacked_age``.

The poller sends, in its ``record.STATE`` messages, the submit time of the oldest op in
flight per direction (queued, taken in or polled) and the completion time of the oldest
op waiting for its ack; the sinks' observable gauges age them when the SDK collects.

1. The poller's STATE, cycle by cycle (no thread, a fake channel that keeps the batches).
2. ``TransferMetrics``' gauges from a state, on a clock the test sets.
3. End to end on the harness (a TransferTelemetry on a simulated device, its sinks
   embedded on in-memory SDK providers), the real poller thread: an op is read while it is
   queued, taken in or polled, whichever the poller is doing. The gauges there are aged on
   the simulated device's clock (the clock that stamps ``submit_ns``), so every value below
   is exact; the consumer's metrics are pointed at it (``on_device_clock``), see the last
   test for why.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any, Callable

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import Gauge, InMemoryMetricReader

from otel_hicache import record as rec
from otel_hicache import semconv as sc
from otel_hicache.capture import poller as engine
from otel_hicache.capture.poller import _ACK_SCAN_INTERVAL_NS, PollerSettings, Poller
from otel_hicache.capture.records import S_ACK_NS
from harness import submission
from otel_hicache.sinks.metrics import TransferMetrics


@pytest.fixture(autouse=True)
def _write_every_cycle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cycles driven by hand do all their work and write it at once (the poller's write interval
    and cycle budget are real time: test_pipeline.py checks them apart)."""
    from otel_hicache.capture import poller as poller_module

    monkeypatch.setattr(poller_module, "_WRITE_INTERVAL_NS", 0)
    monkeypatch.setattr(poller_module, "CYCLE_BUDGET_NS", 1 << 60)

INFLIGHT = sc.TRANSFER_OLDEST_INFLIGHT_AGE[0]
UNACKED = sc.TRANSFER_OLDEST_UNACKED_AGE[0]
STATIC = {"tp_rank": 3}
T0 = 1_767_225_600_000_000_000
S = 1_000_000_000
ZERO = {"offload": 0.0, "onboard": 0.0}
NONE = {"offload": None, "onboard": None}


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
                        assert set(point.attributes) == {sc.DIRECTION, *STATIC}
                        assert dict(point.attributes).items() >= STATIC.items()
                        found[point.attributes[sc.DIRECTION]] = point.value
    return found


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


class _Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> int:
        return self.now


# -- 1. the poller's STATE, cycle by cycle -------------------------------------------------------

class _Channel:
    def __init__(self) -> None:
        self.batches: list[list[tuple[Any, ...]]] = []

    def write(self, batch: list[tuple[Any, ...]], ops: int) -> None:
        self.batches.append(list(batch))

    def stop(self, timeout_s: float, export_s: float | None = None) -> bool:
        return True

    def forget_in_child(self) -> None:
        pass


class _Poller(Poller):
    def _start_thread(self) -> None:
        self.thread = SimpleNamespace(is_alive=lambda: False, join=lambda timeout=None: None, ident=None)


class _Done:
    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


@pytest.fixture
def manual(monkeypatch):
    """A poller whose cycles the test runs; ``state()`` is the last STATE it wrote, as a dict."""
    monkeypatch.setattr(engine, "_STATE_INTERVAL_NS", 0)  # a STATE whenever it changed
    clock = _Clock()
    channel = _Channel()
    settings = PollerSettings()
    settings.max_queue_size = 8
    p = _Poller(settings, lambda: channel, clock)

    def state() -> dict[str, Any]:
        found = [m for batch in channel.batches for m in batch if m[0] == rec.STATE]
        assert found, "no STATE written"
        return dict(zip(rec.STATE_FIELDS, found[-1][1:]))

    return SimpleNamespace(p=p, clock=clock, channel=channel, state=state)


def now_state(p: Poller) -> dict[str, Any]:
    """What the next STATE would say, without a cycle (no intake)."""
    return dict(zip(rec.STATE_FIELDS, p._state_message(0.0)[1:]))  # pylint: disable=protected-access


def test_a_record_is_in_flight_while_queued_taken_in_and_polled(manual):
    p, clock = manual.p, manual.clock
    done = _Done(False)
    p.queue.append(submission("onboard", {"kv": 64}, 4096, 64, finish_event=done, submit_ns=T0))
    clock.now += 2 * S
    queued = now_state(p)
    assert (queued["inflight"], queued["oldest_inflight_ns"], queued["queue_size"]) == (
        {"offload": 0, "onboard": 1}, {"offload": None, "onboard": T0}, 1)
    p._cycle()  # pylint: disable=protected-access
    assert len(p._pending) == 1 and not p.queue  # pylint: disable=protected-access
    polled = manual.state()
    assert (polled["inflight"], polled["oldest_inflight_ns"], polled["oldest_unacked_ns"], polled["queue_size"]) == (
        {"offload": 0, "onboard": 1}, {"offload": None, "onboard": T0}, NONE, 1)
    done.done = True
    p._cycle()  # pylint: disable=protected-access
    finished = manual.state()
    assert (finished["inflight"], finished["oldest_inflight_ns"], finished["queue_size"]) == (
        {"offload": 0, "onboard": 0}, NONE, 0)


def test_the_oldest_op_per_direction_is_sent_and_a_host_start_is_its_submit_time(manual):
    p, clock = manual.p, manual.clock
    never = _Done(False)
    p.queue.append(submission("onboard", {"kv": 64}, 4096, 64, finish_event=never, submit_ns=T0 + 1 * S))
    p.queue.append(submission("offload", {"kv": 64}, 4096, 64, finish_event=never, submit_ns=T0 + 2 * S))
    p.queue.append(submission("onboard", {"kv": 64}, 4096, 64, finish_event=never, submit_ns=T0 + 3 * S))
    # host_start_ns is the op's submit time (TransferTelemetry.submit stamps it so)
    p.queue.append(submission("offload", {"kv": 64}, 4096, 64, finish_event=never, submit_ns=T0 + S // 2,
                              host_start_ns=T0 + S // 2))
    clock.now = T0 + 5 * S
    p._cycle()  # pylint: disable=protected-access
    state = manual.state()
    assert state["inflight"] == {"offload": 2, "onboard": 2}
    assert state["oldest_inflight_ns"] == {"offload": T0 + S // 2, "onboard": T0 + 1 * S}


def test_the_oldest_unacked_op_is_the_first_seen_complete_and_an_ack_not_yet_scanned_counts_as_acked(manual):
    p, clock = manual.p, manual.clock
    first = submission("offload", {"kv": 64}, 4096, 64, finish_event=_Done(True), expect_ack=True, submit_ns=T0)
    p.queue.append(first)
    p._cycle()  # pylint: disable=protected-access
    clock.now += 1 * S
    p.queue.append(submission("offload", {"kv": 64}, 4096, 64, expect_ack=True, submit_ns=clock.now))
    p.queue.append(submission("onboard", {"kv": 64}, 4096, 64, expect_ack=True, submit_ns=clock.now))
    p._cycle()  # pylint: disable=protected-access
    assert manual.state()["oldest_unacked_ns"] == {"offload": T0, "onboard": T0 + S}
    assert manual.state()["inflight"] == {"offload": 0, "onboard": 0}  # complete: no longer in flight
    clock.now += _ACK_SCAN_INTERVAL_NS // 2
    first[S_ACK_NS] = clock.now  # ack() stamped it; the next ack scan is not due yet
    p._cycle()  # pylint: disable=protected-access
    assert len(p._awaiting) == 3  # pylint: disable=protected-access
    assert not any(m[0] == rec.ACK for m in manual.channel.batches[-1])
    assert manual.state()["oldest_unacked_ns"] == {"offload": T0 + S, "onboard": T0 + S}
    assert manual.state()["queue_size"] == 3


def test_unusable_submit_times_are_skipped(manual):
    p, clock = manual.p, manual.clock
    p.queue.append(submission("offload", {"kv": 64}, 4096, 64, submit_ns="later"))
    p.queue.append(submission("sideways", {"kv": 64}, 4096, 64, submit_ns=clock.now - S))
    p.queue.append(["not", "a", "submission"])
    p.queue.append(submission("offload", {"kv": 64}, 4096, 64, submit_ns=float("nan")))
    assert now_state(p)["oldest_inflight_ns"] == NONE
    p.queue.append(submission("offload", {"kv": 64}, 4096, 64, submit_ns=clock.now - S))
    assert now_state(p)["oldest_inflight_ns"] == {"offload": clock.now - S, "onboard": None}


def test_a_held_intake_lock_delays_a_state_by_a_bounded_wait_only(manual):
    """A STATE is also made by another thread (one that finds the poller stuck): it never waits for
    the intake lock without bound."""
    p, clock = manual.p, manual.clock
    p.queue.append(submission("offload", {"kv": 64}, 4096, 64, submit_ns=clock.now - 2 * S))
    held = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with p._lock:  # pylint: disable=protected-access
            held.set()
            release.wait(10.0)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(5.0)
        began = time.monotonic()
        assert now_state(p)["oldest_inflight_ns"] == {"offload": clock.now - 2 * S, "onboard": None}
        assert time.monotonic() - began < 1.0
    finally:
        release.set()
        holder.join(5.0)


# -- 2. the gauges, from a state -----------------------------------------------------------------

@pytest.fixture
def metrics():
    clock = _Clock()
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    made = TransferMetrics(provider, STATIC, clock, "unknown", "embedded")
    yield SimpleNamespace(metrics=made, reader=reader, clock=clock)
    provider.shutdown()


def test_both_gauges_report_zero_for_both_directions_before_any_state(metrics):
    assert gauge(metrics.reader, INFLIGHT) == ZERO and gauge(metrics.reader, UNACKED) == ZERO


def test_the_gauges_age_the_times_sent_when_the_sdk_collects(metrics):
    m, clock = metrics.metrics, metrics.clock
    m.state({"offload": 1, "onboard": 0}, {"offload": T0, "onboard": None}, {"offload": None, "onboard": T0 + S}, 1,
            None)
    clock.now = T0 + 2 * S
    assert gauge(metrics.reader, INFLIGHT) == {"offload": 2.0, "onboard": 0.0}
    assert gauge(metrics.reader, UNACKED) == {"offload": 0.0, "onboard": 1.0}
    clock.now += S // 4
    assert gauge(metrics.reader, INFLIGHT) == {"offload": 2.25, "onboard": 0.0}  # no new state needed
    m.state({"offload": 0, "onboard": 0}, NONE, NONE, 0, None)
    assert gauge(metrics.reader, INFLIGHT) == ZERO and gauge(metrics.reader, UNACKED) == ZERO


def test_a_time_ahead_of_the_clock_is_an_age_of_zero(metrics):
    metrics.metrics.state({"offload": 1, "onboard": 0}, {"offload": T0 + S, "onboard": None}, NONE, 1, None)
    assert gauge(metrics.reader, INFLIGHT) == ZERO


# -- 3. end to end (the harness: embedded sinks, the real poller thread) -------------------------

def consumer(h: Any) -> Any:
    channel = h.tel.channel
    assert channel is not None, "the channel is not open yet"
    return channel.consumer


def ages(h: Any) -> tuple[dict[str, float], dict[str, float]]:
    """(oldest in-flight, oldest un-acked) per direction, from one collection each."""
    return gauge(h.reader, INFLIGHT), gauge(h.reader, UNACKED)


def received(h: Any, direction: str, unacked: bool = False) -> None:
    """Wait until the sinks got a STATE with an op of ``direction`` in flight (or un-acked)."""
    oldest = lambda: consumer(h).metrics._oldest[int(unacked)]  # pylint: disable=protected-access  # noqa: E731
    wait_until(lambda: oldest().get(direction) is not None)


def settles(h: Any, expected: tuple[dict[str, float], dict[str, float]]) -> None:
    """The gauges reach ``expected`` once the poller's next STATE (at most every 50 ms) is applied."""
    deadline = time.monotonic() + 10.0
    while ages(h) != expected:
        assert time.monotonic() < deadline, (ages(h), expected)
        time.sleep(0.002)


def stuck_op(h: Any, direction: str) -> list:
    """An op whose finish event never completes, submitted now."""
    start = h.device.event().record()
    finish = h.device.event().never_completes()
    return h.tel.submit(direction, {"kv": 64}, 64 * 4096, page_size=64, start_event=start, finish_event=finish)


def quick_op(h: Any, direction: str, expect_ack: bool = True) -> list:
    """An op whose copy runs for the next 1 ms (device time)."""
    start, finish = h.device.copy(h.device.time_ns(), 1.0)
    return h.tel.submit(direction, {"kv": 64}, 64 * 4096, page_size=64, start_event=start, finish_event=finish,
                        expect_ack=expect_ack)


@pytest.fixture(autouse=True)
def _short_shutdown(monkeypatch):
    """Ops left stuck at the end of a test would hold shutdown() for its 5 s default."""
    monkeypatch.setenv("OTEL_HICACHE_SHUTDOWN_TIMEOUT_S", "0.2")


def started(harness: Any, on_device_clock: bool = True) -> Any:
    """A harness whose poller has run its first cycle: its sinks, and so the gauges, exist."""
    h = harness(attributes=dict(STATIC))
    assert h.flush()
    if on_device_clock:
        consumer(h).metrics._clock = h.device.time_ns  # pylint: disable=protected-access
    return h


@pytest.fixture
def h(harness):
    return started(harness)


def test_both_directions_report_zero_from_start_up(h):
    assert ages(h) == (ZERO, ZERO)


def test_stuck_op_ages_with_the_clock_in_its_direction_only(h):
    stuck_op(h, "offload")
    received(h, "offload")
    assert ages(h) == (ZERO, ZERO)  # submitted this very nanosecond
    h.device.advance(seconds=2)
    assert ages(h) == ({"offload": 2.0, "onboard": 0.0}, ZERO)
    wait_until(lambda: len(h.tel._pipeline._pending) == 1)  # pylint: disable=protected-access
    h.device.advance(ms=500)
    assert ages(h) == ({"offload": 2.5, "onboard": 0.0}, ZERO)  # queued or taken in, the same value
    h.device.advance(seconds=7.5)
    assert ages(h) == ({"offload": 10.0, "onboard": 0.0}, ZERO)


def test_the_oldest_op_per_direction_counts(h):
    stuck_op(h, "onboard")
    h.device.advance(seconds=1)
    stuck_op(h, "offload")
    h.device.advance(seconds=1)
    stuck_op(h, "onboard")  # younger: the first onboard op is still the oldest
    h.device.advance(seconds=3)
    settles(h, ({"offload": 4.0, "onboard": 5.0}, ZERO))


def test_an_op_counts_from_its_host_start(h):
    """``host_start_ns``, when given, is the op's submit time."""
    start = h.device.event().record()
    finish = h.device.event().never_completes()
    h.tel.submit("onboard", {"kv": 64}, 4096, page_size=64, start_event=start, finish_event=finish,
                 host_start_ns=h.device.time_ns() - 1_500_000_000)
    settles(h, ({"offload": 0.0, "onboard": 1.5}, ZERO))
    h.device.advance(seconds=1)
    assert ages(h) == ({"offload": 0.0, "onboard": 2.5}, ZERO)


def test_completion_brings_it_back_to_zero(h):
    start = h.device.event().record()
    finish = h.device.event().record(at_ns=h.device.time_ns() + 3_000_000_000)  # a 3 s copy
    h.tel.submit("onboard", {"kv": 64}, 4096, page_size=64, start_event=start, finish_event=finish, expect_ack=False)
    h.device.advance(seconds=2)
    settles(h, ({"offload": 0.0, "onboard": 2.0}, ZERO))
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
    settles(h, ({"offload": 5.0, "onboard": 0.0}, ZERO))
    h.device.advance(ms=1)
    assert h.flush()  # the poller timed it out: reported, its slot freed
    assert ages(h) == (ZERO, ZERO)
    assert h.value(sc.RECORDS_FAILED[0], reason=sc.FAIL_TRANSFER_TIMEOUT) == 1
    errors = [s for s in h.finished() if s.attributes.get(sc.ERROR_TYPE) == sc.FAIL_TRANSFER_TIMEOUT]
    assert len(errors) == 1 and errors[0].name == sc.SPAN_OFFLOAD


def test_missing_ack_ages_from_the_completion(h):
    handle = quick_op(h, "onboard")
    h.device.advance(seconds=2)  # the copy ended 1 ms in; the poller sees it complete at 2 s
    assert h.flush()  # no longer in flight; held for its ack
    assert ages(h) == (ZERO, ZERO)  # waiting since its completion was seen, this nanosecond
    received(h, "onboard", unacked=True)
    h.device.advance(seconds=4)
    assert ages(h) == (ZERO, {"offload": 0.0, "onboard": 4.0})
    h.device.advance(ms=250)
    assert ages(h) == (ZERO, {"offload": 0.0, "onboard": 4.25})
    h.tel.ack(handle)  # recovery: acked, the next STATE says so before the ack scan sends its ACK
    settles(h, (ZERO, ZERO))
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
    assert len(h.finished()) == 1  # it was reported: not simply unseen


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
    settles(h, (ZERO, {"offload": 2.0, "onboard": 2.0}))


def test_ack_timeout_ends_it(harness, monkeypatch):
    monkeypatch.setenv("OTEL_HICACHE_ACK_TIMEOUT_S", "10")
    h = started(harness)
    quick_op(h, "offload")
    h.device.advance(ms=1)
    assert h.flush()
    h.device.advance(seconds=10)
    assert ages(h) == (ZERO, {"offload": 10.0, "onboard": 0.0})
    # over the ack timeout, and by a whole ack-scan interval of the poller's clock (the device's
    # here, which stands still between advances): a scan is due whenever the last one ran;
    # the span is emitted with hicache.acked=false
    h.device.advance(ns=_ACK_SCAN_INTERVAL_NS)
    wait_until(lambda: len(h.spans.get_finished_spans()) == 1)
    settles(h, (ZERO, ZERO))
    assert h.finished()[0].attributes[sc.ACKED] is False


def test_both_at_once(h):
    quick_op(h, "offload")
    h.device.advance(ms=1)
    assert h.flush()
    stuck_op(h, "onboard")
    h.device.advance(seconds=3)
    settles(h, ({"offload": 0.0, "onboard": 3.0}, {"offload": 3.0, "onboard": 0.0}))


def test_shutdown_leaves_zero(h):
    stuck_op(h, "offload")
    quick_op(h, "onboard")
    h.device.advance(seconds=1)
    received(h, "onboard", unacked=True)  # seen complete now, after the 1 ms copy
    h.device.advance(seconds=1)
    assert ages(h) == ({"offload": 2.0, "onboard": 0.0}, {"offload": 0.0, "onboard": 1.0})
    h.tel.shutdown()  # the stuck op dropped as shutdown, the un-acked one emitted
    assert ages(h) == (ZERO, ZERO)


def test_a_collection_never_waits_for_the_intake_lock(h):
    """The SDK collects holding its own lock: the gauges read what the sinks were sent, never the
    poller's lock."""
    stuck_op(h, "offload")
    received(h, "offload")
    h.device.advance(seconds=2)
    with h.tel._pipeline._lock:  # pylint: disable=protected-access
        began = time.monotonic()
        assert ages(h) == ({"offload": 2.0, "onboard": 0.0}, ZERO)
        assert time.monotonic() - began < 1.0


def test_the_ages_are_on_the_clock_that_stamps_the_submit_times(harness):
    h = started(harness, on_device_clock=False)
    stuck_op(h, "offload")
    received(h, "offload")
    h.device.advance(seconds=2)
    assert ages(h) == ({"offload": 2.0, "onboard": 0.0}, ZERO)
