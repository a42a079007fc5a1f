"""Span links from a transfer to the traced requests it served or whose KV it wrote.

``submit(requests=...)`` passes span contexts (or spans, or contexts holding one), or a callable
returning them, read on the poller. The valid, sampled ones are kept (an unsampled request's trace
is never exported), each once, in order, at most :data:`MAX_REQUEST_LINKS`; the count of the rest is
``hicache.request.links_dropped``. Only trace and span ids leave the process (``test_privacy.py``).
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace

from ..diagnostics import warn_once

MAX_REQUEST_LINKS = 16


def _span_context(item: Any) -> Any:
    if isinstance(item, trace.SpanContext):
        return item
    if isinstance(item, dict):  # a Context (a dict subclass)
        return trace.get_current_span(item).get_span_context()
    get = getattr(item, "get_span_context", None)
    if get is not None:
        return get()
    raise TypeError(f"a request must be a SpanContext, a Span or a Context, got {type(item).__name__}")


def resolve(requests: Any) -> tuple[tuple[Any, ...], int]:
    """``(span contexts to link, how many more sampled ones there were)``; an item of the wrong type
    is skipped (warned once)."""
    if callable(requests):
        requests = requests()
    kept: list[Any] = []
    seen: set[tuple[int, int]] = set()
    dropped = 0
    for item in requests or ():
        try:
            context = _span_context(item)
        except Exception as exc:  # skip it, keep the others
            warn_once(f"request:{type(item).__name__}", "otel-hicache: cannot link a request (%r)", exc)
            continue
        key = (context.trace_id, context.span_id)
        if not context.is_valid or not context.trace_flags.sampled or key in seen:
            continue
        seen.add(key)
        if len(kept) < MAX_REQUEST_LINKS:
            kept.append(context)
        else:
            dropped += 1
    return tuple(kept), dropped
