"""Two DEBUG lines per completed op: the op, and its direction's totals (bandwidth over busy time)."""

from __future__ import annotations

import logging
from typing import Any

from ..diagnostics import logger
from ..record import DIRECTIONS, TIERS


class TransferLog:
    def __init__(self) -> None:
        self.totals = {d: [0, 0, 0, 0, 0] for d in DIRECTIONS}  # events, blocks, bytes, tokens, busy ns

    def completed(self, r: Any, busy_added_ns: int) -> None:
        totals = self.totals[r.direction]
        for i, value in enumerate((1, r.blocks, r.num_bytes, r.tokens, busy_added_ns)):
            totals[i] += value
        if not logger.isEnabledFor(logging.DEBUG):
            return
        context, name = r.span_context, r.direction.capitalize()
        sampled = context is not None and context.trace_flags.sampled  # (unsampled spans are never exported)
        trace_id, span_id = (f"{context.trace_id:032x}", f"{context.span_id:016x}") if sampled else ("", "")
        extra = {"otelTraceID": trace_id, "otelSpanID": span_id}
        logger.debug('%s transfer complete ts_us=%d blocks=%d bytes=%d tokens=%d xfer_us=%.1f bandwidth=%.2fGB/s '
                     'src="%s" dst="%s" timing_source=%s trace_id=%s span_id=%s', name, r.end_ns // 1000, r.blocks,
                     r.num_bytes, r.tokens, r.duration_ns / 1e3, r.num_bytes / r.duration_ns if r.duration_ns else 0.0,
                     *TIERS[r.direction], r.timing_source, trace_id, span_id, extra=extra)
        events, blocks, num_bytes, tokens, busy_ns = totals
        logger.debug('%s transfer cumulative direction="%s" total_events=%d total_blocks=%d total_bytes=%d '
                     'total_tokens=%d total_busy_us=%.1f bandwidth=%.2fGB/s trace_id=%s span_id=%s', name,
                     r.direction, events, blocks, num_bytes, tokens, busy_ns / 1e3,
                     num_bytes / busy_ns if busy_ns else 0.0, trace_id, span_id, extra=extra)
