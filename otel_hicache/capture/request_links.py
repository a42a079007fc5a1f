"""Links from transfer spans to the requests they served, or whose KV they wrote.

A host application that traces its requests (SGLang with ``--enable-trace``) passes
``submit(requests=...)``: each request's span context (a ``SpanContext``, a ``Span``,
or a ``Context`` holding one), or a callable returning them, read on the poller. The
poller keeps the valid, sampled ones (an unsampled request's trace is never exported,
so a link to it would lead nowhere), each once, in the order given, at most
:data:`MAX_REQUEST_LINKS`; how many more there were is the span's
``hicache.request.links_dropped``.

Each kept one leaves as ids (``record.context_tuple``) and becomes a span link
(``hicache.link_to=request``), the way from a transfer to its requests, and a ``hicache.request`` span event carrying the request's
trace id as Jaeger shows it (``hicache.request.trace_id``), the way back: Jaeger's tag
search matches event attributes, never links. Trace and span ids only: nothing else of
a request leaves the process (``test_privacy.py``).
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
    """``(span contexts to link, how many more sampled ones there were)`` for a record's
    ``requests``. An item of the wrong type is skipped (warned once); the others stay."""
    if callable(requests):
        requests = requests()
    if not requests:
        return (), 0
    kept: list[Any] = []
    seen: set[tuple[int, int]] = set()
    dropped = 0
    for item in requests:
        try:
            context = _span_context(item)
        except Exception as exc:  # pylint: disable=broad-except  # skip it, keep the others
            warn_once(f"request:{type(item).__name__}", "otel-hicache: cannot link a request (%r); its op is "
                      "reported without that link", exc)
            continue
        if not context.is_valid or not context.trace_flags.sampled:
            continue
        key = (context.trace_id, context.span_id)
        if key in seen:
            continue
        seen.add(key)
        if len(kept) < MAX_REQUEST_LINKS:
            kept.append(context)
        else:
            dropped += 1
    return tuple(kept), dropped
