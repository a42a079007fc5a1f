"""Wall-clock anchoring of device events."""

from __future__ import annotations

from otel_hicache.clock import WallClockAnchor
from otel_hicache.testing import SimulatedDevice


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
    assert not anchor.usable
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
