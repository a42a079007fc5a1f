"""Completion and timing of a transfer record, resolved on the poller.

Rules (the lessons this product exists for):

* completion is observed with ``finish_event.query()``, never by a blocking
  ``synchronize()``, and ``elapsed_time()`` is called only after both events
  completed;
* with timing events the duration is ``start.elapsed_time(finish)``, the device
  time of the copy, whatever happens to the ack later;
* without them (``timing_enabled=False``, no events, a CPU device) the duration
  is host time from submit (or the caller's own start stamp) to completion (the
  caller's end stamp, else the observed ``finish_event``; with neither, the op
  counts as complete at submit, duration 0), and the record says so:
  ``timing_source = host_clock``. If ``elapsed_time()``
  fails the record falls back to the host clock and says so too, once warned.

Where a device-timed op lies on the wall clock (``placement``,
``hicache.placement_source``): from the wall-clock anchor when there is one that
can place its start event (``anchor``); else relative to earlier ops with
event-to-event ``elapsed_time()`` (``relative``, see
:class:`~otel_hicache.clock.EventTimeline`), so overlapping ops overlap as they
did on the device; else (its events cannot be compared with an earlier op's,
or it is the first op of its device) ending when the poller saw it end, or at
the caller's end stamp (``host_completion``). Host-clock ops have no placement
of their own (None): their stamps are the placement.
"""

from __future__ import annotations

import math
import reprlib
from typing import Any

from .clock import PLACEMENT_ANCHOR, PLACEMENT_HOST_COMPLETION, EventTimeline, WallClockAnchor
from ..diagnostics import warn_once
from .records import DEVICE_EVENT, HOST_CLOCK, INT64_MAX, TransferRecord

MAX_DEVICE_DURATION_MS = 86_400_000.0
"""A device duration above a day is taken for a broken event, not a copy (the host clock is
used): past about a hundred days it would put the span's end beyond what OTLP can encode."""


def is_complete(record: TransferRecord) -> bool:
    """True once the transfer finished. Raises whatever the events raise."""
    finish = record.finish_event
    if finish is None:
        return True
    # the caller's end stamp ends the wait only when no elapsed_time() will be read: that
    # one needs both events completed, whatever the caller stamped
    if record.host_end_ns is not None and not (record.timing_enabled and record.start_event is not None):
        return True
    if not finish.query():
        return False
    start = record.start_event
    return start is None or bool(start.query())


def resolve(
    record: TransferRecord,
    now_ns: int,
    anchor: WallClockAnchor | None,
    timeline: EventTimeline | None = None,
) -> None:
    """Set duration, wall-clock start/end and placement, timing source and queue wait."""
    start_event, finish_event = record.start_event, record.finish_event
    if record.timing_enabled and start_event is not None and finish_event is not None:
        duration_ms = _device_duration_ms(start_event, finish_event)
        if duration_ms is not None:
            duration_ns = int(round(duration_ms * 1e6))
            record.timing_source = DEVICE_EVENT
            record.duration_ns = duration_ns
            bound = record.host_end_ns if record.host_end_ns is not None else now_ns
            start_wall, record.placement = _place(record, anchor, timeline, duration_ns, bound)
            if record.placement == PLACEMENT_ANCHOR:
                record.queue_wait_ns = max(0, start_wall - record.submit_ns)
            record.start_ns = start_wall
            record.end_ns = start_wall + duration_ns
            return
    resolve_host_clock(record, now_ns)


def _place(record: TransferRecord, anchor: WallClockAnchor | None, timeline: EventTimeline | None,
           duration_ns: int, bound_ns: int) -> tuple[int, str]:
    """Where a device-timed op starts on the wall clock, and how that was found. A placement
    from events that return nonsense (NaN, or times no exporter can encode) gives way to the
    host completion (warned once): one bad event must not cost the op its span."""
    try:
        start = anchor.wall_time_ns(record.start_event) if anchor is not None else None
        if start is not None:
            placement = PLACEMENT_ANCHOR
        elif timeline is not None:  # no anchor: relative to the ops before it
            start, placement = timeline.place(record.start_event, duration_ns, bound_ns)
        else:  # it ended by the time we saw it end (or the caller's end stamp)
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
    """Host-clock timing: no usable timing events (or the record failed)."""
    record.timing_source = HOST_CLOCK
    record.placement = None
    start = record.host_start_ns if record.host_start_ns is not None else record.submit_ns
    if record.host_end_ns is not None:
        end = record.host_end_ns
    elif record.finish_event is not None:
        end = now_ns  # observed completion (poll granularity)
    else:
        end = record.submit_ns  # nothing says when it ended: complete at submit, not at intake
    if end < start:
        end = start
    record.start_ns = start
    record.end_ns = end
    record.duration_ns = end - start


def _device_duration_ms(start_event: Any, finish_event: Any) -> float | None:
    try:
        value = float(start_event.elapsed_time(finish_event))
    except Exception as exc:
        warn_once(
            f"elapsed_time:{type(start_event).__name__}",
            "otel-hicache: elapsed_time() failed on %s events (%r): were they created "
            "with enable_timing=True? These transfers are reported with "
            "hicache.timing_source=host_clock.",
            type(start_event).__name__,
            exc,
        )
        return None
    if not math.isfinite(value) or value < 0 or value > MAX_DEVICE_DURATION_MS:
        warn_once(
            "elapsed_time:negative",
            "otel-hicache: elapsed_time() returned %r ms (finish before start, or more than a day?); "
            "reporting such transfers with hicache.timing_source=host_clock",
            value,
        )
        return None
    return value
