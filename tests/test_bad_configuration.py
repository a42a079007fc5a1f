"""Bad configuration: a malformed standard OTEL_* value never crashes the host.

For every variable otel-hicache's providers depend on: configure() does not
raise, exactly one WARNING names the variable, the SDK object gets the
documented default, and a TransferTelemetry on those providers still reports
through them. Valid values (including forms the bare SDK mishandles) do not warn.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
from opentelemetry.sdk.metrics.export import MetricExportResult
from opentelemetry.sdk.trace.export import SpanExportResult

import otel_hicache
from otel_hicache.sinks import otel_environment
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXECUTABLE_SERVICE = f"unknown_service:{os.path.basename(sys.executable)}"
PARENT_ON = "ParentBased{root:AlwaysOnSampler,"
HTTP = {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}


pytestmark = pytest.mark.usefixtures("fresh_configuration", "embedded")


# -- what the built SDK objects hold --------------------------------------------------------------


def processors(conf):
    return list(conf.tracer_provider._active_span_processor._span_processors)  # pylint: disable=protected-access


def _compression(exporter):
    value = exporter._compression  # pylint: disable=protected-access
    return {"NoCompression": "none", "Gzip": "gzip", "Deflate": "deflate"}.get(value.name, str(value.value))


def _exporter_facts(prefix, exporter):
    if not type(exporter).__module__.startswith("opentelemetry.exporter.otlp"):
        return {f"{prefix}.module": type(exporter).__name__}
    client = getattr(exporter, "_client", None)
    if type(exporter).__module__.startswith("opentelemetry.exporter.otlp.proto.http"):
        timeout = client._timeout  # pylint: disable=protected-access
        headers = {k: v for k, v in client._headers.items() if k not in ("content-type", "user-agent")}
    else:
        timeout = exporter._timeout  # pylint: disable=protected-access
        headers = dict(exporter._headers)  # pylint: disable=protected-access
    return {f"{prefix}.endpoint": exporter._endpoint, f"{prefix}.timeout": timeout,  # pylint: disable=protected-access
            f"{prefix}.compression": _compression(exporter), f"{prefix}.headers": headers,
            f"{prefix}.module": type(exporter).__module__.split(".")[-2]}


def facts(conf):
    """The configuration as the SDK objects hold it (private attributes of SDK 1.45)."""
    if conf.disabled:
        return {"disabled": True, "tracer_provider": type(conf.tracer_provider).__name__}
    found = {"span_exporters": len(processors(conf)), "metric_readers": len(conf.metric_readers),
             "disabled": conf.disabled}
    tracer_provider, meter_provider = conf.tracer_provider, conf.meter_provider
    limits = tracer_provider._span_limits  # pylint: disable=protected-access
    found.update({
        "sampler": tracer_provider.sampler.get_description(),
        "resource": dict(tracer_provider.resource.attributes),
        "limits": (limits.max_attributes, limits.max_span_attributes, limits.max_events, limits.max_attribute_length),
        "exemplar_filter": type(meter_provider._sdk_config.exemplar_filter).__name__,  # pylint: disable=protected-access
    })
    for processor in processors(conf)[:1]:
        batch = processor._batch_processor  # pylint: disable=protected-access
        found["bsp"] = (batch._max_queue_size, batch._schedule_delay_millis, batch._max_export_batch_size,
                        batch._export_timeout_millis)
        found.update(_exporter_facts("span", processor.span_exporter))
    for reader in conf.metric_readers[:1]:
        found["reader"] = (reader._export_interval_millis, reader._export_timeout_millis)
        found["temporality"] = sorted({t.name for t in reader._instrument_class_temporality.values()})
        found["histogram"] = sorted(type(a).__name__ for k, a in reader._instrument_class_aggregation.items()
                                    if k.__name__ == "_Histogram")
        found.update(_exporter_facts("metric", reader._exporter))
    return found


def our_warnings(caplog, variable=None):
    messages = [r.getMessage() for r in caplog.records if r.name == "otel_hicache"]
    named = re.compile(rf"(?<![A-Z_]){variable or 'OTEL_[A-Z_]+'}=")
    return [m for m in messages if m.startswith("otel-hicache: ") and named.search(m)]


def reports_through(conf):
    """A TransferTelemetry on the configured providers: its op reaches the configured
    span processor and metric reader (their exporters' export() captured, no network)."""
    spans, metrics = [], []
    for processor in processors(conf):
        processor.span_exporter.export = lambda batch, **_: spans.extend(batch) or SpanExportResult.SUCCESS
    for reader in conf.metric_readers:
        reader._exporter.export = lambda data, *_, **__: metrics.append(data) or MetricExportResult.SUCCESS
    tel = otel_hicache.TransferTelemetry(attributes={"tp_rank": 0})
    try:
        assert tel.submit("offload", {"kv": 64}, 10, page_size=64, expect_ack=False, host_start_ns=0,
                          host_end_ns=5_000)
        assert tel.force_flush(5)
    finally:
        tel.shutdown()
    names = {m.name for data in metrics for rm in data.resource_metrics for sm in rm.scope_metrics
             for m in sm.metrics}
    return [s.name for s in spans], names


# -- the matrix ------------------------------------------------------------------------------------

GRPC_DEFAULT = {"span.endpoint": "localhost:4317", "metric.endpoint": "localhost:4317"}
HTTP_DEFAULT = {"span.endpoint": "http://localhost:4318/v1/traces",
                "metric.endpoint": "http://localhost:4318/v1/metrics"}
SDK = None  # the SDK reads the value itself: it takes it, or logs a line of its own and uses its default

BAD = [
    # (variable, bad value, other variables, expected facts, text of otel-hicache's one warning, or SDK)
    # endpoints: taken as they are; every export then fails, counted in otel.sdk.exporter.span.exported{error.type}
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "not a url", {}, {"span.endpoint": "not a url"}, SDK),
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "localhost:4318", HTTP, {"span.endpoint": "localhost:4318/v1/traces"}, SDK),
    # timeouts (seconds, as the Python exporters read them)
    ("OTEL_EXPORTER_OTLP_TIMEOUT", "abc", {}, {"span.timeout": 10.0, "metric.timeout": 10.0}, "using 10 instead"),
    ("OTEL_EXPORTER_OTLP_TIMEOUT", "-5", {}, {"span.timeout": 10.0, "metric.timeout": 10.0}, "is not a number > 0"),
    ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "0", HTTP, {"span.timeout": 10.0}, "is not a number > 0"),
    ("OTEL_EXPORTER_OTLP_TIMEOUT", "abc", HTTP, {"span.timeout": 10.0, "metric.timeout": 10.0}, "using 10 instead"),
    ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "soon", HTTP, {"span.timeout": 10.0},
     "using OTEL_EXPORTER_OTLP_TIMEOUT, else 10"),
    # the gRPC exporters float() their per-signal timeout whatever timeout= says: that exporter is left out
    ("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "nan?", {}, {"span_exporters": 1, "metric_readers": 0}, "left out"),
    # headers: malformed entries are dropped, with one warning naming their places (never their text)
    ("OTEL_EXPORTER_OTLP_HEADERS", "a=1,secret-token,b=2", {},
     {"span.headers": {"a": "1", "b": "2"}, "metric.headers": {"a": "1", "b": "2"}}, SDK),
    # compression
    ("OTEL_EXPORTER_OTLP_COMPRESSION", "brotli", {}, {"span.compression": "none", "metric.compression": "none"},
     "using none instead"),
    ("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "zstd", {"OTEL_EXPORTER_OTLP_COMPRESSION": "gzip"},  # as if unset
     {"span.compression": "gzip", "metric.compression": "gzip"}, "using OTEL_EXPORTER_OTLP_COMPRESSION, else none"),
    ("OTEL_EXPORTER_OTLP_COMPRESSION", "br", HTTP, {"span.compression": "none", "metric.compression": "none"},
     "using none instead"),
    # CA certificate: no safe default over TLS (not exported); unused over plain text
    ("OTEL_EXPORTER_OTLP_CERTIFICATE", "/nonexistent/ca.pem", {"OTEL_EXPORTER_OTLP_ENDPOINT": "https://h:4317"},
     {"span_exporters": 0, "metric_readers": 0}, "not exported"),
    ("OTEL_EXPORTER_OTLP_CERTIFICATE", "/nonexistent/ca.pem", {**HTTP, "OTEL_EXPORTER_OTLP_ENDPOINT": "https://h:4318"},
     {"span_exporters": 0, "metric_readers": 0}, "not exported"),
    ("OTEL_EXPORTER_OTLP_METRICS_CERTIFICATE", "/nonexistent/ca.pem", {"OTEL_EXPORTER_OTLP_ENDPOINT": "https://h:4317"},
     {"span_exporters": 1, "metric_readers": 0}, "not exported"),
    # metric reader
    ("OTEL_METRIC_EXPORT_INTERVAL", "abc", {}, {"reader": (60000.0, 30000.0)}, "using 60000 instead"),
    ("OTEL_METRIC_EXPORT_INTERVAL", "0", {}, {"reader": (60000.0, 30000.0)}, "using 60000 instead"),
    ("OTEL_METRIC_EXPORT_INTERVAL", "-1", {}, {"reader": (60000.0, 30000.0)}, "using 60000 instead"),
    ("OTEL_METRIC_EXPORT_INTERVAL", "inf", {}, {"reader": (60000.0, 30000.0)}, "is not a number > 0"),
    ("OTEL_METRIC_EXPORT_TIMEOUT", "-1", {}, {"reader": (60000.0, 30000.0)}, "using 30000 instead"),
    ("OTEL_BSP_EXPORT_TIMEOUT", "-1", {}, {"bsp": (2048, 5000, 512, 30000)}, "using 30000 instead"),
    # batch span processor
    ("OTEL_BSP_SCHEDULE_DELAY", "0", {}, {"bsp": (2048, 5000, 512, 30000)}, "using 5000 instead"),
    ("OTEL_BSP_SCHEDULE_DELAY", "5000.5", {}, {"bsp": (2048, 5000, 512, 30000)}, "using 5000 instead"),
    ("OTEL_BSP_MAX_QUEUE_SIZE", "-5", {}, {"bsp": (2048, 5000, 512, 30000)}, "using 2048 instead"),
    ("OTEL_BSP_MAX_QUEUE_SIZE", "lots", {}, {"bsp": (2048, 5000, 512, 30000)}, "using 2048 instead"),
    ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "0", {}, {"bsp": (2048, 5000, 512, 30000)}, "using 512, or the queue size"),
    ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "4096", {}, {"bsp": (2048, 5000, 512, 30000)}, "using 512, or the queue size"),
    ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "x", {"OTEL_BSP_MAX_QUEUE_SIZE": "100"}, {"bsp": (100, 5000, 100, 30000)},
     "using 512, or the queue size"),
    # sampler: the SDK logs and uses parentbased_always_on / a rate of 1.0
    ("OTEL_TRACES_SAMPLER", "sometimes", {}, {"sampler": PARENT_ON}, SDK),
    ("OTEL_TRACES_SAMPLER", " always_off ", {}, {"sampler": PARENT_ON}, SDK),  # the SDK does not strip it
    ("OTEL_TRACES_SAMPLER_ARG", "1.5", {"OTEL_TRACES_SAMPLER": "traceidratio"},
     {"sampler": "TraceIdRatioBased{1.0}"}, SDK),
    # resource
    ("OTEL_RESOURCE_ATTRIBUTES", "k=v,,x", {}, {"resource": {"k": "v", "service.name": EXECUTABLE_SERVICE}}, SDK),
    # exporters and protocol
    ("OTEL_EXPORTER_OTLP_PROTOCOL", "carrier-pigeon", {}, {"span.module": "grpc", "metric.module": "grpc"},
     "ignoring it"),
    ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json", HTTP, {"span.module": "http", "metric.module": "http"},
     "ignoring it"),
    ("OTEL_TRACES_EXPORTER", "zipkin,otlp", {}, {"span_exporters": 1, "span.module": "grpc"}, "skipping it"),
    ("OTEL_METRICS_EXPORTER", "carrier_pigeon", {}, {"metric_readers": 0}, "skipping it"),
    # metric preferences (the SDK logs and uses its defaults), exemplars
    ("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", "sometimes", {}, {"temporality": ["CUMULATIVE"]}, SDK),
    ("OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION", "buckets", {},
     {"histogram": ["ExplicitBucketHistogramAggregation"]}, SDK),
    ("OTEL_METRICS_EXEMPLAR_FILTER", "sometimes", {}, {"exemplar_filter": "TraceBasedExemplarFilter"},
     "using trace_based instead"),
    # OTEL_SDK_DISABLED: only true disables
    ("OTEL_SDK_DISABLED", "maybe", {}, {"disabled": False, "span_exporters": 1}, "false"),
    # span limits (the SDK raises from TracerProvider())
    ("OTEL_ATTRIBUTE_COUNT_LIMIT", "lots", {}, {"limits": (128, 128, 128, None)}, "using 128 instead"),
    ("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "-1", {"OTEL_ATTRIBUTE_COUNT_LIMIT": "64"},
     {"limits": (64, 64, 128, None)}, "using OTEL_ATTRIBUTE_COUNT_LIMIT, else 128"),
    ("OTEL_SPAN_EVENT_COUNT_LIMIT", "-1", {}, {"limits": (128, 128, 128, None)}, "using 128 instead"),
    ("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "x", {}, {"limits": (128, 128, 128, None)}, "using no limit"),
]


def _ids(case):
    variable, value, others, _, _ = case
    protocol = "-http" if others.get("OTEL_EXPORTER_OTLP_PROTOCOL") else ""
    return f"{variable}={value}{protocol}"


def _setenv(monkeypatch, tmp_path, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value.replace("{tmp}", str(tmp_path)))


def _matches(found, expected):
    for key, value in expected.items():
        if key == "sampler":
            assert found[key].startswith(value), (key, found[key])
        elif key == "resource":
            resource = {k: v for k, v in found[key].items() if not k.startswith(("telemetry.", "service.instance"))}
            assert resource == value, resource
        else:
            assert found[key] == value, (key, found[key], value)


@pytest.mark.parametrize("case", BAD, ids=[_ids(c) for c in BAD])
def test_a_malformed_value_never_raises_and_is_warned_about_once(monkeypatch, tmp_path, warnings_log, case):
    """configure() does not raise; a malformed value of a checked variable gets one WARNING naming
    the variable and what is used instead; one the SDK handles itself gets the SDK's own handling."""
    variable, value, others, expected, using = case
    _setenv(monkeypatch, tmp_path, {**others, variable: value})

    conf = otel_hicache.configure()  # must not raise

    warned = our_warnings(warnings_log, variable)
    if using is SDK:
        assert warned == [], warned
    else:
        assert len(warned) == 1, [r.getMessage() for r in warnings_log.records]
        assert repr(value.replace("{tmp}", str(tmp_path))) in warned[0] and using in warned[0], warned[0]
    _matches(facts(conf), expected)

    span_names, metric_names = reports_through(conf)
    if facts(conf)["span_exporters"]:
        assert "hicache.offload" in span_names
    if facts(conf)["metric_readers"]:
        assert "hicache.transfer.duration" in metric_names
    assert len(our_warnings(warnings_log, variable)) == len(warned)  # once, however often it is read
    assert os.environ[variable] == value.replace("{tmp}", str(tmp_path))  # never modified


VALID = [
    # (variables, expected facts): no warning
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "localhost:4317"}, {"span.endpoint": "localhost:4317"}),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4317"}, {"span.endpoint": "collector:4317"}),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://[::1]:4317"}, {"span.endpoint": "[::1]:4317"}),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "unix:///tmp/otel.sock"}, {"span.endpoint": "unix:///tmp/otel.sock"}),
    ({**HTTP, "OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4318/"},
     {"span.endpoint": "https://collector:4318/v1/traces"}),
    ({**HTTP, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/custom/traces"},
     {"span.endpoint": "http://collector:4318/custom/traces", "metric.endpoint": "http://localhost:4318/v1/metrics"}),
    ({"OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20abc,x-tenant=a"},
     {"span.headers": {"authorization": "Bearer abc", "x-tenant": "a"}}),
    ({**HTTP, "OTEL_EXPORTER_OTLP_HEADERS": "api-key=a b, x-tenant = t "},
     {"span.headers": {"api-key": "a b", "x-tenant": "t"}}),
    ({"OTEL_EXPORTER_OTLP_COMPRESSION": "none"}, {"span.compression": "none"}),  # the bare gRPC exporter raises
    ({"OTEL_EXPORTER_OTLP_COMPRESSION": "GZIP"}, {"span.compression": "gzip", "metric.compression": "gzip"}),
    ({**HTTP, "OTEL_EXPORTER_OTLP_METRICS_COMPRESSION": "deflate"}, {"metric.compression": "deflate"}),
    ({"OTEL_EXPORTER_OTLP_TIMEOUT": "2.5"}, {"span.timeout": 2.5, "metric.timeout": 2.5}),
    ({"OTEL_EXPORTER_OTLP_CERTIFICATE": "{tmp}/ca.pem", "OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4317"},
     {"span_exporters": 1, "metric_readers": 1}),
    ({**HTTP, "OTEL_EXPORTER_OTLP_CERTIFICATE": "{tmp}", "OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4318"},
     {"span_exporters": 1, "metric_readers": 1}),  # a directory of CA certificates, for requests
    ({"OTEL_METRIC_EXPORT_INTERVAL": "1500", "OTEL_METRIC_EXPORT_TIMEOUT": "2500.5"}, {"reader": (1500.0, 2500.5)}),
    ({"OTEL_BSP_MAX_QUEUE_SIZE": "100"}, {"bsp": (100, 5000, 100, 30000)}),  # the bare SDK raises (512 > 100)
    ({"OTEL_BSP_SCHEDULE_DELAY": "250", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "64"}, {"bsp": (2048, 250, 64, 30000)}),
    ({"OTEL_TRACES_SAMPLER": "TraceIdRatio", "OTEL_TRACES_SAMPLER_ARG": "0.5"},
     {"sampler": "TraceIdRatioBased{0.5}"}),
    ({"OTEL_TRACES_SAMPLER": "traceidratio"}, {"sampler": "TraceIdRatioBased{1.0}"}),  # no argument: 1.0
    ({"OTEL_TRACES_SAMPLER": "always_on", "OTEL_TRACES_SAMPLER_ARG": "not read"}, {"sampler": "AlwaysOnSampler"}),
    ({"OTEL_RESOURCE_ATTRIBUTES": "a=b,c=d%2Ce", "OTEL_SERVICE_NAME": "svc"},
     {"resource": {"a": "b", "c": "d,e", "service.name": "svc"}}),
    ({"OTEL_SERVICE_NAME": ""}, {"resource": {"service.name": EXECUTABLE_SERVICE}}),  # empty means unset
    ({"OTEL_SERVICE_NAME": "   "}, {"resource": {"service.name": EXECUTABLE_SERVICE}}),  # (the SDK takes it)
    ({"OTEL_SERVICE_NAME": " ", "OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attributes"},
     {"resource": {"service.name": "from-attributes"}}),
    ({"OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE": "Delta"}, {"temporality": ["CUMULATIVE", "DELTA"]}),
    ({"OTEL_METRICS_EXEMPLAR_FILTER": "ALWAYS_OFF"}, {"exemplar_filter": "AlwaysOffExemplarFilter"}),
    ({"OTEL_SDK_DISABLED": "FALSE"}, {"disabled": False}),
    ({"OTEL_SDK_DISABLED": "true"}, {"disabled": True, "tracer_provider": "NoOpTracerProvider"}),
    ({"OTEL_ATTRIBUTE_COUNT_LIMIT": "0", "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": "256"}, {"limits": (0, 0, 128, 256)}),
]


@pytest.mark.parametrize("env, expected", VALID, ids=[",".join(f"{k}={v}" for k, v in e.items()) for e, _ in VALID])
def test_valid_values_do_not_warn(monkeypatch, tmp_path, warnings_log, env, expected):
    (tmp_path / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n")
    _setenv(monkeypatch, tmp_path, env)
    conf = otel_hicache.configure()
    assert our_warnings(warnings_log) == []
    _matches(facts(conf), expected)


def test_the_variables_table_is_the_documented_one():
    """docs/configuration.md "Malformed values" says what the tables of otel_environment say."""
    with open(os.path.join(ROOT, "docs", "configuration.md"), encoding="utf-8") as file:
        section = file.read().split("## Malformed values", 1)[1].split("\n## ", 1)[0]
    rows = [[cell.strip() for cell in line.strip().strip("|").split(" | ")]
            for line in section.splitlines() if line.startswith("| `OTEL_")]
    oe = otel_environment
    tables = (oe.SPAN_LIMITS, oe.BATCH_SPAN_PROCESSOR, oe.METRIC_READER, oe.METER_PROVIDER,
              *(oe.otlp_exporter("traces", protocol) for protocol in ("grpc", "http/protobuf")))
    replaced = {name.replace("_OTLP_", "_OTLP_{,TRACES_,METRICS_}"): table[name][3]
               for table in tables for name in table if "_TRACES_" not in name}
    documented = {row[0].strip("`"): row[1] for row in rows}
    endpoints = documented.pop("OTEL_EXPORTER_OTLP_{,TRACES_,METRICS_}ENDPOINT")
    assert "http://localhost:4317" in endpoints and "http://localhost:4318/v1/<signal>" in endpoints
    replaced.pop("OTEL_EXPORTER_OTLP_{,TRACES_,METRICS_}ENDPOINT")
    assert documented == replaced
    assert all(len(row) == 3 and row[2] for row in rows)  # and what the bare SDK did


ALL_BAD = {
    "OTEL_SDK_DISABLED": "maybe",
    "OTEL_SERVICE_NAME": "  ",
    "OTEL_RESOURCE_ATTRIBUTES": "k=v,,x",
    "OTEL_TRACES_EXPORTER": "zipkin,otlp",
    "OTEL_METRICS_EXPORTER": "otlp,carrier_pigeon",
    "OTEL_EXPORTER_OTLP_PROTOCOL": "carrier-pigeon",
    "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/json",
    "OTEL_EXPORTER_OTLP_ENDPOINT": "not a url",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://:abc",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "ftp://collector:4317",
    "OTEL_EXPORTER_OTLP_TIMEOUT": "abc",
    "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "-1",
    "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT": "nan",
    "OTEL_EXPORTER_OTLP_HEADERS": "a=1,secret-token",
    "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "=x",
    "OTEL_EXPORTER_OTLP_COMPRESSION": "brotli",
    "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": "deflate",
    "OTEL_EXPORTER_OTLP_METRICS_COMPRESSION": "zstd",
    "OTEL_EXPORTER_OTLP_CERTIFICATE": "/nonexistent/ca.pem",
    "OTEL_EXPORTER_OTLP_METRICS_CERTIFICATE": "{tmp}",
    "OTEL_TRACES_SAMPLER": "sometimes",
    "OTEL_METRIC_EXPORT_INTERVAL": "0",
    "OTEL_METRIC_EXPORT_TIMEOUT": "-1",
    "OTEL_BSP_SCHEDULE_DELAY": "soon",
    "OTEL_BSP_EXPORT_TIMEOUT": "-1",
    "OTEL_BSP_MAX_QUEUE_SIZE": "-5",
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "0",
    "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE": "sometimes",
    "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION": "buckets",
    "OTEL_METRICS_EXEMPLAR_FILTER": "sometimes",
    "OTEL_ATTRIBUTE_COUNT_LIMIT": "lots",
    "OTEL_SPAN_EVENT_COUNT_LIMIT": "-1",
    "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": "x",
}


OURS = {  # what otel-hicache warns about in that host: one line each
    "OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER",
    "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "OTEL_EXPORTER_OTLP_TIMEOUT",
    "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_COMPRESSION", "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION",
    "OTEL_EXPORTER_OTLP_METRICS_CERTIFICATE", "OTEL_BSP_SCHEDULE_DELAY", "OTEL_BSP_EXPORT_TIMEOUT",
    "OTEL_BSP_MAX_QUEUE_SIZE", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "OTEL_METRICS_EXEMPLAR_FILTER",
    "OTEL_ATTRIBUTE_COUNT_LIMIT", "OTEL_SPAN_EVENT_COUNT_LIMIT", "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT",
}


def test_a_host_with_every_bad_value_at_once_starts_runs_and_exits(tmp_path):
    script = tmp_path / "host.py"
    script.write_text(textwrap.dedent(
        """
        import otel_hicache
        conf = otel_hicache.configure()
        tel = otel_hicache.TransferTelemetry(attributes={"tp_rank": 0})
        for i in range(20):
            tel.submit("offload" if i % 2 else "onboard", {"kv": 64}, 4096, page_size=64, expect_ack=False,
                       host_start_ns=0, host_end_ns=1_000 + i)
        print("ops", len(conf.metric_readers), flush=True)
        """
    ))
    env = {name: value.replace("{tmp}", str(tmp_path)) for name, value in ALL_BAD.items()}
    # with a sampler that is not a ratio sampler, OTEL_TRACES_SAMPLER_ARG is not read: no warning
    env.update(OTEL_TRACES_SAMPLER_ARG="half", OTEL_HICACHE_SHUTDOWN_TIMEOUT_S="0.5", PATH=os.environ.get("PATH", ""),
               PYTHONPATH=ROOT)
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    # the metrics' CA certificate (a directory) cannot be read, and ftp:// is not plain http: not exported
    assert done.stdout.strip() == "ops 0", done.stdout
    assert elapsed < 10, (elapsed, done.stderr)
    for variable in ALL_BAD:  # the SDK handles the others itself (its own log lines)
        lines = [line for line in done.stderr.splitlines() if line.startswith(f"otel-hicache: {variable}=")]
        assert len(lines) == (variable in OURS), (variable, lines, done.stderr)
    assert not re.search(r"^otel-hicache: OTEL_TRACES_SAMPLER_ARG=", done.stderr, re.M)
    assert "secret-token" not in "\n".join(l for l in done.stderr.splitlines() if l.startswith("otel-hicache:"))
