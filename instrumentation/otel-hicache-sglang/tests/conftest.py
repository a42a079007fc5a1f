"""Fixtures for the SGLang adapter tests: the real SGLang on CPU, in-memory OTel sinks."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_hicache.diagnostics import reset_warnings

# the core's in-process OTLP receiver
CORE_TESTS = Path(__file__).resolve().parents[3] / "tests"
if str(CORE_TESTS) not in sys.path:
    sys.path.append(str(CORE_TESTS))


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith(("OTEL_", "SGLANG_PLUGINS")):
            monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("OTEL_HICACHE_POLL_INTERVAL_MS", "0.5")
    reset_warnings()


@pytest.fixture(scope="session")
def sglang_cpu() -> Any:
    """The CPU support module, installed once (importing SGLang takes a few seconds)."""
    import sglang_cpu as module

    module.install_cpu_support()
    return module


class Instrumented:
    """The adapter instrumented with in-memory providers."""

    def __init__(self) -> None:
        from otel_hicache_sglang import SGLangHiCacheInstrumentor

        self.spans = InMemorySpanExporter()
        self.tracer_provider = TracerProvider(shutdown_on_exit=False)
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader], shutdown_on_exit=False)
        self.instrumentor = SGLangHiCacheInstrumentor()
        self.instrumentor.instrument(tracer_provider=self.tracer_provider, meter_provider=self.meter_provider)

    def finished(self) -> list[Any]:
        telemetry = self.instrumentor.telemetry
        assert telemetry is not None, "no HiCache controller was created: no telemetry"
        assert telemetry.force_flush(10.0)
        # in the order the ops happened: a span ends when its ack is seen, which need not keep that order
        return sorted(self.spans.get_finished_spans(), key=lambda span: span.start_time)

    def metric(self, name: str, **attrs: Any) -> float:
        """Sum of the points of ``name`` whose attributes include ``attrs`` (of a histogram's: their counts),
        once what was counted reached the sinks (cache events travel with the poller's state)."""
        telemetry = self.instrumentor.telemetry
        if telemetry is not None and telemetry.enabled:
            assert telemetry.force_flush(10.0)
        data = self.reader.get_metrics_data()
        total = 0
        for rm in data.resource_metrics if data else ():
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    if metric.name != name:
                        continue
                    for point in metric.data.data_points:
                        if all(point.attributes.get(k) == v for k, v in attrs.items()):
                            total += point.count if hasattr(point, "count") else point.value
        return total

    def close(self) -> None:
        if self.instrumentor.is_instrumented_by_opentelemetry:
            self.instrumentor.uninstrument()
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


@pytest.fixture
def make_instrumented(sglang_cpu: Any) -> Any:
    """Instrument now (after what the test changed in SGLang first); closed at teardown."""
    made: list[Instrumented] = []

    def make() -> Instrumented:
        made.append(Instrumented())
        return made[-1]

    yield make
    for inst in reversed(made):
        inst.close()


@pytest.fixture
def instrumented(make_instrumented: Any) -> Any:
    return make_instrumented()


@pytest.fixture
def warnings_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.WARNING, logger="otel_hicache")
    return caplog
