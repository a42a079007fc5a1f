"""Private tracer and meter providers built from the standard ``OTEL_*`` variables.

:func:`configure` never touches the global providers: a host application
(SGLang's ``--enable-trace`` sets its own global ``TracerProvider`` after
plugins load) keeps whatever it sets. Variables read:

* ``OTEL_SDK_DISABLED``: ``true`` gives no-op providers (and disables otel-hicache).
* ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``: the resource (SDK rules).
* ``OTEL_TRACES_EXPORTER``, ``OTEL_METRICS_EXPORTER``: comma-separated list of
  ``otlp`` (default), ``console``, ``none``. Unknown names are warned about and skipped.
* ``OTEL_EXPORTER_OTLP_PROTOCOL`` and ``OTEL_EXPORTER_OTLP_{TRACES,METRICS}_PROTOCOL``:
  ``grpc`` (default, as the Python SDK's ``otlp`` exporter) or ``http/protobuf``.
* ``OTEL_EXPORTER_OTLP_{ENDPOINT,HEADERS,CERTIFICATE,TIMEOUT,COMPRESSION}`` and
  their per-signal forms: read by the OTLP exporters themselves, as specified.
* ``OTEL_TRACES_SAMPLER``, ``OTEL_TRACES_SAMPLER_ARG``: the SDK sampler.
* ``OTEL_METRIC_EXPORT_INTERVAL`` (ms, default 60000) and ``OTEL_METRIC_EXPORT_TIMEOUT``.
* ``OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE`` and
  ``OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION`` (explicit or
  base2 exponential buckets), for every metric exporter.

Per process: after ``fork()`` the child drops the parent's providers (without
exporting the parent's frozen metrics again) and builds new ones on first use.
Shutdown at interpreter exit is bounded by ``OTEL_HICACHE_SHUTDOWN_TIMEOUT_S``
even when the collector is unreachable.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Sequence

from .bounded_flush import shutdown_providers
from .delivery import DeliveryAccount, exporter_name
from .diagnostics import warn_once
from .http_session import certificate_session
from .environment_variables import OTEL_HICACHE_SHUTDOWN_TIMEOUT_S
from .process_exit import on_exit
from .settings import env_float, sdk_disabled

_KNOWN_EXPORTERS = ("otlp", "console", "none")
_PROTOCOLS = ("grpc", "http/protobuf")


class Configuration:
    """The providers :func:`configure` built for this process."""

    def __init__(
        self, tracer_provider: Any, meter_provider: Any, disabled: bool, metric_readers: Sequence[Any] = (),
        delivery: DeliveryAccount | None = None,
    ) -> None:
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self.metric_readers = tuple(metric_readers)
        self.disabled = disabled
        self.delivery = delivery  # what the exporters delivered and lost (otel_hicache.delivery)
        self.pid = os.getpid()

    def shutdown(self, timeout_s: float) -> bool:
        done = shutdown_providers(self.tracer_provider, self.meter_provider, timeout_s)
        if self.delivery is not None:
            self.delivery.report_undelivered_at_exit()
        return done


_lock = threading.RLock()
_configured: Configuration | None = None


def configure(force: bool = False) -> Configuration:
    """Build (once per process) private providers from the ``OTEL_*`` variables."""
    global _configured
    with _lock:
        previous = _configured
        if previous is not None and not force and previous.pid == os.getpid():
            return previous
        _configured = _build()
    if previous is not None and previous.pid == os.getpid():
        previous.shutdown(env_float(OTEL_HICACHE_SHUTDOWN_TIMEOUT_S))  # configure(force=True)
    return _configured


def configured() -> Configuration | None:
    """The providers :func:`configure` built in this process, if any."""
    current = _configured
    if current is not None and current.pid != os.getpid():
        return None
    return current


def shutdown(timeout_s: float | None = None) -> bool:
    """Flush and shut down the configured providers, bounded in time."""
    global _configured
    with _lock:
        current, _configured = configured(), None
    if current is None:
        return True
    if timeout_s is None:
        timeout_s = env_float(OTEL_HICACHE_SHUTDOWN_TIMEOUT_S)
    return current.shutdown(timeout_s)


def _exporter_names(variable: str) -> list[str]:
    raw = os.environ.get(variable, "otlp")
    names = [n.strip().lower() for n in raw.split(",") if n.strip()] or ["otlp"]
    known = []
    for name in names:
        if name in _KNOWN_EXPORTERS:
            known.append(name)
        else:
            warn_once(
                f"exporter:{variable}:{name}",
                "otel-hicache: %s=%r: unknown exporter %r (supported: otlp, console, none); skipping it",
                variable,
                raw,
                name,
            )
    if "none" in known:
        return []
    return known


def _protocol(signal: str) -> str:
    for variable in (f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        raw = os.environ.get(variable)
        if raw:
            value = raw.strip().lower()
            if value in _PROTOCOLS:
                return value
            warn_once(
                f"protocol:{variable}",
                "otel-hicache: %s=%r is not supported (grpc, http/protobuf); ignoring it",
                variable,
                raw,
            )
    return "grpc"


def _span_exporters() -> list[Any]:
    exporters = []
    for name in _exporter_names("OTEL_TRACES_EXPORTER"):
        if name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            exporters.append(ConsoleSpanExporter())
        elif _protocol("TRACES") == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporters.append(_construct(OTLPSpanExporter, "traces"))
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporters.append(_construct(OTLPSpanExporter, "traces"))
    return [e for e in exporters if e is not None]


def _metric_preferences() -> dict[str, Any]:
    """The histogram aggregation preference for the console exporter (the OTLP
    exporters read ``OTEL_EXPORTER_OTLP_METRICS_*`` themselves)."""
    from opentelemetry.sdk.metrics import Histogram
    from opentelemetry.sdk.metrics.view import ExponentialBucketHistogramAggregation

    raw = os.environ.get("OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION", "").strip().lower()
    if raw == "base2_exponential_bucket_histogram":
        return {"preferred_aggregation": {Histogram: ExponentialBucketHistogramAggregation()}}
    if raw not in ("", "explicit_bucket_histogram"):
        warn_once(
            "histogram_aggregation",
            "otel-hicache: OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION=%r is not "
            "supported; using explicit_bucket_histogram",
            raw,
        )
    return {}  # explicit buckets: the instruments' second-based advisory boundaries


def _metric_exporters() -> list[Any]:
    exporters = []
    for name in _exporter_names("OTEL_METRICS_EXPORTER"):
        if name == "console":
            from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

            exporters.append(ConsoleMetricExporter(**_metric_preferences()))
        elif _protocol("METRICS") == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

            exporters.append(_construct(OTLPMetricExporter, "metrics"))
        else:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

            exporters.append(_construct(OTLPMetricExporter, "metrics"))
    return [e for e in exporters if e is not None]


def _construct(cls: Any, signal: str) -> Any:
    """An OTLP exporter from the environment; a bad endpoint or certificate warns, never raises."""
    try:
        if ".proto.http" in cls.__module__:  # OTEL_EXPORTER_OTLP_CERTIFICATE over REQUESTS_CA_BUNDLE
            return cls(session=certificate_session())
        return cls()
    except Exception as exc:
        warn_once(
            f"exporter:{signal}",
            "otel-hicache: cannot create the OTLP %s exporter (%r); check OTEL_EXPORTER_OTLP_ENDPOINT, "
            "OTEL_EXPORTER_OTLP_CERTIFICATE and OTEL_EXPORTER_OTLP_HEADERS. %s are not exported.",
            signal,
            exc,
            signal.capitalize(),
        )
        return None


def _build() -> Configuration:
    if sdk_disabled():
        from opentelemetry.metrics import NoOpMeterProvider
        from opentelemetry.trace import NoOpTracerProvider

        return Configuration(NoOpTracerProvider(), NoOpMeterProvider(), disabled=True)
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create()
    tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    delivery = DeliveryAccount()  # every exporter counted: delivered, lost, still on its way
    for exporter in _span_exporters():
        name = exporter_name(exporter)
        processor = BatchSpanProcessor(delivery.span_exporter(exporter, name))
        delivery.watch(processor, name)
        tracer_provider.add_span_processor(processor)
    readers = [PeriodicExportingMetricReader(delivery.metric_exporter(e, exporter_name(e)))
               for e in _metric_exporters()]
    meter_provider = MeterProvider(metric_readers=readers, resource=resource, shutdown_on_exit=False)
    return Configuration(tracer_provider, meter_provider, disabled=False, metric_readers=readers,
                         delivery=delivery)


def _at_exit() -> None:
    shutdown()


def _after_fork_in_child() -> None:
    """Forget the parent's providers without exporting its frozen data again."""
    global _configured, _lock
    _lock = threading.RLock()
    parent, _configured = _configured, None
    if parent is None:
        return
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult

    class _Discard(MetricExporter):
        def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> Any:
            return MetricExportResult.SUCCESS

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return True

        def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
            return None

    for reader in parent.metric_readers:
        if hasattr(reader, "_exporter"):
            reader._exporter = _Discard()  # pylint: disable=protected-access
        event = getattr(reader, "_shutdown_event", None)
        if event is not None:
            event.set()  # stops the reader thread the SDK restarted in this child


on_exit(_at_exit, priority=10)  # after every TransferTelemetry (priority 20)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
