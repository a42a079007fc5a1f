"""Links from transfer spans to SGLang's traced requests (``--enable-trace``), on the real
SGLang 0.5.23 HiCache on CPU.

Each request's trace context comes the way a scheduler gets it: SGLang's own
``TraceReqContext`` starts the request's root span and crosses the process boundary by
pickling. The requests of each op are known by construction (which request's insert,
admission or retraction asked for the copy); every span's links and ``hicache.request``
events are checked against the requests' own root spans.
"""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_hicache import semconv as sc
from otel_hicache.sinks.spans import trace_id_hex

REQUEST_GROUP = "request links"


@pytest.fixture
def sglang_tracing(sglang_cpu: Any) -> Any:
    """SGLang's request tracing on, its spans in memory (the requests' root spans)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with sglang_cpu.request_tracing(provider):
        yield exporter
    provider.shutdown()


def _root(request: Any) -> Any:
    """A request's root span context, from its tokenizer-side TraceReqContext (or given)."""
    root_span = getattr(request, "root_span", None)
    return root_span.get_span_context() if root_span is not None else request


def _linked(span: Any) -> list[tuple[int, int, str]]:
    """The span's links to requests (a load-back also links to the offloads that wrote its
    pages, host residence being on by default: those say ``hicache.link_to=offload``)."""
    return [(link.context.trace_id, link.context.span_id, link.attributes[sc.LINK_TO]) for link in span.links
            if link.attributes[sc.LINK_TO] == sc.LINK_TO_REQUEST]


def _request_events(span: Any) -> list[str]:
    return [e.attributes[sc.REQUEST_TRACE_ID] for e in span.events if e.name == sc.EVENT_REQUEST]


def _expect(span: Any, *tokenizer_sides: Any) -> None:
    roots = [_root(t) for t in tokenizer_sides]
    assert _linked(span) == [(r.trace_id, r.span_id, sc.LINK_TO_REQUEST) for r in roots]
    assert _request_events(span) == [trace_id_hex(r) for r in roots]
    assert sc.REQUEST_LINKS_DROPPED not in span.attributes


def test_write_through_and_load_back_link_to_their_requests(sglang_tracing, make_instrumented, sglang_cpu):
    instrumented = make_instrumented()
    stack = sglang_cpu.build_stack("write_through", tree_core_backend="python")
    assert REQUEST_GROUP in instrumented.instrumentor.instrumented_groups()
    did = sglang_cpu.traced_round_trip(stack)
    offload, onboard = instrumented.finished()
    assert (offload.attributes["hicache.cause"], onboard.attributes["hicache.cause"]) == ("write_through",
                                                                                          "prefix_hit")
    assert (offload.attributes["hicache.bytes"], onboard.attributes["hicache.bytes"]) == (did["offload_bytes"],
                                                                                          did["onboard_bytes"])
    _expect(offload, did["writer"])
    _expect(onboard, did["reader"])
    # the load-back's other link: the offload that wrote its pages, before the requests
    assert [(link.context.trace_id, link.context.span_id, link.attributes[sc.LINK_TO]) for link in onboard.links][
        0] == (offload.context.trace_id, offload.context.span_id, sc.LINK_TO_OFFLOAD)
    exported = {(s.context.trace_id, s.context.span_id) for s in sglang_tracing.get_finished_spans()}
    assert {(t, s) for span in (offload, onboard) for t, s, _ in _linked(span)} <= exported  # real, exported spans


def test_one_merged_load_back_links_to_every_request_it_served(sglang_tracing, make_instrumented, sglang_cpu):
    instrumented = make_instrumented()
    stack = sglang_cpu.build_stack("write_through", tree_core_backend="python")
    for start in (100, 200):
        sglang_cpu.insert_sequence(stack, start, 12)
    stack.cache.flush_pending_backups()
    stack.cache.check_hicache_events()
    assert sglang_cpu._evict_device(stack, 24) == 24  # pylint: disable=protected-access
    first, first_ctx = sglang_cpu.traced_request("rid-a", list(range(100, 112)))
    second, second_ctx = sglang_cpu.traced_request("rid-b", list(range(200, 212)))
    untraced, _ = sglang_cpu.traced_request("rid-c", list(range(100, 112)), sampled=False)
    for req in (first, second, untraced):  # one scheduling step admits all three
        sglang_cpu.load_back_request(stack, req) if req is not untraced else None
    stack.cache.ready_to_load_host_cache()
    stack.cache.check_hicache_events()
    offload, onboard = instrumented.finished()
    assert onboard.attributes["hicache.tokens"] == 24  # the two loads, merged
    assert offload.links == ()  # inserted outside any request
    _expect(onboard, first_ctx, second_ctx)


def test_an_unsampled_or_untraced_request_is_not_linked(sglang_tracing, make_instrumented, sglang_cpu):
    instrumented = make_instrumented()
    stack = sglang_cpu.build_stack("write_through", tree_core_backend="python")
    unsampled, _ = sglang_cpu.traced_request("rid-unsampled", list(range(100, 112)), sampled=False)
    assert unsampled.time_stats.trace_ctx.tracing_enable  # traced, but its trace is not sampled
    sglang_cpu.checkpoint_request(stack, unsampled)
    untraced, _ = sglang_cpu.traced_request("rid-untraced", list(range(300, 312)))
    from sglang.srt.observability.trace import TraceNullContext

    untraced.time_stats.trace_ctx = TraceNullContext()  # what a request without tracing carries
    sglang_cpu.checkpoint_request(stack, untraced, req_pool_idx=1)
    stack.cache.flush_pending_backups()
    stack.cache.check_hicache_events()
    (offload,) = instrumented.finished()
    assert offload.attributes["hicache.tokens"] == 24 and offload.links == ()
    assert not _request_events(offload)


def test_retraction_backup_and_restore_link_to_the_retracted_request(sglang_tracing, make_instrumented, sglang_cpu):
    instrumented = make_instrumented()
    stack = sglang_cpu.build_stack("write_through", tree_core_backend="python")
    req, ctx = sglang_cpu.traced_request("rid-retracted", list(range(700, 708)))
    sglang_cpu.decode_retraction(stack, n=8, req=req)
    backup, restore = instrumented.finished()
    assert [s.attributes["hicache.cause"] for s in (backup, restore)] == ["retraction_backup", "retraction_restore"]
    _expect(backup, ctx)
    _expect(restore, ctx)


def test_a_write_back_during_a_request_does_not_link_to_it(sglang_tracing, make_instrumented, sglang_cpu):
    """A request's load-back that needs device memory evicts other prefixes; under
    write_back that backs them up first, inside the request's ``load_back``. Those
    offloads wrote earlier requests' KV: not linked to the current one, even while an
    earlier request's load-back waits in the load queue, tagged with its request."""
    instrumented = make_instrumented()
    stack = sglang_cpu.build_stack("write_back", kv_size=48, tree_core_backend="python")
    for start in (100, 200):  # two prefixes on the host only
        sglang_cpu.insert_sequence(stack, start, 16)
        assert sglang_cpu._evict_device(stack, 16) == 16  # pylint: disable=protected-access  # backed up
    for start in (300, 400, 500):
        sglang_cpu.insert_sequence(stack, start, 16)
    assert stack.allocator.available_size() == 0  # the device pool (48 slots) is full
    first, first_ctx = sglang_cpu.traced_request("rid-first", list(range(100, 116)))
    second, second_ctx = sglang_cpu.traced_request("rid-second", list(range(200, 216)))
    for req in (first, second):  # each load-back evicts (and backs up) 16 other tokens first
        assert sglang_cpu.load_back_request(stack, req) == 16
    stack.cache.ready_to_load_host_cache()
    stack.cache.check_hicache_events()
    spans = instrumented.finished()
    assert [(s.name, s.attributes["hicache.cause"]) for s in spans] == [
        ("hicache.offload", "write_back")] * 4 + [("hicache.onboard", "prefix_hit")]
    assert all(s.links == () for s in spans[:4])
    _expect(spans[4], first_ctx, second_ctx)


def test_without_sglang_tracing_nothing_is_wrapped_or_linked(make_instrumented, sglang_cpu):
    import sglang.srt.observability.trace as sglang_trace

    assert not sglang_trace.get_global_tracing_enabled()
    instrumented = make_instrumented()
    stack = sglang_cpu.build_stack("write_through", tree_core_backend="python")
    assert REQUEST_GROUP not in instrumented.instrumentor.instrumented_groups()
    cls = type(stack.cache)
    assert getattr(cls.checkpoint_into_tree, "__wrapped__", None) is None  # SGLang's own function
    provider = TracerProvider(shutdown_on_exit=False)
    with sglang_cpu.request_tracing(provider):  # a trace context on the request, tracing on too late
        req, ctx = sglang_cpu.traced_request("rid-x", list(range(100, 112)))
    sglang_cpu.checkpoint_request(stack, req)
    stack.cache.flush_pending_backups()
    stack.cache.check_hicache_events()
    (offload,) = instrumented.finished()
    assert offload.links == () and not _request_events(offload)
