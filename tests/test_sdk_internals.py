"""Which path otel-hicache takes on the installed OpenTelemetry SDK.

On an SDK release whose internals :mod:`otel_hicache.sdk_internals` was checked
against, the fast paths are on; on any other (scripts/test-old-sdk.sh runs the
core tests on an older one) the shape check reports the mismatch and the public
API is used. No skips: the expected path is read from the installed version.
"""

from __future__ import annotations

import pathlib
import re

import pytest
from opentelemetry import context as otel_context
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.version import __version__ as SDK_VERSION

from otel_hicache import sdk_internals, telemetry
from otel_hicache.metrics_fast_path import resolver_for
from otel_hicache.spans import ApiSpanBuilder, FastSpanBuilder, make_span_builder

FIRST, LAST = sdk_internals.KNOWN_SDK
KNOWN = FIRST <= tuple(int(p) for p in re.match(r"(\d+)\.(\d+)", SDK_VERSION).groups()) <= LAST


class _Exporter(SpanExporter):
    def export(self, spans):
        return SpanExportResult.SUCCESS


@pytest.fixture
def providers():
    tracer_provider = TracerProvider(shutdown_on_exit=False)
    meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()], shutdown_on_exit=False)
    yield tracer_provider, meter_provider
    tracer_provider.shutdown()
    meter_provider.shutdown()


@pytest.fixture
def unknown_sdk(monkeypatch):
    """The report an SDK release outside the checked range gets (whatever is installed)."""
    monkeypatch.setattr(sdk_internals, "_report", sdk_internals.Report("9.99.0", False, {}))


def test_the_shape_is_checked_once_and_names_the_installed_sdk():
    report = sdk_internals.report()
    assert sdk_internals.report() is report
    assert all(sdk_internals.available(area) is report.available(area) for area in sdk_internals.AREAS)
    assert report.sdk_version == SDK_VERSION
    assert report.known_version is KNOWN
    assert set(report.problems) == set(sdk_internals.AREAS)


def test_the_installed_sdk_takes_the_expected_path(providers, warnings_log):
    tracer_provider, meter_provider = providers
    report = sdk_internals.report()
    builder = make_span_builder(tracer_provider, {}, True)
    resolver = resolver_for(meter_provider, True)
    processor = BatchSpanProcessor(_Exporter())
    try:
        size = sdk_internals.batch_queue_size(processor)
        queued = size() if size is not None else None
    finally:
        processor.shutdown()
    if KNOWN:  # the release checked: every fast path on
        assert all(report.available(area) for area in sdk_internals.AREAS), report.summary()
        assert report.summary() == "all fast paths available"
        assert type(builder) is FastSpanBuilder
        assert resolver is not None
        assert telemetry._get_current_context is not otel_context.get_current  # pylint: disable=protected-access
        assert queued == 0
    else:  # an older (or newer) release: the mismatch reported, the public API used
        assert not any(report.available(area) for area in sdk_internals.AREAS)
        assert f"opentelemetry-sdk {SDK_VERSION} is outside the checked range" in report.summary()
        assert type(builder) is ApiSpanBuilder
        assert resolver is None
        assert telemetry._get_current_context is otel_context.get_current  # pylint: disable=protected-access
        assert size is None
    assert not warnings_log.records


def test_an_unknown_sdk_gets_the_public_api_everywhere(providers, unknown_sdk):
    tracer_provider, meter_provider = providers
    assert "9.99.0 is outside the checked range" in sdk_internals.report().summary()
    assert type(make_span_builder(tracer_provider, {}, True)) is ApiSpanBuilder
    with pytest.raises(TypeError):
        FastSpanBuilder(tracer_provider, {})
    assert resolver_for(meter_provider, True) is None
    assert sdk_internals.context_getter() is None
    assert telemetry._context_getter() is otel_context.get_current  # pylint: disable=protected-access
    assert sdk_internals.tracer_parts(tracer_provider.get_tracer("t")) is None
    assert sdk_internals.meter_parts(meter_provider) is None
    processor = BatchSpanProcessor(_Exporter())
    try:
        assert sdk_internals.batch_queue_size(processor) is None
    finally:
        processor.shutdown()


def test_one_mismatched_area_turns_off_only_its_own_fast_path(providers, monkeypatch):
    tracer_provider, meter_provider = providers
    report = sdk_internals.report()
    problems = {area: () for area in sdk_internals.AREAS}
    monkeypatch.setattr(sdk_internals, "_report", report._replace(
        known_version=True, problems={**problems, "spans": ("Tracer._span_limits",)}))
    assert "spans: Tracer._span_limits" == sdk_internals.report().summary()
    assert type(make_span_builder(tracer_provider, {}, True)) is ApiSpanBuilder
    if KNOWN:
        assert resolver_for(meter_provider, True) is not None


def test_non_sdk_objects_get_none(monkeypatch):
    from opentelemetry.metrics import NoOpMeterProvider
    from opentelemetry.trace import NoOpTracer

    assert sdk_internals.tracer_parts(NoOpTracer()) is None
    assert sdk_internals.meter_parts(NoOpMeterProvider()) is None
    assert sdk_internals.batch_queue_size(object()) is None


@pytest.mark.parametrize("version, known", [
    (f"{FIRST[0]}.{FIRST[1]}.0", True), (f"{LAST[0]}.{LAST[1]}.7", True),
    (f"{LAST[0]}.{LAST[1] + 1}.0", False), (f"{LAST[0]}.{LAST[1] + 1}.0.dev0", False),
    ("1.30.0", False), ("2.0.0", False), ("garbage", False),
])
def test_the_version_range(monkeypatch, version, known):
    import opentelemetry.sdk.version

    monkeypatch.setattr(opentelemetry.sdk.version, "__version__", version)
    monkeypatch.setattr(sdk_internals, "_report", None)
    monkeypatch.setattr(sdk_internals, "_version", None)
    assert sdk_internals.available("context") is (known and not sdk_internals._area("context"))
    assert sdk_internals.report().known_version is known
    assert sdk_internals.report().sdk_version == version


def test_value_checked_writes_on_any_sdk():
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader

    from opentelemetry.sdk.metrics.export import MetricExportResult

    inherited = ConsoleMetricExporter()
    reader = PeriodicExportingMetricReader(inherited, export_interval_millis=60_000)
    try:
        sdk_internals.stop_reader_in_fork_child(reader)
        assert reader._exporter is not inherited  # pylint: disable=protected-access
        assert reader._exporter.export(None) is MetricExportResult.SUCCESS  # pylint: disable=protected-access
        assert reader._shutdown_event.is_set()  # pylint: disable=protected-access
    finally:
        reader.shutdown()
    sdk_internals.stop_reader_in_fork_child(object())  # nothing of the kind: nothing done


def test_the_span_fast_path_takes_the_tracers_own_metrics(monkeypatch):
    """otel.sdk.span.* (OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED=true): the tracer's recorder;
    off, nothing to call per span; an SDK tracer without one: no fast path (tests/test_spans.py
    checks the points are the API path's)."""
    def parts(enabled):
        if enabled:
            monkeypatch.setenv("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED", "true")
        else:
            monkeypatch.delenv("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED", raising=False)
        meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()], shutdown_on_exit=False)
        tracer = TracerProvider(shutdown_on_exit=False, meter_provider=meter_provider).get_tracer("t")
        return tracer, sdk_internals.tracer_parts(tracer)

    if not KNOWN:  # (and older SDKs' TracerProvider takes no meter_provider)
        assert sdk_internals.tracer_parts(TracerProvider(shutdown_on_exit=False).get_tracer("t")) is None
        return
    tracer, off = parts(False)
    assert off.metrics is None
    tracer, on = parts(True)
    assert on.metrics is tracer._tracer_metrics  # pylint: disable=protected-access
    monkeypatch.delattr(tracer, "_tracer_metrics")
    assert sdk_internals.tracer_parts(tracer) is None


def test_no_private_access_outside_sdk_internals():
    package = pathlib.Path(sdk_internals.__file__).parent
    found = [f"{path.name}:{n}" for path in sorted(package.glob("*.py")) if path.name != "sdk_internals.py"
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if "protected-access" in line or re.search(r"opentelemetry[\w.]*\._[a-z]", line)
             or re.search(r"attr\([^,]+, \"_[a-z]", line)]
    assert found == []
