"""Private tracer and meter providers from the standard ``OTEL_*`` variables, built of the SDK's parts.

As the SDK's configurator does, privately (the host's global providers are left
alone) and per process: exporters by the SDK's entry-point names, each SDK object
reading its own variables (:mod:`otel_hicache.otel_environment` retries what a
constructor rejects), and this meter provider handed to them for the SDK's
``otel.sdk.*`` self-metrics. Added where the SDK lacks it: a forked child's own
providers, and a bounded shutdown that reports what it could not deliver.
``docs/configuration.md`` has the details.
"""

from __future__ import annotations

import inspect
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

from . import fork, otel_environment, sdk_internals
from .bounded_flush import bounded
from .diagnostics import logger, shown, warn_once, withhold
from .environment_variables import OTEL_HICACHE_SHUTDOWN_TIMEOUT_S, OTEL_HICACHE_SPAN_EXPORT_PROCESS
from .http_session import otlp_session
from .process_exit import on_exit
from .settings import env_bool, env_float, sdk_disabled


@dataclass
class Configuration:
    """The providers :func:`configure` built for this process."""

    tracer_provider: Any
    meter_provider: Any
    disabled: bool
    metric_readers: Sequence[Any] = ()
    span_processors: Sequence[Any] = ()
    pid: int = field(default_factory=os.getpid)

    def shutdown(self, timeout_s: float) -> bool:
        done = bounded("shutdown", self.tracer_provider, self.meter_provider, timeout_s)
        left = sum(size() for size in map(sdk_internals.batch_queue_size, self.span_processors) if size is not None)
        if left:  # no metric can carry this any more
            logger.warning("otel-hicache: %d spans were still queued at exit and were not delivered (collector "
                           "unreachable or slow?)", left)
        return done


_lock = threading.RLock()
_configured: Configuration | None = None
_fork_registered = False


def configure(force: bool = False, *, metric_readers: Sequence[Any] = ()) -> Configuration:
    """Build (once per process) private providers from the ``OTEL_*`` variables;
    ``metric_readers`` are added to the meter provider's own (when it is built)."""
    global _configured
    with _lock:
        previous = _configured
        if previous is not None and not force and previous.pid == os.getpid():
            return previous
        _configured = _build(metric_readers)
    if previous is not None and previous.pid == os.getpid():
        previous.shutdown(env_float(OTEL_HICACHE_SHUTDOWN_TIMEOUT_S))  # configure(force=True)
    return _configured


def configured() -> Configuration | None:
    """The providers :func:`configure` built in this process, if any."""
    current = _configured
    return None if current is None or current.pid != os.getpid() else current


def shutdown(timeout_s: float | None = None) -> bool:
    """Flush and shut down the configured providers, bounded in time."""
    global _configured
    with _lock:
        current, _configured = configured(), None
    if current is None:
        return True
    return current.shutdown(env_float(OTEL_HICACHE_SHUTDOWN_TIMEOUT_S) if timeout_s is None else timeout_s)


# -- exporters, by the names of the SDK's entry-point groups ----------------------------------------

EXPORTER_GROUPS = {"traces": ("OTEL_TRACES_EXPORTER", "opentelemetry_traces_exporter"),
                   "metrics": ("OTEL_METRICS_EXPORTER", "opentelemetry_metrics_exporter")}
OTLP_EXPORTERS = {"grpc": "otlp_proto_grpc", "http/protobuf": "otlp_proto_http"}


def exporter_names(signal: str) -> list[str]:
    """The names ``OTEL_{TRACES,METRICS}_EXPORTER`` lists (``otlp`` when unset); [] for ``none``."""
    raw = os.environ.get(EXPORTER_GROUPS[signal][0], "otlp")
    names = [n.strip().lower() for n in raw.split(",") if n.strip()] or ["otlp"]
    return [] if "none" in names else names


def otlp_protocol(signal: str, name: str) -> str | None:
    """The OTLP protocol exporter ``name`` uses (``otlp``: by the protocol variables); None if not OTLP."""
    return protocol(signal) if name == "otlp" else {v: k for k, v in OTLP_EXPORTERS.items()}.get(name)


def protocol(signal: str) -> str:
    for variable in (f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        value = (otel_environment.raw(variable) or "").strip().lower()
        if value in OTLP_EXPORTERS:
            return value
        if value:
            warn_once(f"protocol:{variable}", "otel-hicache: %s=%s is not supported (grpc, http/protobuf); "
                      "ignoring it", variable, shown(os.environ[variable]))
    return "grpc"


def _accepted(cls: Any, **kwargs: Any) -> dict[str, Any]:
    """The keyword arguments ``cls`` takes (``meter_provider``: SDK 1.3x does not)."""
    try:
        return {k: v for k, v in kwargs.items() if k in inspect.signature(cls).parameters}
    except (TypeError, ValueError):
        return {}


def _entry_point(group: str, name: str) -> Any:
    from importlib.metadata import entry_points

    return next(iter(entry_points(group=group, name=name)), None)


def exporters(signal: str, meter_provider: Any = None, names: Sequence[str] | None = None) -> list[Any]:
    """The exporters (or, for metrics, pull readers) ``names`` (default: what
    ``OTEL_{TRACES,METRICS}_EXPORTER`` names) stand for, built as configure() builds them."""
    variable, group = EXPORTER_GROUPS[signal]
    built = []
    for name in exporter_names(signal) if names is None else names:
        otlp = otlp_protocol(signal, name)
        found = _entry_point(group, OTLP_EXPORTERS[otlp] if otlp else name)
        if found is None:
            warn_once(f"exporter:{variable}:{name}", "otel-hicache: %s=%s: unknown exporter %s (none, or an "
                      "installed %s entry point); skipping it", variable, shown(os.environ.get(variable)),
                      shown(name), group)
            continue
        if otlp is not None and not otel_environment.certificate_usable(signal, otlp):
            continue
        cls = otel_environment.build(f"{name} {signal} exporter class", found.load, {})
        fixed = {"session": otlp_session()} if otlp == "http/protobuf" else {}
        if otlp is not None:  # its headers, parsed here (none of their values reaches a log line)
            fixed.update(otel_environment.otlp_keywords(signal, otlp))
        if meter_provider is not None:
            fixed.update(_accepted(cls, meter_provider=meter_provider))  # its otel.sdk.exporter.* self-metrics
        retries = otel_environment.otlp_exporter(signal, otlp) if otlp else {}
        exporter = cls and otel_environment.build(f"{name} {signal} exporter", lambda **kw: cls(**fixed, **kw),
                                                  retries)
        if exporter is not None:
            if otlp == "grpc":  # a child forked during one of its calls could never use gRPC
                exporter.export = fork.quiet_at_fork(exporter.export)
            if "session" in fixed:  # a blank certificate or key variable means unset
                otel_environment.settle_session(fixed["session"], signal)
            built.append(exporter)
    return built


# -- providers ------------------------------------------------------------------------------------

def _build(extra_readers: Sequence[Any]) -> Configuration:
    from opentelemetry.metrics import NoOpMeterProvider
    from opentelemetry.trace import NoOpTracerProvider

    if sdk_disabled():
        return Configuration(NoOpTracerProvider(), NoOpMeterProvider(), disabled=True)
    from opentelemetry.sdk.trace import SpanLimits, TracerProvider

    withhold(())  # no SDK log line quotes a whole value from now on
    build = otel_environment.build
    resource = otel_environment.resource()  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES: the SDK's rules
    readers, meter_provider = _meter_provider(resource, extra_readers)
    # Not this meter provider: otel.sdk.span.started/live cost the worker ~35 us per span (measured
    # with benchmarks/soak.py), and its own counters already count every op; nor the host's global one.
    own = _accepted(TracerProvider, meter_provider=NoOpMeterProvider())
    tracer_provider = build("tracer provider", lambda **limits: TracerProvider(
        resource=resource, shutdown_on_exit=False, span_limits=SpanLimits(**limits) if limits else None,
        sampler=otel_environment.sampler(), **own),
        otel_environment.SPAN_LIMITS) or NoOpTracerProvider()
    if env_bool(OTEL_HICACHE_SPAN_EXPORT_PROCESS) and exporter_names("traces"):
        processors = [p for p in (_process_span_processor(meter_provider),) if p is not None]
    else:
        processors = span_processors(exporters("traces", meter_provider), meter_provider)
    for processor in processors:
        tracer_provider.add_span_processor(processor)
    global _fork_registered
    if not _fork_registered:  # once, and after the SDK objects registered theirs (otel_hicache.fork)
        fork.after_fork_in_child(_after_fork_in_child)
        _fork_registered = True
    return Configuration(tracer_provider, meter_provider, disabled=False, metric_readers=readers,
                         span_processors=processors)


def _meter_provider(resource: Any, extra_readers: Sequence[Any] = (),
                    names: Sequence[str] | None = None) -> tuple[list[Any], Any]:
    """The readers ``OTEL_METRICS_EXPORTER`` names (or ``names``), ``extra_readers``, and a meter provider of them."""
    from opentelemetry.metrics import NoOpMeterProvider
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader

    build = otel_environment.build
    readers: list[Any] = []
    metric_exporters = []
    for made in exporters("metrics", names=names):
        if isinstance(made, MetricReader):
            readers.append(made)  # a pull reader (prometheus) serving its own endpoint
        else:
            reader = build("periodic metric reader", lambda **kw: PeriodicExportingMetricReader(made, **kw),
                           otel_environment.METRIC_READER)
            if reader is not None:
                readers.append(reader)
                metric_exporters.append(made)
    readers += extra_readers
    meter_provider = build("meter provider", lambda **kw: MeterProvider(
        metric_readers=readers, resource=resource, shutdown_on_exit=False, **kw), otel_environment.METER_PROVIDER)
    meter_provider = meter_provider or NoOpMeterProvider()  # (warned)
    for exporter in metric_exporters:  # the OTLP metric exporters' self-metrics
        if callable(getattr(exporter, "set_meter_provider", None)):
            exporter.set_meter_provider(meter_provider)
    return readers, meter_provider


def span_processors(span_exporters: Sequence[Any], meter_provider: Any) -> list[Any]:
    """A ``BatchSpanProcessor`` per exporter, each reading the ``OTEL_BSP_*`` variables."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    batch = otel_environment.BATCH_SPAN_PROCESSOR
    own = _accepted(BatchSpanProcessor, meter_provider=meter_provider)
    if "OTEL_BSP_MAX_EXPORT_BATCH_SIZE" not in os.environ:  # at most the queue size (the SDK raises); blank: build()
        own["max_export_batch_size"] = batch["OTEL_BSP_MAX_EXPORT_BATCH_SIZE"][1]()
    return [p for p in (otel_environment.build("batch span processor",
                                               lambda **kw: BatchSpanProcessor(e, **own, **kw), batch)
                        for e in span_exporters) if p is not None]


def _process_span_processor(meter_provider: Any) -> Any:
    """OTEL_HICACHE_SPAN_EXPORT_PROCESS=true: one processor writing small batches to a helper process
    that exports as :func:`span_processors` would here (:mod:`otel_hicache.span_export_process`)."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from . import span_export_process as sep

    batch = otel_environment.BATCH_SPAN_PROCESSOR
    delay = otel_environment.raw("OTEL_BSP_SCHEDULE_DELAY")
    own = _accepted(BatchSpanProcessor, meter_provider=meter_provider)
    # at most the queue size, as the SDK requires: the batch size's own default, capped
    own["max_export_batch_size"] = min(sep.BATCH, batch["OTEL_BSP_MAX_EXPORT_BATCH_SIZE"][1]())
    own["schedule_delay_millis"] = sep.SCHEDULE_DELAY_MS
    if delay is not None and otel_environment.positive(delay):
        try:
            own["schedule_delay_millis"] = min(float(delay), sep.SCHEDULE_DELAY_MS)
        except ValueError:  # the SDK's parse warns about it in the helper
            pass
    in_process = lambda: exporters("traces", meter_provider)  # noqa: E731  # if no helper can be had
    retries = {k: v for k, v in batch.items() if k in ("OTEL_BSP_EXPORT_TIMEOUT", "OTEL_BSP_MAX_QUEUE_SIZE")}
    return otel_environment.build("span export process", lambda **kw: sep.ProcessSpanProcessor(
        sep.ProcessSpanExporter(in_process), **own, **kw), retries)


def self_metrics_meter_provider() -> Any:
    """For the span export helper: a meter provider of the ``OTEL_METRICS_EXPORTER`` push exporters when
    ``OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED=true`` (the exporters' ``otel.sdk.exporter.span.*``,
    which only the helper has), else None. Not ``prometheus``: its port is the serving process's."""
    if (otel_environment.raw("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED") or "").strip().lower() != "true":
        return None  # (as the SDK reads it)
    names = [name for name in exporter_names("metrics") if name != "prometheus"]
    return _meter_provider(otel_environment.resource(), names=names)[1] if names else None


def _after_fork_in_child() -> None:
    """Forget the parent's providers without exporting its frozen data again."""
    global _configured, _lock
    _lock = threading.RLock()
    parent, _configured = _configured, None
    for reader in parent.metric_readers if parent is not None else ():
        sdk_internals.stop_reader_in_fork_child(reader)


on_exit(shutdown, priority=10)  # after every TransferTelemetry (priority 20)
