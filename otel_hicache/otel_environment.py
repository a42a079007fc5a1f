"""The standard ``OTEL_*`` variables: read by the SDK itself, with one promise added.

Each SDK object reads its own variables (``configure()`` passes no arguments for them)
and handles most malformed values itself. Where a constructor rejects one, which would
raise into the host, :func:`build` retries with that variable's default passed
explicitly and warns once naming it. Checked ahead, as the SDK would go on without a
word: a time <= 0 or infinite, and an unreadable CA certificate. ``os.environ`` is never
modified. The tables are those ``docs/configuration.md`` ("Malformed values") lists.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

from .diagnostics import warn_once

Retry = tuple[str, Any, str]
"""(the constructor's keyword, its default (or a function giving it), how the warning shows it)."""

MEANT = {"OTEL_METRICS_EXEMPLAR_FILTER": ("trace_based", "always_on", "always_off"),
         "OTEL_EXPORTER_OTLP_COMPRESSION": ("none",)}
"""Values the specification allows (enum values in any case) that an SDK constructor
rejects: replaced by what they mean, without a warning."""


def raw(name: str) -> str | None:
    """The value of ``name``; None when unset or blank (the specification's "unset")."""
    value = os.environ.get(name)
    return value if value is not None and value.strip() else None


def _count_or(name: str, default: int | None) -> Callable[[], int | None]:
    """The integer >= 0 in ``name``, else ``default``: a per-kind limit defaults to the general one."""
    return lambda: int(text) if (text := (raw(name) or "").strip()).isdigit() else default


def _exemplar_filter() -> Any:
    from opentelemetry.sdk import metrics

    name = (raw("OTEL_METRICS_EXEMPLAR_FILTER") or "").strip().lower()
    return {"always_on": metrics.AlwaysOnExemplarFilter, "always_off": metrics.AlwaysOffExemplarFilter}.get(
        name, metrics.TraceBasedExemplarFilter)()


_NO_LIMIT = -1  # SpanLimits.UNSET
_COUNT, _LENGTH = "OTEL_ATTRIBUTE_COUNT_LIMIT", "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT"
SPAN_LIMITS: dict[str, Retry] = {  # SpanLimits keywords; the general limits first
    _COUNT: ("max_attributes", 128, "128"),
    **{f"OTEL_{kind}_ATTRIBUTE_COUNT_LIMIT": (f"max_{kind.lower()}_attributes", _count_or(_COUNT, 128),
                                             f"{_COUNT}, else 128") for kind in ("SPAN", "EVENT", "LINK")},
    "OTEL_SPAN_EVENT_COUNT_LIMIT": ("max_events", 128, "128"),
    "OTEL_SPAN_LINK_COUNT_LIMIT": ("max_links", 128, "128"),
    _LENGTH: ("max_attribute_length", _NO_LIMIT, "no limit"),
    "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT": ("max_span_attribute_length", _count_or(_LENGTH, _NO_LIMIT),
                                               f"{_LENGTH}, else no limit"),
}

BATCH_SPAN_PROCESSOR: dict[str, Retry] = {  # the batch size first: it is checked against the queue size
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": (
        "max_export_batch_size", lambda: min(512, _count_or("OTEL_BSP_MAX_QUEUE_SIZE", 2048)() or 2048),
        "512, or the queue size when that is smaller"),
    "OTEL_BSP_SCHEDULE_DELAY": ("schedule_delay_millis", 5000, "5000"),
    "OTEL_BSP_EXPORT_TIMEOUT": ("export_timeout_millis", 30000, "30000"),
    "OTEL_BSP_MAX_QUEUE_SIZE": ("max_queue_size", 2048, "2048"),
}

METRIC_READER: dict[str, Retry] = {
    "OTEL_METRIC_EXPORT_INTERVAL": ("export_interval_millis", 60000.0, "60000"),
    "OTEL_METRIC_EXPORT_TIMEOUT": ("export_timeout_millis", 30000.0, "30000"),
}

METER_PROVIDER: dict[str, Retry] = {
    "OTEL_METRICS_EXEMPLAR_FILTER": ("exemplar_filter", _exemplar_filter, "trace_based"),
}


def otlp_exporter(signal: str, protocol: str) -> dict[str, Retry]:
    """What the OTLP exporter of ``signal`` (``traces``, ``metrics``) over ``protocol`` is retried with."""
    import importlib

    grpc = protocol == "grpc"
    none = importlib.import_module("grpc" if grpc else "opentelemetry.exporter.otlp.proto.http").Compression
    endpoint = "http://localhost:4317" if grpc else f"http://localhost:4318/v1/{signal}"
    retries: dict[str, Retry] = {}
    for suffix, retry in (("ENDPOINT", ("endpoint", endpoint, endpoint)),
                          ("TIMEOUT", ("timeout", 10.0, "10")),
                          ("COMPRESSION", ("compression", none.NoCompression, "none"))):
        retries[f"OTEL_EXPORTER_OTLP_{signal.upper()}_{suffix}"] = retries[f"OTEL_EXPORTER_OTLP_{suffix}"] = retry
    return retries


def _value(default: Any) -> Any:
    return default() if callable(default) else default


def positive(text: str) -> bool:
    """Whether ``text`` is a time the SDK may take: > 0 and finite (not a number: the SDK's parse decides)."""
    try:
        return 0 < float(text) < float("inf")
    except ValueError:  # not a number: the SDK's own parse decides
        return True


def build(what: str, make: Callable[..., Any], retries: Mapping[str, Retry]) -> Any:
    """``make()``, a time of ``retries`` <= 0 or infinite replaced by its default (the SDK would
    take it: every export fails, or none happens); while it raises, the variable whose default
    cures the error is replaced too. One WARNING per variable replaced; None (warned) if none helps."""
    given = [name for name in retries if raw(name) is not None]
    chosen = {n: "is not > 0" for n in given if n.endswith(("TIMEOUT", "INTERVAL", "DELAY"))
              and not positive(os.environ[n])}

    def attempt(names: Any) -> tuple[Any, Exception | None]:
        try:
            return make(**{retries[n][0]: _value(retries[n][1]) for n in names}), None
        except Exception as exc:  # pylint: disable=broad-except  # never into the host
            return None, exc

    built, error = attempt(chosen)
    while error is not None:
        for n in (n for n in given if n not in chosen):
            built, after = attempt([*chosen, n])
            if after is None or str(after) != str(error):  # n was what the constructor rejected
                chosen[n] = f"is rejected by the SDK ({type(error).__name__}: {error})"
                error = after
                break
        else:
            read = "".join(f"; check {name}={os.environ[name]!r}" for name in given)
            warn_once(f"otel_environment:{what}", "otel-hicache: cannot create the %s (%s: %s)%s; it is left out",
                      what, type(error).__name__, error, read)
            return None
    for n, problem in chosen.items():
        if os.environ[n].strip().lower() not in MEANT.get(n.replace("_OTLP_TRACES_", "_OTLP_")
                                                          .replace("_OTLP_METRICS_", "_OTLP_"), ()):
            warn_once(f"otel_environment:{n}", "otel-hicache: %s=%r %s; using %s instead", n, os.environ[n],
                      problem, retries[n][2])
    return built


def certificate_usable(signal: str, protocol: str) -> bool:
    """False, warned about once, when the signal's CA certificate cannot be read and the
    connection would use TLS: there is no safe default (the gRPC exporters would fall back
    to the system's CA certificates, the HTTP ones fail every export)."""
    name = next((n for n in (f"OTEL_EXPORTER_OTLP_{signal.upper()}_CERTIFICATE", "OTEL_EXPORTER_OTLP_CERTIFICATE")
                 if raw(n) is not None), None)
    if name is None or (protocol != "grpc" and os.path.isdir(os.environ[name])):  # requests takes a directory
        return True
    try:
        with open(os.environ[name], "rb") as file:
            file.read(1)
        return True
    except OSError as exc:
        problem = f"{name}={os.environ[name]!r} cannot be read ({type(exc).__name__})"
    endpoint = (raw(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT") or raw("OTEL_EXPORTER_OTLP_ENDPOINT")
                or "http://localhost").strip()
    scheme = endpoint.partition("://")[0].lower() if "://" in endpoint else ""
    insecure = raw(f"OTEL_EXPORTER_OTLP_{signal.upper()}_INSECURE") or raw("OTEL_EXPORTER_OTLP_INSECURE") or ""
    if scheme != "https" and (protocol != "grpc" or scheme == "http" or insecure.strip().lower() == "true"):
        return True  # plain text: the certificate is unused
    warn_once(f"certificate:{problem}", "otel-hicache: %s; there is no safe default for a CA certificate, so what "
              "would be exported with it over TLS is not exported", problem)
    return False
