"""Wall-clock anchoring of device events, and placement without an anchor (EventTimeline)."""

from __future__ import annotations

import math

import pytest

from otel_hicache.capture import timing as clock
from otel_hicache.capture.timing import PLACEMENT_HOST_COMPLETION, PLACEMENT_RELATIVE, EventTimeline, WallClockAnchor
from simulated import DuckEvent, SimulatedDevice


class SkewedDevice(SimulatedDevice):
    """Device events are recorded on the device timeline; the host clock runs
    ``offset`` ns ahead of it, and synchronize() returns ``wake`` ns late."""

    def __init__(self, offset: int, wake: int) -> None:
        super().__init__()
        self.offset = offset
        self.wake = wake

    def host_ns(self) -> int:
        return self.time_ns() + self.offset

    def anchor_event(self):
        event = super().anchor_event()
        self.advance(ns=self.wake)  # the host notices completion a little later
        return event


def test_events_are_placed_on_the_wall_clock_within_the_bracket():
    device = SkewedDevice(offset=3_000_000_000, wake=8_000)
    anchor = WallClockAnchor(device.anchor_event, interval_s=1.0, clock=device.host_ns)
    anchor.refresh()
    assert anchor.uncertainty_ns == 4_000
    event = device.event().record(at_ns=device.time_ns() + 5_000_000)
    device.advance(ms=6)
    true_wall = event.at_ns + device.offset
    assert abs(anchor.wall_time_ns(event) - true_wall) <= anchor.uncertainty_ns


def test_refresh_keeps_a_tight_anchor_over_a_noisy_one():
    device = SkewedDevice(offset=0, wake=2_000)
    anchor = WallClockAnchor(device.anchor_event, interval_s=1.0, clock=device.host_ns)
    anchor.refresh()
    good = anchor.event
    device.wake = 5_000_000  # a busy device: the bracket is 5 ms wide
    device.advance(seconds=1.5)
    anchor.maybe_refresh(device.host_ns())
    assert anchor.event is good
    device.wake = 2_000
    device.advance(seconds=1.5)
    anchor.maybe_refresh(device.host_ns())
    assert anchor.event is not good and anchor.uncertainty_ns == 1_000


def test_a_failing_anchor_factory_is_warned_once_and_leaves_spans_host_placed(warnings_log):
    def broken():
        raise RuntimeError("no device")

    anchor = WallClockAnchor(broken)
    anchor.refresh()
    anchor.maybe_refresh(10**19)
    assert anchor.event is None
    assert warnings_log.text.count("cannot record a wall-clock anchor") == 1


def test_the_first_anchor_does_not_carry_the_factory_s_one_time_set_up():
    """A CUDA factory creates its side stream on its first call, between the two host
    readings: that sample would place every span early by half the set-up time."""
    device = SkewedDevice(offset=0, wake=2_000)
    calls = []

    def factory():
        if not calls:
            device.advance(ms=4)  # stream creation before the event is recorded
        calls.append(1)
        return device.anchor_event()

    anchor = WallClockAnchor(factory, interval_s=1.0, clock=device.host_ns)
    anchor.refresh()
    assert anchor.uncertainty_ns == 1_000
    event = device.event().record(at_ns=device.time_ns() + 1_000_000)
    device.advance(ms=2)
    assert abs(anchor.wall_time_ns(event) - event.at_ns) <= anchor.uncertainty_ns


# -- EventTimeline: placement without an anchor -----------------------------------------------


MS = 1_000_000


def ns(ms):
    return int(round(ms * MS))


def op(device, start_ms, duration_ms, base, cls=DuckEvent, **kw):
    start, finish = device.copy(base + ns(start_ms), duration_ms)
    return cls(start, **kw), cls(finish, **kw), ns(duration_ms)


def place_when_seen(timeline, device, ops, seen_ms, base):
    """Advance the device (and host) clock to each op's observation and place it there."""
    placed = []
    for (start, _finish, duration), seen in zip(ops, seen_ms):
        device.advance_to(base + ns(seen))
        assert start.query() and _finish.query()
        placed.append(timeline.place(start, duration, device.time_ns()))
    return placed


def union_ms(intervals):
    total, last = 0, -math.inf
    for s, e in sorted(intervals):
        if e > last:
            total += e - max(s, last)
            last = e
    return total / MS


@pytest.mark.parametrize("seen_ms", [(10, 15), (100, 100), (12.5, 40)], ids=["prompt", "both-late", "second-late"])
def test_overlapping_ops_are_placed_exactly_relative_to_each_other(seen_ms):
    device = SimulatedDevice()
    base = device.time_ns()
    ops = [op(device, 0, 10, base), op(device, 5, 10, base)]
    (first, how1), (second, how2) = place_when_seen(EventTimeline(), device, ops, seen_ms, base)
    assert (how1, how2) == (PLACEMENT_HOST_COMPLETION, PLACEMENT_RELATIVE)
    assert first == base + ns(seen_ms[0]) - 10 * MS  # the first op ends when it was seen to end
    assert second - first == 5 * MS  # exact, however late either was seen
    assert union_ms([(first, first + 10 * MS), (second, second + 10 * MS)]) == 15


def test_an_op_that_started_before_the_reference_gets_a_negative_offset():
    device = SimulatedDevice()
    base = device.time_ns()
    long_op, short_op = op(device, 0, 20, base), op(device, 5, 5, base)  # the short one completes first
    (short_start, _), (long_start, how) = place_when_seen(EventTimeline(), device, [short_op, long_op], (10, 20), base)
    assert how == PLACEMENT_RELATIVE
    assert (short_start - base, long_start - base) == (5 * MS, 0)


def test_a_late_first_observation_is_corrected_at_the_next_idle_gap():
    device = SimulatedDevice()
    base = device.time_ns()
    timeline = EventTimeline()
    ops = [op(device, 0, 10, base), op(device, 5, 10, base), op(device, 200, 10, base), op(device, 205, 10, base)]
    placed = place_when_seen(timeline, device, ops, (100, 100.5, 210.2, 215.1), base)
    starts = [start - base for start, _how in placed]
    # seen 90 ms late: the second op overlaps the first, so no correction there (it ends after it was seen)
    assert starts[:2] == [90 * MS, 95 * MS]
    # the third starts after an idle gap: moved earlier to end at its own observation, no earlier
    assert starts[2] == ns(200.2)
    assert starts[3] - starts[2] == 5 * MS  # and the timeline follows it, exactly
    assert all(how == PLACEMENT_RELATIVE for _start, how in placed[1:])


def test_a_correction_never_takes_more_than_the_idle_gap():
    device = SimulatedDevice()
    base = device.time_ns()
    timeline = EventTimeline()
    ops = [op(device, 0, 10, base), op(device, 12, 10, base)]  # a 2 ms gap between them
    (first, _), (second, _) = place_when_seen(timeline, device, ops, (50, 22), base)
    # the second op was seen at 22 (placed to end at 62): moved earlier by only the 2 ms gap
    assert first == base + 40 * MS and second == first + 10 * MS


def test_a_correction_that_never_finds_a_gap_is_made_after_ten_seconds():
    device = SimulatedDevice()
    base = device.time_ns()
    timeline = EventTimeline()
    placed = []  # (placed start, placed end, seen)
    # ops of 10 ms every 5 ms, always overlapping; the poller stalls until 60 ms, then keeps up
    ops = [op(device, 5 * k, 10, base) for k in range(2400)]
    for k, (start, finish, duration) in enumerate(ops):
        seen = base + max(60 * MS, ns(5 * k + 10.1))
        device.advance_to(seen)
        placed_start, _how = timeline.place(start, duration, seen)
        placed.append((placed_start, placed_start + duration, seen))
    forced = [k for k in range(1, len(placed)) if placed[k][0] - placed[k - 1][0] != 5 * MS]
    assert len(forced) == 1, forced[:5]  # one correction, made once 10 s had passed without a gap
    k = forced[0]
    assert placed[k][2] - placed[1][2] >= clock._FORCE_AFTER_NS  # pylint: disable=protected-access
    assert all(end > seen for _start, end, seen in placed[1:k])  # late until then (50 ms)
    assert all(end <= seen for _start, end, seen in placed[k:])  # never after they were seen, since


def test_a_host_clock_step_forward_is_followed_after_a_window():
    device = SimulatedDevice()
    base = device.time_ns()
    timeline = EventTimeline()
    host_offset = 0
    placed = []
    for i in range(30):  # an op every 100 ms, each seen 0.1 ms after it ended
        if i == 5:
            host_offset = 7 * MS  # the host clock steps 7 ms forward
        start, finish, duration = op(device, i * 100, 1, base)
        device.advance_to(base + ns(i * 100 + 1.1))
        placed.append(timeline.place(start, duration, device.time_ns() + host_offset)[0] - base - host_offset)
    # placed as the host clock reads: 0.1 ms (the prompt-most lag) late before and after the step
    assert placed[0] == ns(0.1)
    assert placed[-1] == pytest.approx(29 * 100 * MS + ns(0.1), abs=ns(0.01))
    assert all(p - q == 100 * MS for p, q in zip(placed[1:5], placed[:4]))  # untouched before the step


def test_placed_spans_never_end_after_they_were_seen_once_a_gap_allowed_it():
    device = SimulatedDevice()
    base = device.time_ns()
    timeline = EventTimeline()
    for i in range(50):  # the device clock runs 100 ppm fast against the host's
        start, finish, duration = op(device, i * 20, 2, base)
        device.advance_to(base + ns(i * 20 + 2.3))
        host_seen = base + int(round(ns(i * 20 + 2.3) * (1 - 1e-4)))
        placed_start, how = timeline.place(start, duration, host_seen)
        assert how == (PLACEMENT_HOST_COMPLETION if i == 0 else PLACEMENT_RELATIVE)
        assert placed_start + duration <= host_seen, i


def test_the_reference_moves_to_a_newer_event_after_a_second_of_device_time():
    device = SimulatedDevice()
    base = device.time_ns()
    timeline = EventTimeline()
    first = op(device, 0, 1, base)
    later = op(device, 1500, 1, base)
    place_when_seen(timeline, device, [first], (1,), base)
    assert timeline._timelines[0].event is first[0]  # pylint: disable=protected-access
    (start, how), = place_when_seen(timeline, device, [later], (1501,), base)
    assert how == PLACEMENT_RELATIVE and start == base + 1500 * MS
    assert timeline._timelines[0].event is later[0]  # pylint: disable=protected-access
    assert timeline._timelines[0].wall_ns == start  # pylint: disable=protected-access


def test_events_that_cannot_be_compared_are_placed_from_their_host_completion():
    device = SimulatedDevice()
    base = device.time_ns()
    timeline = EventTimeline()
    ops = [op(device, 0, 10, base, DuckEvent, stream=1), op(device, 5, 10, base, DuckEvent, stream=2),
           op(device, 20, 10, base, DuckEvent, stream=2), op(device, 22, 10, base, DuckEvent, stream=1)]
    placed = place_when_seen(timeline, device, ops, (100, 100, 120, 122), base)
    assert [how for _start, how in placed] == [PLACEMENT_HOST_COMPLETION, PLACEMENT_HOST_COMPLETION,
                                             PLACEMENT_RELATIVE, PLACEMENT_RELATIVE]
    assert placed[1][0] == base + 90 * MS  # ends when seen: its overlap with the first op is lost
    assert placed[2][0] - placed[1][0] == 15 * MS and placed[3][0] - placed[0][0] == 22 * MS  # each stream's own
    assert len(timeline._timelines) == 2


def test_events_never_comparable_stop_being_tried_and_say_so_once(warnings_log):
    device = SimulatedDevice()
    base = device.time_ns()
    timeline = EventTimeline()
    calls = []

    class Loner(DuckEvent):
        def elapsed_time(self, end):
            calls.append(end)
            if end is not getattr(self, "partner", None):
                raise RuntimeError("no")
            return super().elapsed_time(end)

    for i in range(clock._GIVE_UP_AFTER + 5):  # pylint: disable=protected-access
        start, finish, duration = op(device, i * 20, 1, base, Loner)
        device.advance_to(base + ns(i * 20 + 2))
        assert timeline.place(start, duration, device.time_ns()) == (device.time_ns() - duration,
                                                                      PLACEMENT_HOST_COMPLETION)
    tries = len(calls)
    start, finish, duration = op(device, 1000, 1, base, Loner)
    device.advance_to(base + 1002 * MS)
    timeline.place(start, duration, device.time_ns())
    assert len(calls) == tries and len(timeline._timelines) == 0  # no more tries
    assert warnings_log.text.count("between the events of different transfers fails on Loner") == 1
    assert "hicache.placement_source=host_completion" in warnings_log.text


def test_timelines_of_several_devices_are_kept_apart():
    devices = [SimulatedDevice(start_ns=1_767_225_600_000_000_000 + k * 10**12) for k in range(2)]
    timeline = EventTimeline()

    class DeviceEvent(DuckEvent):
        def __init__(self, inner, device):
            super().__init__(inner)
            self.device = device

        def elapsed_time(self, end):
            if end.device is not self.device:
                raise RuntimeError("different devices")
            return super().elapsed_time(end)

    host = 1_767_225_600_000_000_000
    placed = []
    for i in range(6):
        k = i % 2
        device = devices[k]
        base = device.time_ns()
        start, finish = device.copy(base + MS, 2)
        start, finish = DeviceEvent(start, k), DeviceEvent(finish, k)
        device.advance(ms=4)
        host += 4 * MS
        placed.append(timeline.place(start, 2 * MS, host))
    assert [how for _s, how in placed] == [PLACEMENT_HOST_COMPLETION] * 2 + [PLACEMENT_RELATIVE] * 4
    assert len(timeline._timelines) == 2
