"""configure(): private providers from the standard OTEL_* variables."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest
from opentelemetry import metrics, trace

import otel_hicache
from otel_hicache.sinks import providers


pytestmark = pytest.mark.usefixtures("fresh_configuration", "embedded")


def span_exporters(conf):
    processors = conf.tracer_provider._active_span_processor._span_processors  # pylint: disable=protected-access
    exporters = [p.span_exporter for p in processors]
    return [type(e).__module__ + "." + type(e).__name__ for e in exporters]


def metric_readers(conf):
    return list(conf.metric_readers)


def test_the_sdk_configurator_is_not_used_for_these_gaps():
    """Why sinks.providers builds the providers itself (issue 33) instead of the SDK's configurator
    (opentelemetry.sdk._configuration._initialize_components, private: only opentelemetry-distro's
    entry point calls it). Each gap below costs a promise: it always installs the global providers
    (embedded sinks must never touch the host's); one unknown name in OTEL_TRACES_EXPORTER raises
    (every signal lost, not one exporter skipped); its constructors read the environment unguarded
    (a blank OTEL_EXPORTER_OTLP_TIMEOUT raises from the gRPC exporter); and it has no hook for an
    exporter's export (the counters' start time in a successor, the spans never handed at exit,
    the fork guard), nor, on SDK 1.30, any exporter arguments (the parsed headers, the HTTP session)."""
    import inspect

    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk import _configuration as sdk

    assert "set_tracer_provider(provider)" in inspect.getsource(sdk._init_tracing)  # pylint: disable=protected-access
    assert "set_meter_provider(provider)" in inspect.getsource(sdk._init_metrics)  # pylint: disable=protected-access
    with pytest.raises(RuntimeError):
        sdk._import_exporters(["no-such-exporter"], [], [])  # pylint: disable=protected-access
    with pytest.MonkeyPatch.context() as env, pytest.raises(ValueError):
        env.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", " ")
        OTLPSpanExporter()


def test_private_providers_leave_the_globals_alone(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    global_tp, global_mp = trace.get_tracer_provider(), metrics.get_meter_provider()
    conf = otel_hicache.configure()
    assert conf is otel_hicache.configure()  # once per process
    assert otel_hicache.configured() is conf
    assert trace.get_tracer_provider() is global_tp
    assert metrics.get_meter_provider() is global_mp
    assert conf.tracer_provider is not global_tp


def test_service_name_and_resource_attributes(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "sglang")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test,k8s.pod.name=p0")
    resource = otel_hicache.configure().tracer_provider.resource
    assert resource.attributes["service.name"] == "sglang"
    assert resource.attributes["deployment.environment"] == "test"
    assert resource.attributes["k8s.pod.name"] == "p0"


def test_default_is_otlp_grpc(monkeypatch):
    conf = otel_hicache.configure()
    assert span_exporters(conf) == ["opentelemetry.exporter.otlp.proto.grpc.trace_exporter.OTLPSpanExporter"]
    [reader] = metric_readers(conf)
    assert type(reader._exporter).__module__.startswith("opentelemetry.exporter.otlp.proto.grpc")


@pytest.mark.parametrize("variable", ["OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"])
def test_http_protobuf_protocol(monkeypatch, variable):
    monkeypatch.setenv(variable, "http/protobuf")
    conf = otel_hicache.configure()
    assert span_exporters(conf) == ["opentelemetry.exporter.otlp.proto.http.trace_exporter.OTLPSpanExporter"]


def test_console_and_none(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    conf = otel_hicache.configure()
    assert span_exporters(conf) == ["opentelemetry.sdk.trace.export.ConsoleSpanExporter"]
    assert metric_readers(conf) == []


def test_unknown_exporter_and_protocol_warn_naming_the_variable(monkeypatch, warnings_log):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin,otlp")  # no zipkin exporter is installed
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "carrier_pigeon")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "carrier-pigeon")
    conf = otel_hicache.configure()
    assert span_exporters(conf) == ["opentelemetry.exporter.otlp.proto.grpc.trace_exporter.OTLPSpanExporter"]
    assert metric_readers(conf) == []
    assert "OTEL_TRACES_EXPORTER='zipkin,otlp': unknown exporter 'zipkin'" in warnings_log.text
    assert "opentelemetry_traces_exporter entry point" in warnings_log.text
    assert "OTEL_METRICS_EXPORTER='carrier_pigeon'" in warnings_log.text
    assert "OTEL_EXPORTER_OTLP_PROTOCOL='carrier-pigeon'" in warnings_log.text


@pytest.mark.parametrize("name, exporter", [
    ("otlp_proto_http", "opentelemetry.exporter.otlp.proto.http.trace_exporter.OTLPSpanExporter"),
    ("otlp_proto_grpc", "opentelemetry.exporter.otlp.proto.grpc.trace_exporter.OTLPSpanExporter"),
])
def test_exporters_by_their_sdk_entry_point_names(monkeypatch, warnings_log, name, exporter):
    # the names the SDK's own configurator takes; the OTLP ones keep our validated path
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", name)
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", name)
    conf = otel_hicache.configure()
    assert span_exporters(conf) == [exporter]
    [reader] = metric_readers(conf)
    assert type(reader._exporter).__module__ == exporter.rsplit(".", 1)[0].replace("trace_exporter", "metric_exporter")
    assert "unknown exporter" not in warnings_log.text


def test_prometheus_metrics_exporter_serves_the_exact_counters(monkeypatch, harness):
    """OTEL_METRICS_EXPORTER=prometheus: the SDK's entry point gives a pull reader with its own
    HTTP endpoint (OTEL_EXPORTER_PROMETHEUS_HOST/PORT); our series are on it."""
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "prometheus")
    monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_HOST", "127.0.0.1")
    monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_PORT", str(port))
    conf = otel_hicache.configure()
    [reader] = metric_readers(conf)
    assert type(reader).__name__.endswith("PrometheusMetricReader")
    tel = otel_hicache.TransferTelemetry(attributes={"tp_rank": 3})
    try:
        for _ in range(3):
            tel.submit("offload", {"kv": 64}, 1000, page_size=64, expect_ack=False, host_start_ns=1, host_end_ns=2,
                       cause="retraction_backup")
        # the worker has recorded them (no force_flush: each one queues a collection that the
        # pull reader serves with the next scrape, beside the scrape's own)
        assert tel._pipeline.flush(5)  # pylint: disable=protected-access
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        tel.shutdown()
    [line] = [l for l in body.splitlines() if l.startswith("hicache_transfer_bytes_total{")
              and 'hicache_direction="offload"' in l and 'hicache_cause="retraction_backup"' in l]
    assert 'tp_rank="3"' in line and 'hicache_origin="direct"' in line and line.endswith(" 3000.0")


def test_static_attributes_go_into_the_resource_unless_a_pull_reader_serves_the_metrics(monkeypatch):
    """Providers built for one serving process (its telemetry process): its static attributes in
    the resource, not on the points; with the SDK's prometheus reader (the resource on target_info
    only) on the points, so tp_rank stays a label of every series either way."""
    import socket
    import urllib.request

    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.resources import Resource

    from otel_hicache.sinks.consumer import Consumer

    static = {"tp_rank": 3, "hicache.io_backend": "kernel"}
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "console")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "600000")
    built = providers.build(Resource({"service.name": "sglang"}), static=static)
    try:
        assert built.static_in_resource
        assert built.tracer_provider.resource.attributes["tp_rank"] == 3
        assert built.tracer_provider.resource.attributes["service.name"] == "sglang"
    finally:
        built.shutdown(2.0)
    reader = InMemoryMetricReader()
    built = providers.build(Resource({"service.name": "sglang"}), [reader], static=static)  # a reader of its own
    try:
        assert not built.static_in_resource and "tp_rank" not in built.tracer_provider.resource.attributes
    finally:
        built.shutdown(2.0)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "prometheus")
    monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_HOST", "127.0.0.1")
    monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_PORT", str(port))
    built = providers.build(Resource({"service.name": "sglang"}), static=static)
    try:
        assert not built.static_in_resource and "tp_rank" not in built.tracer_provider.resource.attributes
        consumer = Consumer(built.tracer_provider, built.meter_provider,
                            {"attributes": static, "in_resource": built.static_in_resource})
        assert consumer.metrics._io_backend == "kernel"  # pylint: disable=protected-access
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        built.shutdown(2.0)
    lines = [l for l in body.splitlines() if l.startswith("hicache_transfer_bytes_total{")]
    assert lines and all('tp_rank="3"' in l for l in lines)


def test_exponential_histogram_preference_is_honoured_by_the_otlp_exporter_only(monkeypatch):
    """The variable is the OTLP exporters' (as the SDK reads it); the console exporter
    keeps the instruments' explicit advisory buckets."""
    from opentelemetry.sdk.metrics.view import DefaultAggregation, ExponentialBucketHistogramAggregation

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION", "base2_exponential_bucket_histogram")
    for exporter, expected in (("otlp", ExponentialBucketHistogramAggregation), ("console", DefaultAggregation)):
        monkeypatch.setenv("OTEL_METRICS_EXPORTER", exporter)
        [reader] = metric_readers(otel_hicache.configure(force=True))
        aggregations = reader._instrument_class_aggregation  # pylint: disable=protected-access
        preferred = [v for k, v in aggregations.items() if k.__name__ == "_Histogram"]
        assert len(preferred) == 1 and type(preferred[0]) is expected, exporter


def test_exponential_histograms_end_to_end(monkeypatch):
    """The env preference reaches the data: exponential points, not our explicit buckets."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import (
        ExponentialHistogramDataPoint,
        InMemoryMetricReader,
    )
    from opentelemetry.sdk.metrics import Histogram
    from opentelemetry.sdk.metrics.view import ExponentialBucketHistogramAggregation

    reader = InMemoryMetricReader(preferred_aggregation={Histogram: ExponentialBucketHistogramAggregation()})
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    tel = otel_hicache.TransferTelemetry(trace.NoOpTracerProvider(), provider)
    tel.submit("offload", {"kv": 64}, 10, page_size=64, expect_ack=False, host_start_ns=0, host_end_ns=5_000)
    assert tel.force_flush(5)
    tel.shutdown()
    points = [p for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
              for m in sm.metrics if m.name == "hicache.transfer.duration" for p in m.data.data_points]
    assert points and all(isinstance(p, ExponentialHistogramDataPoint) for p in points)


def test_sdk_disabled_gives_no_op_providers(monkeypatch):
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    conf = otel_hicache.configure()
    assert conf.disabled
    assert isinstance(conf.tracer_provider, trace.NoOpTracerProvider)


def test_bad_endpoint_never_raises(monkeypatch, warnings_log):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "not a url at all")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_CERTIFICATE", "/nonexistent/ca.pem")
    conf = otel_hicache.configure()
    tel = otel_hicache.TransferTelemetry(attributes={"tp_rank": 0})
    tel.submit("offload", {"kv": 64}, 10, page_size=64, expect_ack=False, host_start_ns=0, host_end_ns=10)
    tel.force_flush(1.0)
    tel.shutdown()
    assert conf.tracer_provider is not None


def test_exit_is_bounded_when_the_collector_is_unreachable(tmp_path):
    """A process that reported ops and never called shutdown() exits within the
    configured bound (per step), not after the exporters' retries."""
    script = tmp_path / "app.py"
    script.write_text(textwrap.dedent(
        """
        import time
        import otel_hicache
        otel_hicache.configure()
        tel = otel_hicache.TransferTelemetry(attributes={"tp_rank": 0})
        for _ in range(100):
            tel.submit("offload", {"kv": 64}, 100, page_size=64, expect_ack=False, host_start_ns=0, host_end_ns=10)
        print("submitted", flush=True)
        """
    ))
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_HICACHE_SHUTDOWN_TIMEOUT_S": "0.5",
           "OTEL_METRIC_EXPORT_INTERVAL": "600000", "PATH": "/usr/bin:/bin"}
    import time

    started = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert "submitted" in done.stdout
    # one bounded wait of 0.5 s (later steps do not wait on a stuck exporter) plus
    # interpreter start-up; the exporters alone would retry for their 10 s timeout.
    assert elapsed < 8, (elapsed, done.stderr)
    # the bounded step waits what is left of the 0.5 s after stopping the pipeline (less on a busy
    # machine: the literal "0.5 s" failed a CI run), never more
    waited = re.search(r"did not finish within (\d+\.\d) s", done.stderr)
    assert waited is not None, done.stderr
    assert 0 < float(waited.group(1)) <= 0.5, done.stderr


def test_standard_otlp_variables_reach_the_exporters(monkeypatch):
    """Endpoint, headers, timeout and compression (general and per-signal forms) are
    read by the OTLP exporters themselves; configure() must not get in their way."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:5555")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-tenant=a")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "3")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "1234")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    conf = otel_hicache.configure()
    [processor] = conf.tracer_provider._active_span_processor._span_processors  # pylint: disable=protected-access
    exporter = processor.span_exporter
    assert exporter._endpoint == "127.0.0.1:5555"
    assert exporter._headers == (("x-tenant", "a"),)
    assert exporter._timeout == 3.0
    assert exporter._compression.name == "Gzip"
    [reader] = metric_readers(conf)
    assert reader._export_interval_millis == 1234.0
    assert conf.tracer_provider.sampler.get_description() == "TraceIdRatioBased{0.25}"


def test_per_signal_http_endpoint(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:5555/v1/traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_COMPRESSION", "gzip")
    conf = otel_hicache.configure()
    [processor] = conf.tracer_provider._active_span_processor._span_processors  # pylint: disable=protected-access
    assert processor.span_exporter._endpoint == "http://127.0.0.1:5555/v1/traces"
    [reader] = metric_readers(conf)
    assert reader._exporter._endpoint == "http://localhost:4318/v1/metrics"
    assert reader._exporter._compression.value == "gzip"


def test_an_entry_point_exporter_that_cannot_be_built_is_warned_about_and_skipped(monkeypatch, warnings_log):
    class Broken:
        def __init__(self):
            raise RuntimeError("needs a collector address")

    class EntryPoint:
        def load(self):
            return Broken

    real = providers.entry_points
    monkeypatch.setattr(providers, "entry_points",
                        lambda group, name: [EntryPoint()] if name == "broken" else real(group=group, name=name))
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "broken,console")
    conf = otel_hicache.configure()  # must not raise
    assert span_exporters(conf) == ["opentelemetry.sdk.trace.export.ConsoleSpanExporter"]
    assert "cannot create the broken traces exporter" in warnings_log.text
    assert "needs a collector address" in warnings_log.text


def test_spans_still_queued_when_the_bounded_shutdown_gives_up_are_reported(monkeypatch, warnings_log):
    """What the SDK's self-metrics cannot carry any more: the spans left in the queue at exit."""
    import threading
    import time

    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    from otel_hicache import configuration
    release, exporting = threading.Event(), threading.Event()

    class Stalled(SpanExporter):  # a collector that stopped answering
        def export(self, spans):
            exporting.set()
            release.wait(30)
            return SpanExportResult.SUCCESS

    class EntryPoint:
        def load(self):
            return Stalled

    monkeypatch.setattr(providers, "entry_points", lambda group, name: [EntryPoint()] if name == "stalled" else [])
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "stalled")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "10")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "1")
    conf = otel_hicache.configure()
    tracer = conf.tracer_provider.get_tracer("t")
    for _ in range(10):
        tracer.start_span("first batch").end()
    assert exporting.wait(10)  # the worker is inside export() with the first 10
    for _ in range(15):
        tracer.start_span("queued").end()
    time.sleep(0.05)
    try:
        assert configuration.shutdown(0.3) is False
    finally:
        release.set()
    assert "15 spans ended but were never handed to the exporter" in warnings_log.text
