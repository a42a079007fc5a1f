"""Delivery accounting: what the exporters could not deliver, counted and warned about once.

The spans and metric points otel-hicache produces leave through the SDK's
batch span processor and periodic metric reader, whose exporters fail quietly
(an SDK log line per failure, no count) when the collector is unreachable,
stalls, rejects a certificate or a header. For the exporters
:func:`otel_hicache.configure` builds, :class:`DeliveryAccount` wraps each one
and keeps exact per-process counts, read by observable counters:

* ``otel_hicache.spans.exported{exporter}``: spans an exporter delivered;
* ``otel_hicache.spans.undelivered{exporter, reason}``: spans lost, because an
  export failed (``export_failed``, after the exporter's own retries) or the
  batch span processor's queue was full (``queue_full``, the SDK drops the
  oldest span);
* ``otel_hicache.metric_exports.failed{exporter}``: metric exports that failed.
  Counters are cumulative, so the next successful export carries the totals:
  only the intermediate points of a failed export are lost;
* ``otel_hicache.spans.export_queue.size{exporter}``: spans waiting in the batch
  span processor (bounded by ``OTEL_BSP_MAX_QUEUE_SIZE``).

The first failure of each kind is warned about once, naming the endpoint and
the variables to check. At shutdown, spans still queued or inside an export
that did not finish in time are reported in one line (they cannot be counted
in a metric that no longer gets exported).

Everything here runs on the exporters' threads (and the completion worker, for
queue-full drops), never on the caller's hot path.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from . import sdk_internals
from . import semconv as sc
from .diagnostics import logger, warn_once
from .version import __version__


class _Counts:
    """One exporter's counts (ints under a lock: updated once per export batch)."""

    __slots__ = ("exported", "export_failed", "queue_full", "in_export", "metric_failures",
                 "metric_exports", "queue_size")

    def __init__(self) -> None:
        self.exported = 0
        self.export_failed = 0
        self.queue_full = 0
        self.in_export = 0
        self.metric_failures = 0
        self.metric_exports = 0
        self.queue_size: Callable[[], int] | None = None


def _endpoint_of(exporter: Any) -> str:
    return sdk_internals.exporter_endpoint(exporter) or type(exporter).__name__


class DeliveryAccount:
    """Counts for the exporters of one process's providers.

    ``span_exporter()``/``metric_exporter()`` wrap an exporter; ``watch()``
    hooks a ``BatchSpanProcessor``'s queue-full drops; ``bind()`` registers
    the observable counters on a meter provider (with the static attributes,
    ranks, of the telemetry that binds it; once per provider).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: dict[str, _Counts] = {}
        self._metrics: dict[str, _Counts] = {}
        self._bound: set[int] = set()

    # -- wrapping ------------------------------------------------------------------
    def span_exporter(self, exporter: Any, name: str) -> Any:
        counts = self._spans.setdefault(name, _Counts())
        return _CountingSpanExporter(exporter, name, counts, self._lock)

    def metric_exporter(self, exporter: Any, name: str) -> Any:
        counts = self._metrics.setdefault(name, _Counts())
        return _counting_metric_exporter(exporter, name, counts, self._lock)

    def watch(self, processor: Any, name: str) -> bool:
        """Count the spans ``processor`` (an SDK ``BatchSpanProcessor``) drops
        on a full queue, and read its queue depth. False (warned once) when this
        SDK version does not expose them."""
        counts = self._spans.setdefault(name, _Counts())
        hooks = sdk_internals.batch_queue(processor)
        if hooks is None:
            warn_once("delivery:watch", "otel-hicache: this OpenTelemetry SDK's batch span processor does not "
                      "expose its queue; spans it drops on a full queue are not counted")
            return False
        counts.queue_size = hooks.size
        hooks.install_metrics(_CountingProcessorMetrics(hooks.metrics, counts, self._lock, name))
        return True

    # -- reading ---------------------------------------------------------------------
    def snapshot(self) -> dict[str, dict[str, int]]:
        """Current counts per exporter name (tests, benchmarks, the exit report)."""
        out: dict[str, dict[str, int]] = {}
        with self._lock:
            for name, c in self._spans.items():
                out[f"spans:{name}"] = {
                    "exported": c.exported, "export_failed": c.export_failed, "queue_full": c.queue_full,
                    "in_export": c.in_export, "queued": c.queue_size() if c.queue_size else 0,
                }
            for name, c in self._metrics.items():
                out[f"metrics:{name}"] = {"exports": c.metric_exports, "failed": c.metric_failures}
        return out

    def report_undelivered_at_exit(self) -> int:
        """Log (once) the spans still queued or inside an unfinished export; returns their number."""
        left = 0
        for name, counts in self.snapshot().items():
            if name.startswith("spans:"):
                left += counts["queued"] + counts["in_export"]
        if left:
            logger.warning(
                "otel-hicache: %d spans were still queued or being exported at exit and were not delivered "
                "(collector unreachable or slow?)", left)
        return left

    # -- metrics -------------------------------------------------------------------------
    def bind(self, meter_provider: Any, static: dict[str, Any]) -> None:
        key = id(meter_provider)
        if key in self._bound:
            return
        self._bound.add(key)
        from opentelemetry.metrics import Observation

        meter = meter_provider.get_meter(sc.SCOPE_NAME, __version__)
        static = dict(static)

        def attrs(name: str, **extra: str) -> dict[str, Any]:
            return {**static, sc.EXPORTER: name, **extra}

        def exported(_options: Any) -> list[Any]:
            with self._lock:
                return [Observation(c.exported, attrs(n)) for n, c in self._spans.items()]

        def undelivered(_options: Any) -> list[Any]:
            with self._lock:
                return [Observation(value, attrs(n, **{sc.REASON: reason}))
                        for n, c in self._spans.items()
                        for reason, value in ((sc.UNDELIVERED_EXPORT_FAILED, c.export_failed),
                                              (sc.UNDELIVERED_QUEUE_FULL, c.queue_full))]

        def metric_failures(_options: Any) -> list[Any]:
            with self._lock:
                return [Observation(c.metric_failures, attrs(n)) for n, c in self._metrics.items()]

        def queue_size(_options: Any) -> list[Any]:
            with self._lock:
                sizes = [(n, c.queue_size) for n, c in self._spans.items() if c.queue_size is not None]
            return [Observation(size(), attrs(n)) for n, size in sizes]

        for spec, callback, make in (
            (sc.SPANS_EXPORTED, exported, meter.create_observable_counter),
            (sc.SPANS_UNDELIVERED, undelivered, meter.create_observable_counter),
            (sc.METRIC_EXPORTS_FAILED, metric_failures, meter.create_observable_counter),
            (sc.SPAN_EXPORT_QUEUE_SIZE, queue_size, meter.create_observable_gauge),
        ):
            make(spec[0], callbacks=[callback], unit=spec[1], description=spec[2])


def _span_export_failed(name: str, exporter: Any, count: int, exc: BaseException | None) -> None:
    warn_once(
        f"delivery:spans:{name}",
        "otel-hicache: could not export %d spans to %s (%s exporter%s); counted in "
        "otel_hicache.spans.undelivered{reason=export_failed}, further failures are counted, not logged. "
        "Check OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_CERTIFICATE and OTEL_EXPORTER_OTLP_HEADERS",
        count, _endpoint_of(exporter), name, f": {exc!r}" if exc is not None else "",
    )


class _CountingSpanExporter:
    """A span exporter that counts what it delivered and what it lost."""

    def __init__(self, inner: Any, name: str, counts: _Counts, lock: threading.Lock) -> None:
        self._inner = self.inner = inner
        self._name = name
        self._counts = counts
        self._lock = lock

    def export(self, spans: Any) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        count = len(spans)
        counts = self._counts
        with self._lock:
            counts.in_export += count
        result, error = SpanExportResult.FAILURE, None
        try:
            result = self._inner.export(spans)
        except Exception as exc:  # an exporter that raises loses the batch: count it
            error = exc
        finally:
            with self._lock:
                counts.in_export -= count
                if result is SpanExportResult.SUCCESS:
                    counts.exported += count
                else:
                    counts.export_failed += count
        if result is not SpanExportResult.SUCCESS:
            _span_export_failed(self._name, self._inner, count, error)
        return result

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        import inspect

        shutdown = self._inner.shutdown
        try:
            accepts_timeout = "timeout_millis" in inspect.getfullargspec(shutdown).args
        except TypeError:
            accepts_timeout = False
        if accepts_timeout:
            shutdown(timeout_millis=timeout_millis, **kwargs)
        else:
            shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        flush = getattr(self._inner, "force_flush", None)
        return True if flush is None else flush(timeout_millis)

    def __getattr__(self, item: str) -> Any:  # _endpoint and the like, for messages and tests
        return getattr(self._inner, item)


def _counting_metric_exporter(inner: Any, name: str, counts: _Counts, lock: threading.Lock) -> Any:
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult

    class _CountingMetricExporter(MetricExporter):
        """A metric exporter with the inner one's temporality and aggregation
        preferences, counting failed exports."""

        def __init__(self) -> None:
            temporality, aggregation = sdk_internals.exporter_preferences(inner)
            super().__init__(preferred_temporality=temporality, preferred_aggregation=aggregation)
            self.inner = inner

        def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> Any:
            result, error = MetricExportResult.FAILURE, None
            try:
                result = inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
            except Exception as exc:
                error = exc
            with lock:
                counts.metric_exports += 1
                if result is not MetricExportResult.SUCCESS:
                    counts.metric_failures += 1
            if result is not MetricExportResult.SUCCESS:
                warn_once(
                    f"delivery:metrics:{name}",
                    "otel-hicache: a metric export to %s failed (%s exporter%s); counted in "
                    "otel_hicache.metric_exports.failed. Cumulative counters are re-sent in full by the next "
                    "export that succeeds. Check OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_CERTIFICATE "
                    "and OTEL_EXPORTER_OTLP_HEADERS",
                    _endpoint_of(inner), name, f": {error!r}" if error is not None else "",
                )
            return result

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return inner.force_flush(timeout_millis=timeout_millis)

        def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
            inner.shutdown(timeout_millis=timeout_millis, **kwargs)

    return _CountingMetricExporter()


class _CountingProcessorMetrics:
    """Stands in for the SDK batch processor's own metrics hook: counts the
    spans it drops on a full queue, then delegates (the SDK's internal metrics
    keep working when enabled)."""

    def __init__(self, inner: Any, counts: _Counts, lock: threading.Lock, name: str) -> None:
        self._inner = inner
        self._counts = counts
        self._lock = lock
        self._name = name

    def drop_items(self, count: int, error_type: str = "queue_full") -> None:
        if error_type == "queue_full":
            with self._lock:
                self._counts.queue_full += count
            warn_once(
                f"delivery:queue_full:{self._name}",
                "otel-hicache: the span export queue is full (OTEL_BSP_MAX_QUEUE_SIZE): the exporter cannot keep "
                "up or the collector stalls; spans are dropped and counted in "
                "otel_hicache.spans.undelivered{reason=queue_full}",
            )
        self._inner.drop_items(count, error_type)

    def finish_items(self, count: int) -> None:
        self._inner.finish_items(count)

    def register_queue_size(self, get_queue_size: Callable[[], int]) -> None:
        self._inner.register_queue_size(get_queue_size)
