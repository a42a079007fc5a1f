"""A record's completion (``query()``, never ``synchronize()``) and timing: with both events completed,
``elapsed_time()`` (``device_event``) placed by :mod:`.clock`; else host times (``host_clock``)."""

from __future__ import annotations

import math
import reprlib
from typing import Any

from ..diagnostics import warn_once
from ..record import DEVICE_EVENT, HOST_CLOCK, INT64_MAX
from .clock import PLACEMENT_ANCHOR, PLACEMENT_HOST_COMPLETION, EventTimeline, WallClockAnchor
from .device import anchor_factory_for
from .records import TransferRecord

MAX_DEVICE_DURATION_MS = 86_400_000.0  # above a day: a broken event


def is_complete(record: TransferRecord) -> bool:
    """True once the transfer finished; raises whatever the events raise."""
    finish, start = record.finish_event, record.start_event
    if finish is None or (record.host_end_ns is not None and start is None):  # nothing left to read
        return True
    return bool(finish.query()) and (start is None or bool(start.query()))


class Timing:
    """The poller's anchor (from ``anchor_factory``, else the first timed op's events) and timeline."""

    def __init__(self, anchor_factory: Any, interval_s: float, clock: Any) -> None:
        self._factory, self._interval_s, self._clock = anchor_factory, interval_s, clock
        self._anchor: Any = False  # False: not looked for yet
        self._timeline = EventTimeline()

    def refresh(self, now_ns: int) -> None:
        if self._anchor:
            self._anchor.maybe_refresh(now_ns)

    def resolve(self, record: TransferRecord, now_ns: int) -> None:
        if self._anchor is False and record.start_event is not None:
            self._anchor, factory = None, self._factory
            try:
                factory = factory or anchor_factory_for(record.start_event)
            except Exception:
                factory = None
            if factory is not None:
                self._anchor = WallClockAnchor(factory, self._interval_s, self._clock)
                self._anchor.refresh()
        resolve(record, now_ns, self._anchor or None, self._timeline)


def resolve(record: TransferRecord, now_ns: int, anchor: WallClockAnchor | None,
            timeline: EventTimeline | None = None) -> None:
    """Set duration, wall-clock start and end, placement, timing source and queue wait."""
    duration_ms = None if record.start_event is None or record.finish_event is None else \
        _device_duration_ms(record.start_event, record.finish_event)
    if duration_ms is None:
        return resolve_host_clock(record, now_ns)
    duration_ns = record.duration_ns = int(round(duration_ms * 1e6))
    record.timing_source = DEVICE_EVENT
    bound = record.host_end_ns if record.host_end_ns is not None else now_ns
    start, record.placement = _place(record.start_event, anchor, timeline, duration_ns, bound)
    if record.placement == PLACEMENT_ANCHOR:
        record.queue_wait_ns = max(0, start - record.submit_ns)
    record.start_ns, record.end_ns = start, start + duration_ns


def _place(event: Any, anchor: WallClockAnchor | None, timeline: EventTimeline | None, duration_ns: int,
           bound_ns: int) -> tuple[int, str]:
    """Where a device-timed op starts, and how that was found (nonsense: the host completion, warned once)."""
    try:
        start, placement = anchor.wall_time_ns(event) if anchor is not None else None, PLACEMENT_ANCHOR
        if start is None and timeline is not None:
            start, placement = timeline.place(event, duration_ns, bound_ns)
        elif start is None:
            start, placement = bound_ns - duration_ns, PLACEMENT_HOST_COMPLETION
        if type(start) is int and 0 <= start <= INT64_MAX - duration_ns:
            return start, placement
        problem: object = start
    except (ArithmeticError, ValueError, TypeError) as exc:  # e.g. int(round(nan)) of an event's offset
        problem = exc
    warn_once("placement", "otel-hicache: a device-timed op could not be placed on the wall clock from its "
              "events (%s); such ops end where the poller saw them end", reprlib.repr(problem))
    return max(0, bound_ns - duration_ns), PLACEMENT_HOST_COMPLETION


def resolve_host_clock(record: TransferRecord, now_ns: int) -> None:
    """Host-clock timing: no usable timing events, or the record failed."""
    record.timing_source, record.placement = HOST_CLOCK, None
    start = record.host_start_ns if record.host_start_ns is not None else record.submit_ns
    if record.host_end_ns is not None:
        end = record.host_end_ns
    else:  # seen complete now, or (nothing says when) complete at submit
        end = now_ns if record.finish_event is not None else record.submit_ns
    record.start_ns, record.end_ns = start, max(end, start)
    record.duration_ns = record.end_ns - start


def _device_duration_ms(start_event: Any, finish_event: Any) -> float | None:
    try:
        value = float(start_event.elapsed_time(finish_event))
    except Exception as exc:
        warn_once(f"elapsed_time:{type(start_event).__name__}", "otel-hicache: elapsed_time() failed on %s events "
                  "(%r): were they created with enable_timing=True? These transfers are reported with "
                  "hicache.timing_source=host_clock.", type(start_event).__name__, exc)
        return None
    if not math.isfinite(value) or not 0 <= value <= MAX_DEVICE_DURATION_MS:
        warn_once("elapsed_time:negative", "otel-hicache: elapsed_time() returned %r ms (finish before start, or "
                  "more than a day?); reporting such transfers with hicache.timing_source=host_clock", value)
        return None
    return value
