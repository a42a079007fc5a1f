"""Transfer spans, through the public ``Tracer`` API of any tracer provider.

A span begins when the op's completion arrives (its duration exemplar carries it) and ends
at the end of its ack wait, or at once; its times are the copy's own (device time on the
wall clock), however late the ack. Its parent is the span context current at ``submit()``
in the serving process (SGLang's request or step span), carried as ids.
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping

from opentelemetry import trace
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.propagation import set_span_in_context

from .. import semconv as sc
from .host_residence import OFFLOAD_LINK_ATTRIBUTES
from ..record import OFFLOAD, ONBOARD, TIERS
from ..version import __version__

REQUEST_LINK_ATTRIBUTES = {sc.LINK_TO: sc.LINK_TO_REQUEST}  # of every link to a request (shared, never mutated)
SPAN_NAMES = {OFFLOAD: sc.SPAN_OFFLOAD, ONBOARD: sc.SPAN_ONBOARD}
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


def trace_id_hex(context: Any) -> str:
    """A trace id as Jaeger and Zipkin show it (searches find it): 16 hex digits for a 64-bit id
    (SGLang's request tracing makes those), else 32."""
    trace_id = context.trace_id
    return f"{trace_id:016x}" if trace_id < 1 << 64 else trace.format_trace_id(trace_id)


class OpIds(IdGenerator):
    """Span and trace ids from the op (:meth:`use`, before its span starts) and a key of the serving
    process: an op a successor replays keeps its ids, so a span exported twice is one span.
    Random ids until the first op."""

    def __init__(self, key: bytes) -> None:
        self._key = key[:64]
        self._digest: bytes | None = None
        self._random = RandomIdGenerator()

    def use(self, seq: int) -> None:
        """The op whose span starts next: one hash gives both of its ids."""
        self._digest = hashlib.blake2b(seq.to_bytes(8, "little", signed=True), key=self._key, digest_size=24).digest()

    def generate_span_id(self) -> int:
        digest = self._digest
        return int.from_bytes(digest[:8], "little") or 1 if digest else self._random.generate_span_id()

    def generate_trace_id(self) -> int:
        digest = self._digest
        return int.from_bytes(digest[8:], "little") or 1 if digest else self._random.generate_trace_id()


def span_attributes(record: Any, static: Mapping[str, Any]) -> dict[str, Any]:
    """Everything a transfer span carries, ack fields aside: the static attributes, the call's own,
    then the measured ones (a caller's attribute never overwrites what otel-hicache measured)."""
    src, dst = TIERS[record.direction]
    reuse, ok = record.host[2], record.error is None
    attrs = {**static, **(record.attributes or {})}  # (the call's checked and limited in capture.attributes)
    for key, value in (
            (sc.DIRECTION, record.direction), (sc.SRC_TIER, src), (sc.DST_TIER, dst), (sc.ORIGIN, record.origin),
            (sc.CAUSE, record.cause), (sc.CAUSES_ATTR, record.cause_parts and tuple(p[0] for p in record.cause_parts)),
            (sc.TOKENS, record.tokens), (sc.BLOCKS, record.blocks), (sc.BYTES, record.num_bytes),
            (sc.PAGE_SIZE, record.page_size), (sc.POOL_NAMES, record.pool_names), (sc.POOL_TOKENS, record.pool_tokens),
            (sc.IO_BACKEND, None if record.io_backend is None else str(record.io_backend)),
            (sc.TIMING_SOURCE, record.timing_source), (sc.PLACEMENT_SOURCE, record.placement),
            (sc.QUEUE_WAIT_US, None if record.queue_wait_ns is None else record.queue_wait_ns / 1e3),
            (sc.BANDWIDTH, record.num_bytes * 1e9 / record.duration_ns if ok and record.duration_ns > 0 else None),
            (sc.ERROR_TYPE, record.error),
            (sc.RESIDENCE_MIN_US, reuse.min_ns / 1e3 if reuse and reuse.min_ns is not None else None),
            (sc.RESIDENCE_MAX_US, reuse.max_ns / 1e3 if reuse and reuse.max_ns is not None else None),
            (sc.UNKNOWN_PAGES, reuse and reuse.unknown_pages or None), (sc.LINKS_DROPPED, record.links_dropped or None),
            (sc.REQUEST_LINKS_DROPPED, record.request_links_dropped or None)):
        if value is not None:
            attrs[key] = value
    return attrs


def span_links(record: Any) -> list[Any]:
    """For a load-back, the sampled offload spans that wrote its pages (newest first, at most
    ``host_residence.MAX_LINKS``); then the requests it served or wrote."""
    return [*(Link(SpanContext(trace_id, span_id, is_remote=False, trace_flags=_SAMPLED), OFFLOAD_LINK_ATTRIBUTES)
              for trace_id, span_id in record.links),
            *(Link(context, REQUEST_LINK_ATTRIBUTES) for context in record.request_links)]


def _ack_attributes(record: Any) -> dict[str, Any]:
    if record.ack_ns is not None:
        return {sc.ACKED: True, sc.ACK_DELAY_US: max(0, record.ack_ns - record.end_ns) / 1e3}
    return {sc.ACKED: False} if record.expect_ack else {}


class SpanBuilder:
    """Spans of transfer records on one tracer provider."""

    def __init__(self, tracer_provider: Any, static: Mapping[str, Any], ids: OpIds | None = None) -> None:
        self._tracer = tracer_provider.get_tracer(sc.SCOPE_NAME, __version__)
        self._static, self._ids = static, ids  # ids: the telemetry process's, for a successor's replay

    def begin(self, record: Any) -> tuple[Any, bool]:
        """The op's span, started with every attribute known (the ack's, unless it waits for it)."""
        if self._ids is not None:
            self._ids.use(record.seq)
        attrs = span_attributes(record, self._static)
        waits = record.expect_ack and record.ack_ns is None and record.error is None
        if not waits:
            attrs.update(_ack_attributes(record))
        span = self._tracer.start_span(SPAN_NAMES[record.direction], context=record.parent_context,
                                       kind=SpanKind.INTERNAL, attributes=attrs, links=span_links(record),
                                       start_time=record.start_ns)
        record.span_context = span.get_span_context()
        if record.span_context.trace_flags.sampled:
            record.exemplar_context = set_span_in_context(span)
        if span.is_recording():
            for context in record.request_links:  # the way back from a request, in Jaeger's search
                span.add_event(sc.EVENT_REQUEST, {sc.REQUEST_TRACE_ID: trace_id_hex(context)}, record.submit_ns)
            if record.error is not None:
                span.set_status(Status(StatusCode.ERROR, record.error))
        return span, waits

    def finish(self, record: Any, state: tuple[Any, bool]) -> None:
        """The end of the span (at the copy's end), and of its ack wait."""
        span, waited = state
        if waited and span.is_recording():
            span.set_attributes(_ack_attributes(record))
        span.end(end_time=record.end_ns)
