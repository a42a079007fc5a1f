"""Span links from a transfer to the traced requests it served or whose KV it wrote.

``submit(requests=...)`` passes span contexts, read on the poller; the valid, sampled ones are
kept (an unsampled request's trace is never exported), each once, in order, at most
:data:`MAX_REQUEST_LINKS`. Only trace and span ids leave the process (``test_privacy.py``).
"""

from __future__ import annotations

from typing import Any

from opentelemetry.trace import SpanContext

from ..diagnostics import warn_once

MAX_REQUEST_LINKS = 16


def resolve(requests: Any) -> tuple[tuple[SpanContext, ...], int]:
    """``(span contexts to link, how many more sampled ones there were)``; anything but a span
    context is skipped (warned once)."""
    kept: list[SpanContext] = []
    seen: set[tuple[int, int]] = set()
    for context in requests:
        if not isinstance(context, SpanContext):
            warn_once(f"request:{type(context).__name__}", "otel-hicache: a request to link must be a SpanContext, "
                      "got %s; skipped", type(context).__name__)
            continue
        key = (context.trace_id, context.span_id)
        if context.is_valid and context.trace_flags.sampled and key not in seen:
            seen.add(key)
            kept.append(context)
    return tuple(kept[:MAX_REQUEST_LINKS]), max(0, len(kept) - MAX_REQUEST_LINKS)
