"""Span links from a transfer to the traced requests it served or whose KV it wrote."""

from __future__ import annotations

from typing import Any

from opentelemetry.trace import SpanContext

from ..diagnostics import warn_once

MAX_REQUEST_LINKS = 16


def resolve(requests: Any) -> tuple[tuple[SpanContext, ...], int]:
    """The valid, sampled span contexts, once each, at most ``MAX_REQUEST_LINKS``, and how many more."""
    kept: dict = {}
    for context in requests:
        if not isinstance(context, SpanContext):
            warn_once(f"request:{type(context).__name__}", "otel-hicache: a request to link must be a SpanContext, "
                      "got %s; skipped", type(context).__name__)
        elif context.is_valid and context.trace_flags.sampled:
            kept.setdefault((context.trace_id, context.span_id), context)
    links = tuple(kept.values())
    return links[:MAX_REQUEST_LINKS], max(0, len(links) - MAX_REQUEST_LINKS)
