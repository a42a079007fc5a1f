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
from ..record import ONBOARD, TIERS
from ..version import __version__

REQUEST_LINK_ATTRIBUTES = {sc.LINK_TO: sc.LINK_TO_REQUEST}
"""The attributes of every link to a request (shared, never mutated)."""


def trace_id_hex(context: Any) -> str:
    """A span context's trace id as Jaeger and Zipkin show it, so a search for what the UI
    shows finds it: 16 lowercase hex digits for a 64-bit id (SGLang's own request tracing
    makes those), 32 otherwise (``trace.format_trace_id``)."""
    trace_id = context.trace_id
    return f"{trace_id:016x}" if trace_id < 1 << 64 else trace.format_trace_id(trace_id)


class OpIds(IdGenerator):
    """Span and trace ids derived from the op (:meth:`use`, before each span starts) and a key of
    the serving process: an op a successor telemetry process replays gets the ids it had, so a
    span exported twice (its first telemetry process died before saying so) is one span to
    whoever stores it. Random ids until the first op."""

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


SPAN_NAMES = {"offload": sc.SPAN_OFFLOAD, ONBOARD: sc.SPAN_ONBOARD}
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


def span_attributes(record: Any, static: Mapping[str, Any]) -> dict[str, Any]:
    """Everything a transfer span carries, ack fields aside.

    Static attributes first, then the call's own, then the ``hicache.*`` ones:
    a caller's attribute never overwrites what otel-hicache measured."""
    src, dst = TIERS[record.direction]
    attrs: dict[str, Any] = dict(static)
    if record.attributes:  # (checked and limited in the capture: capture.attributes)
        attrs.update(record.attributes)
    attrs[sc.DIRECTION] = record.direction
    attrs[sc.SRC_TIER] = src
    attrs[sc.DST_TIER] = dst
    attrs[sc.ORIGIN] = record.origin
    attrs[sc.CAUSE] = record.cause
    if record.cause_parts is not None:
        attrs[sc.CAUSES_ATTR] = tuple(part[0] for part in record.cause_parts)
    attrs[sc.TOKENS] = record.tokens
    attrs[sc.BLOCKS] = record.blocks
    attrs[sc.BYTES] = record.num_bytes
    attrs[sc.PAGE_SIZE] = record.page_size
    attrs[sc.POOL_NAMES] = record.pool_names
    attrs[sc.POOL_TOKENS] = record.pool_tokens
    if record.io_backend is not None:
        attrs[sc.IO_BACKEND] = str(record.io_backend)
    attrs[sc.TIMING_SOURCE] = record.timing_source
    if record.placement is not None:
        attrs[sc.PLACEMENT_SOURCE] = record.placement
    if record.queue_wait_ns is not None:
        attrs[sc.QUEUE_WAIT_US] = record.queue_wait_ns / 1e3
    if record.duration_ns > 0 and record.error is None:
        attrs[sc.BANDWIDTH] = record.num_bytes * 1e9 / record.duration_ns
    if record.error is not None:
        attrs[sc.ERROR_TYPE] = record.error
    reuse = record.reuse
    if reuse is not None:
        if reuse.min_ns is not None:
            attrs[sc.RESIDENCE_MIN_US] = reuse.min_ns / 1e3
            attrs[sc.RESIDENCE_MAX_US] = reuse.max_ns / 1e3
        if reuse.unknown_pages:
            attrs[sc.UNKNOWN_PAGES] = reuse.unknown_pages
    if record.links_dropped:
        attrs[sc.LINKS_DROPPED] = record.links_dropped
    if record.request_links_dropped:
        attrs[sc.REQUEST_LINKS_DROPPED] = record.request_links_dropped
    return attrs


def span_links(record: Any) -> tuple[Any, ...]:
    """A span's links: for a load-back, the sampled offload spans that wrote its pages
    (newest first, at most ``host_residence.MAX_LINKS``); then the requests it served or
    wrote (:mod:`.request_links`). Each says what it points to in ``hicache.link_to``."""
    links, requests = record.links, record.request_links
    if not links:
        return tuple([Link(context, REQUEST_LINK_ATTRIBUTES) for context in requests]) if requests else ()
    return (*[Link(SpanContext(trace_id, span_id, is_remote=False, trace_flags=_SAMPLED), OFFLOAD_LINK_ATTRIBUTES)
              for trace_id, span_id in links],
            *[Link(context, REQUEST_LINK_ATTRIBUTES) for context in requests])


def _ack_attributes(record: Any) -> dict[str, Any]:
    if record.ack_ns is not None:
        return {sc.ACKED: True, sc.ACK_DELAY_US: max(0, record.ack_ns - record.end_ns) / 1e3}
    return {sc.ACKED: False} if record.expect_ack else {}


class SpanBuilder:
    """Spans of transfer records on one tracer provider."""

    def __init__(self, tracer_provider: Any, static: Mapping[str, Any]) -> None:
        self._tracer = tracer_provider.get_tracer(sc.SCOPE_NAME, __version__)
        self._static = static

    def begin(self, record: Any, waits: bool = False) -> Any:
        """The op's span, started with every attribute known (the ack's too, unless it ``waits``)."""
        attrs = span_attributes(record, self._static)
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
        return span

    def finish(self, record: Any, span: Any, waited: bool = False) -> None:
        """The end of the span (at the copy's end); ``waited``: its ack wait just ended."""
        if waited and span.is_recording():
            span.set_attributes(_ack_attributes(record))
        span.end(end_time=record.end_ns)
