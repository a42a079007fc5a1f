"""``configure()``: where the sinks run, once per process (again in a forked child): a telemetry process when
an exporter sends over OTLP, else embedded on private providers (never the host's globals)."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from . import environment_variables as ev
from .capture import fork
from .capture.channel import ProcessChannel
from .capture.process_exit import on_exit
from .diagnostics import warned
from .environment_variables import env_bool, env_float, sdk_disabled


@dataclass
class Configuration:
    telemetry_process: bool
    built: Any  # sinks.providers.Providers, or None
    resource: Any = None

    disabled = property(lambda self: getattr(self.built, "disabled", False))
    tracer_provider = property(lambda self: getattr(self.built, "tracer_provider", None))
    meter_provider = property(lambda self: getattr(self.built, "meter_provider", None))
    metric_readers = property(lambda self: getattr(self.built, "metric_readers", ()))
    span_processors = property(lambda self: getattr(self.built, "span_processors", ()))

    def shutdown(self, timeout_s: float) -> bool:
        return self.built is None or self.built.shutdown(timeout_s)


_lock = threading.RLock()
_configured: Configuration | None = None
_fork_registered = False


def configure(force: bool = False, *, metric_readers: Sequence[Any] = ()) -> Configuration:
    """``metric_readers`` keep the sinks embedded."""
    global _configured, _fork_registered
    with _lock:
        previous = _configured
        if previous is not None and not force:
            return previous
        from .sinks import otel_environment, providers  # (``import otel_hicache`` loads the capture only)
        resource = None if sdk_disabled() else otel_environment.resource()
        process = not metric_readers and uses_telemetry_process()
        built = None if process else providers.build(resource, metric_readers, wrap_export=fork.quiet_at_fork)
        _configured = Configuration(process, built, resource)
        if not _fork_registered:  # once, and after the SDK objects registered theirs
            fork.after_fork_in_child(_after_fork_in_child)
            _fork_registered = True
    if previous is not None:
        previous.shutdown(env_float(ev.OTEL_HICACHE_SHUTDOWN_TIMEOUT_S))
    return _configured


def configured() -> Configuration | None:
    return _configured  # None in a forked child: _after_fork_in_child()


def shutdown(timeout_s: float | None = None) -> bool:
    global _configured
    with _lock:
        current, _configured = _configured, None
    timeout_s = env_float(ev.OTEL_HICACHE_SHUTDOWN_TIMEOUT_S) if timeout_s is None else timeout_s
    return current is None or current.shutdown(timeout_s)


def uses_telemetry_process() -> bool:
    """:envvar:`OTEL_HICACHE_TELEMETRY_PROCESS`, or when unset: whether an exporter sends over OTLP."""
    from .sinks import providers
    if sdk_disabled():
        return False
    if (chosen := env_bool(ev.OTEL_HICACHE_TELEMETRY_PROCESS)) is not None:  # a malformed one: its default, unset
        return chosen
    return any(providers.otlp_protocol(signal, name) is not None
               for signal in ("traces", "metrics") for name in providers.exporter_names(signal))


def hello(static: Mapping[str, Any], resource: Any = None) -> dict[str, Any]:
    """The sinks' ``record`` hello."""
    from .sinks import otel_environment
    resource = resource or otel_environment.resource()
    return {"resource": dict(resource.attributes), "schema_url": resource.schema_url, "attributes": dict(static),
            "pid": os.getpid(), "warned": warned()}


def open_channel(tracer_provider: Any, meter_provider: Any, static: Mapping[str, Any],
                 max_ops: int, clock: Callable[[], int]) -> Callable[[], Any]:
    """On the providers passed (the other configure()'s, else global), else configure()'s choice."""
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.resources import Resource
    from .sinks.embedded import EmbeddedChannel
    given = tracer_provider is not None or meter_provider is not None
    used_configure = configured() is not None

    def opened() -> Any:
        nonlocal used_configure
        if (current := configured()) is None and not given and used_configure:
            current = configure()  # a forked child: its own
        used_configure = used_configure or current is not None
        if not given and current is not None and current.telemetry_process:
            return ProcessChannel(hello(static, current.resource), max_ops,
                                  lambda: _embedded_fallback(static, current.resource))
        tracer = tracer_provider or getattr(current, "tracer_provider", None) or trace.get_tracer_provider()
        meter = meter_provider or getattr(current, "meter_provider", None) or metrics.get_meter_provider()
        # the static attributes on every point: these providers may serve others
        return EmbeddedChannel(tracer, meter, hello(static, current.resource if current else Resource.get_empty()),
                               clock)

    return opened


def _embedded_fallback(static: Mapping[str, Any], resource: Any) -> Any:
    """When no telemetry process could run: providers here, the static attributes in their resource."""
    from .sinks import providers
    from .sinks.embedded import EmbeddedChannel
    built = providers.build(resource, wrap_export=fork.quiet_at_fork, static=static)
    with _lock:
        if _configured is not None and _configured.built is None:
            _configured.built = built  # shut down with the rest at exit
    return EmbeddedChannel(built.tracer_provider, built.meter_provider,
                           {**hello(static, resource), "fallback": True, "in_resource": built.static_in_resource})


def _after_fork_in_child() -> None:
    global _configured, _lock
    _lock = threading.RLock()
    _configured = None


on_exit(shutdown, priority=10)  # after every TransferTelemetry (priority 20)
