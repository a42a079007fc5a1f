"""A record's completion and timing: device time placed by an anchor or by earlier ops, else host times."""

from __future__ import annotations

import contextlib
import math
import reprlib
import time
from typing import Any, Callable

from ..diagnostics import logger, warn_once
from ..record import DEVICE_EVENT, HOST_CLOCK, INT64_MAX
from .device import anchor_factory_for
from .records import TransferRecord

# hicache.placement_source
PLACEMENT_ANCHOR, PLACEMENT_RELATIVE, PLACEMENT_HOST_COMPLETION = "anchor", "relative", "host_completion"


def is_complete(record: TransferRecord) -> bool:
    """Raises whatever the events raise."""
    finish, start = record.finish_event, record.start_event
    if finish is None or (record.host_end_ns is not None and start is None):
        return True
    return bool(finish.query()) and (start is None or bool(start.query()))


def resolve(record: TransferRecord, now_ns: int, anchor: WallClockAnchor | None,
            timeline: EventTimeline | None = None) -> None:
    event, finish = record.start_event, record.finish_event
    if event is None or finish is None:
        return resolve_host_clock(record, now_ns)
    try:
        ms = float(event.elapsed_time(finish))
    except Exception as exc:
        warn_once(f"elapsed_time:{type(event).__name__}", "otel-hicache: elapsed_time() failed on %s events (%r): "
                  "made without enable_timing=True? Such ops get hicache.timing_source=host_clock",
                  type(event).__name__, exc)
        return resolve_host_clock(record, now_ns)
    if not math.isfinite(ms) or not 0 <= ms <= 86_400_000.0:  # (a day)
        warn_once("elapsed_time:negative", "otel-hicache: elapsed_time() returned %r ms (finish before start, or "
                  "over a day?); such ops get hicache.timing_source=host_clock", ms)
        return resolve_host_clock(record, now_ns)
    duration = record.duration_ns = int(round(ms * 1e6))
    record.timing_source = DEVICE_EVENT
    bound = record.host_end_ns if record.host_end_ns is not None else now_ns
    try:
        start, placement = anchor.wall_time_ns(event) if anchor is not None else None, PLACEMENT_ANCHOR
        if start is None:
            start, placement = timeline.place(event, duration, bound) if timeline is not None else \
                (bound - duration, PLACEMENT_HOST_COMPLETION)
        if type(start) is not int or not 0 <= start <= INT64_MAX - duration:
            raise ValueError(reprlib.repr(start))
    except (ArithmeticError, ValueError, TypeError) as exc:  # e.g. int(round(nan))
        warn_once("placement", "otel-hicache: cannot place a device-timed op on the wall clock from its events "
                  "(%r); such ops end where the poller saw them end", exc)
        start, placement = max(0, bound - duration), PLACEMENT_HOST_COMPLETION
    if placement == PLACEMENT_ANCHOR:
        record.queue_wait_ns = max(0, start - record.submit_ns)
    record.start_ns, record.end_ns, record.placement = start, start + duration, placement


def resolve_host_clock(record: TransferRecord, now_ns: int) -> None:
    record.timing_source, record.placement = HOST_CLOCK, None
    start = record.host_start_ns if record.host_start_ns is not None else record.submit_ns
    end = record.host_end_ns if record.host_end_ns is not None else \
        now_ns if record.finish_event is not None else record.submit_ns  # seen complete now, or at submit
    record.start_ns, record.end_ns = start, max(end, start)
    record.duration_ns = record.end_ns - start


_FIRST_SAMPLES = 3  # the first pays one-time costs: the narrowest of a few


class WallClockAnchor:
    """Device events on the wall clock: an event synchronized between two clock readings ran at their midpoint
    (without a ``factory``, the first event placed finds one)."""

    def __init__(self, factory: Callable[[], Any] | None, interval_s: float = 1.0,
                 clock: Callable[[], int] = time.time_ns) -> None:
        self._factory, self._clock, self._interval_ns = factory, clock, int(interval_s * 1e9)
        self.event: Any = None
        self.wall_ns = self.uncertainty_ns = self._taken_at_ns = 0
        self._best_ns = 1 << 62
        self._failed = False  # no first anchor: none tried again

    def maybe_refresh(self, now_ns: int) -> None:
        if self.event is not None and now_ns - self._taken_at_ns >= self._interval_ns:
            self.refresh()

    def refresh(self) -> None:
        try:
            samples = [self._sample() for _ in range(_FIRST_SAMPLES if self.event is None else 1)]
        except Exception as exc:
            self._failed = self.event is None
            warn_once("anchor", "otel-hicache: cannot record a wall-clock anchor event (%r); device-timed ops are "
                      "placed from their host completion", exc)
            return
        before, event, after = min(samples, key=lambda s: s[2] - s[0])
        half = (after - before) // 2
        # a much noisier sample than the best replaces only an old anchor (drift)
        if self.event is not None and half > max(4 * self._best_ns, 20_000) \
                and after - self._taken_at_ns < 8 * self._interval_ns:
            return
        self.event, self.wall_ns, self.uncertainty_ns, self._taken_at_ns = event, before + half, half, after
        self._best_ns = min(self._best_ns, half)
        logger.log(5, "otel-hicache anchor wall_ns=%d uncertainty_ns=%d", self.wall_ns, half)

    def _sample(self) -> tuple[int, Any, int]:
        before = self._clock()
        event = self._factory()
        event.synchronize()
        return before, event, self._clock()

    def wall_time_ns(self, event: Any) -> int | None:
        if self.event is None and not self._failed:
            with contextlib.suppress(Exception):  # (None stays None)
                self._factory = self._factory or anchor_factory_for(event)
            self._failed = self._factory is None
            if not self._failed:
                self.refresh()
        if self.event is None:
            return None
        try:
            offset_ms = self.event.elapsed_time(event)
        except Exception:
            return None
        return self.wall_ns + int(round(offset_ms * 1e6))


_REFRESH_MS = 1000.0  # an op this far after its reference becomes it (float32 ms)
_WINDOW_NS = 1_000_000_000  # host time a timeline looks back for evidence it is early
_MAX_TIMELINES = 4  # devices or incomparable streams (LRU)
_GIVE_UP_AFTER = 8  # seeds without a comparison: incomparable events
_FORCE_AFTER_NS = 10_000_000_000  # a correction without an idle gap this long is made anyway
_NO_LAG = 1 << 62


class _Timeline:
    def __init__(self, event: Any, start_ns: int, end_ns: int) -> None:
        self.event, self.wall_ns, self.latest_end_ns = event, start_ns, end_ns
        self.window_end_ns = end_ns + _WINDOW_NS
        self.window_min_lag_ns = self.owed_ns = 0  # (the seed ends at its observation)
        self.blocked_since_ns: Any = None

    def place(self, event: Any, offset_ms: float, duration_ns: int, bound_ns: int) -> int:
        start = self.wall_ns + int(round(offset_ms * 1e6))
        excess = start + duration_ns - bound_ns
        if excess > 0:  # it ends after it was seen to: late
            self.owed_ns, want = 0, -excess
        else:  # the last window's ops all ended owed_ns late
            want = min(self.owed_ns, -excess)
        gap = start - self.latest_end_ns  # shifted only at an idle gap: no overlap with earlier ops changes
        shift = (max(want, -gap) if gap > 0 else 0) if want < 0 else (want if gap >= 0 else 0)
        if shift != want:  # (a device never idle would stay wrong)
            if self.blocked_since_ns is None:
                self.blocked_since_ns = bound_ns
            elif bound_ns - self.blocked_since_ns >= _FORCE_AFTER_NS:
                shift = want
        if shift == want:
            self.blocked_since_ns = None
            if want > 0:
                self.owed_ns = 0
        if shift:
            start += shift
            self.wall_ns += shift
            if self.window_min_lag_ns != _NO_LAG:
                self.window_min_lag_ns -= shift
        end = start + duration_ns
        self.latest_end_ns = max(self.latest_end_ns, end)
        self.window_min_lag_ns = min(self.window_min_lag_ns, bound_ns - end)
        if bound_ns >= self.window_end_ns:  # (an older correction is stale)
            self.owed_ns = max(0, self.window_min_lag_ns)
            self.window_min_lag_ns, self.window_end_ns = _NO_LAG, bound_ns + _WINDOW_NS
        if offset_ms >= _REFRESH_MS:
            self.event, self.wall_ns = event, start  # as good a reference, and newer
        return start


class EventTimeline:
    """Without an anchor: a timeline's first op ends when seen complete, later ones by their device time
    difference from it, the offset corrected at idle gaps."""

    def __init__(self) -> None:
        self._timelines: list[_Timeline] = []
        self._seeds = 0  # timelines started; far negative once two events compared

    def place(self, event: Any, duration_ns: int, bound_ns: int) -> tuple[int, str]:
        start, timelines = bound_ns - duration_ns, self._timelines
        if self._seeds > _GIVE_UP_AFTER:
            return start, PLACEMENT_HOST_COMPLETION
        for index, timeline in enumerate(timelines):
            try:
                offset_ms = float(timeline.event.elapsed_time(event))
            except Exception:  # another device, stream or back-end
                continue
            if math.isfinite(offset_ms):
                self._seeds = -1 << 62
                timelines.insert(0, timelines.pop(index))
                return timeline.place(event, offset_ms, duration_ns, bound_ns), PLACEMENT_RELATIVE
        self._seeds += 1
        if self._seeds <= _GIVE_UP_AFTER:
            timelines.insert(0, _Timeline(event, start, bound_ns))
            del timelines[_MAX_TIMELINES:]
        else:
            timelines.clear()
            warn_once(f"timeline:{type(event).__name__}", "otel-hicache: elapsed_time() between the events "
                      "of different transfers fails on %s events; without an anchor, they end when seen complete "
                      "(hicache.placement_source=host_completion): overlaps under-count hicache.transfer.busy_time",
                      type(event).__name__)
        return start, PLACEMENT_HOST_COMPLETION
