"""Placing device events on the host wall clock.

Device timing events only measure intervals between each other. To put a
transfer span on the wall clock (so it lines up with request spans in a trace
view) the poller keeps an *anchor*: a timing event it records on its
own side stream and synchronizes, bracketed by two host clock readings. The
event ran at about the midpoint of the bracket; the bracket's half-width bounds
the error. Any other completed event ``e`` is then placed at
``anchor_wall_ns + anchor.elapsed_time(e)``.

Anchors are re-taken every ``OTEL_HICACHE_ANCHOR_INTERVAL_S`` (off the hot path,
on the poller thread) so device/host clock drift stays small. A new sample is
kept only when its bracket is not much wider than the best one seen, so an
anchor taken while the device was busy does not replace a good one.

Without an anchor (events that offer no way to record a new one, or an anchor
that cannot be compared with them) :class:`EventTimeline` still places ops
*relative to each other* exactly: an earlier op's completed start event is the
reference, and a new op starts at ``reference_wall_ns +
reference.elapsed_time(start_event)`` (negative when it started before the
reference). Only the timeline's offset to the wall clock is estimated, from
when the poller saw ops complete; see :class:`EventTimeline`.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

from ..diagnostics import logger, warn_once


_FIRST_SAMPLES = 3

# How a device-timed span was placed on the wall clock (hicache.placement_source)
PLACEMENT_ANCHOR = "anchor"
"""By the wall-clock anchor: ``anchor_wall_ns + anchor.elapsed_time(start_event)``."""
PLACEMENT_RELATIVE = "relative"
"""By ``elapsed_time()`` from an earlier op's event (:class:`EventTimeline`): exact
relative to the other ops of its timeline; the offset to the wall clock is estimated."""
PLACEMENT_HOST_COMPLETION = "host_completion"
"""Ends when the poller saw it end (or at the caller's ``host_end_ns``): its events
could not be compared with an earlier op's (it may start a timeline of its own)."""


class WallClockAnchor:
    """Maps completed device events to host wall-clock nanoseconds."""

    __slots__ = (
        "_factory",
        "_clock",
        "_interval_ns",
        "event",
        "wall_ns",
        "uncertainty_ns",
        "_best_uncertainty_ns",
        "_taken_at_ns",
        "_failed",
    )

    def __init__(
        self,
        factory: Callable[[], Any],
        interval_s: float = 1.0,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
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
        """Take a new anchor sample if the current one is older than the interval."""
        if self._failed:
            return
        if self.event is not None and now_ns - self._taken_at_ns < self._interval_ns:
            return
        self.refresh()

    def refresh(self) -> None:
        # The first sample pays one-time costs between the two host readings (a CUDA
        # factory creates its side stream, the context warms up) and would sit early in
        # its bracket: the first refresh takes a few samples and keeps the narrowest.
        tries = _FIRST_SAMPLES if self.event is None else 1
        try:
            before, event, after = self._sample()
            for _ in range(tries - 1):
                sample = self._sample()
                if sample[2] - sample[0] < after - before:
                    before, event, after = sample
        except Exception as exc:  # never let a device problem stop the poller
            self._failed = self.event is None
            warn_once(
                "anchor",
                "otel-hicache: cannot record a wall-clock anchor event (%r); "
                "device-timed spans are placed from host completion times instead",
                exc,
            )
            return
        half = (after - before) // 2
        best = self._best_uncertainty_ns
        # Keep a sample unless it is much noisier than the best one seen; an old
        # anchor is still replaced eventually (drift), at 4x the best width.
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


_REFRESH_MS = 1000.0
"""An op starting this much device time after its timeline's reference becomes the
reference: offsets stay short (elapsed_time() is a float32 of ms on CUDA: 61 ns
resolution at 1 s, 0.25 ms at an hour) and a held event is never old."""
_WINDOW_NS = 1_000_000_000
"""Host time over which a timeline looks for evidence that it is placed too early."""
_MAX_TIMELINES = 4
"""Timelines kept at once (devices, or streams where events of different streams
cannot be compared), least recently used dropped first."""
_GIVE_UP_AFTER = 8
"""Timelines started without one comparison ever succeeding: the events cannot be
compared at all, stop trying (each try is an exception)."""
_FORCE_AFTER_NS = 10_000_000_000
"""A correction of a timeline's offset that found no idle gap for this long (host
time) is made anyway, at the cost of that one op's overlap with the ops before it."""
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
            # It ends after the poller saw it end (or after the caller's end stamp):
            # the timeline is late by at least that.
            self.owed_ns = 0
            want = -excess
        elif self.owed_ns:
            # Every op of the last window was seen complete at least owed_ns after it
            # was placed to end (drift, a host clock step): later, never past this op's
            # own observation.
            want = min(self.owed_ns, -excess)
        else:
            want = 0
        shift = 0
        if want:
            # The offset to the wall clock is corrected only where no correction can
            # change how this op overlaps the ops placed before it: at an idle gap before
            # its start (later ops of the timeline then follow it; only one completing out
            # of order across the gap can see its overlap off by the correction). Earlier
            # by at most the gap; later only if it overlaps none of them.
            gap = start - self.latest_end_ns
            if want < 0:
                shift = max(want, -gap) if gap > 0 else 0
            elif gap >= 0:
                shift = want
            if shift != want:
                # A device busy without a gap would keep a wrong offset for ever (drift
                # grows it): after _FORCE_AFTER_NS the correction is made anyway.
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

    The first op of a timeline is placed from its host completion: it ends at
    ``bound_ns`` (when the poller saw it end, or the caller's end stamp), and its
    start event becomes the timeline's reference. Every later op whose start
    event can be compared with the reference (``reference.elapsed_time(start)``
    does not raise) is placed from that device time difference, so overlapping
    ops overlap exactly as they did on the device, however late the poller saw
    them complete. The reference moves to a newer op's start event once the
    offsets reach :data:`_REFRESH_MS`.

    The timeline's wall-clock offset is the first op's observation, corrected as
    evidence comes, and only at an idle gap before an op (so overlaps stay
    exact): earlier when an op would end after it was seen to end (the first op
    was seen late, or the device clock runs fast), later when every op of a
    window of :data:`_WINDOW_NS` was seen complete after it was placed to end
    (a slow device clock, a host clock step). Spans are then placed late by at
    most the smallest observation delay of recent ops, and never end after they
    were seen to end, up to a correction still waiting for a gap; one that finds
    none within :data:`_FORCE_AFTER_NS` is made anyway.

    An op whose start event cannot be compared with any timeline (another
    device; a back-end that compares only events of one stream) is placed from
    its host completion and starts a timeline of its own. After
    :data:`_GIVE_UP_AFTER` timelines without one successful comparison, every op
    is placed from its host completion. Not thread-safe: the poller's.
    """

    __slots__ = ("_timelines", "_seeded", "_compared", "_disabled")

    def __init__(self) -> None:
        self._timelines: list[_Timeline] = []
        self._seeded = 0
        self._compared = False
        self._disabled = False

    def place(self, start_event: Any, duration_ns: int, bound_ns: int) -> tuple[int, str]:
        """Wall-clock start of a completed op, and how it was placed
        (:data:`PLACEMENT_RELATIVE` or :data:`PLACEMENT_HOST_COMPLETION`)."""
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
            warn_once(
                f"timeline:{type(start_event).__name__}",
                "otel-hicache: elapsed_time() between the events of different transfers fails on %s "
                "events; without a wall-clock anchor such transfers are placed from the time their "
                "completion was seen (hicache.placement_source=host_completion), so overlapping "
                "ones can be under-counted in hicache.transfer.busy_time",
                type(start_event).__name__,
            )
            return start, PLACEMENT_HOST_COMPLETION
        timelines.insert(0, _Timeline(start_event, start, bound_ns))
        del timelines[_MAX_TIMELINES:]
        return start, PLACEMENT_HOST_COMPLETION

    def __len__(self) -> int:
        return len(self._timelines)
