"""Why each copy was made (``hicache.cause``), on the real SGLang 0.5.23 HiCache on CPU.

Each workload's cause is known by construction (which SGLang method asked for the copy);
every span's cause, and the tokens and bytes per cause, are checked against it and
against SGLang's own acks and counters.
"""

from __future__ import annotations

from typing import Any

from test_sglang_transfers import SGLangDelta

OFFLOAD = {"hicache.direction": "offload"}
ONBOARD = {"hicache.direction": "onboard"}


def _causes(spans: list[Any]) -> list[tuple[str, str, str, int]]:
    return [(s.name, s.attributes["hicache.origin"], s.attributes["hicache.cause"], s.attributes["hicache.tokens"])
            for s in spans]


def _by_cause(instrumented: Any, metric: str, direction: dict[str, str], cause: str, **extra: Any) -> float:
    return instrumented.metric(metric, **direction, **{"hicache.cause": cause}, **extra)


def test_write_through_offloads_on_insert_and_the_load_back_is_a_prefix_hit(instrumented, sglang_cpu):
    delta = SGLangDelta(sglang_cpu)
    stack = sglang_cpu.build_stack("write_through")
    did = sglang_cpu.write_through_round_trip(stack)
    assert _causes(instrumented.finished()) == [("hicache.offload", "merged_op", "write_through", 12),
                                                ("hicache.onboard", "merged_op", "prefix_hit", 12)]
    for metric, sglang_series, key in (("hicache.transfer.bytes", "sglang:hicache_backup_bytes_total", "offload_bytes"),
                                       ("hicache.transfer.tokens", "sglang:hicache_backup_tokens_total",
                                        "offload_tokens")):
        labels = {"pool": "kv"} if metric.endswith("tokens") else {}
        assert _by_cause(instrumented, metric, OFFLOAD, "write_through") == did[key] == delta(sglang_series, **labels)
    assert _by_cause(instrumented, "hicache.transfer.bytes", ONBOARD, "prefix_hit") == did["onboard_bytes"] == delta(
        "sglang:load_back_bytes_total")
    assert _by_cause(instrumented, "hicache.transfer.tokens", ONBOARD, "prefix_hit") == did["onboard_tokens"]
    # nothing under any other cause: the totals are the per-cause sums
    for direction, cause in ((OFFLOAD, "write_through"), (ONBOARD, "prefix_hit")):
        assert instrumented.metric("hicache.transfer.bytes", **direction) == _by_cause(
            instrumented, "hicache.transfer.bytes", direction, cause)
    # one op of each: the duration histograms are by cause too
    assert instrumented.metric("hicache.transfer.duration", **OFFLOAD, **{"hicache.cause": "write_through"}) == 1
    assert instrumented.metric("hicache.transfer.duration", **ONBOARD, **{"hicache.cause": "prefix_hit"}) == 1


def test_selective_write_through_offloads_on_the_second_hit(instrumented, sglang_cpu):
    stack = sglang_cpu.build_stack("write_through_selective")
    did = sglang_cpu.selective_write_through(stack)
    assert (did["queued_after_first_insert"], did["queued_after_second_insert"]) == (0, 1)
    assert _causes(instrumented.finished()) == [("hicache.offload", "merged_op", "write_through_selective", 12)]
    assert _by_cause(instrumented, "hicache.transfer.bytes", OFFLOAD, "write_through_selective") == did[
        "offload_bytes"]


def test_write_back_offloads_on_device_eviction(instrumented, sglang_cpu):
    delta = SGLangDelta(sglang_cpu)
    stack = sglang_cpu.build_stack("write_back")
    did = sglang_cpu.write_back_eviction(stack, n=12, load_back=True)
    assert _causes(instrumented.finished()) == [("hicache.offload", "merged_op", "write_back", 12),
                                                ("hicache.onboard", "merged_op", "prefix_hit", 12)]
    assert _by_cause(instrumented, "hicache.transfer.tokens", OFFLOAD, "write_back", **{"hicache.pool": "kv"}) == \
        did["offload_tokens"] == delta("sglang:hicache_backup_tokens_total", pool="kv")
    assert _by_cause(instrumented, "hicache.transfer.bytes", OFFLOAD, "write_back") == delta(
        "sglang:hicache_backup_bytes_total")


def test_decode_retraction_backup_and_restore(instrumented, sglang_cpu):
    stack = sglang_cpu.build_stack("write_through")
    did = sglang_cpu.decode_retraction(stack)
    assert _causes(instrumented.finished()) == [
        ("hicache.offload", "direct", "retraction_backup", did["direct_offload_tokens"]),
        ("hicache.onboard", "direct", "retraction_restore", did["direct_onboard_tokens"])]
    per_token = stack.host_pool.size_per_token
    assert _by_cause(instrumented, "hicache.transfer.bytes", OFFLOAD, "retraction_backup") == \
        did["direct_offload_tokens"] * per_token
    assert _by_cause(instrumented, "hicache.transfer.bytes", ONBOARD, "retraction_restore") == \
        did["direct_onboard_tokens"] * per_token


def test_a_bare_controller_driven_by_hand_is_other(instrumented, sglang_cpu):
    controller, kv, allocator = sglang_cpu.build_controller()
    acks = sglang_cpu.controller_round_trip(controller, kv, allocator)
    assert [s.attributes["hicache.cause"] for s in instrumented.finished()] == ["other", "other"]
    assert _by_cause(instrumented, "hicache.transfer.bytes", OFFLOAD, "other") == acks["offload_bytes"]
    assert _by_cause(instrumented, "hicache.transfer.bytes", ONBOARD, "other") == acks["onboard_bytes"]


def test_a_merged_op_of_two_causes_is_mixed_and_its_tokens_and_bytes_split_exactly(instrumented, sglang_cpu):
    """A write-through backup queued by an insert and a write queued by hand (no cause site)
    merged into one op by the next flush."""
    stack = sglang_cpu.build_stack("write_through")
    cache, controller = stack.cache, stack.controller
    sglang_cpu.insert_sequence(stack, 700, 12)
    assert len(controller.write_queue) == 1  # the insert's backup, deferred (HybridCacheController)
    by_hand = stack.allocator.alloc(8)
    assert controller.write(by_hand, node_id=-1, flush=False) is not None
    cache.flush_pending_backups()
    [ack] = list(controller.ack_write_queue)
    controller.ack_write_queue.pop(0)  # by hand: SGLang's own consumer knows no node -1
    ack.finish_event.synchronize()
    [span] = instrumented.finished()
    a = span.attributes
    assert (a["hicache.cause"], a["hicache.causes"], a["hicache.tokens"], a["hicache.bytes"]) == (
        "mixed", ("other", "write_through"), 20, ack.num_bytes)
    per_token = stack.host_pool.size_per_token
    assert _by_cause(instrumented, "hicache.transfer.tokens", OFFLOAD, "write_through", **{"hicache.pool": "kv"}) == 12
    assert _by_cause(instrumented, "hicache.transfer.tokens", OFFLOAD, "other", **{"hicache.pool": "kv"}) == 8
    assert _by_cause(instrumented, "hicache.transfer.bytes", OFFLOAD, "write_through") == 12 * per_token
    assert _by_cause(instrumented, "hicache.transfer.bytes", OFFLOAD, "other") == 8 * per_token
    assert instrumented.metric("hicache.transfer.bytes", **OFFLOAD) == ack.num_bytes == 20 * per_token
    assert _by_cause(instrumented, "hicache.transfer.bytes", OFFLOAD, "mixed") == 0  # never a bytes cause
    assert instrumented.metric("hicache.transfer.duration", **OFFLOAD, **{"hicache.cause": "mixed"}) == 1


def test_causes_are_exact_when_the_worker_resolves_them_long_after(instrumented, sglang_cpu):
    """The worker works the causes out at intake: paused while SGLang queues, merges and
    acks op after op (with ops queued by hand between them), every cause is still exact."""
    stacks = [sglang_cpu.build_stack("write_through") for _ in range(3)]  # a controller each, one worker
    pipeline = instrumented.instrumentor.telemetry._pipeline  # pylint: disable=protected-access
    pipeline._cycle = lambda: None  # paused: every record waits in the queue, its cause unresolved
    observer_log = lambda: instrumented.instrumentor._observer.causes.log  # pylint: disable=protected-access
    expected = []
    try:
        for round_, stack in enumerate(stacks):
            controller = stack.controller
            did = sglang_cpu.write_through_round_trip(stack, n=12, start=2000 + 100 * round_)
            expected += [("hicache.offload", "write_through", did["offload_tokens"]),
                         ("hicache.onboard", "prefix_hit", did["onboard_tokens"])]
            by_hand = stack.allocator.alloc(8)  # a merged op of no site's ops: nothing logged to hand over
            assert controller.write(by_hand, node_id=-1 - round_, flush=False) is not None
            controller.start_writing()
            controller.ack_write_queue.clear()
            stack.allocator.free(by_hand)
            expected.append(("hicache.offload", "other", 8))
        assert sum(type(item) is list for item in pipeline.queue) == len(expected)  # (and the host pool, announced)
        # each merged op carries the site calls logged before it, and only those
        from otel_hicache.capture.records import SUBMISSION_FIELDS
        causes = [record[SUBMISSION_FIELDS.index("cause_call")] for record in pipeline.queue if type(record) is list]
        logs = [cause[-1] for cause in causes if type(cause) is tuple]
        assert [len(log) for log in logs] == [1, 1, 0] * 3  # the insert's backup, the load-back, nothing
        assert len({id(log) for log in logs if log}) == 6 and not any(log is observer_log() for log in logs)
    finally:
        del pipeline._cycle
    spans = sorted(instrumented.finished(), key=lambda s: s.start_time)
    assert [(s.name, s.attributes["hicache.cause"], s.attributes["hicache.tokens"]) for s in spans] == expected
