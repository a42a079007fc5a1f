"""OTEL_HICACHE_SPAN_EXPORT_PROCESS: spans exported by a helper process.

The wire must lose nothing the OTLP encoding carries (the rebuilt spans encode to the
same bytes), spans must reach a real OTLP receiver through the helper, and a helper that
dies, cannot be started or is shared by a forked child must never take the host down."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace import TraceState

from harness import Harness
from otel_hicache import sdk_internals
from otel_hicache import span_export_process as sep
from otlp_receiver import GrpcReceiver, HttpReceiver, StallingServer, attributes


def frames(data: bytes) -> list[tuple]:
    stream, out = io.BytesIO(data), []
    while (frame := sep._read(stream)) is not None:  # pylint: disable=protected-access
        out.append(frame)
    return out


def api_spans() -> list:
    """Spans of every shape the OTLP encoding carries, dropped counts included."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource({"service.name": "t", "n": 3}, "https://schema/1"),
                              span_limits=SpanLimits(max_span_attributes=3, max_events=1, max_links=1,
                                                     max_event_attributes=1, max_link_attributes=1),
                              shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("scope.a", "1.2", schema_url="https://schema/2", attributes={"k": "v"})
    other = provider.get_tracer("scope.b")
    remote = SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=TraceFlags(1),
                         trace_state=TraceState([("vendor", "x1")]))
    link = Link(SpanContext(0x123, 0x456, is_remote=False, trace_flags=TraceFlags(0)), {"a": 1, "b": 2})
    with tracer.start_as_current_span("root", kind=SpanKind.SERVER, attributes={"s": "x", "i": 1, "f": 0.5,
                                                                                  "b": True, "t": (1, 2)},
                                      links=[link, link]) as root:
        root.add_event("e1")
        root.add_event("e2", {"x": 1, "y": 2}, timestamp=123)
        root.set_status(Status(StatusCode.ERROR, "broken"))
    with trace.use_span(NonRecordingSpan(remote)):
        with other.start_as_current_span("child", kind=SpanKind.CLIENT):
            pass
    provider.shutdown()
    return list(exporter.get_finished_spans())


def engine_spans() -> list:
    """Transfer spans as the completion worker builds them (fast path), with a parent and an ack."""
    h = Harness(attributes={"tp_rank": 1, "model": "m"})
    try:
        parent = NonRecordingSpan(SpanContext(7, 8, False, TraceFlags(1)))
        request = SpanContext(9, 10, False, TraceFlags(1))
        for i, direction in enumerate(("offload", "onboard", "onboard")):
            start, finish = h.device.copy(h.device.time_ns(), 2.0)
            with trace.use_span(parent) if i else contextlib.nullcontext():
                handle = h.tel.submit(direction, {"kv": 64 + i, "swa": 8}, 4096, 16, start, finish, True, "kernel",
                                      requests=[request] if i == 2 else None)
            h.device.advance(ms=3)
            h.tel.ack(handle)
        return h.finished()
    finally:
        h.close()


@pytest.mark.parametrize("make", [api_spans, engine_spans], ids=["api", "engine"])
def test_rebuilt_spans_encode_to_the_same_otlp_bytes(make):
    spans = make()
    exporter = sep.ProcessSpanExporter(lambda: [])
    wire = exporter._frames(spans)  # pylint: disable=protected-access
    rebuilt = sep.rebuild(frames(wire))
    assert len(rebuilt) == len(spans) >= 2
    assert encode_spans(rebuilt).SerializeToString() == encode_spans(spans).SerializeToString()
    if make is api_spans:  # the limits bit, and the counts travelled
        assert {s.dropped_attributes for s in rebuilt} == {2, 0} and rebuilt[0].dropped_events == 1
        assert rebuilt[0].dropped_links == 1 and rebuilt[0].events[0].attributes.dropped == 1
    else:  # a parent, a link to a request and its event made the trip
        assert any(s.parent for s in rebuilt) and any(s.links for s in rebuilt)
    # a resource and a scope are sent once per helper
    again = frames(exporter._frames(spans))  # pylint: disable=protected-access
    assert {f[0] for f in again} == {"s"} and all(len(f[1]) <= sep.FRAME_SPANS for f in again)
    assert sum(len(f[1]) for f in again) == len(spans)


def configure_for(receiver, monkeypatch, protocol="http/protobuf", readers=(), **extra):
    import otel_hicache

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "helper-test")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_HICACHE_SPAN_EXPORT_PROCESS", "true")
    for key, value in extra.items():
        monkeypatch.setenv(key, value)
    return otel_hicache.configure(force=True, metric_readers=readers)


@pytest.fixture
def through_helper(monkeypatch, fresh_configuration):
    """configure() with the helper on, to an HTTP receiver; a TransferTelemetry whose 40 spans
    the helper has already exported."""
    import otel_hicache

    receiver = HttpReceiver()
    try:
        conf = configure_for(receiver, monkeypatch)
        tel = otel_hicache.TransferTelemetry(attributes={"tp_rank": 0})
        submit(tel, 40)
        assert tel.force_flush(30.0)
        yield SimpleNamespace(receiver=receiver, tel=tel, exporter=conf.span_processors[0].helper)
        tel.shutdown()
        otel_hicache.shutdown(10.0)
    finally:
        receiver.stop()


def submit(tel, n, offset=0):
    from otel_hicache.testing import WallClockDevice

    device = WallClockDevice()
    for i in range(n):
        start, finish = device.copy(time.time_ns() - 5_000_000, 2.0)
        tel.ack(tel.submit("offload" if i & 1 else "onboard", {"kv": 64 + offset + i}, 4096, 16, start, finish,
                           True, "kernel"))


@pytest.mark.parametrize("protocol, slice_us", [("grpc", "0"), ("http/protobuf", "0"), ("http/protobuf", "20")],
                         ids=["grpc", "http", "http-gil-slices"])
def test_spans_reach_the_receiver_through_the_helper(protocol, slice_us, monkeypatch, fresh_configuration):
    import otel_hicache

    receiver = GrpcReceiver() if protocol == "grpc" else HttpReceiver()
    try:
        monkeypatch.setenv("OTEL_HICACHE_GIL_SLICE_US", slice_us)
        reader = InMemoryMetricReader()
        conf = configure_for(receiver, monkeypatch, protocol, readers=[reader])
        [processor] = conf.span_processors
        assert isinstance(processor, sep.ProcessSpanProcessor)
        tel = otel_hicache.TransferTelemetry(attributes={"tp_rank": 0})
        submit(tel, 100)
        assert tel.force_flush(30.0)
        helper = processor.helper.pid
        assert helper is not None and helper != os.getpid()
        # background work: the helper runs at a lower priority than the serving process
        assert os.getpriority(os.PRIO_PROCESS, helper) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + sep.NICE)
        # with GIL slices, 32 spans flattened (~0.3 ms) take pauses; without, none
        assert (processor.helper._slice.pauses > 0) == (slice_us != "0")
        spans = receiver.received.spans()
        assert len(spans) == 100  # all there once force_flush returned: it waits for the helper
        assert sorted(attributes(s.attributes)["hicache.tokens"] for _, s in spans) == list(range(64, 164))
        assert {attributes(r.attributes)["service.name"] for r, _ in spans} == {"helper-test"}
        # the helper's CPU time is on the telemetry's own CPU counter, per rank
        cpu = {p.attributes["thread"]: p for r in reader.get_metrics_data().resource_metrics
               for sm in r.scope_metrics for m in sm.metrics if m.name == "otel_hicache.export.cpu_time"
               for p in m.data.data_points}
        if sdk_internals.available("threads"):  # found with the export threads (else no point, as for them)
            assert cpu["export_process"].value > 0 and cpu["export_process"].attributes["tp_rank"] == 0
        else:
            assert "export_process" not in cpu
        tel.shutdown()
        otel_hicache.shutdown(10.0)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and os.path.exists(f"/proc/{helper}"):
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{helper}")  # it ended with the providers
    finally:
        receiver.stop()


def test_shutdown_is_bounded_and_the_helper_ends_with_the_collector_stalled(monkeypatch, fresh_configuration):
    import otel_hicache

    stalling = StallingServer()  # every export waits for OTEL_EXPORTER_OTLP_TIMEOUT
    try:
        conf = configure_for(stalling, monkeypatch, OTEL_HICACHE_SHUTDOWN_TIMEOUT_S="1",
                             OTEL_EXPORTER_OTLP_TIMEOUT="20")
        exporter = conf.span_processors[0].helper
        tel = otel_hicache.TransferTelemetry(attributes={"tp_rank": 0})
        submit(tel, 20)
        tel.force_flush(1.0)  # the helper has them, its export is stuck in the stalled request
        helper = exporter.pid
        assert helper is not None
        started = time.monotonic()
        tel.shutdown()
        otel_hicache.shutdown()  # OTEL_HICACHE_SHUTDOWN_TIMEOUT_S
        assert time.monotonic() - started < 6.0
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline and os.path.exists(f"/proc/{helper}"):
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{helper}")  # not left waiting for the SDK's 30 s or the request's 20
    finally:
        stalling.stop()


PARENT = """
import os, sys, time
sys.path.insert(0, {tests!r})
import otel_hicache
from test_span_export_process import submit
conf = otel_hicache.configure()
tel = otel_hicache.TransferTelemetry(attributes={{"tp_rank": 0}})
submit(tel, 5)
tel.force_flush(10.0)
print(conf.span_processors[0].helper.pid, flush=True)
time.sleep(60)
"""


def test_the_helper_ends_when_its_process_is_killed(monkeypatch):
    receiver = HttpReceiver()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.update(OTEL_TRACES_EXPORTER="otlp", OTEL_METRICS_EXPORTER="none", OTEL_HICACHE_SPAN_EXPORT_PROCESS="true",
                   OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf", OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint)
        parent = subprocess.Popen([sys.executable, "-c", PARENT.format(tests=os.path.dirname(__file__))], env=env,
                                  stdout=subprocess.PIPE, text=True)
        helper = int(parent.stdout.readline())
        assert os.path.exists(f"/proc/{helper}")
        parent.kill()  # SIGKILL: no exit hook runs; the helper's pipe closes with the process
        parent.wait(10)
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline and os.path.exists(f"/proc/{helper}"):
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{helper}")
        assert len(receiver.received.spans()) == 5  # flushed before the kill
    finally:
        receiver.stop()


def test_the_sdk_self_metrics_count_every_span_from_both_processes(monkeypatch, fresh_configuration):
    """OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED=true: the serving process's processor counts what it
    handed over, the helper's OTLP exporter what it exported, both to the same metrics endpoint."""
    import otel_hicache

    receiver = HttpReceiver()
    try:
        configure_for(receiver, monkeypatch, OTEL_METRICS_EXPORTER="otlp", OTEL_METRIC_EXPORT_INTERVAL="600000",
                      OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED="true")
        tel = otel_hicache.TransferTelemetry(attributes={"tp_rank": 0})
        submit(tel, 50)
        assert tel.force_flush(30.0)
        tel.shutdown()
        otel_hicache.shutdown(10.0)  # the last collection of both processes
        exported = receiver.received.last_points("otel.sdk.exporter.span.exported")
        processed = receiver.received.last_points("otel.sdk.processor.span.processed")
        assert sum(p.as_int for p in exported) == 50 and not any("error.type" in attributes(p.attributes)
                                                                  for p in exported)
        assert sum(p.as_int for p in processed) == 50
    finally:
        receiver.stop()


def test_the_helper_never_serves_a_prometheus_port(monkeypatch):
    from otel_hicache import configuration

    monkeypatch.setenv("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED", "true")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "prometheus")  # the serving process's port
    assert configuration.self_metrics_meter_provider() is None
    monkeypatch.setenv("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED", "false")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "otlp")
    assert configuration.self_metrics_meter_provider() is None


def test_no_helper_without_span_exporters(monkeypatch, fresh_configuration):
    import otel_hicache

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    monkeypatch.setenv("OTEL_HICACHE_SPAN_EXPORT_PROCESS", "true")
    assert otel_hicache.configure(force=True).span_processors == []


def test_a_malformed_value_is_warned_about_and_spans_stay_in_process(monkeypatch, fresh_configuration, warnings_log):
    import otel_hicache

    receiver = HttpReceiver()
    try:
        conf = configure_for(receiver, monkeypatch, OTEL_HICACHE_SPAN_EXPORT_PROCESS="yes")
        assert [type(p).__name__ for p in conf.span_processors] == ["BatchSpanProcessor"]
        assert "OTEL_HICACHE_SPAN_EXPORT_PROCESS='yes'" in warnings_log.text
        otel_hicache.shutdown(5.0)
    finally:
        receiver.stop()


def test_a_helper_that_dies_is_replaced_and_the_loss_is_counted(through_helper, warnings_log):
    exporter, tel = through_helper.exporter, through_helper.tel
    first = exporter.pid
    cpu_before = exporter.helper_cpu_s()
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while exporter._proc.poll() is None and time.monotonic() < deadline:  # pylint: disable=protected-access
        time.sleep(0.01)
    submit(tel, 40, offset=1000)  # the first batch meets the dead helper's pipe
    tel.force_flush(30.0)
    submit(tel, 40, offset=2000)
    assert tel.force_flush(30.0)
    assert exporter.pid not in (None, first)
    assert exporter.helper_cpu_s() >= cpu_before > 0  # the dead helper's CPU stays counted
    tokens = {attributes(s.attributes)["hicache.tokens"] for _, s in through_helper.receiver.received.spans()}
    assert set(range(64, 104)) <= tokens and set(range(2064, 2104)) <= tokens
    lost = 40 - len(tokens & set(range(1064, 1104)))
    assert lost == exporter.lost > 0  # what did not arrive is what was counted
    assert "span export helper process" in warnings_log.text and "were lost" in warnings_log.text


def test_without_a_helper_spans_are_exported_in_process(warnings_log):
    sink = InMemorySpanExporter()
    exporter = sep.ProcessSpanExporter(lambda: [sink], command=[sys.executable, "-c", "raise SystemExit(3)"])
    spans = api_spans()
    results = []
    for _ in range(sep.MAX_STARTS * 3):
        results.append(exporter.export(spans))
        time.sleep(0.2)  # the helper exits: the next write meets a closed pipe
    assert results[-1] is SpanExportResult.SUCCESS
    assert len(sink.get_finished_spans()) > 0  # the later batches were exported here
    assert "exporting spans in this process instead" in warnings_log.text
    assert exporter.force_flush(1000) and exporter.pid is None
    exporter.shutdown()


def test_a_helper_that_cannot_start_falls_back_at_once(warnings_log):
    sink = InMemorySpanExporter()
    exporter = sep.ProcessSpanExporter(lambda: [sink], command=["/nonexistent/python"])
    assert exporter.export(api_spans()) is SpanExportResult.SUCCESS
    assert len(sink.get_finished_spans()) == 2
    assert "cannot be started" in warnings_log.text
    exporter.shutdown()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork() is POSIX-only")
def test_a_forked_child_exports_through_its_own_helper(through_helper):
    import otel_hicache

    exporter, tel = through_helper.exporter, through_helper.tel
    parent_helper = exporter.pid
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its own providers and helper
        code = 1
        try:
            os.close(read)
            child_conf = otel_hicache.configure()
            child_tel = otel_hicache.TransferTelemetry(attributes={"tp_rank": 1})
            submit(child_tel, 10, offset=500)
            ok = child_tel.force_flush(30.0)
            helper = child_conf.span_processors[0].helper.pid
            os.write(write, f"{int(ok)} {helper}".encode())
            child_tel.shutdown()
            otel_hicache.shutdown(10.0)
            code = 0
        finally:
            os._exit(code)  # pylint: disable=protected-access
    os.close(write)
    answer = os.read(read, 100).decode().split()
    os.close(read)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0 and answer[0] == "1"
    assert int(answer[1]) not in (parent_helper, pid, os.getpid())
    submit(tel, 10, offset=1000)  # the parent's helper still takes the parent's spans
    assert tel.force_flush(30.0) and exporter.pid == parent_helper
    by_rank = {}
    for _, span in through_helper.receiver.received.spans():
        attrs = attributes(span.attributes)
        by_rank.setdefault(attrs["tp_rank"], set()).add(attrs["hicache.tokens"])
    assert by_rank == {0: set(range(64, 104)) | set(range(1064, 1074)), 1: set(range(564, 574))}
