"""Private tracer and meter providers (never the host's globals) from the ``OTEL_*`` variables."""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field, replace
from importlib.metadata import entry_points
from typing import Any, Callable, Mapping, Sequence

from ..diagnostics import logger, shown, warn_once, withhold
from ..environment_variables import sdk_disabled
from . import otel_environment as oe
from .bounded_flush import bounded
from .http_session import OtlpSession


@dataclass
class Providers:
    tracer_provider: Any
    meter_provider: Any
    disabled: bool = False
    metric_readers: Sequence[Any] = ()
    span_processors: Sequence[Any] = ()
    undelivered: list[list[int]] = field(default_factory=list)  # _counting()'s, per span processor
    static_in_resource: bool = False

    def shutdown(self, timeout_s: float) -> bool:
        done = bounded("shutdown", self.tracer_provider, self.meter_provider, timeout_s)
        if left := max((ended - handed for ended, handed in self.undelivered), default=0):  # no metric can carry it
            logger.warning("otel-hicache: %d spans ended but were never handed to the exporter: dropped by the "
                           "SDK's full span queue (error.type=queue_full) or still queued at exit", left)
        return done

    def force_flush(self, timeout_s: float) -> bool:
        return bounded("force_flush", self.tracer_provider, self.meter_provider, timeout_s)


def _counting(processor: Any, exporter: Any) -> list[int]:
    """[the sampled spans ``processor`` was given, those its exporter was handed] from now on."""
    counts, on_end, export = [0, 0], processor.on_end, exporter.export

    def ended(span: Any) -> Any:
        counts[0] += bool(span.context is not None and span.context.trace_flags.sampled)
        return on_end(span)

    def handed(spans: Any, *args: Any, **kwargs: Any) -> Any:
        counts[1] += len(spans)
        return export(spans, *args, **kwargs)

    processor.on_end, exporter.export = ended, handed
    return counts


EXPORTER_GROUPS = {"traces": ("OTEL_TRACES_EXPORTER", "opentelemetry_traces_exporter"),
                   "metrics": ("OTEL_METRICS_EXPORTER", "opentelemetry_metrics_exporter")}
OTLP_EXPORTERS = {"grpc": "otlp_proto_grpc", "http/protobuf": "otlp_proto_http"}


def exporter_names(signal: str) -> list[str]:
    """The names ``OTEL_{TRACES,METRICS}_EXPORTER`` lists (``otlp`` when unset); [] for ``none``."""
    names = [n.strip().lower() for n in os.environ.get(EXPORTER_GROUPS[signal][0], "").split(",") if n.strip()]
    return [] if "none" in names else names or ["otlp"]


def otlp_protocol(signal: str, name: str) -> str | None:
    """The OTLP protocol exporter ``name`` uses; None if not OTLP."""
    if name != "otlp":
        return {v: k for k, v in OTLP_EXPORTERS.items()}.get(name)
    for variable in oe.signal_variable(signal, "PROTOCOL"):
        if (value := (oe.raw(variable) or "").lower()) in OTLP_EXPORTERS:
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


def exporters(signal: str, meter_provider: Any = None, names: Sequence[str] | None = None,
              wrap_export: Callable[[Any], Any] | None = None, own_process: bool = False) -> list[Any]:
    """Those ``names`` (default: the variable's) name (metrics: or pull readers)."""
    variable, group = EXPORTER_GROUPS[signal]
    built = []
    for name in exporter_names(signal) if names is None else names:
        otlp = otlp_protocol(signal, name)
        found = next(iter(entry_points(group=group, name=OTLP_EXPORTERS[otlp] if otlp else name)), None)
        if found is None:
            warn_once(f"exporter:{variable}:{name}", "otel-hicache: %s=%s: unknown exporter %s (none, or an "
                      "installed %s entry point); skipping it", variable, shown(os.environ.get(variable)),
                      shown(name), group)
            continue
        cls = oe.build(f"{name} {signal} exporter class", found.load)  # first: its loggers then exist to filter
        if (fixed := oe.otlp_keywords(signal, otlp, own_process) if otlp else {}) is None:
            continue
        if otlp == "http/protobuf":
            fixed["session"] = OtlpSession()
        if meter_provider is not None:
            fixed.update(_accepted(cls, meter_provider=meter_provider))  # its otel.sdk.exporter.* self-metrics
        table = oe.otlp_exporter(signal, otlp) if otlp else {}
        if cls and (exporter := oe.build(f"{name} {signal} exporter", lambda **kw: cls(**fixed, **kw), table)):
            if otlp == "grpc" and wrap_export is not None:
                exporter.export = wrap_export(exporter.export)
            if "session" in fixed:
                oe.settle_session(fixed["session"], signal)
            built.append(exporter)
    return built


def build(resource: Any, extra_readers: Sequence[Any] = (),
          wrap_export: Callable[[Any], Any] | None = None, id_generator: Any = None,
          counters_since_ns: int | None = None, own_process: bool = False,
          static: Mapping[str, Any] | None = None) -> Providers:
    """``wrap_export`` wraps gRPC exports; ``static`` goes into the resource unless a reader here reads metrics."""
    from opentelemetry.metrics import NoOpMeterProvider
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import SpanLimits, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.trace import NoOpTracerProvider
    if sdk_disabled():
        return Providers(NoOpTracerProvider(), NoOpMeterProvider(), disabled=True)
    withhold((), own_process)  # no log line quotes a whole value
    readers, pushed = [], []
    for made in exporters("metrics", wrap_export=wrap_export, own_process=own_process):
        if isinstance(made, MetricReader):  # a pull reader (prometheus) serving its own endpoint
            readers.append(made)
            continue
        if counters_since_ns is not None:
            made.export = _counters_since(made.export, counters_since_ns)
        if reader := oe.build("periodic metric reader", lambda **kw: PeriodicExportingMetricReader(made, **kw),
                              oe.METRIC_READER):
            readers.append(reader)
            pushed.append(made)
    readers += extra_readers
    if in_resource := bool(static) and len(pushed) == len(readers):
        resource = resource.merge(Resource(dict(static)))  # ours win
    meter_provider = oe.build("meter provider", lambda **kw: MeterProvider(
        metric_readers=readers, resource=resource, shutdown_on_exit=False, **kw),
        oe.METER_PROVIDER) or NoOpMeterProvider()
    for exporter in pushed:  # the OTLP metric exporters' self-metrics
        if callable(getattr(exporter, "set_meter_provider", None)):
            exporter.set_meter_provider(meter_provider)
    # otel.sdk.span.started/live would cost the sinks two SDK calls a span
    own = _accepted(TracerProvider, meter_provider=NoOpMeterProvider())
    tracer_provider = oe.build("tracer provider", lambda **limits: TracerProvider(
        resource=resource, shutdown_on_exit=False, span_limits=SpanLimits(**limits) if limits else None,
        sampler=oe.sampler(), **({"id_generator": id_generator} if id_generator else {}), **own),
        oe.SPAN_LIMITS) or NoOpTracerProvider()
    # an unset batch size is the queue's when smaller (the SDK raises)
    batch = {**_accepted(BatchSpanProcessor, meter_provider=meter_provider),
             "max_export_batch_size": oe.BATCH_SPAN_PROCESSOR["OTEL_BSP_MAX_EXPORT_BATCH_SIZE"][2]()}
    processors, undelivered = [], []
    for exporter in exporters("traces", meter_provider, wrap_export=wrap_export, own_process=own_process):
        if processor := oe.build("batch span processor", lambda **kw: BatchSpanProcessor(exporter, **{**batch, **kw}),
                                 oe.BATCH_SPAN_PROCESSOR):
            undelivered.append(_counting(processor, exporter))
            processors.append(processor)
            tracer_provider.add_span_processor(processor)
    return Providers(tracer_provider, meter_provider, metric_readers=readers, span_processors=processors,
                     undelivered=undelivered, static_in_resource=in_resource)


def _counters_since(export: Callable[..., Any], start_ns: int) -> Callable[..., Any]:
    """``export`` with every monotonic sum counting since ``start_ns``: a successor's counters go on from
    its predecessor's totals, and a later start time is a reset to ``rate()`` and delta converters."""
    from opentelemetry.sdk.metrics.export import Sum
    def since(point: Any) -> Any:
        return replace(point, start_time_unix_nano=start_ns) if point.start_time_unix_nano > start_ns else point

    def exported(data: Any, *args: Any, **kwargs: Any) -> Any:
        data = replace(data, resource_metrics=[replace(rm, scope_metrics=[replace(sm, metrics=[
            replace(m, data=replace(m.data, data_points=[since(p) for p in m.data.data_points]))
            if isinstance(m.data, Sum) and m.data.is_monotonic else m for m in sm.metrics])
            for sm in rm.scope_metrics]) for rm in data.resource_metrics])
        return export(data, *args, **kwargs)

    return exported
