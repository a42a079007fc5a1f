"""Real SGLang 0.5.23 HiCache on CPU, instrumented: spans and metrics against SGLang's own counters.

Every scenario drives the real controller, engine, pools and UnifiedRadixCache
(see ``sglang_cpu``), then compares what otel-hicache reported with the
``sglang:*`` Prometheus counters SGLang moved in the same run.
"""

from __future__ import annotations

from typing import Any

import pytest

MERGED = {"hicache.origin": "merged_op"}
DIRECT = {"hicache.origin": "direct"}
RANKS = ("tp_rank", "pp_rank", "dp_rank", "attn_cp_rank")


class SGLangDelta:
    """SGLang's own counters: what moved between two reads."""

    def __init__(self, sglang_cpu: Any) -> None:
        self._module = sglang_cpu
        self._before = sglang_cpu.sglang_counter_values()

    def __call__(self, name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        return self._module.sglang_counter_values().get(key, 0.0) - self._before.get(key, 0.0)


def _by(spans: list[Any], **attrs: Any) -> list[Any]:
    return [s for s in spans if all(s.attributes.get(k) == v for k, v in attrs.items())]


def test_write_through_and_load_back_match_sglang_counters(instrumented, sglang_cpu):
    delta = SGLangDelta(sglang_cpu)
    stack = sglang_cpu.build_stack("write_through")
    did = sglang_cpu.write_through_round_trip(stack)
    spans = instrumented.finished()

    [offload] = _by(spans, **{"hicache.direction": "offload"})
    [onboard] = _by(spans, **{"hicache.direction": "onboard"})
    for span, tokens, nbytes in ((offload, did["offload_tokens"], did["offload_bytes"]),
                                 (onboard, did["onboard_tokens"], did["onboard_bytes"])):
        a = span.attributes
        assert a["hicache.origin"] == "merged_op"
        assert a["hicache.tokens"] == tokens == 12
        assert a["hicache.blocks"] == 3  # 12 tokens, page size 4
        assert a["hicache.bytes"] == nbytes
        assert a["hicache.pool.names"] == ("kv",) and a["hicache.pool.tokens"] == (12,)
        assert a["hicache.page_size"] == 4
        assert a["hicache.io_backend"] == "direct"
        assert a["hicache.write_policy"] == "write_through"
        assert a["hicache.layer_num"] == 3
        assert a["hicache.mem_layout"] == "layer_first"
        assert a["hicache.controller"] == type(stack.controller).__name__
        # CPU: torch.cpu events cannot time, the copy ran inside the submit call
        assert a["hicache.timing_source"] == "host_clock"
        # consumed by check_hicache_events(): the ack left its queue, its delay known
        assert a["hicache.acked"] is True and isinstance(a["hicache.ack_delay_us"], float)
        assert all(a[r] == 0 for r in RANKS)
        assert span.end_time >= span.start_time

    # exactly what SGLang counted for the same run
    assert delta("sglang:hicache_backup_tokens_total", pool="kv") == 12
    assert instrumented.metric("hicache.transfer.tokens", **{"hicache.direction": "offload", "hicache.pool": "kv"},
                               **MERGED) == delta("sglang:hicache_backup_tokens_total", pool="kv")
    assert instrumented.metric("hicache.transfer.bytes", **{"hicache.direction": "offload"}, **MERGED) == delta(
        "sglang:hicache_backup_bytes_total")
    assert instrumented.metric("hicache.transfer.tokens", **{"hicache.direction": "onboard", "hicache.pool": "kv"},
                               **MERGED) == delta("sglang:load_back_tokens_total", pool="kv")
    assert instrumented.metric("hicache.transfer.bytes", **{"hicache.direction": "onboard"}, **MERGED) == delta(
        "sglang:load_back_bytes_total")
    assert instrumented.metric("hicache.transfer.blocks", **{"hicache.direction": "onboard"}) == 3


def test_write_back_eviction_blocking_flush_is_seen(instrumented, sglang_cpu):
    """Eviction under write_back runs start_writing, then synchronizes and clear()s the ack queue."""
    delta = SGLangDelta(sglang_cpu)
    stack = sglang_cpu.build_stack("write_back")
    did = sglang_cpu.write_back_eviction(stack, n=12, load_back=True)
    spans = instrumented.finished()
    offloads = _by(spans, **{"hicache.direction": "offload"})
    onboards = _by(spans, **{"hicache.direction": "onboard"})
    assert sum(s.attributes["hicache.tokens"] for s in offloads) == did["offload_tokens"] == delta(
        "sglang:hicache_backup_tokens_total", pool="kv")
    assert sum(s.attributes["hicache.bytes"] for s in offloads) == delta("sglang:hicache_backup_bytes_total")
    assert sum(s.attributes["hicache.tokens"] for s in onboards) == delta("sglang:load_back_tokens_total", pool="kv")
    assert {s.attributes["hicache.write_policy"] for s in spans} == {"write_back"}
    assert all(s.attributes["hicache.acked"] is True for s in spans)


def test_decode_retraction_copies_are_direct_spans_sglang_does_not_count(instrumented, sglang_cpu):
    stack = sglang_cpu.build_stack("write_through")
    delta = SGLangDelta(sglang_cpu)
    did = sglang_cpu.decode_retraction(stack)
    spans = instrumented.finished()
    assert [(s.name, s.attributes["hicache.origin"], s.attributes["hicache.tokens"]) for s in spans] == [
        ("hicache.offload", "direct", did["direct_offload_tokens"]),
        ("hicache.onboard", "direct", did["direct_onboard_tokens"]),
    ]
    per_token = stack.host_pool.size_per_token
    assert all(s.attributes["hicache.bytes"] == s.attributes["hicache.tokens"] * per_token for s in spans)
    assert all("hicache.acked" not in s.attributes for s in spans)  # nobody acks them
    assert instrumented.metric("hicache.transfer.tokens", **DIRECT) == 2 * did["direct_offload_tokens"]
    # SGLang has no series for these copies
    assert delta("sglang:hicache_backup_tokens_total", pool="kv") == 0
    assert delta("sglang:load_back_tokens_total", pool="kv") == 0


def test_engine_level_controller_round_trip(instrumented, sglang_cpu):
    """A bare HiCacheController (no tree cache): acks popped by hand."""
    controller, kv, allocator = sglang_cpu.build_controller()
    acks = sglang_cpu.controller_round_trip(controller, kv, allocator)
    spans = instrumented.finished()
    assert [(s.name, s.attributes["hicache.origin"]) for s in spans] == [
        ("hicache.offload", "merged_op"), ("hicache.onboard", "merged_op")]
    assert [s.attributes["hicache.bytes"] for s in spans] == [acks["write_ack"].num_bytes,
                                                             acks["load_ack"].num_bytes]
    assert spans[0].attributes["hicache.controller"] == "HiCacheController"


def test_rank_labels_on_every_point(instrumented, sglang_cpu):
    sglang_cpu.build_stack("write_through")
    instrumented.finished()
    data = instrumented.reader.get_metrics_data()
    points = [p for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
              for p in m.data.data_points]
    assert points
    assert all(set(RANKS) <= set(p.attributes) for p in points)


def test_a_request_span_current_at_submit_is_the_parent(instrumented, sglang_cpu):
    stack = sglang_cpu.build_stack("write_through")
    tracer = instrumented.tracer_provider.get_tracer("test")
    with tracer.start_as_current_span("request") as request:
        sglang_cpu.decode_retraction(stack)
    spans = [s for s in instrumented.finished() if s.name.startswith("hicache.")]
    assert spans and all(s.parent is not None and s.parent.span_id == request.get_span_context().span_id
                         for s in spans)
    assert all(s.context.trace_id == request.get_span_context().trace_id for s in spans)


def test_a_start_that_raises_after_its_copy_reports_the_copy_as_direct(instrumented, sglang_cpu, monkeypatch):
    """SGLang's error reaches SGLang unchanged; the copy made before it is still a span."""
    controller, _kv, allocator = sglang_cpu.build_controller()

    def broken(*args, **kwargs):
        raise RuntimeError("SGLang failed after the copy")

    monkeypatch.setattr(controller.mem_pool_device_allocator, "set_hicache_transfer_done_event", broken)
    with pytest.raises(RuntimeError, match="after the copy"):
        controller.write(allocator.alloc(8), node_id=1)
    assert not controller.ack_write_queue
    spans = instrumented.finished()
    assert [(s.name, s.attributes["hicache.origin"], s.attributes["hicache.tokens"]) for s in spans] == [
        ("hicache.offload", "direct", 8)]
