"""The wrappers read SGLang's parameters by position or by name: the real SGLang objects
called with keywords report exactly what positional calls report, and a parameter that
a later SGLang renames and passes by keyword costs what it carried, never the call.

``start_writing``/``start_loading`` take no parameters; their merged ops are driven
here with their engine's ``transfers`` passed by keyword instead.
"""

from __future__ import annotations

from typing import Any

import pytest

# timings: differ from run to run
VOLATILE = {"hicache.ack_delay_us", "hicache.queue_wait_us", "hicache.bandwidth_bytes_per_second",
            "hicache.host.residence_min_us", "hicache.host.residence_max_us"}


def _reports(spans: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(s.name, {k: v for k, v in s.attributes.items() if k not in VOLATILE}) for s in spans]


def by_keyword(monkeypatch: pytest.MonkeyPatch, obj: Any, method: str, *names: str) -> None:
    """SGLang's own calls of ``obj.method(...)`` reach the (wrapped) class attribute with
    their positional arguments passed as ``names`` by keyword."""

    def call(*args: Any, **kwargs: Any) -> Any:
        assert len(args) <= len(names), (method, args)
        kwargs.update(zip(names, args))
        return getattr(type(obj), method)(obj, **kwargs)

    monkeypatch.setattr(obj, method, call, raising=False)


def _transfers(controller: Any, allocator: Any, n: int = 8) -> tuple[Any, Any, Any]:
    device_indices = allocator.alloc(n)
    host_indices = controller.mem_pool_host.alloc(n)
    return controller._l2_transfers(host_indices, device_indices), host_indices, device_indices


def test_direct_copies_with_transfers_by_keyword_report_as_positional(instrumented, sglang_cpu):
    controller, _kv, allocator = sglang_cpu.build_controller()
    engine = controller.l2_transfer_engine
    transfers, host_indices, device_indices = _transfers(controller, allocator)
    layers = controller.transfer_layer_id_max
    engine.submit_device_to_host(transfers).finish_event.synchronize()
    engine.submit_device_to_host(transfers=transfers).finish_event.synchronize()
    engine.submit_host_to_device(transfers, transfer_layer_id_max=layers).finish_event.synchronize()
    engine.submit_host_to_device(transfers=transfers, transfer_layer_id_max=layers).finish_event.synchronize()
    offload, offload_kw, onboard, onboard_kw = _reports(instrumented.finished())
    assert offload == offload_kw and onboard == onboard_kw
    assert offload[0] == "hicache.offload" and onboard[0] == "hicache.onboard"
    assert offload[1]["hicache.origin"] == "direct" and offload[1]["hicache.tokens"] == 8
    assert instrumented.metric("hicache.transfer.tokens", **{"hicache.origin": "direct"}) == 4 * 8
    controller.mem_pool_host.free(host_indices)
    allocator.free(device_indices)


def test_merged_ops_and_retraction_with_transfers_by_keyword_report_as_positional(instrumented, sglang_cpu,
                                                                                   monkeypatch):
    def run(keyword: bool) -> tuple[list[Any], dict[str, float]]:
        before = {origin: instrumented.metric("hicache.transfer.tokens", **{"hicache.origin": origin})
                  for origin in ("merged_op", "direct")}
        stack = sglang_cpu.build_stack("write_through")
        if keyword:
            engine = stack.controller.l2_transfer_engine
            by_keyword(monkeypatch, engine, "submit_device_to_host", "transfers")
            by_keyword(monkeypatch, engine, "submit_host_to_device", "transfers")
        assert sglang_cpu.write_through_round_trip(stack)["offload_tokens"] == 12
        assert sglang_cpu.decode_retraction(stack)["bit_exact"] is True
        spans = _reports(instrumented.finished())
        instrumented.spans.clear()
        return spans, {origin: instrumented.metric("hicache.transfer.tokens", **{"hicache.origin": origin})
                       - value for origin, value in before.items()}

    positional, positional_tokens = run(keyword=False)
    keyword, keyword_tokens = run(keyword=True)
    assert [(name, a["hicache.origin"]) for name, a in positional] == [
        ("hicache.offload", "merged_op"), ("hicache.onboard", "merged_op"),
        ("hicache.offload", "direct"), ("hicache.onboard", "direct")]
    assert keyword == positional
    assert keyword_tokens == positional_tokens == {"merged_op": 24, "direct": 16}


def test_a_renamed_parameter_passed_by_keyword_costs_the_report_never_the_call(monkeypatch, make_instrumented,
                                                                                sglang_cpu, warnings_log):
    """As if a later SGLang renamed ``transfers`` and passed it by keyword."""
    from sglang.srt.mem_cache.l2_transfer import L2TransferEngine

    submit = L2TransferEngine.submit_device_to_host

    def submit_device_to_host(self: Any, transfer_list: Any) -> Any:
        return submit(self, transfer_list)

    monkeypatch.setattr(L2TransferEngine, "submit_device_to_host", submit_device_to_host)
    instrumented = make_instrumented()

    controller, _kv, allocator = sglang_cpu.build_controller()
    engine = controller.l2_transfer_engine
    transfers, host_indices, device_indices = _transfers(controller, allocator)
    for _ in range(2):  # a direct copy: SGLang's call succeeds, the copy is not reported
        completion = engine.submit_device_to_host(transfer_list=transfers)
        completion.finish_event.synchronize()
        assert type(completion).__name__ == "TransferCompletion"
    by_keyword(monkeypatch, engine, "submit_device_to_host", "transfer_list")
    acks = sglang_cpu.controller_round_trip(controller, _kv, allocator)  # a merged op: still counted from its ack
    spans = instrumented.finished()
    assert [(s.name, s.attributes["hicache.origin"]) for s in spans] == [
        ("hicache.offload", "merged_op"), ("hicache.onboard", "merged_op")]
    assert spans[0].attributes["hicache.tokens"] == acks["offload_tokens"] == 8

    messages = [r.getMessage() for r in warnings_log.records]
    renamed = [m for m in messages if "without a parameter" in m]
    assert len(renamed) == 1, messages
    assert "submit_device_to_host() without a parameter 'transfers'" in renamed[0]
    assert not [m for m in messages if "could not" in m or "does not match" in m], messages
    controller.mem_pool_host.free(host_indices)
    allocator.free(device_indices)
