"""docs/reference.md and docs/configuration.md agree with the code.

Names come from :mod:`otel_hicache.semconv`. Instrument kinds and the
attributes on each metric point come from a real run on a simulated device.
Prometheus series names are derived from name, unit and kind using the
OTLP->Prometheus translation rules and must be the ones the reference lists.
The SDK's own self-metrics (``otel.sdk.*``), which report delivery, are not
otel-hicache's (not in semconv): the reference documents those a real
``configure()`` run makes the SDK emit, from that run.
"""

from __future__ import annotations

import itertools
import re
import time
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics.export import Gauge, Histogram, InMemoryMetricReader, Sum

from otel_hicache import configuration, environment_variables
from otel_hicache import semconv as sc
DOCS = Path(__file__).resolve().parents[1] / "docs"
STATIC = {"tp_rank": 0}


@pytest.fixture(scope="module")
def reference() -> str:
    return (DOCS / "reference.md").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def config_doc() -> str:
    return (DOCS / "configuration.md").read_text(encoding="utf-8")


# -- names from semconv ------------------------------------------------------


def semconv_metrics() -> dict[str, tuple[str, str, str]]:
    """Every (name, unit, description) tuple semconv defines, by constant name."""
    found = {}
    for const, value in vars(sc).items():
        if (
            const.isupper()
            and isinstance(value, tuple)
            and len(value) == 3
            and all(isinstance(v, str) for v in value)
            and "." in value[0]  # a metric name, not a tuple of values such as DROP_REASONS
        ):
            found[const] = value
    return found


_NOT_ATTRIBUTES = ("SCOPE_NAME", "SPAN_", "EVENT_", "DROP_", "FAIL_")


def semconv_attributes() -> dict[str, str]:
    """Every attribute-name constant (span attributes plus metric-only ``hicache.pool``/``reason``)."""
    return {
        const: value
        for const, value in vars(sc).items()
        if const.isupper() and isinstance(value, str) and not const.startswith(_NOT_ATTRIBUTES)
    }


def test_semconv_is_what_this_test_expects():
    metrics = semconv_metrics()
    assert {"TRANSFER_DURATION", "TRANSFER_BYTES", "RECORDS_DROPPED", "RECORDS_FAILED", "QUEUE_SIZE"} <= set(metrics)
    assert len(metrics) == 21
    assert not any(spec[0].startswith("otel.sdk.") for spec in metrics.values())  # the SDK's, not ours
    attrs = semconv_attributes()
    assert attrs["DIRECTION"] == "hicache.direction" and attrs["ERROR_TYPE"] == "error.type"
    assert "SPAN_OFFLOAD" not in attrs and "DROP_QUEUE_FULL" not in attrs


# -- OTLP -> Prometheus translation -----------------------------------------

_UNIT_WORDS = {"s": "seconds", "ms": "milliseconds", "us": "microseconds", "ns": "nanoseconds", "By": "bytes"}
_PER_UNIT_WORDS = {"s": "second", "m": "minute", "h": "hour"}


def prometheus_base_name(name: str, unit: str) -> str:
    """Dots to underscores, then the unit suffix unless the name already ends with it."""
    base = re.sub(r"[^A-Za-z0-9_:]", "_", name)
    unit = re.sub(r"\{[^}]*\}", "", unit).strip()
    words = []
    if unit:
        main, _, per = unit.partition("/")
        if main:
            words.append(_UNIT_WORDS.get(main, main))
        if per:
            words.append("per_" + _PER_UNIT_WORDS.get(per, per))
    suffix = "_".join(words)
    if suffix and not base.endswith("_" + suffix):
        base = f"{base}_{suffix}"
    return base


def prometheus_series(name: str, unit: str, kind: str) -> list[str]:
    """Series names for an instrument kind: counter, updowncounter, gauge, histogram."""
    base = prometheus_base_name(name, unit)
    if kind in ("counter", "observable_counter"):
        return [base if base.endswith("_total") else base + "_total"]
    if kind == "histogram":
        return [base + "_bucket", base + "_sum", base + "_count"]
    if kind in ("updowncounter", "observable_updowncounter", "gauge"):
        return [base]
    raise ValueError(kind)


def prometheus_label(attribute: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", attribute)


@pytest.mark.parametrize(
    "name, unit, kind, expected",
    [
        ("hicache.transfer.bytes", "By", "counter", ["hicache_transfer_bytes_total"]),
        ("hicache.transfer.busy_time", "s", "counter", ["hicache_transfer_busy_time_seconds_total"]),
        ("hicache.transfer.blocks", "{block}", "counter", ["hicache_transfer_blocks_total"]),
        ("hicache.transfer.inflight", "{transfer}", "updowncounter", ["hicache_transfer_inflight"]),
        ("x.y", "By/s", "histogram", ["x_y_bytes_per_second_bucket", "x_y_bytes_per_second_sum",
                                      "x_y_bytes_per_second_count"]),
        ("http.server.request.duration", "s", "histogram", ["http_server_request_duration_seconds_bucket",
                                                            "http_server_request_duration_seconds_sum",
                                                            "http_server_request_duration_seconds_count"]),
    ],
)
def test_translation_rules(name, unit, kind, expected):
    assert prometheus_series(name, unit, kind) == expected


def test_label_translation():
    assert prometheus_label("hicache.direction") == "hicache_direction"
    assert prometheus_label("tp_rank") == "tp_rank"


# -- what the code actually emits -------------------------------------------


@pytest.fixture
def emitted(harness, monkeypatch) -> dict[str, Any]:
    """One acked device-timed op per direction; metric kinds, point attributes and span attributes."""
    h = harness(attributes=dict(STATIC))
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    h.tracer_provider.add_span_processor(BatchSpanProcessor(InMemorySpanExporter()))
    # what only a telemetry process reports (otel_hicache.export.cpu_time): its metrics, on a provider
    # of its own (a second registration of each instrument on the harness's would be dropped)
    from opentelemetry.sdk.metrics import MeterProvider
    from otel_hicache.sinks.metrics import TransferMetrics
    process_reader = InMemoryMetricReader()
    process_provider = MeterProvider(metric_readers=[process_reader], shutdown_on_exit=False)
    TransferMetrics(process_provider, STATIC, time.time_ns, "unknown", "telemetry_process")
    monkeypatch.setenv("OTEL_HICACHE_HOST_RESIDENCE", "true")
    pool = h.tel.host_pool(1024, 64)  # the load-back reads what the offload wrote, and a page it did not
    for direction, slots in (("offload", range(128)), ("onboard", range(192))):
        ev0, ev1 = h.device.copy(h.device.time_ns() + 100_000, 1.0)
        handle = h.tel.submit(direction, {"kv": 128, "draft_kv": 128}, 1 << 24, page_size=64, start_event=ev0,
                              finish_event=ev1, io_backend="kernel",
                              cause="write_through" if direction == "offload" else "prefix_hit",
                              host_slots=(pool, list(slots)))
        h.device.advance(ms=2)
        assert h.flush()
        h.device.advance(ms=1)
        h.tel.ack(handle)
        assert h.flush()
    spans = h.finished()
    assert len(spans) == 2
    metrics: dict[str, dict[str, Any]] = {}
    data = h.reader.get_metrics_data()
    process_only = [rm for rm in process_reader.get_metrics_data().resource_metrics
                    for sm in rm.scope_metrics for m in sm.metrics if m.name == sc.EXPORT_CPU_TIME[0]]
    process_provider.shutdown()
    for rm in [*data.resource_metrics, *process_only]:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if isinstance(metric.data, Histogram):
                    kind = "histogram"
                elif isinstance(metric.data, Sum):
                    # (every otel-hicache counter is observable: totals reported at collection)
                    kind = "observable_counter" if metric.data.is_monotonic else "observable_updowncounter"
                elif isinstance(metric.data, Gauge):
                    kind = "gauge"
                else:
                    raise AssertionError(f"{metric.name}: unexpected data {type(metric.data).__name__}")
                keys = set()
                for point in metric.data.data_points:
                    assert dict(point.attributes).items() >= STATIC.items(), metric.name
                    keys |= set(point.attributes)
                metrics[metric.name] = {"kind": kind, "unit": metric.unit, "attributes": keys - set(STATIC)}
    span_attributes = set().union(*(set(s.attributes) for s in spans)) - set(STATIC)
    return {"metrics": metrics, "span_attributes": span_attributes}


_KIND_WORD = {"observable_counter": "ObservableCounter", "observable_updowncounter": "ObservableUpDownCounter",
              "gauge": "ObservableGauge",
              "histogram": "Histogram"}


def _section(doc: str, heading: str) -> str:
    """The text under ``heading`` up to the next heading of level 2 or 3."""
    lines = doc.splitlines()
    assert heading in lines, f"no heading {heading!r} in the reference"
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith(("## ", "### "))), len(lines))
    return "\n".join(lines[start:end])


def _row(section: str, field: str) -> str:
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0] == field:
            return cells[1]
    raise AssertionError(f"no '{field}' row")


def _ticked(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


def test_every_metric_is_emitted_and_documented(emitted, reference):
    names = {spec[0] for spec in semconv_metrics().values()}
    assert names == set(emitted["metrics"]), "semconv and the emitted metrics differ"
    for name in names:
        assert f"### `{name}`" in reference.splitlines(), name


@pytest.mark.parametrize("const", sorted(semconv_metrics()))
def test_metric_section_matches_the_code(const, emitted, reference):
    name, unit, description = getattr(sc, const)
    actual = emitted["metrics"][name]
    assert actual["unit"] == unit
    section = _section(reference, f"### `{name}`")

    assert _ticked(_row(section, "Unit")) == [unit]
    assert _row(section, "Instrument") == _KIND_WORD[actual["kind"]]

    attributes_cell = _row(section, "Attributes")
    assert "the static attributes" in attributes_cell
    assert set(_ticked(attributes_cell)) == actual["attributes"], name

    expected_series = prometheus_series(name, unit, actual["kind"])
    assert set(_ticked(_row(section, "Prometheus"))) == set(expected_series), name

    labels = set(_ticked(_row(section, "Labels"))) - set(STATIC)  # static ones may be named as examples
    assert {prometheus_label(a) for a in actual["attributes"]} == labels, name

    promql = re.findall(r"```promql\n(.*?)```", section, flags=re.S)
    assert promql, f"{name}: no PromQL example"
    base = prometheus_base_name(name, unit)
    assert any(re.search(rf"\b{re.escape(base)}(_bucket|_sum|_count|_total)?\b", q) for q in promql), name

    summary = [line for line in reference.splitlines() if line.startswith(f"| `{name}` |")]
    assert len(summary) == 1, f"{name}: not exactly one summary-table row"
    assert f"`{expected_series[0]}`" in summary[0]
    assert _KIND_WORD[actual["kind"]] in summary[0] and f"`{unit}`" in summary[0]


# -- the SDK's own self-metrics (delivery) -------------------------------------

DELIVERY = "### Delivery: what the exporters delivered and lost"
_SDK_KIND_WORD = {"counter": "Counter", "updowncounter": "UpDownCounter", "histogram": "Histogram"}


@pytest.fixture
def sdk_emitted(monkeypatch, fresh_configuration) -> dict[str, dict[str, Any]]:
    """The otel.sdk.* metrics a configure() run makes the SDK emit (OTLP/gRPC to a closed port,
    so failed exports carry error.type): kind, unit and the attribute keys seen."""
    import time

    import otel_hicache
    from otlp_receiver import closed_port

    monkeypatch.setenv("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED", "true")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "0.3")
    reader = InMemoryMetricReader()
    conf = configuration.configure(force=True, metric_readers=[reader])
    tel = otel_hicache.TransferTelemetry(attributes=dict(STATIC))
    end = time.time_ns()
    tel.ack(tel.submit("offload", {"kv": 64}, 64 * 4096, page_size=64, host_start_ns=end - 20_000, host_end_ns=end))
    assert tel.force_flush(10.0)
    conf.meter_provider.force_flush()  # one metric export (failing): its data point counts too
    found: dict[str, dict[str, Any]] = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            if sm.scope.name != "opentelemetry-sdk":
                continue
            for metric in sm.metrics:
                data = metric.data
                kind = ("histogram" if isinstance(data, Histogram)
                        else "counter" if data.is_monotonic else "updowncounter")
                keys = set().union(*(set(p.attributes) for p in data.data_points))
                found[metric.name] = {"kind": kind, "unit": metric.unit, "attributes": keys}
    tel.shutdown()
    return found


def _delivery_rows(reference: str) -> dict[str, list[str]]:
    rows = {}
    for line in _section(reference, DELIVERY).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `otel.sdk.") and len(cells) == 6:
            rows[_ticked(cells[0])[0]] = cells
    return rows


def test_sdk_self_metrics_are_documented(sdk_emitted, reference):
    assert {"otel.sdk.exporter.span.exported", "otel.sdk.processor.span.processed",
            "otel.sdk.processor.span.queue.size", "otel.sdk.exporter.metric_data_point.exported"} <= set(sdk_emitted)
    assert "error.type" in sdk_emitted["otel.sdk.exporter.span.exported"]["attributes"]
    rows = _delivery_rows(reference)
    assert set(rows) == set(sdk_emitted), "the delivery table and what the SDK emits differ"
    for name, actual in sdk_emitted.items():
        _, instrument, unit, prometheus, labels, _meaning = rows[name]
        assert instrument == _SDK_KIND_WORD[actual["kind"]], name
        assert _ticked(unit) == [actual["unit"]], name
        kind = "gauge" if actual["kind"] == "updowncounter" else actual["kind"]
        assert _ticked(prometheus)[0] == prometheus_series(name, actual["unit"], kind)[0], name
        assert {prometheus_label(a) for a in actual["attributes"]} <= set(_ticked(labels)), name


def test_delivery_section_says_how_to_enable_and_join(reference):
    section = _section(reference, DELIVERY)
    assert "OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED=true" in section
    assert "tp_rank" in section and "service_instance_id" in section  # no rank labels: the join
    for series in ("otel_sdk_exporter_span_exported_total", "otel_sdk_processor_span_processed_total",
                   "otel_sdk_processor_span_queue_size", "otel_sdk_exporter_metric_data_point_exported_total"):
        assert series in "\n".join(re.findall(r"```promql\n(.*?)```", section, flags=re.S)), series


def test_span_names_events_and_values(reference):
    from otel_hicache.adapters import causes  # the SGLang adapter's, installed beside the core

    for value in (*causes()["offload"], *causes()["onboard"], sc.SPAN_OFFLOAD, sc.SPAN_ONBOARD, sc.EVENT_REQUEST,
                  *sc.DROP_REASONS, *sc.FAIL_REASONS, "INTERNAL", "device_event", "host_clock"):
        assert f"`{value}`" in reference, value
    assert "No token ids, node ids or hashes" in reference


@pytest.mark.parametrize("const", sorted(semconv_attributes()))
def test_attribute_constant_in_reference(const, reference):
    assert f"`{getattr(sc, const)}`" in reference, const


def test_span_attribute_table_covers_what_spans_carry(emitted, reference):
    table = _section(reference, "### Span attributes")
    documented = {cells[0] for cells in (_ticked(line)[:1] for line in table.splitlines()
                                         if line.startswith("| `")) if cells}
    assert emitted["span_attributes"] <= documented, emitted["span_attributes"] - documented
    assert sc.ERROR_TYPE in documented and sc.ACKED in documented


def test_bandwidth_section_gives_the_right_and_wrong_queries(reference):
    section = _section(reference, "## 3. Reading bandwidth correctly")
    by = "sum by (hicache_direction, tp_rank)"
    bytes_total = prometheus_series(*sc.TRANSFER_BYTES[:2], "counter")[0]
    busy_total = prometheus_series(*sc.TRANSFER_BUSY_TIME[:2], "counter")[0]
    duration_sum = prometheus_series(*sc.TRANSFER_DURATION[:2], "histogram")[1]
    bandwidth_bucket = prometheus_series(*sc.TRANSFER_BANDWIDTH[:2], "histogram")[0]
    assert f"{by} (rate({bytes_total}[1m]))" in section
    assert f"{by} (rate({busy_total}[1m]))" in section
    assert f"{by} (rate({duration_sum}[1m]))" in section
    assert bandwidth_bucket in section
    assert "concurrency factor" in section


def _bucket_line(doc: str, label: str) -> list[float]:
    match = re.search(rf"^{re.escape(label)} \([^)]*\): (.+)$", doc, flags=re.M)
    assert match, f"no {label} line"
    return [float(v) for v in match.group(1).split(",")]


def test_histogram_buckets_are_exact(reference):
    assert _bucket_line(reference, "DURATION_BUCKETS_S") == list(sc.DURATION_BUCKETS_S)
    assert _bucket_line(reference, "BANDWIDTH_BUCKETS") == list(sc.BANDWIDTH_BUCKETS)
    assert "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION=base2_exponential_bucket_histogram" in reference


# -- configuration.md --------------------------------------------------------


def _format_default(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def test_every_hicache_variable_has_a_default():
    constants = {v for k, v in vars(environment_variables).items() if k.startswith("OTEL_HICACHE_")}
    assert constants == set(environment_variables.DEFAULTS)


@pytest.mark.parametrize("variable", sorted(environment_variables.DEFAULTS))
def test_hicache_variable_documented_with_its_default(variable, config_doc):
    rows = [line for line in config_doc.splitlines() if line.startswith(f"| `{variable}` |")]
    assert len(rows) == 1, f"{variable}: not exactly one table row"
    cells = [c.strip() for c in rows[0].strip().strip("|").split("|")]
    assert cells[1] == f"`{_format_default(environment_variables.DEFAULTS[variable])}`", (variable, cells[1])


def _expand(pattern: str) -> list[str]:
    parts = re.split(r"(\{[^}]*\})", pattern)
    choices = [p[1:-1].split(",") if p.startswith("{") else [p] for p in parts]
    return ["".join(c) for c in itertools.product(*choices)]


def standard_variables() -> set[str]:
    """Every OTEL_* variable configure() reads or checks: the literals of configuration.py,
    otel_environment.py and environment_variables.py, their per-signal templates, the checked
    tables and the certificate and key variables."""
    from otel_hicache.sinks import otel_environment
    found = set()
    from otel_hicache.sinks import providers
    for module in (configuration, providers, otel_environment, environment_variables):
        with open(module.__file__, encoding="utf-8") as file:
            source = file.read()
        found |= set(re.findall(r'"(OTEL_[A-Z0-9_]+)"', source))
        for template in re.findall(r'f"(OTEL_[A-Z0-9_]*\{signal\.upper\(\)\}_[A-Z0-9_]+)"', source):
            found |= {template.replace("{signal.upper()}", signal) for signal in ("TRACES", "METRICS")}
    for table in (otel_environment.SPAN_LIMITS, otel_environment.BATCH_SPAN_PROCESSOR,
                  otel_environment.METRIC_READER, otel_environment.METER_PROVIDER):
        found |= set(table)
    for signal in ("traces", "metrics"):
        found |= set(otel_environment.otlp_exporter(signal, "grpc"))
        found |= set(otel_environment.file_variables(signal))
        for suffix in ("PROTOCOL", "HEADERS"):
            found |= set(otel_environment.signal_variable(signal, suffix))
    return found


def test_standard_variables_documented(config_doc):
    names = standard_variables()
    assert {"OTEL_SDK_DISABLED", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            "OTEL_EXPORTER_OTLP_METRICS_CERTIFICATE", "OTEL_BSP_MAX_QUEUE_SIZE", "OTEL_TRACES_EXPORTER"} <= names
    documented = {name for token in re.findall(r"`(OTEL_[A-Z0-9_{},]+)`", config_doc) for name in _expand(token)}
    missing = sorted(names - documented)
    assert not missing, missing


def test_configuration_semantics_are_covered(config_doc):
    for phrase in ("never replaces the global providers", "Bounded shutdown", "Fork", "Quick start",
                   "configure()", "TransferTelemetry(attributes=", "tel.submit(", "tel.ack(handle)"):
        assert phrase in config_doc, phrase
