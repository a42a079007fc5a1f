"""The two DEBUG log lines per completed op (per op and cumulative), only when DEBUG is on.

The SGLang seed's fields, the timing source and the span's ids; the cumulative bandwidth is
bytes over the busy time (the union of intervals), right when ops overlap.
"""

from __future__ import annotations

import logging
from typing import Any

from ..diagnostics import logger
from ..record import DIRECTIONS, TIERS


class CumulativeTotals:
    __slots__ = ("events", "blocks", "bytes", "tokens", "busy_ns")

    def __init__(self) -> None:
        self.events = self.blocks = self.bytes = self.tokens = self.busy_ns = 0


class TransferLog:
    def __init__(self) -> None:
        self.totals = {d: CumulativeTotals() for d in DIRECTIONS}

    def completed(self, record: Any, busy_added_ns: int) -> None:
        totals = self.totals[record.direction]
        totals.events += 1
        totals.blocks += record.blocks
        totals.bytes += record.num_bytes
        totals.tokens += record.tokens
        totals.busy_ns += busy_added_ns
        if not logger.isEnabledFor(logging.DEBUG):
            return
        src, dst = TIERS[record.direction]
        context = record.span_context
        sampled = context is not None and context.trace_flags.sampled
        trace_id = f"{context.trace_id:032x}" if sampled else ""  # unsampled spans are never exported
        span_id = f"{context.span_id:016x}" if sampled else ""
        extra = {"otelTraceID": trace_id, "otelSpanID": span_id}
        name = record.direction.capitalize()
        bandwidth = record.num_bytes / record.duration_ns if record.duration_ns else 0.0
        logger.debug('%s transfer complete ts_us=%d blocks=%d bytes=%d tokens=%d xfer_us=%.1f bandwidth=%.2fGB/s '
                     'src="%s" dst="%s" timing_source=%s trace_id=%s span_id=%s', name, record.end_ns // 1000,
                     record.blocks, record.num_bytes, record.tokens, record.duration_ns / 1e3, bandwidth, src, dst,
                     record.timing_source, trace_id, span_id, extra=extra)
        cumulative_bw = totals.bytes / totals.busy_ns if totals.busy_ns else 0.0
        logger.debug('%s transfer cumulative direction="%s" total_events=%d total_blocks=%d total_bytes=%d '
                     'total_tokens=%d total_busy_us=%.1f bandwidth=%.2fGB/s trace_id=%s span_id=%s', name,
                     record.direction, totals.events, totals.blocks, totals.bytes, totals.tokens,
                     totals.busy_ns / 1e3, cumulative_bw, trace_id, span_id, extra=extra)
