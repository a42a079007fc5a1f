"""Placing device events on the host wall clock.

The *anchor* is a timing event the poller records on a side stream of its own and synchronizes,
between two host clock readings: it ran at about their midpoint, within half their distance; any
completed event ``e`` is then at ``anchor_wall_ns + anchor.elapsed_time(e)``. It is re-taken every
``OTEL_HICACHE_ANCHOR_INTERVAL_S`` (drift), a sample much wider than the best one kept only once old.
Without an anchor, :class:`EventTimeline` places ops relative to each other exactly, and only
estimates the offset of that timeline to the wall clock.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

from ..diagnostics import logger, warn_once

_FIRST_SAMPLES = 3
# How a device-timed span was placed (hicache.placement_source): by the anchor; by elapsed_time() from an
# earlier op's event (exact relative to its timeline's other ops); or ending when the poller saw it end (or
# at the caller's end stamp), its events comparable with no earlier op's.
PLACEMENT_ANCHOR = "anchor"
PLACEMENT_RELATIVE = "relative"
PLACEMENT_HOST_COMPLETION = "host_completion"


class WallClockAnchor:
    """Maps completed device events to host wall-clock nanoseconds."""

    __slots__ = ("_factory", "_clock", "_interval_ns", "event", "wall_ns", "uncertainty_ns", "_best_uncertainty_ns",
                 "_taken_at_ns", "_failed")

    def __init__(self, factory: Callable[[], Any], interval_s: float = 1.0,
                 clock: Callable[[], int] = time.time_ns) -> None:
        self._factory = factory
        self._clock = clock
        self._interval_ns = int(interval_s * 1e9)
        self.event: Any = None
        self.wall_ns = 0
        self.uncertainty_ns = 0
        self._best_uncertainty_ns: int | None = None
        self._taken_at_ns = 0
        self._failed = False

    @property
    def usable(self) -> bool:
        return self.event is not None

    def maybe_refresh(self, now_ns: int) -> None:
        if not self._failed and (self.event is None or now_ns - self._taken_at_ns >= self._interval_ns):
            self.refresh()

    def refresh(self) -> None:
        # the first sample pays one-time costs inside its bracket (a side stream, a warm-up): keep the narrowest of a few
        tries = _FIRST_SAMPLES if self.event is None else 1
        try:
            before, event, after = self._sample()
            for _ in range(tries - 1):
                sample = self._sample()
                if sample[2] - sample[0] < after - before:
                    before, event, after = sample
        except Exception as exc:  # never let a device problem stop the poller
            self._failed = self.event is None
            warn_once("anchor", "otel-hicache: cannot record a wall-clock anchor event (%r); device-timed spans "
                      "are placed from host completion times instead", exc)
            return
        half = (after - before) // 2
        best = self._best_uncertainty_ns
        # a sample much noisier than the best one seen replaces only an old anchor (drift)
        if self.event is not None and best is not None and half > max(4 * best, 20_000):
            if after - self._taken_at_ns < 8 * self._interval_ns:
                return
        self.event = event
        self.wall_ns = before + half
        self.uncertainty_ns = half
        self._taken_at_ns = after
        if best is None or half < best:
            self._best_uncertainty_ns = half
        if logger.isEnabledFor(5):
            logger.log(5, "otel-hicache anchor wall_ns=%d uncertainty_ns=%d", self.wall_ns, half)

    def _sample(self) -> tuple[int, Any, int]:
        before = self._clock()
        event = self._factory()
        event.synchronize()
        return before, event, self._clock()

    def wall_time_ns(self, event: Any) -> int | None:
        """Wall-clock time of a completed timing event, or None if unknown."""
        if self.event is None:
            return None
        try:
            offset_ms = self.event.elapsed_time(event)
        except Exception:
            return None
        return self.wall_ns + int(round(offset_ms * 1e6))


# an op this far after its timeline's reference becomes the reference (CUDA's elapsed_time() is a float32 of ms)
_REFRESH_MS = 1000.0
_WINDOW_NS = 1_000_000_000  # host time over which a timeline looks for evidence it is placed too early
_MAX_TIMELINES = 4  # devices, or streams whose events cannot be compared; least recently used dropped
_GIVE_UP_AFTER = 8  # timelines started without one comparison succeeding: the events cannot be compared
_FORCE_AFTER_NS = 10_000_000_000  # a correction that found no idle gap for this long is made anyway
_NO_LAG = 1 << 62


class _Timeline:
    """One device timeline: a reference event and its wall-clock placement."""

    __slots__ = ("event", "wall_ns", "latest_end_ns", "window_end_ns", "window_min_lag_ns", "owed_ns",
                 "blocked_since_ns")

    def __init__(self, event: Any, start_ns: int, end_ns: int) -> None:
        self.event = event
        self.wall_ns = start_ns
        self.latest_end_ns = end_ns
        self.window_end_ns = end_ns + _WINDOW_NS
        self.window_min_lag_ns = 0  # the seed ends at its observation
        self.owed_ns = 0
        self.blocked_since_ns: int | None = None

    def place(self, event: Any, offset_ms: float, duration_ns: int, bound_ns: int) -> int:
        start = self.wall_ns + int(round(offset_ms * 1e6))
        end = start + duration_ns
        excess = end - bound_ns
        if excess > 0:
            # it ends after it was seen to end: the timeline is late by at least that
            self.owed_ns = 0
            want = -excess
        elif self.owed_ns:
            # every op of the last window was seen to end owed_ns after it was placed to: later
            want = min(self.owed_ns, -excess)
        else:
            want = 0
        shift = 0
        if want:
            # corrected only at an idle gap before it, so no overlap with the ops before changes:
            # earlier by at most the gap, later only if it overlaps none of them
            gap = start - self.latest_end_ns
            if want < 0:
                shift = max(want, -gap) if gap > 0 else 0
            elif gap >= 0:
                shift = want
            if shift != want:
                # a device busy without a gap would keep a wrong offset for ever
                if self.blocked_since_ns is None:
                    self.blocked_since_ns = bound_ns
                elif bound_ns - self.blocked_since_ns >= _FORCE_AFTER_NS:
                    shift = want
            if shift == want:
                self.blocked_since_ns = None
                if want > 0:
                    self.owed_ns = 0
        else:
            self.blocked_since_ns = None
        if shift:
            start += shift
            end += shift
            self.wall_ns += shift
            if self.window_min_lag_ns != _NO_LAG:
                self.window_min_lag_ns -= shift  # the window's ops, as the new offset places them
        if end > self.latest_end_ns:
            self.latest_end_ns = end
        lag = bound_ns - end
        if lag < self.window_min_lag_ns:
            self.window_min_lag_ns = lag
        if bound_ns >= self.window_end_ns:
            # what the last window shows (a correction still owed from before is stale)
            self.owed_ns = self.window_min_lag_ns if self.window_min_lag_ns > 0 else 0
            self.window_min_lag_ns = _NO_LAG
            self.window_end_ns = bound_ns + _WINDOW_NS
        if offset_ms >= _REFRESH_MS:
            self.event = event  # its placement is known: as good a reference, and newer
            self.wall_ns = start
        return start


class EventTimeline:
    """Places device-timed ops on the wall clock without an anchor.

    A timeline's first op ends at ``bound_ns`` (when the poller saw it end, or the caller's end stamp)
    and its start event becomes the reference; every later op whose start event compares with the
    reference is placed by that device time difference, so ops overlap as they did on the device.
    The offset to the wall clock is corrected, at idle gaps only, earlier when an op would end after
    it was seen to, later when every op of a window was seen to end after it was placed to. Ops that
    compare with no timeline start one of their own; after :data:`_GIVE_UP_AFTER` timelines without a
    comparison every op is placed from its host completion. Not thread-safe: the poller's.
    """

    __slots__ = ("_timelines", "_seeded", "_compared", "_disabled")

    def __init__(self) -> None:
        self._timelines: list[_Timeline] = []
        self._seeded = 0
        self._compared = False
        self._disabled = False

    def place(self, start_event: Any, duration_ns: int, bound_ns: int) -> tuple[int, str]:
        """Wall-clock start of a completed op, and how it was placed."""
        if self._disabled:
            return bound_ns - duration_ns, PLACEMENT_HOST_COMPLETION
        timelines = self._timelines
        for index, timeline in enumerate(timelines):
            try:
                offset_ms = float(timeline.event.elapsed_time(start_event))
            except Exception:  # another device, stream or back-end: try the next
                continue
            if not math.isfinite(offset_ms):
                continue
            self._compared = True
            if index:
                timelines.insert(0, timelines.pop(index))
            return timeline.place(start_event, offset_ms, duration_ns, bound_ns), PLACEMENT_RELATIVE
        start = bound_ns - duration_ns
        self._seeded += 1
        if not self._compared and self._seeded > _GIVE_UP_AFTER:
            self._disabled = True
            timelines.clear()
            warn_once(f"timeline:{type(start_event).__name__}", "otel-hicache: elapsed_time() between the events "
                      "of different transfers fails on %s events; without a wall-clock anchor they are placed from "
                      "when their completion was seen (hicache.placement_source=host_completion), so overlapping "
                      "ones can be under-counted in hicache.transfer.busy_time", type(start_event).__name__)
            return start, PLACEMENT_HOST_COMPLETION
        timelines.insert(0, _Timeline(start_event, start, bound_ns))
        del timelines[_MAX_TIMELINES:]
        return start, PLACEMENT_HOST_COMPLETION

    def __len__(self) -> int:
        return len(self._timelines)
