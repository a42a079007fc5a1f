"""Delivery accounting: every span handed to the SDK is delivered, lost (counted) or still on its way."""

from __future__ import annotations

import threading
import time

from opentelemetry.sdk.metrics import Counter, MeterProvider
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    ConsoleMetricExporter,
    InMemoryMetricReader,
    MetricExportResult,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from otel_hicache import semconv as sc
from otel_hicache.delivery import DeliveryAccount


class ScriptedSpanExporter(SpanExporter):
    """Returns the scripted results in turn (an exception is raised); can hold an export."""

    def __init__(self, *results) -> None:
        self.results = list(results)
        self.release = threading.Event()
        self.release.set()
        self.entered = threading.Event()
        self._endpoint = "http://collector.invalid:4317"

    def export(self, spans):
        self.entered.set()
        self.release.wait(10)
        result = self.results.pop(0) if len(self.results) > 1 else self.results[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def shutdown(self):
        pass


def _spans(n):
    provider = TracerProvider(shutdown_on_exit=False)
    tracer = provider.get_tracer("t")
    out = []
    for i in range(n):
        span = tracer.start_span(f"s{i}")
        span.end()
        out.append(span)
    return out


def test_span_exporter_counts_delivered_and_failed_batches_and_warns_once(warnings_log):
    account = DeliveryAccount()
    inner = ScriptedSpanExporter(SpanExportResult.SUCCESS, SpanExportResult.FAILURE, RuntimeError("boom"),
                                 SpanExportResult.FAILURE)
    exporter = account.span_exporter(inner, "otlp_grpc")
    assert exporter.export(_spans(3)) is SpanExportResult.SUCCESS
    assert exporter.export(_spans(2)) is SpanExportResult.FAILURE
    assert exporter.export(_spans(4)) is SpanExportResult.FAILURE  # raised inside: never propagates
    assert exporter.export(_spans(1)) is SpanExportResult.FAILURE
    counts = account.snapshot()["spans:otlp_grpc"]
    assert counts == {"exported": 3, "export_failed": 7, "queue_full": 0, "in_export": 0, "queued": 0}
    warnings = [r.getMessage() for r in warnings_log.records]
    assert len(warnings) == 1, warnings
    assert "could not export 2 spans to http://collector.invalid:4317" in warnings[0]
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in warnings[0]


def test_batch_processor_queue_full_drops_are_counted_exactly(warnings_log):
    account = DeliveryAccount()
    inner = ScriptedSpanExporter(SpanExportResult.SUCCESS)
    inner.release.clear()  # the first export stalls: a collector that accepts and never answers
    processor = BatchSpanProcessor(account.span_exporter(inner, "otlp_http"), max_queue_size=8,
                                   max_export_batch_size=4, schedule_delay_millis=60_000)
    assert account.watch(processor, "otlp_http")
    spans = _spans(30)
    processor.on_end(spans[0])
    for span in spans[1:4]:
        processor.on_end(span)  # a batch of 4: the worker takes it and stalls in export
    assert inner.entered.wait(5)
    for span in spans[4:]:
        processor.on_end(span)
    counts = account.snapshot()["spans:otlp_http"]
    # 4 inside the stalled export, the queue full at 8, the other 18 dropped
    assert counts == {"exported": 0, "export_failed": 0, "queue_full": 18, "in_export": 4, "queued": 8}
    inner.release.set()
    processor.force_flush()
    counts = account.snapshot()["spans:otlp_http"]
    assert counts["exported"] + counts["queue_full"] == 30
    assert counts["in_export"] == counts["queued"] == 0
    assert sum("span export queue is full" in r.getMessage() for r in warnings_log.records) == 1
    processor.shutdown()


def test_metric_exporter_keeps_the_preferences_and_counts_failed_exports(warnings_log):
    account = DeliveryAccount()

    class Flaky(ConsoleMetricExporter):
        def __init__(self):
            super().__init__(preferred_temporality={Counter: AggregationTemporality.DELTA})
            self._endpoint = "https://collector.invalid:4318/v1/metrics"
            self.results = [MetricExportResult.FAILURE, MetricExportResult.SUCCESS]

        def export(self, metrics_data, timeout_millis=10_000, **kwargs):
            return self.results.pop(0)

    wrapped = account.metric_exporter(Flaky(), "otlp_http")
    assert wrapped._preferred_temporality[Counter] is AggregationTemporality.DELTA
    assert wrapped.export(None) is MetricExportResult.FAILURE
    assert wrapped.export(None) is MetricExportResult.SUCCESS
    assert account.snapshot()["metrics:otlp_http"] == {"exports": 2, "failed": 1}
    warnings = [r.getMessage() for r in warnings_log.records]
    assert len(warnings) == 1 and "https://collector.invalid:4318/v1/metrics" in warnings[0]


def test_bound_self_metrics_have_zero_series_and_the_static_attributes():
    account = DeliveryAccount()
    account.span_exporter(ScriptedSpanExporter(SpanExportResult.FAILURE), "otlp_grpc").export(_spans(5))
    account.metric_exporter(ConsoleMetricExporter(), "otlp_grpc")
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    account.bind(provider, {"tp_rank": 1})
    account.bind(provider, {"tp_rank": 1})  # once per provider: no duplicate instruments
    points = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                for p in metric.data.data_points:
                    points[(metric.name, tuple(sorted(p.attributes.items())))] = p.value
    base = (("exporter", "otlp_grpc"), ("tp_rank", 1))
    assert points == {
        (sc.SPANS_EXPORTED[0], base): 0,
        (sc.SPANS_UNDELIVERED[0], tuple(sorted(base + (("reason", "export_failed"),)))): 5,
        (sc.SPANS_UNDELIVERED[0], tuple(sorted(base + (("reason", "queue_full"),)))): 0,
        (sc.METRIC_EXPORTS_FAILED[0], base): 0,
    }


def test_exit_report_names_what_is_still_on_its_way(warnings_log):
    account = DeliveryAccount()
    inner = ScriptedSpanExporter(SpanExportResult.SUCCESS)
    inner.release.clear()
    exporter = account.span_exporter(inner, "otlp_grpc")
    worker = threading.Thread(target=exporter.export, args=(_spans(6),), daemon=True)
    worker.start()
    assert inner.entered.wait(5)
    assert account.report_undelivered_at_exit() == 6
    assert any("6 spans were still queued or being exported at exit" in r.getMessage()
               for r in warnings_log.records)
    inner.release.set()
    worker.join(5)
    time.sleep(0)
    assert account.report_undelivered_at_exit() == 0
