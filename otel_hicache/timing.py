"""Completion and timing of a transfer record, resolved on the worker.

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
or it is the first op of its device) ending when the worker saw it end, or at
the caller's end stamp (``host_completion``). Host-clock ops have no placement
of their own (None): their stamps are the placement.
"""

from __future__ import annotations

import math
from typing import Any

from .clock import PLACEMENT_ANCHOR, PLACEMENT_HOST_COMPLETION, EventTimeline, WallClockAnchor
from .diagnostics import warn_once
from .records import DEVICE_EVENT, HOST_CLOCK, TransferRecord


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
            start_wall = anchor.wall_time_ns(start_event) if anchor is not None else None
            if start_wall is None:
                # No anchor: it ended by the time we saw it end (or the caller's end stamp).
                bound = record.host_end_ns if record.host_end_ns is not None else now_ns
                if timeline is not None:
                    start_wall, record.placement = timeline.place(start_event, duration_ns, bound)
                else:
                    start_wall, record.placement = bound - duration_ns, PLACEMENT_HOST_COMPLETION
            else:
                record.placement = PLACEMENT_ANCHOR
                record.queue_wait_ns = max(0, start_wall - record.submit_ns)
            record.start_ns = start_wall
            record.end_ns = start_wall + duration_ns
            return
    resolve_host_clock(record, now_ns)


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
    if not math.isfinite(value) or value < 0:
        warn_once(
            "elapsed_time:negative",
            "otel-hicache: elapsed_time() returned %r ms (finish before start?); "
            "reporting such transfers with hicache.timing_source=host_clock",
            value,
        )
        return None
    return value
