"""What the OpenTelemetry SDK's own self-metrics say its exporters delivered and lost.

Read by the paced workload (``paced_workload.py``) and by ``e2e/test_fleet.py``'s nodes, in
the workload's process, through an in-memory metric reader of its meter provider.
"""

from __future__ import annotations

from typing import Any

# The SDK's own switch (read by each SDK object when it is built): without it the
# otel.sdk.* instruments below do not exist and every count reads 0.
SDK_SELF_METRICS = {"OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED": "true"}

_SPAN_KEYS = ("exported", "export_failed", "queue_full", "after_shutdown", "queued", "in_export")


def sdk_delivery(metrics_data: Any) -> dict[str, Any]:
    """The SDK's self-metrics (scope ``opentelemetry-sdk``) in one collection, summed over
    every span processor and exporter that reports to that meter provider:

    * ``spans``: ``exported`` (``otel.sdk.exporter.span.exported`` without ``error.type``:
      delivered to the next hop), ``export_failed`` (the same with ``error.type``: lost in an
      export that failed after the exporter's retries), ``queue_full`` and ``after_shutdown``
      (``otel.sdk.processor.span.processed{error.type}``: dropped by the batch span processor
      on a full queue, or ended after its shutdown), ``queued``
      (``otel.sdk.processor.span.queue.size``) and ``in_export``
      (``otel.sdk.exporter.span.inflight``: inside an export that has not returned);
    * ``metric_points``: ``exported`` and ``failed`` data points
      (``otel.sdk.exporter.metric_data_point.exported`` without and with ``error.type``);
    * ``components``: the ``otel.component.name`` of each reporting component (empty when
      ``OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED`` was not ``true``).

    Every span the SDK was handed is in exactly one of the ``spans`` counts (the fault tests
    check ``exported + export_failed + queue_full + queued + in_export`` = spans emitted).
    """
    spans = dict.fromkeys(_SPAN_KEYS, 0)
    points = {"exported": 0, "failed": 0}
    components: set[str] = set()
    for resource_metrics in metrics_data.resource_metrics if metrics_data else ():
        for scope_metrics in resource_metrics.scope_metrics:
            if scope_metrics.scope.name != "opentelemetry-sdk":
                continue
            for metric in scope_metrics.metrics:
                for point in metric.data.data_points:
                    attributes = point.attributes or {}
                    error = attributes.get("error.type")
                    if "otel.component.name" in attributes:
                        components.add(str(attributes["otel.component.name"]))
                    value = int(getattr(point, "value", 0))
                    if metric.name == "otel.sdk.exporter.span.exported":
                        spans["export_failed" if error else "exported"] += value
                    elif metric.name == "otel.sdk.exporter.span.inflight":
                        spans["in_export"] += value
                    elif metric.name == "otel.sdk.processor.span.queue.size":
                        spans["queued"] += value
                    elif metric.name == "otel.sdk.processor.span.processed" and error:
                        spans["after_shutdown" if error == "already_shutdown" else "queue_full"] += value
                    elif metric.name == "otel.sdk.exporter.metric_data_point.exported":
                        points["failed" if error else "exported"] += value
    return {"spans": spans, "metric_points": points, "components": sorted(components)}


def read_sdk_delivery(reader: Any, attempts: int = 5) -> dict[str, Any]:
    """:func:`sdk_delivery` of ``reader`` (an ``InMemoryMetricReader`` of the providers'
    meter provider), collected until two collections in a row agree, at most
    ``attempts`` + 1 of them: a collection reads the instruments one after the other while
    the exporter threads move spans on, so one read of a busy pipeline can count a batch
    twice or not at all. ``attempts=0``: a single collection (samples during a run)."""
    last = sdk_delivery(reader.get_metrics_data())
    for _ in range(attempts):
        now = sdk_delivery(reader.get_metrics_data())
        if now == last:
            break
        last = now
    return last
