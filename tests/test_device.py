"""Finding the device back-end of duck-typed events (for anchors and transfer())."""

from __future__ import annotations

import sys
import types

import pytest

from otel_hicache.capture.device import anchor_factory_for, timing_event_pair
from simulated import SimulatedDevice


@pytest.fixture
def fake_backend(monkeypatch):
    """A stand-in for torch.cuda / torch.xpu / torch.npu: module ``torch.fakedev``."""
    import torch  # noqa: F401  (the real package; we add a submodule to it)

    module = types.ModuleType("torch.fakedev")
    calls = []

    class Stream:
        def __init__(self, device=None):
            calls.append(("stream", device))

    class Event:
        def __init__(self, enable_timing=False):
            self.enable_timing = enable_timing
            self.stream = None
            self.device = types.SimpleNamespace(index=3)

        def record(self, stream=None):
            self.stream = stream

    Stream.__module__ = Event.__module__ = "torch.fakedev"
    module.Stream, module.Event = Stream, Event
    module.set_device = lambda index: calls.append(("set_device", index))
    monkeypatch.setitem(sys.modules, "torch.fakedev", module)
    return module, calls


def test_torch_backend_anchor_records_timing_events_on_its_own_stream(fake_backend):
    module, calls = fake_backend
    factory = anchor_factory_for(module.Event(enable_timing=True))
    first, second = factory(), factory()
    assert first.enable_timing and second.enable_timing
    assert first.stream is second.stream is not None  # one side stream, created once
    assert calls == [("set_device", 3), ("stream", 3)]  # on the events' device, from the poller thread


def test_timing_event_pair_for_a_torch_backend_stream(fake_backend):
    module, _ = fake_backend
    start, finish = timing_event_pair(module.Stream())
    assert start.enable_timing and finish.enable_timing and start is not finish


def test_custom_events_provide_their_own_anchor():
    device = SimulatedDevice()
    factory = anchor_factory_for(device.event())
    anchor = factory()
    assert anchor.query() and device.anchors_taken == 1


def test_unknown_events_have_no_anchor_and_unknown_streams_no_events():
    class Opaque:
        pass

    assert anchor_factory_for(Opaque()) is None
    with pytest.raises(TypeError, match="no timing events known"):
        timing_event_pair(Opaque())


def test_duck_typed_events_without_anchor_support_have_no_anchor():
    """record/query/synchronize/elapsed_time only (not torch's, no anchor_factory()):
    no anchor; the pipeline places such ops with an EventTimeline instead."""
    from simulated import DuckEvent

    assert anchor_factory_for(DuckEvent(SimulatedDevice().event())) is None


def test_wall_clock_device_ops_are_placed_by_its_anchor(caplog):
    """benchmarks/serving_cpu.py's device: the capture anchors its events, no fallback to host times."""
    import time

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from otel_hicache import TransferTelemetry
    from otel_hicache.testing import WallClockDevice

    spans, provider = InMemorySpanExporter(), TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(spans))
    tel = TransferTelemetry(provider, attributes={})
    start, finish = WallClockDevice().copy(time.time_ns() - 2_000_000, 1.0)
    tel.ack(tel.submit("offload", tokens_by_pool={"kv": 64}, num_bytes=4096, page_size=64, start_event=start,
                       finish_event=finish))
    tel.shutdown()
    [span] = spans.get_finished_spans()
    assert span.attributes["hicache.placement_source"] == "anchor" and span.end_time - span.start_time == 1_000_000
    assert "anchor" not in caplog.text
