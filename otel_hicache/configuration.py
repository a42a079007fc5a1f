"""Private tracer and meter providers built from the standard ``OTEL_*`` variables.

:func:`configure` never touches the global providers: a host application
(SGLang's ``--enable-trace`` sets its own global ``TracerProvider`` after
plugins load) keeps whatever it sets. Variables read:

* ``OTEL_SDK_DISABLED``: ``true`` gives no-op providers (and disables otel-hicache).
* ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``: the resource (SDK rules).
* ``OTEL_TRACES_EXPORTER``, ``OTEL_METRICS_EXPORTER``: comma-separated list of
  ``otlp`` (default), ``console``, ``none``, or any exporter installed in the SDK's
  entry-point groups (``otlp_proto_grpc``, ``otlp_proto_http``, ``prometheus``...), as the
  SDK's own configurator resolves them. Unknown names are warned about and skipped.
* ``OTEL_EXPORTER_OTLP_PROTOCOL`` and ``OTEL_EXPORTER_OTLP_{TRACES,METRICS}_PROTOCOL``:
  ``grpc`` (default, as the Python SDK's ``otlp`` exporter) or ``http/protobuf``.
* ``OTEL_EXPORTER_OTLP_{ENDPOINT,HEADERS,CERTIFICATE,TIMEOUT,COMPRESSION}`` and
  their per-signal forms: read by the OTLP exporters themselves, as specified.
* ``OTEL_TRACES_SAMPLER``, ``OTEL_TRACES_SAMPLER_ARG``: the SDK sampler.
* ``OTEL_METRIC_EXPORT_INTERVAL`` (ms, default 60000) and ``OTEL_METRIC_EXPORT_TIMEOUT``.
* ``OTEL_BSP_*`` (span batching) and the span limits (``OTEL_*_LIMIT``).
* ``OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE`` and
  ``OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION`` (explicit or
  base2 exponential buckets), for every metric exporter.

Every one of them is validated first (:mod:`otel_hicache.otel_environment`): a
malformed value is warned about once, naming the variable, and its documented
default is passed to the SDK constructor instead, so a bad value never raises
into the host. ``os.environ`` is never modified.

Per process: after ``fork()`` the child drops the parent's providers (without
exporting the parent's frozen metrics again) and builds new ones on first use.
Shutdown at interpreter exit is bounded by ``OTEL_HICACHE_SHUTDOWN_TIMEOUT_S``
even when the collector is unreachable.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Sequence

from . import fork, otel_environment, sdk_internals
from .bounded_flush import shutdown_providers
from .delivery import DeliveryAccount
from .diagnostics import warn_once
from .http_session import certificate_session
from .environment_variables import OTEL_HICACHE_SHUTDOWN_TIMEOUT_S
from .process_exit import on_exit
from .settings import env_float, sdk_disabled


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
_fork_registered = False


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


_exporter_names = otel_environment.exporter_names
_protocol = otel_environment.protocol


# The OTLP names: ours (the validated path, with the certificate session over HTTP).
_OTLP = {"otlp": None, "otlp_proto_grpc": "grpc", "otlp_proto_http": "http/protobuf"}


# The ``exporter`` label of the delivery self-metrics, by protocol.
_LABELS = {"grpc": "otlp_grpc", "http/protobuf": "otlp_http"}
# The OTLP exporter classes, by signal and protocol (imported only when used).
_OTLP_CLASSES = {
    ("traces", "grpc"): ("opentelemetry.exporter.otlp.proto.grpc.trace_exporter", "OTLPSpanExporter"),
    ("traces", "http/protobuf"): ("opentelemetry.exporter.otlp.proto.http.trace_exporter", "OTLPSpanExporter"),
    ("metrics", "grpc"): ("opentelemetry.exporter.otlp.proto.grpc.metric_exporter", "OTLPMetricExporter"),
    ("metrics", "http/protobuf"): ("opentelemetry.exporter.otlp.proto.http.metric_exporter", "OTLPMetricExporter"),
}


def _otlp(signal: str, name: str) -> tuple[Any, str]:
    """(the OTLP exporter for ``signal`` that ``name`` asks for, its ``exporter`` label)."""
    import importlib

    protocol = _OTLP[name] or _protocol(signal)
    module, cls = _OTLP_CLASSES[(signal, protocol)]
    return _construct(getattr(importlib.import_module(module), cls), signal, protocol), _LABELS[protocol]


def _span_exporters() -> list[tuple[Any, str]]:
    """(exporter, its ``exporter`` label) for each name of OTEL_TRACES_EXPORTER."""
    exporters = []
    for name in _exporter_names("OTEL_TRACES_EXPORTER"):
        if name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            exporters.append((ConsoleSpanExporter(), name))
        elif name in _OTLP:
            exporters.append(_otlp("traces", name))
        else:
            exporters.append((_from_entry_point("OTEL_TRACES_EXPORTER", name), name))
    return [(e, label) for e, label in exporters if e is not None]


def _metric_exporters() -> tuple[list[tuple[Any, str]], list[Any]]:
    """(exporter, its ``exporter`` label) for each name of OTEL_METRICS_EXPORTER that each get
    a periodic reader, and the readers an entry point gives directly (``prometheus``: a pull
    reader serving its own endpoint)."""
    from opentelemetry.sdk.metrics.export import MetricReader

    exporters, readers = [], []
    for name in _exporter_names("OTEL_METRICS_EXPORTER"):
        if name == "console":
            from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

            exporters.append((ConsoleMetricExporter(**otel_environment.console_metric_exporter()), name))
        elif name in _OTLP:
            exporters.append(_otlp("metrics", name))
        else:
            made = _from_entry_point("OTEL_METRICS_EXPORTER", name)
            if isinstance(made, MetricReader):
                readers.append(made)
            else:
                exporters.append((made, name))
    return [(e, label) for e, label in exporters if e is not None], readers


def _from_entry_point(variable: str, name: str) -> Any:
    """An exporter (or metric reader) from the SDK's entry-point group, built as the SDK's
    own configurator builds it (no arguments: it reads its own environment); None, warned
    about, when it cannot be built."""
    try:
        return otel_environment.exporter_entry_point(variable, name).load()()
    except Exception as exc:
        warn_once(f"exporter:{variable}:{name}:build", "otel-hicache: %s=%s: cannot create that exporter (%r); "
                  "skipping it", variable, name, exc)
        return None


def _construct(cls: Any, signal: str, protocol: str) -> Any:
    """An OTLP exporter from the environment, malformed values replaced by their defaults
    (:func:`otel_environment.otlp_exporter`); None, warned about, when it cannot be built."""
    settings = otel_environment.otlp_exporter(signal, protocol)
    if settings is None:
        return None  # a CA certificate that cannot be read, over TLS: warned
    try:
        if protocol != "grpc":  # OTEL_EXPORTER_OTLP_CERTIFICATE over REQUESTS_CA_BUNDLE
            settings.kwargs["session"] = certificate_session()
        return otel_environment.construct(cls, settings)
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
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # malformed OTEL_* values: warned about once, their defaults passed explicitly
    resource = otel_environment.resource()
    tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False, **otel_environment.tracer_provider())
    delivery = DeliveryAccount()  # every exporter counted: delivered, lost, still on its way
    batching = otel_environment.batch_span_processor()
    for exporter, name in _span_exporters():
        processor = BatchSpanProcessor(delivery.span_exporter(exporter, name), **batching)
        delivery.watch(processor, name)
        tracer_provider.add_span_processor(processor)
    reading = otel_environment.metric_reader()
    exporters, pull_readers = _metric_exporters()
    readers = [PeriodicExportingMetricReader(delivery.metric_exporter(e, name), **reading)
               for e, name in exporters] + pull_readers
    meter_provider = MeterProvider(metric_readers=readers, resource=resource, shutdown_on_exit=False,
                                   **otel_environment.meter_provider())
    global _fork_registered
    if not _fork_registered:  # once, and after the SDK objects registered theirs (otel_hicache.fork)
        fork.after_fork_in_child(_after_fork_in_child)
        _fork_registered = True
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
        sdk_internals.stop_reader_in_fork_child(reader, _Discard())


on_exit(_at_exit, priority=10)  # after every TransferTelemetry (priority 20)
