"""Unit tests of otel_hicache.capture.timing on records built by hand: completion
(``is_complete``) and duration resolution (``resolve``, ``resolve_host_clock``),
with events whose ``query()`` and ``elapsed_time()`` the test controls."""

from __future__ import annotations

import pytest

from otel_hicache.capture.records import TransferRecord, validate

from harness import submission
from otel_hicache.capture.timing import (PLACEMENT_ANCHOR, PLACEMENT_HOST_COMPLETION, PLACEMENT_RELATIVE, EventTimeline,
                                         is_complete, resolve, resolve_host_clock)
from otel_hicache.record import DEVICE_EVENT, HOST_CLOCK
from simulated import SimulatedDevice

SUBMIT = 1_767_225_600_000_000_000
NOW = SUBMIT + 50_000_000  # when the poller observed the completion


class Event:
    """``query()`` answers ``done`` (or raises ``query_error``); ``elapsed_time()``
    answers ``elapsed_ms`` (or raises ``elapsed_error``) and, as CUDA does, raises
    if either event has not completed. Every call is noted."""

    def __init__(self, done=True, elapsed_ms=0.0, elapsed_error=None, query_error=None):
        self.done = done
        self.elapsed_ms = elapsed_ms
        self.elapsed_error = elapsed_error
        self.query_error = query_error
        self.queries = 0
        self.elapsed_calls = []  # (end event, this one completed, end completed)

    def query(self):
        self.queries += 1
        if self.query_error is not None:
            raise self.query_error
        return self.done

    def elapsed_time(self, end):
        self.elapsed_calls.append((end, bool(self.done), bool(end.done)))
        if self.elapsed_error is not None:
            raise self.elapsed_error
        if not (self.done and end.done):
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return self.elapsed_ms


class OtherEvent(Event):
    """Another event type: elapsed_time() failures are warned about once per type."""


class Anchor:
    """A wall-clock anchor that places every event at ``wall_ns`` (None: cannot)."""

    def __init__(self, wall_ns):
        self.wall_ns = wall_ns
        self.asked = []

    def wall_time_ns(self, event):
        self.asked.append(event)
        return self.wall_ns


def record(start=None, finish=None, timing=True, host_start=None, host_end=None, submit_ns=SUBMIT):
    r = TransferRecord(submission("onboard", {"kv": 64}, 4096, 64, start if timing else None, finish,
                                  submit_ns=submit_ns, host_start_ns=host_start, host_end_ns=host_end))
    validate(r)
    return r


def timing_of(r):
    return r.timing_source, r.start_ns, r.end_ns, r.duration_ns, r.queue_wait_ns


def warnings_about(log, text):
    return [r.getMessage() for r in log.records if text in r.getMessage()]


# -- is_complete ------------------------------------------------------------------

def test_no_finish_event_is_complete_at_once_without_asking_the_start_event():
    start = Event(done=False)
    assert is_complete(record(start, None)) is True
    assert start.queries == 0


def test_a_host_end_stamp_is_complete_without_querying_untimed_events():
    finish = Event(done=False)
    assert is_complete(record(None, finish, timing=False, host_end=SUBMIT + 10)) is True
    assert finish.queries == 0


def test_an_unfinished_copy_is_not_complete_and_its_start_event_is_not_asked():
    start, finish = Event(done=True), Event(done=False)
    assert is_complete(record(start, finish)) is False
    assert (start.queries, finish.queries) == (0, 1)


def test_a_finish_before_its_start_completed_is_not_complete():
    # events on two streams: the finish event can complete before the start one
    start, finish = Event(done=False), Event(done=True)
    assert is_complete(record(start, finish)) is False
    assert (start.queries, finish.queries) == (1, 1)
    assert start.elapsed_calls == [] and finish.elapsed_calls == []


@pytest.mark.parametrize("start", [None, Event(done=True), Event(done=1)], ids=["no-start", "start-done", "truthy"])
def test_complete_once_every_event_completed(start):
    assert is_complete(record(start, Event(done=True))) is True  # a bool, whatever query() returned


def test_query_errors_propagate_to_the_poller():
    with pytest.raises(RuntimeError, match="illegal memory access"):
        is_complete(record(Event(), Event(query_error=RuntimeError("illegal memory access"))))
    with pytest.raises(ValueError, match="start"):
        is_complete(record(Event(query_error=ValueError("start")), Event(done=True)))


# -- resolve: device timing -------------------------------------------------------------

def test_device_duration_without_an_anchor_ends_when_the_completion_was_observed():
    start, finish = Event(elapsed_ms=6.781), Event()
    r = record(start, finish)
    resolve(r, NOW, None)
    assert timing_of(r) == (DEVICE_EVENT, NOW - 6_781_000, NOW, 6_781_000, None)
    assert start.elapsed_calls == [(finish, True, True)]  # start.elapsed_time(finish), once
    assert finish.elapsed_calls == []


def test_device_duration_without_an_anchor_ends_at_the_callers_end_stamp():
    r = record(Event(elapsed_ms=2.0), Event(), host_end=SUBMIT + 10_000_000)
    resolve(r, NOW, None)
    assert timing_of(r) == (DEVICE_EVENT, SUBMIT + 8_000_000, SUBMIT + 10_000_000, 2_000_000, None)


def test_an_anchor_places_the_copy_on_the_wall_clock_and_gives_its_queue_wait():
    start = Event(elapsed_ms=6.781)
    anchor = Anchor(SUBMIT + 200_000)
    r = record(start, Event())
    resolve(r, NOW, anchor)
    assert timing_of(r) == (DEVICE_EVENT, SUBMIT + 200_000, SUBMIT + 6_981_000, 6_781_000, 200_000)
    assert anchor.asked == [start]


def test_queue_wait_is_never_negative():
    r = record(Event(elapsed_ms=1.0), Event())
    resolve(r, NOW, Anchor(SUBMIT - 5))  # the anchor's error puts the start before the submit
    assert timing_of(r) == (DEVICE_EVENT, SUBMIT - 5, SUBMIT - 5 + 1_000_000, 1_000_000, 0)


def test_an_anchor_that_cannot_place_the_event_falls_back_to_the_observed_completion():
    r = record(Event(elapsed_ms=1.0), Event())
    resolve(r, NOW, Anchor(None))
    assert timing_of(r) == (DEVICE_EVENT, NOW - 1_000_000, NOW, 1_000_000, None)


@pytest.mark.parametrize("elapsed_ms, duration_ns", [
    (6.781, 6_781_000),
    (0.001, 1_000),
    (1e-7, 0),  # 0.1 ns rounds down
    (9e-7, 1),  # 0.9 ns rounds up, not truncated
    (0.0, 0),  # a zero device time is still device timing
    (2, 2_000_000),  # an int from elapsed_time()
])
def test_device_duration_is_rounded_to_the_nearest_ns(elapsed_ms, duration_ns):
    r = record(Event(elapsed_ms=elapsed_ms), Event())
    resolve(r, NOW, None)
    assert (r.timing_source, r.duration_ns, r.end_ns - r.start_ns) == (DEVICE_EVENT, duration_ns, duration_ns)


def test_elapsed_time_is_not_called_when_timing_is_disabled():
    start, finish = Event(elapsed_ms=3.0), Event()
    r = record(start, finish, timing=False)
    resolve(r, NOW, Anchor(SUBMIT))
    assert timing_of(r) == (HOST_CLOCK, SUBMIT, NOW, NOW - SUBMIT, None)
    assert start.elapsed_calls == []


def test_without_a_start_event_the_host_clock_is_used():
    finish = Event(elapsed_ms=3.0)
    r = record(None, finish)
    resolve(r, NOW, None)
    assert timing_of(r) == (HOST_CLOCK, SUBMIT, NOW, NOW - SUBMIT, None)
    assert finish.elapsed_calls == []


@pytest.mark.parametrize("error", [RuntimeError("Both events must be created with argument 'enable_timing=True'."),
                                   ValueError("no")])
def test_an_elapsed_time_failure_falls_back_to_the_host_clock_and_warns_once_per_event_type(warnings_log, error):
    for cls in (Event, Event, OtherEvent):
        r = record(cls(elapsed_error=error), Event(), host_start=SUBMIT + 1_000)
        resolve(r, NOW, Anchor(SUBMIT))
        assert timing_of(r) == (HOST_CLOCK, SUBMIT + 1_000, NOW, NOW - SUBMIT - 1_000, None)
    messages = warnings_about(warnings_log, "elapsed_time() failed")
    assert len(messages) == 2, messages  # one per event type
    assert "on Event events" in messages[0] and "on OtherEvent events" in messages[1]
    assert "enable_timing=True" in messages[0] and "timing_source=host_clock" in messages[0]


def test_elapsed_time_returning_none_is_a_failure_too():
    r = record(Event(elapsed_ms=None), Event())
    resolve(r, NOW, None)
    assert timing_of(r) == (HOST_CLOCK, SUBMIT, NOW, NOW - SUBMIT, None)


@pytest.mark.parametrize("value", [-0.5, float("nan"), float("inf"), float("-inf")])
def test_a_negative_or_non_finite_device_time_falls_back_to_the_host_clock(warnings_log, value):
    for _ in range(2):
        r = record(Event(elapsed_ms=value), Event())
        resolve(r, NOW, None)
        assert timing_of(r) == (HOST_CLOCK, SUBMIT, NOW, NOW - SUBMIT, None)
    assert len(warnings_about(warnings_log, "elapsed_time() returned")) == 1


# -- resolve_host_clock -------------------------------------------------------------------

def test_host_clock_uses_the_callers_own_stamps():
    r = record(None, Event(), timing=False, host_start=SUBMIT + 1_000_000, host_end=SUBMIT + 4_000_000)
    resolve_host_clock(r, NOW)
    assert timing_of(r) == (HOST_CLOCK, SUBMIT + 1_000_000, SUBMIT + 4_000_000, 3_000_000, None)


def test_host_clock_starts_at_submit_and_ends_at_the_observed_completion():
    r = record(None, Event(), timing=False)
    resolve_host_clock(r, NOW)
    assert timing_of(r) == (HOST_CLOCK, SUBMIT, NOW, NOW - SUBMIT, None)


def test_with_no_finish_event_and_no_end_stamp_the_op_completes_at_submit():
    r = record(None, None, timing=False)
    resolve_host_clock(r, NOW)  # however late the poller got to it
    assert timing_of(r) == (HOST_CLOCK, SUBMIT, SUBMIT, 0, None)


@pytest.mark.parametrize("host_start, host_end", [(SUBMIT + 5, SUBMIT), (SUBMIT + 5, None)],
                         ids=["end-stamp-before-start", "start-stamp-after-submit"])
def test_an_end_before_the_start_is_a_zero_duration_at_the_start(host_start, host_end):
    r = record(None, None, timing=False, host_start=host_start, host_end=host_end)
    resolve_host_clock(r, NOW)
    assert timing_of(r) == (HOST_CLOCK, SUBMIT + 5, SUBMIT + 5, 0, None)


# -- the rule across both: elapsed_time() only after both events completed --------------------------

# is_complete() once returned True as soon as host_end_ns was set, without querying the timing
# events, and resolve() then called elapsed_time() on events still in flight (CUDA raises; the op
# went to the host clock with the 'were they created with enable_timing=True?' warning).
def test_elapsed_time_waits_for_the_timing_events_even_with_an_end_stamp():
    start, finish = Event(done=True, elapsed_ms=2.0), Event(done=False)
    r = record(start, finish, host_start=SUBMIT, host_end=SUBMIT + 2_000_000)
    if is_complete(r):  # what the poller does each cycle
        resolve(r, NOW, None)
    assert all(start_done and end_done for _end, start_done, end_done in start.elapsed_calls), start.elapsed_calls


# -- resolve: where a device-timed op is placed (hicache.placement_source) --------------------------


def test_the_placement_says_anchor_when_the_anchor_placed_the_op():
    r = record(Event(elapsed_ms=1.0), Event())
    resolve(r, NOW, Anchor(SUBMIT + 5), EventTimeline())
    assert (r.placement, r.start_ns) == (PLACEMENT_ANCHOR, SUBMIT + 5)


def test_host_clock_ops_have_no_placement_of_their_own():
    r = record(None, Event(), timing=False)
    resolve(r, NOW, None, EventTimeline())
    assert (r.timing_source, r.placement) == (HOST_CLOCK, None)
    r = record(Event(elapsed_error=RuntimeError("no timing")), Event())
    resolve(r, NOW, None, EventTimeline())
    assert (r.timing_source, r.placement) == (HOST_CLOCK, None)


def test_without_a_timeline_an_unanchored_op_ends_at_its_host_completion():
    r = record(Event(elapsed_ms=2.0), Event())
    resolve(r, NOW, None)
    assert (r.placement, r.start_ns, r.end_ns) == (PLACEMENT_HOST_COMPLETION, NOW - 2_000_000, NOW)


@pytest.mark.parametrize("anchor", [None, Anchor(None)], ids=["no-anchor", "anchor-cannot-place"])
def test_unanchored_ops_are_placed_relative_to_each_other_with_their_events(anchor):
    device = SimulatedDevice(start_ns=SUBMIT)
    timeline = EventTimeline()
    a = record(*device.copy(SUBMIT, 10.0))
    b = record(*device.copy(SUBMIT + 5_000_000, 10.0))
    device.advance(ms=100)  # both seen complete at 100 ms
    resolve(a, device.time_ns(), anchor, timeline)
    resolve(b, device.time_ns(), anchor, timeline)
    assert (a.placement, b.placement) == (PLACEMENT_HOST_COMPLETION, PLACEMENT_RELATIVE)
    assert (a.end_ns - a.start_ns, b.end_ns - b.start_ns) == (10_000_000, 10_000_000)
    assert b.start_ns - a.start_ns == 5_000_000  # as on the device
    assert a.queue_wait_ns is None and b.queue_wait_ns is None  # the wall-clock offset is only estimated


def test_the_callers_end_stamp_bounds_an_unanchored_op_as_the_observation_does():
    device = SimulatedDevice(start_ns=SUBMIT)
    r = record(*device.copy(SUBMIT, 2.0), host_end=SUBMIT + 3_000_000)
    device.advance(ms=50)
    resolve(r, device.time_ns(), None, EventTimeline())
    assert (r.placement, r.start_ns, r.end_ns) == (PLACEMENT_HOST_COMPLETION, SUBMIT + 1_000_000, SUBMIT + 3_000_000)
