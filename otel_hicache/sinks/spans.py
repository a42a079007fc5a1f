"""Spans timed by the copy, ended after the ack wait, children of the context at submit."""

from __future__ import annotations

import hashlib
import os
from typing import Any, Mapping

from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace import TraceState, set_span_in_context

from .. import semconv as sc
from ..record import OFFLOAD, ONBOARD, TIERS
from ..version import __version__

SPAN_NAMES = {OFFLOAD: sc.SPAN_OFFLOAD, ONBOARD: sc.SPAN_ONBOARD}
_TO_OFFLOAD, _TO_REQUEST = {sc.LINK_TO: sc.LINK_TO_OFFLOAD}, {sc.LINK_TO: sc.LINK_TO_REQUEST}
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


def trace_id_hex(context: Any) -> str:
    """As Jaeger shows it: 16 hex digits for a 64-bit id, else 32."""
    return f"{context.trace_id:0{16 if context.trace_id < 1 << 64 else 32}x}"


def span_context(values: Any) -> SpanContext:
    trace_id, span_id, flags, remote, state = values
    return SpanContext(trace_id, span_id, remote, TraceFlags(flags), TraceState(list(state)) if state else None)


class OpIds(IdGenerator):
    """Ids hashed from the seq: a replayed op is the same span."""

    def __init__(self, key: bytes) -> None:
        self._key, self._digest = key[:64], os.urandom(24)

    def use(self, seq: int) -> None:
        self._digest = hashlib.blake2b(seq.to_bytes(8, "little", signed=True), key=self._key, digest_size=24).digest()

    def generate_span_id(self) -> int:
        return int.from_bytes(self._digest[:8], "little") or 1

    def generate_trace_id(self) -> int:
        return int.from_bytes(self._digest[8:], "little") or 1


def span_attributes(r: Any, static: Mapping) -> dict:
    """All but the ack's; the measured ones win."""
    (src, dst), reuse = TIERS[r.direction], r.host[2]
    residence = reuse.residence_ns if reuse else ()  # (oldest write first)
    attrs = {**static, **(r.attributes or {})}
    for key, value in (
            (sc.DIRECTION, r.direction), (sc.SRC_TIER, src), (sc.DST_TIER, dst), (sc.ORIGIN, r.origin),
            (sc.CAUSE, r.cause), (sc.CAUSES_ATTR, r.cause_parts and tuple(p[0] for p in r.cause_parts)),
            (sc.TOKENS, r.tokens), (sc.BLOCKS, r.blocks), (sc.BYTES, r.num_bytes), (sc.PAGE_SIZE, r.page_size),
            (sc.POOL_NAMES, r.pool_names), (sc.POOL_TOKENS, r.pool_tokens),
            (sc.IO_BACKEND, None if r.io_backend is None else str(r.io_backend)),
            (sc.TIMING_SOURCE, r.timing_source), (sc.PLACEMENT_SOURCE, r.placement),
            (sc.QUEUE_WAIT_US, None if r.queue_wait_ns is None else r.queue_wait_ns / 1e3),
            (sc.BANDWIDTH, r.num_bytes * 1e9 / r.duration_ns if r.error is None and r.duration_ns > 0 else None),
            (sc.ERROR_TYPE, r.error), (sc.RESIDENCE_MIN_US, residence[-1] / 1e3 if residence else None),
            (sc.RESIDENCE_MAX_US, residence[0] / 1e3 if residence else None),
            (sc.UNKNOWN_PAGES, reuse and reuse.unknown_pages or None), (sc.LINKS_DROPPED, r.links_dropped or None),
            (sc.REQUEST_LINKS_DROPPED, r.request_links_dropped or None)):
        if value is not None:
            attrs[key] = value
    return attrs


def _ack_attributes(r: Any) -> dict:
    if r.ack_ns is not None:
        return {sc.ACKED: True, sc.ACK_DELAY_US: max(0, r.ack_ns - r.end_ns) / 1e3}
    return {sc.ACKED: False} if r.expect_ack else {}


class SpanBuilder:
    def __init__(self, tracer_provider: Any, static: Mapping, ids: OpIds | None = None) -> None:
        self._tracer = tracer_provider.get_tracer(sc.SCOPE_NAME, __version__)
        self._static, self._ids = static, ids

    def begin(self, r: Any) -> tuple[Any, bool]:
        """The span, and whether it waits for the ack."""
        if self._ids is not None:
            self._ids.use(r.seq)
        attrs = span_attributes(r, self._static)
        waits = r.expect_ack and r.ack_ns is None and r.error is None
        if not waits:
            attrs.update(_ack_attributes(r))
        requests = [span_context(c) for c in r.request_links]
        links = [Link(SpanContext(t, s, False, _SAMPLED), _TO_OFFLOAD) for t, s in r.links]
        links += [Link(context, _TO_REQUEST) for context in requests]
        parent = set_span_in_context(NonRecordingSpan(span_context(r.parent))) if r.parent else None
        span = self._tracer.start_span(SPAN_NAMES[r.direction], parent, SpanKind.INTERNAL, attrs, links, r.start_ns)
        r.span_context = span.get_span_context()
        if r.span_context.trace_flags.sampled:
            r.exemplar_context = set_span_in_context(span)
        if span.is_recording():
            for context in requests:  # (a request's trace id is searchable)
                span.add_event(sc.EVENT_REQUEST, {sc.REQUEST_TRACE_ID: trace_id_hex(context)}, r.submit_ns)
            if r.error is not None:
                span.set_status(Status(StatusCode.ERROR, r.error))
        return span, waits

    def finish(self, r: Any, state: tuple[Any, bool]) -> None:
        span, waited = state
        if waited and span.is_recording():
            span.set_attributes(_ack_attributes(r))
        span.end(end_time=r.end_ns)
