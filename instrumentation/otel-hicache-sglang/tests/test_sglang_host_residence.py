"""Host residence and lineage on the real SGLang 0.5.23 HiCache on CPU: how long a prefix sat in
host memory before its load-back, the load-back's span links to the offload that wrote it, and
host pages freed without ever being loaded back, against ground truth known by construction."""

from __future__ import annotations

import time
from typing import Any

import pytest

from test_sglang_transfers import SGLangDelta

RESIDENCE = "hicache.host.residence_time"


@pytest.fixture(autouse=True)
def _on(monkeypatch):
    monkeypatch.setenv("OTEL_HICACHE_HOST_RESIDENCE", "true")  # off by default; read per controller


def _points(instrumented: Any, name: str) -> list[Any]:
    data = instrumented.reader.get_metrics_data()
    return [p for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics if m.name == name
            for p in m.data.data_points]


def test_a_prefix_loaded_back_after_a_gap_resided_for_the_gap(instrumented, sglang_cpu):
    stack = sglang_cpu.build_stack("write_through")
    cache, controller = stack.cache, stack.controller
    _, _, match = sglang_cpu.insert_sequence(stack, 100, 12)
    before_offload = time.time_ns()
    cache.flush_pending_backups()  # the merged offload is submitted in here
    after_offload = time.time_ns()
    cache.check_hicache_events()
    sglang_cpu._evict_device(stack, 12)  # pylint: disable=protected-access
    time.sleep(0.3)  # the gap
    hit = match()
    assert hit.host_hit_length == 12 and cache.load_back(hit.best_match_node)
    before_onboard = time.time_ns()
    cache.ready_to_load_host_cache()  # the merged load-back is submitted in here
    after_onboard = time.time_ns()
    [load_ack] = list(controller.ack_load_queue)
    cache.check_hicache_events()
    offload, onboard = instrumented.finished()
    [point] = _points(instrumented, RESIDENCE)
    assert (dict(point.attributes)["hicache.cause"], dict(point.attributes)["hicache.offload_cause"]) == (
        "prefix_hit", "write_through")
    # submit to submit, bracketed by the workload's own clock reads
    assert point.count == 1
    assert (before_onboard - after_offload) / 1e9 <= point.sum <= (after_onboard - before_offload) / 1e9
    assert point.sum >= 0.3
    a = onboard.attributes
    # the same nanoseconds: microseconds on the span, seconds on the histogram (float rounding aside)
    assert a["hicache.host.residence_min_us"] == a["hicache.host.residence_max_us"] == pytest.approx(
        point.sum * 1e6, rel=1e-12)
    assert "hicache.host.unknown_pages" not in a
    assert [(link.context.trace_id, link.context.span_id) for link in onboard.links] == [
        (offload.context.trace_id, offload.context.span_id)]
    # every byte loaded back was written by the write-through: hit value 1 for this run
    assert instrumented.metric("hicache.host.reloaded_bytes", **{"hicache.offload_cause": "write_through"}) == \
        load_ack.num_bytes == instrumented.metric("hicache.transfer.bytes", **{"hicache.direction": "offload"})
    assert instrumented.metric("hicache.host.wasted_bytes") == 0


def test_host_pages_evicted_without_a_load_back_are_wasted(instrumented, sglang_cpu):
    stack = sglang_cpu.build_stack("write_through")
    did = sglang_cpu.host_eviction(stack, n=12)
    instrumented.finished()
    per_token = stack.host_pool.size_per_token
    # SGLang's own count of the host tokens evict_host freed: all of them were written, none read
    assert did["host_evicted_tokens"] == did["offload_tokens"] == 12
    assert instrumented.metric("hicache.host.wasted_tokens", **{"hicache.offload_cause": "write_through"}) == 12
    assert instrumented.metric("hicache.host.wasted_bytes", **{"hicache.offload_cause": "write_through"}) == \
        12 * per_token
    assert instrumented.metric("hicache.host.reloaded_bytes") == 0


def test_write_back_pages_loaded_back_count_for_write_back(instrumented, sglang_cpu):
    delta = SGLangDelta(sglang_cpu)
    stack = sglang_cpu.build_stack("write_back")
    sglang_cpu.write_back_eviction(stack, n=12, load_back=True)
    offload, onboard = instrumented.finished()
    assert instrumented.metric("hicache.host.reloaded_bytes", **{"hicache.offload_cause": "write_back"}) == delta(
        "sglang:load_back_bytes_total") == delta("sglang:hicache_backup_bytes_total")
    assert [link.context.span_id for link in onboard.links] == [offload.context.span_id]
    [point] = _points(instrumented, RESIDENCE)
    assert dict(point.attributes)["hicache.offload_cause"] == "write_back" and point.count == 1


def test_selective_write_through_pages_count_for_their_policy_loaded_back_or_wasted(instrumented, sglang_cpu):
    """write_through_selective backs a prefix up on its second hit: loaded back, its bytes
    count as reloaded for that policy; of two host copies freed, only the one never read back
    counts as wasted."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    stack = sglang_cpu.build_stack("write_through_selective")
    cache, controller = stack.cache, stack.controller
    kept = sglang_cpu.selective_write_through(stack, n=12, start=300)  # backed up on its second hit
    assert sglang_cpu._evict_device(stack, 12) == 12  # pylint: disable=protected-access
    hit = cache.match_prefix(MatchPrefixParams(key=sglang_cpu._radix_key(list(range(300, 312)))))  # pylint: disable=protected-access
    assert hit.host_hit_length == 12 and cache.load_back(hit.best_match_node)
    cache.ready_to_load_host_cache()
    [load_ack] = list(controller.ack_load_queue)
    cache.check_hicache_events()
    wasted = sglang_cpu.selective_write_through(stack, n=8, start=600)  # another prefix, never read again
    sglang_cpu._evict_device(stack, cache.evictable_size())  # pylint: disable=protected-access
    freed = cache.evict_host(20)  # both host copies: the one read back is no waste, the other is
    instrumented.finished()
    selective = {"hicache.offload_cause": "write_through_selective"}
    assert instrumented.metric("hicache.host.reloaded_bytes", **selective) == load_ack.num_bytes == kept[
        "offload_bytes"]
    [point] = _points(instrumented, RESIDENCE)
    assert dict(point.attributes)["hicache.offload_cause"] == "write_through_selective" and point.count == 1
    assert freed >= 20
    assert instrumented.metric("hicache.host.wasted_bytes", **selective) == wasted["offload_bytes"]
    assert instrumented.metric("hicache.host.wasted_tokens", **selective) == wasted["offload_tokens"] == 8


def test_retraction_copies_are_not_host_residence_and_their_frees_waste_nothing(instrumented, sglang_cpu):
    """Retraction backups live outside the radix tree's host pages: not tracked, not wasted."""
    stack = sglang_cpu.build_stack("write_through")
    sglang_cpu.decode_retraction(stack)  # backup, restore, then discard_kv_cache_backup frees the slots
    instrumented.finished()
    assert not _points(instrumented, RESIDENCE)
    assert instrumented.metric("hicache.host.wasted_bytes") == 0
    assert instrumented.metric("hicache.host.reloaded_bytes") == 0
