"""Links from transfer spans to the requests they served (``submit(requests=...)``): which
requests are linked (valid, sampled, each once, at most 16, the rest counted), the links
and ``hicache.request`` events on the span, bad
input skipped with one warning, and the metrics unchanged."""

from __future__ import annotations

import logging

from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from otel_hicache import semconv as sc
from otel_hicache.capture.records import S_SUBMIT_NS
from otel_hicache.capture.request_links import MAX_REQUEST_LINKS, resolve
from otel_hicache.sinks.spans import trace_id_hex


def request(n: int, sampled: bool = True) -> SpanContext:
    return SpanContext(0x1000 + n, 0x2000 + n, is_remote=True,
                       trace_flags=TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT))


def copy(h, requests, direction="onboard", **kwargs):
    now = h.device.time_ns()
    ev0, ev1 = h.device.copy(now - 2_000_000, 1.0)
    return h.tel.submit(direction, {"kv": 64}, 1 << 20, page_size=64, start_event=ev0, finish_event=ev1,
                        expect_ack=False, requests=requests, **kwargs)


def linked(span):
    return [(link.context.trace_id, link.context.span_id, dict(link.attributes)) for link in span.links]


def request_events(span):
    return [(e.name, dict(e.attributes), e.timestamp) for e in span.events if e.name == sc.EVENT_REQUEST]


# -- which requests -----------------------------------------------------------------------------------

def test_resolve_keeps_valid_sampled_requests_once_in_order():
    a, b = request(1), request(2)
    assert resolve([a, b, a, request(3, sampled=False), trace.INVALID_SPAN_CONTEXT, b]) == ((a, b), 0)
    assert resolve([]) == ((), 0)


def test_trace_ids_are_named_as_jaeger_and_zipkin_show_them():
    wide = SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 1, is_remote=True)
    assert trace_id_hex(wide) == "0af7651916cd43dd8448eb211c80319c"
    assert trace_id_hex(SpanContext((1 << 64) - 1, 1, is_remote=True)) == "ffffffffffffffff"
    assert trace_id_hex(SpanContext(1 << 64, 1, is_remote=True)) == "00000000000000010000000000000000"


def test_resolve_links_at_most_sixteen_and_counts_the_rest():
    many = [request(n) for n in range(MAX_REQUEST_LINKS + 5)]
    kept, dropped = resolve(many + many)  # duplicates are not counted as dropped
    assert kept == tuple(many[:MAX_REQUEST_LINKS]) and dropped == 5


def test_a_bad_request_is_skipped_with_one_warning_and_the_others_kept(caplog):
    caplog.set_level(logging.WARNING, logger="otel_hicache")
    a = request(1)
    assert resolve(["rid-1", a, 42, "rid-2", NonRecordingSpan(a)]) == ((a,), 0)  # span contexts only
    warnings = [r for r in caplog.records if "must be a SpanContext" in r.getMessage()]
    assert len(warnings) == 3  # once per type (str, int, span), not per item


# -- on the span -----------------------------------------------------------------------------------------

def test_the_span_links_to_its_requests_and_names_their_trace_ids(harness):
    h = harness()
    a, b = request(1), request(2)
    handle = copy(h, [a, b, request(3, sampled=False)])
    copy(h, None, direction="offload")
    onboard, offload = h.finished()
    assert linked(onboard) == [(a.trace_id, a.span_id, {sc.LINK_TO: sc.LINK_TO_REQUEST}),
                               (b.trace_id, b.span_id, {sc.LINK_TO: sc.LINK_TO_REQUEST})]
    submit_ns = handle[S_SUBMIT_NS]
    assert request_events(onboard) == [  # 64-bit trace ids, as Jaeger shows them: 16 hex digits
        (sc.EVENT_REQUEST, {sc.REQUEST_TRACE_ID: "0000000000001001"}, submit_ns),
        (sc.EVENT_REQUEST, {sc.REQUEST_TRACE_ID: "0000000000001002"}, submit_ns),
    ]
    assert [e.name for e in onboard.events] == [sc.EVENT_REQUEST, sc.EVENT_REQUEST]
    assert onboard.parent is None  # a link, not a parent: the op is not part of the request's trace
    assert sc.REQUEST_LINKS_DROPPED not in onboard.attributes
    assert offload.links == () and list(offload.events) == []


def test_more_than_sixteen_requests_are_counted_on_the_span(harness):
    h = harness()
    copy(h, [request(n) for n in range(20)])
    (span,) = h.finished()
    assert len(span.links) == MAX_REQUEST_LINKS == len(request_events(span))
    assert span.attributes[sc.REQUEST_LINKS_DROPPED] == 4


def test_requests_given_to_transfer_are_linked(harness):
    h = harness()
    with h.tel.transfer("offload", {"kv": 8}, 4096, page_size=4, requests=[request(7)]):
        pass
    (span,) = h.finished()
    assert [(t, s) for t, s, _ in linked(span)] == [(0x1007, 0x2007)]


def test_a_failed_op_keeps_its_request_links(harness):
    h = harness()
    now = h.device.time_ns()
    ev0, ev1 = h.device.copy(now - 2_000_000, 1.0)
    ev1.raise_on_query = RuntimeError("device lost")
    h.tel.submit("onboard", {"kv": 64}, 1 << 20, page_size=64, start_event=ev0, finish_event=ev1, expect_ack=False,
                 requests=[request(1)])
    (span,) = h.finished()
    assert span.attributes["error.type"] == sc.FAIL_EVENT_ERROR and len(span.links) == 1


def test_links_to_requests_pass_the_span_limits(harness, monkeypatch):
    """Links and events are bounded by the provider's limits, as the SDK's Span does."""
    monkeypatch.setenv("OTEL_SPAN_LINK_COUNT_LIMIT", "3")
    monkeypatch.setenv("OTEL_SPAN_EVENT_COUNT_LIMIT", "2")
    h = harness()
    copy(h, [request(n) for n in range(5)])
    (span,) = h.finished()
    # 5 links, 5 events: the newest 3 and 2 kept
    assert [link.context.trace_id for link in span.links] == [0x1002, 0x1003, 0x1004] and span.dropped_links == 2
    assert [e.name for e in span.events] == [sc.EVENT_REQUEST] * 2 and span.dropped_events == 3


def test_a_tracer_provider_without_the_sdk_still_gets_links(monkeypatch):
    """Any TracerProvider: links go through start_span(links=...)."""
    from otel_hicache import TransferTelemetry
    from otel_hicache.testing import WallClockDevice

    seen = []

    class Tracer:
        def start_span(self, name, context=None, kind=None, attributes=None, links=None, start_time=None):
            seen.append([link.context for link in links or ()])
            return NonRecordingSpan(trace.INVALID_SPAN_CONTEXT)

    class Provider:
        def get_tracer(self, *args, **kwargs):
            return Tracer()

    from opentelemetry.sdk.metrics import MeterProvider

    tel = TransferTelemetry(Provider(), MeterProvider(shutdown_on_exit=False), {})
    try:
        device = WallClockDevice()
        ev0, ev1 = device.copy(device.time_ns() - 2_000_000, 1.0)
        tel.submit("onboard", {"kv": 4}, 4096, page_size=4, start_event=ev0, finish_event=ev1, expect_ack=False,
                   requests=[request(1)])
        assert tel.force_flush(5.0)
    finally:
        tel.shutdown()
    assert seen == [[request(1)]]


def test_without_requests_the_span_is_unchanged(harness):
    h = harness()
    copy(h, None)
    (span,) = h.finished()
    assert span.links == () and list(span.events) == []
    assert not any(k.startswith("hicache.request") for k in span.attributes)
