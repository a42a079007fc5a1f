"""The instrumentor's contract: symmetric, idempotent, version-guarded, never raising into SGLang."""

from __future__ import annotations

from typing import Any

import pytest

WRAPPED = [
    ("sglang.srt.mem_cache.l2_transfer", "L2TransferEngine", "submit_device_to_host"),
    ("sglang.srt.mem_cache.l2_transfer", "L2TransferEngine", "submit_host_to_device"),
    ("sglang.srt.managers.cache_controller", "HiCacheController", "__init__"),
    ("sglang.srt.managers.cache_controller", "HiCacheController", "start_writing"),
    ("sglang.srt.managers.cache_controller", "HiCacheController", "start_loading"),
]


def _own(module: str, owner: str | None, attribute: str) -> Any:
    import importlib

    obj: Any = importlib.import_module(module)
    if owner:
        obj = getattr(obj, owner)
    return vars(obj)[attribute]


def _originals() -> dict[tuple[str, str | None, str], Any]:
    return {target: _own(*target) for target in WRAPPED}


def test_instrument_wraps_and_uninstrument_restores_the_originals_exactly(sglang_cpu):
    from otel_hicache_sglang import SGLangHiCacheInstrumentor

    before = _originals()
    instrumentor = SGLangHiCacheInstrumentor()
    instrumentor.instrument()
    try:
        for target, original in before.items():
            wrapper = _own(*target)
            assert wrapper is not original, target
            assert wrapper.__wrapped__ is original, target
            assert wrapper.__name__ == original.__name__
    finally:
        instrumentor.uninstrument()
    assert all(_own(*target) is original for target, original in before.items())
    # HybridCacheController inherits start_* from the base: it has no own attribute, before or after
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    assert "start_writing" not in vars(HybridCacheController)


def test_uninstrument_lets_the_telemetry_and_its_providers_go(sglang_cpu):
    """Nothing the adapter registered (wrapt's post-import hooks for modules SGLang has not
    imported, at-fork callbacks) keeps an uninstrumented adapter's telemetry alive."""
    import gc
    import weakref

    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider

    from otel_hicache_sglang import SGLangHiCacheInstrumentor

    instrumentor = SGLangHiCacheInstrumentor()
    meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()], shutdown_on_exit=False)
    instrumentor.instrument(tracer_provider=TracerProvider(shutdown_on_exit=False), meter_provider=meter_provider)
    try:
        sglang_cpu.decode_retraction(sglang_cpu.build_stack("write_through"))
        telemetry = instrumentor.telemetry
        assert telemetry is not None and telemetry.force_flush(10.0)
        gone = [weakref.ref(telemetry), weakref.ref(meter_provider)]
    finally:
        instrumentor.uninstrument()
    meter_provider.shutdown()
    del telemetry, meter_provider
    gc.collect()
    assert [ref() for ref in gone] == [None, None]


def test_uninstrumented(instrumented, sglang_cpu):
    """After uninstrument() SGLang's transfers produce nothing."""
    sglang_cpu.decode_retraction(sglang_cpu.build_stack("write_through"))
    assert len(instrumented.finished()) == 2
    telemetry = instrumented.instrumentor.telemetry
    instrumented.instrumentor.uninstrument()
    assert instrumented.instrumentor.telemetry is None
    assert telemetry.enabled is False  # shut down: its spans were exported
    sglang_cpu.decode_retraction(sglang_cpu.build_stack("write_through"))
    assert len(instrumented.spans.get_finished_spans()) == 2


def test_instrumenting_twice_reports_each_copy_once(instrumented, sglang_cpu):
    from otel_hicache_sglang import SGLangHiCacheInstrumentor, plugin

    SGLangHiCacheInstrumentor().instrument()  # BaseInstrumentor: a no-op (logs that it already is)
    plugin()  # SGLang's entry point: sees it is instrumented, does nothing
    assert SGLangHiCacheInstrumentor() is instrumented.instrumentor
    sglang_cpu.decode_retraction(sglang_cpu.build_stack("write_through"))
    assert len(instrumented.finished()) == 2


def test_disabled_patches_nothing(monkeypatch, sglang_cpu):
    from otel_hicache_sglang import SGLangHiCacheInstrumentor

    monkeypatch.setenv("OTEL_HICACHE_ENABLED", "false")
    before = _originals()
    instrumentor = SGLangHiCacheInstrumentor()
    instrumentor.instrument()
    try:
        assert _originals() == before
        assert instrumentor.instrumented_groups() == []
    finally:
        instrumentor.uninstrument()


@pytest.mark.parametrize("break_sglang, message", [
    ("missing_ack_field", "HiCacheAck has no field num_bytes"),
    ("renamed_method", "L2TransferEngine.submit_host_to_device not found"),
])
def test_an_incompatible_sglang_warns_once_and_keeps_serving(monkeypatch, sglang_cpu, warnings_log,
                                                            break_sglang, message):
    from sglang.srt.managers.cache_controller import HiCacheAck
    from sglang.srt.mem_cache.l2_transfer import L2TransferEngine

    from otel_hicache_sglang import SGLangHiCacheInstrumentor

    if break_sglang == "missing_ack_field":
        monkeypatch.setattr(HiCacheAck, "_fields", tuple(f for f in HiCacheAck._fields if f != "num_bytes"))
    else:  # as if a later SGLang renamed it (the old name still works for SGLang's own calls here)
        original = vars(L2TransferEngine)["submit_host_to_device"]
        monkeypatch.delattr(L2TransferEngine, "submit_host_to_device")
        monkeypatch.setattr(L2TransferEngine, "submit_h2d", original, raising=False)
    instrumentor = SGLangHiCacheInstrumentor()
    instrumentor.instrument()
    try:
        assert "L1<->L2 transfers" not in instrumentor.instrumented_groups()
        assert "host residence" in instrumentor.instrumented_groups()  # the other groups still work
        warnings = [r.getMessage() for r in warnings_log.records if "does not match" in r.getMessage()]
        assert len(warnings) == 1 and message in warnings[0] and "L1<->L2 transfers" in warnings[0]
        if break_sglang == "renamed_method":
            monkeypatch.setattr(L2TransferEngine, "submit_host_to_device", original, raising=False)  # SGLang calls it
        controller, kv, allocator = sglang_cpu.build_controller()
        assert sglang_cpu.controller_round_trip(controller, kv, allocator)["offload_tokens"] == 8  # bit-exact inside
    finally:
        instrumentor.uninstrument()


def test_reporting_failures_never_raise_into_sglang(instrumented, sglang_cpu, monkeypatch, warnings_log):
    """A controller without the ack queue the wrapper pairs with: SGLang's call still succeeds."""
    stack = sglang_cpu.build_stack("write_through")
    telemetry = instrumented.instrumentor.telemetry

    def broken_submit(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("telemetry is broken")

    monkeypatch.setattr(telemetry, "submit", broken_submit)
    did = sglang_cpu.write_through_round_trip(stack)
    assert did["bit_exact"] is True
    did = sglang_cpu.decode_retraction(stack)
    assert did["bit_exact"] is True
    messages = [r.getMessage() for r in warnings_log.records]
    assert any("could not report a merged op" in m for m in messages)
    assert any("could not report an L2 copy" in m for m in messages)


def test_the_per_op_methods_are_plain_functions_not_proxies(sglang_cpu):
    """start_writing/start_loading and the engine's submit_* run on every HiCache op: a plain
    function costs one Python frame, a wrapt proxy ~1 us more per call (docs/performance.md)."""
    import types

    from otel_hicache_sglang import SGLangHiCacheInstrumentor

    per_op = [t for t in WRAPPED if t[2].startswith(("start_", "submit_"))]
    instrumentor = SGLangHiCacheInstrumentor()
    instrumentor.instrument()
    try:
        for target in per_op:
            assert type(_own(*target)) is types.FunctionType, target
    finally:
        instrumentor.uninstrument()
