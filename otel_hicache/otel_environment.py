"""The standard ``OTEL_*`` variables otel-hicache's providers depend on, validated.

:func:`otel_hicache.configure` builds its tracer and meter providers from the
standard variables. Given a malformed value, the bare SDK and OTLP exporters
(1.45) may raise from a constructor (which would crash the host in
``configure()``), use the value as it is (a negative timeout fails every
export, a bad endpoint fails every export), log a line that does not name the
variable, or quietly fall back to a default. Here every variable is checked up
front, each time ``configure()`` builds providers (so once per process):

* a valid value, an unset one or an empty one (the specification's "unset") is
  left to the SDK, which reads it as specified;
* a malformed value is reported by one WARNING per process that names the
  variable, the value and what is used instead (``otel-hicache: OTEL_X='bad'
  is not ...; using ... instead``), and that default is passed explicitly to
  the SDK constructor, so the malformed value does not decide anything.

``os.environ`` is never modified: the host application (SGLang and its own
OpenTelemetry tracing) shares it. Every function here returns the keyword
arguments for one SDK object: :func:`otlp_exporter` (span and metric exporters,
per protocol), :func:`batch_span_processor`, :func:`metric_reader`,
:func:`meter_provider`, :func:`tracer_provider` (sampler and span limits),
:func:`console_metric_exporter`, and :func:`resource` builds the resource.

:data:`VARIABLES` is the table of what is accepted and the default used for
each variable; ``docs/configuration.md`` ("Malformed values") says the same.
"""

from __future__ import annotations

import math
import os
import re
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable
from urllib.parse import urlsplit

from .diagnostics import warn_once

GRPC = "grpc"
HTTP_PROTOBUF = "http/protobuf"
PROTOCOLS = (GRPC, HTTP_PROTOBUF)
EXPORTERS = ("otlp", "console", "none")

_ENDPOINT_ACCEPTED = (
    "an `http://` or `https://` URL with a host and a port in 1-65535; with `grpc` also `host:port` "
    "and gRPC target names (`unix:`, `dns:`, `ipv4:`, `ipv6:`...)"
)
_TIMEOUT_ACCEPTED = "a number > 0, in seconds (the Python exporters' unit)"
_HEADERS_ACCEPTED = "comma-separated `name=value`, the value URL-encoded"
_COUNT_ACCEPTED = "an integer >= 0"

VARIABLES: dict[str, tuple[str, str]] = {
    # variable (``{TRACES,METRICS}``: both per-signal forms): (accepted, default used for a malformed value)
    "OTEL_SDK_DISABLED": ("`true` or `false`, any case", "`false`"),
    "OTEL_SERVICE_NAME": (
        "a name that is not only blanks",
        "`service.name` from `OTEL_RESOURCE_ATTRIBUTES`, else `unknown_service:<executable>`",
    ),
    "OTEL_RESOURCE_ATTRIBUTES": (
        "comma-separated `key=value`, the value URL-encoded",
        "the valid entries (malformed ones are dropped)",
    ),
    "OTEL_TRACES_EXPORTER": (
        "comma-separated `otlp`, `console`, `none` or installed entry-point names",
        "the known names (unknown ones are skipped)",
    ),
    "OTEL_METRICS_EXPORTER": (
        "comma-separated `otlp`, `console`, `none` or installed entry-point names",
        "the known names (unknown ones are skipped)",
    ),
    "OTEL_EXPORTER_OTLP_PROTOCOL": ("`grpc`, `http/protobuf`", "`grpc`"),
    "OTEL_EXPORTER_OTLP_{TRACES,METRICS}_PROTOCOL": ("`grpc`, `http/protobuf`", "the general value"),
    "OTEL_EXPORTER_OTLP_ENDPOINT": (
        _ENDPOINT_ACCEPTED,
        "`http://localhost:4317` (grpc), `http://localhost:4318` (http/protobuf)",
    ),
    "OTEL_EXPORTER_OTLP_{TRACES,METRICS}_ENDPOINT": (
        _ENDPOINT_ACCEPTED,
        "the general value (plus `/v1/traces` or `/v1/metrics` with http/protobuf), else "
        "`http://localhost:4317` (grpc), `http://localhost:4318/v1/traces` or `/v1/metrics` (http/protobuf)",
    ),
    "OTEL_EXPORTER_OTLP_TIMEOUT": (_TIMEOUT_ACCEPTED, "`10`"),
    "OTEL_EXPORTER_OTLP_{TRACES,METRICS}_TIMEOUT": (_TIMEOUT_ACCEPTED, "the general value, else `10`"),
    "OTEL_EXPORTER_OTLP_HEADERS": (_HEADERS_ACCEPTED, "the valid entries (malformed ones are dropped)"),
    "OTEL_EXPORTER_OTLP_{TRACES,METRICS}_HEADERS": (
        _HEADERS_ACCEPTED,
        "the valid entries of that variable, which replaces the general one",
    ),
    "OTEL_EXPORTER_OTLP_COMPRESSION": ("`gzip`, `none`; `deflate` with http/protobuf only", "`none`"),
    "OTEL_EXPORTER_OTLP_{TRACES,METRICS}_COMPRESSION": (
        "`gzip`, `none`; `deflate` with http/protobuf only",
        "the general value, else `none`",
    ),
    "OTEL_EXPORTER_OTLP_CERTIFICATE": (
        "a readable file (with http/protobuf also a directory of CA certificates)",
        "none: over TLS the signal is not exported; unused over plain text",
    ),
    "OTEL_EXPORTER_OTLP_{TRACES,METRICS}_CERTIFICATE": (
        "a readable file (with http/protobuf also a directory of CA certificates)",
        "none: over TLS the signal is not exported; unused over plain text",
    ),
    "OTEL_TRACES_SAMPLER": (
        "`always_on`, `always_off`, `traceidratio`, `parentbased_always_on`, `parentbased_always_off`, "
        "`parentbased_traceidratio`",
        "`parentbased_always_on`",
    ),
    "OTEL_TRACES_SAMPLER_ARG": ("a number in [0, 1] (read by the ratio samplers only)", "`1.0`"),
    "OTEL_METRIC_EXPORT_INTERVAL": ("a number > 0, in milliseconds", "`60000`"),
    "OTEL_METRIC_EXPORT_TIMEOUT": ("a number > 0, in milliseconds", "`30000`"),
    "OTEL_BSP_SCHEDULE_DELAY": ("an integer > 0, in milliseconds", "`5000`"),
    "OTEL_BSP_EXPORT_TIMEOUT": ("an integer > 0, in milliseconds", "`30000`"),
    "OTEL_BSP_MAX_QUEUE_SIZE": ("an integer > 0", "`2048`"),
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": (
        "an integer > 0, at most the queue size",
        "`512`, or the queue size when that is smaller",
    ),
    "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE": ("`cumulative`, `delta`, `lowmemory`", "`cumulative`"),
    "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION": (
        "`explicit_bucket_histogram`, `base2_exponential_bucket_histogram`",
        "`explicit_bucket_histogram`",
    ),
    "OTEL_METRICS_EXEMPLAR_FILTER": ("`trace_based`, `always_on`, `always_off`, any case", "`trace_based`"),
    "OTEL_ATTRIBUTE_COUNT_LIMIT": (_COUNT_ACCEPTED, "`128`"),
    "OTEL_{SPAN,EVENT,LINK}_ATTRIBUTE_COUNT_LIMIT": (_COUNT_ACCEPTED, "`OTEL_ATTRIBUTE_COUNT_LIMIT`, else `128`"),
    "OTEL_SPAN_{EVENT,LINK}_COUNT_LIMIT": (_COUNT_ACCEPTED, "`128`"),
    "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": (_COUNT_ACCEPTED, "no limit"),
    "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT": (
        _COUNT_ACCEPTED,
        "`OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT`, else no limit",
    ),
}
"""What each variable accepts and the default used instead of a malformed value."""


# -- reading one variable ---------------------------------------------------------------------

_UNSET = object()  # unset or empty: the SDK reads it as specified
_BAD = object()  # malformed: warned about, the default is used


def _raw(name: str) -> str | None:
    raw = os.environ.get(name)
    return None if raw is None or not raw.strip() else raw


def _warn(name: str, shown: str, problem: str, using: str) -> None:
    warn_once(f"otel_environment:{name}={shown}", "otel-hicache: %s=%s %s; using %s instead", name, shown,
              problem, using)


def _value(name: str, parse: Callable[[str], Any], using: str) -> Any:
    """``parse(raw)``; ``_UNSET`` when unset or empty; ``_BAD`` when ``parse`` raises
    ValueError, after one warning that says ``using`` is used instead."""
    raw = _raw(name)
    if raw is None:
        return _UNSET
    try:
        return parse(raw)
    except ValueError as exc:
        _warn(name, repr(raw), str(exc), using)
        return _BAD


def _per_signal(signal: str, suffix: str) -> tuple[str, str]:
    """The per-signal and the general variable: ``OTEL_EXPORTER_OTLP_TRACES_<suffix>``, ``OTEL_EXPORTER_OTLP_<suffix>``."""
    return f"OTEL_EXPORTER_OTLP_{signal.upper()}_{suffix}", f"OTEL_EXPORTER_OTLP_{suffix}"


# -- parsers: each returns the value or raises ValueError("<what is wrong>") --------------------


def _number(integer: bool, minimum: float, inclusive: bool) -> Callable[[str], Any]:
    kind = "an integer" if integer else "a number"
    expected = f"is not {kind} {'>=' if inclusive else '>'} {minimum:g}"

    def parse(raw: str) -> Any:
        try:
            value = int(raw.strip()) if integer else float(raw.strip())
        except ValueError:
            raise ValueError(expected) from None
        if not math.isfinite(value) or value < minimum or (value == minimum and not inclusive):
            raise ValueError(expected)
        return value

    return parse


_POSITIVE_INT = _number(integer=True, minimum=0, inclusive=False)
_POSITIVE_NUMBER = _number(integer=False, minimum=0, inclusive=False)
_COUNT = _number(integer=True, minimum=0, inclusive=True)


def _choice(options: tuple[str, ...], what: str = "") -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in options:
            raise ValueError(f"is not {what or 'supported'} ({', '.join(options)})")
        return value

    return parse


def _ratio(raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        raise ValueError("is not a number in [0, 1]") from None
    if not 0.0 <= value <= 1.0:  # also rejects nan
        raise ValueError("is not a number in [0, 1]")
    return value


_GRPC_TARGET_PREFIXES = ("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:", "vsock:")
_HOST_NAME = re.compile(r"[A-Za-z0-9_~.-]+")
_IPV6 = re.compile(r"[0-9A-Fa-f:.]+(%[A-Za-z0-9_.~-]+)?")


def _check_authority(authority: str) -> None:
    """``host[:port]``: a host of URL characters and, when given, a port in 1-65535."""
    parts = urlsplit("//" + authority)
    try:
        port = parts.port
    except ValueError:
        raise ValueError("has an invalid port (expected 1-65535)") from None
    host = parts.hostname or ""
    bracketed = "[" in parts.netloc
    if not host or not (_IPV6.fullmatch(host) if bracketed else _HOST_NAME.fullmatch(host)):
        raise ValueError("has no valid host")
    if port == 0:
        raise ValueError("has an invalid port (expected 1-65535)")
    if parts.path or parts.query or parts.fragment:
        raise ValueError("is not host:port")


def _endpoint_parser(protocol: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip()
        if protocol == GRPC and value.lower().startswith(_GRPC_TARGET_PREFIXES):
            return value  # a gRPC target name, given to the channel as it is
        if "://" not in value:
            if protocol == GRPC:
                _check_authority(value)  # host:port, as the Python gRPC exporter accepts
                return value
            raise ValueError("is not a URL (expected http://host:port or https://host:port)")
        scheme, _, rest = value.partition("://")
        if scheme.lower() not in ("http", "https"):
            raise ValueError(f"has the unsupported scheme {scheme!r} (expected http or https)")
        _check_authority(rest.split("/", 1)[0].split("?", 1)[0].rpartition("@")[2])
        return value

    return parse


# -- exporters ----------------------------------------------------------------------------------


# The SDK's own entry-point groups: what OTEL_TRACES_EXPORTER / OTEL_METRICS_EXPORTER name
# (otlp_proto_grpc, otlp_proto_http, console, prometheus, ... whatever is installed).
ENTRY_POINT_GROUPS = {
    "OTEL_TRACES_EXPORTER": "opentelemetry_traces_exporter",
    "OTEL_METRICS_EXPORTER": "opentelemetry_metrics_exporter",
}


def exporter_entry_point(variable: str, name: str) -> Any:
    """The installed entry point ``name`` of the SDK's exporter group for ``variable``, or None."""
    from importlib.metadata import entry_points

    found = list(entry_points(group=ENTRY_POINT_GROUPS[variable], name=name))
    return found[0] if found else None


def exporter_names(variable: str) -> list[str]:
    """``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER``: ``otlp``, ``console``, ``none``
    or the name of an installed exporter entry point; other names are warned about and skipped."""
    raw = os.environ.get(variable, "otlp")
    names = [n.strip().lower() for n in raw.split(",") if n.strip()] or ["otlp"]
    known = []
    for name in names:
        if name in EXPORTERS or exporter_entry_point(variable, name) is not None:
            known.append(name)
        else:
            warn_once(
                f"exporter:{variable}:{name}",
                "otel-hicache: %s=%r: unknown exporter %r (otlp, console, none, or an installed %s entry "
                "point); skipping it",
                variable,
                raw,
                name,
                ENTRY_POINT_GROUPS[variable],
            )
    if "none" in known:
        return []
    return known


def protocol(signal: str) -> str:
    """The OTLP protocol of ``signal`` (``traces`` or ``metrics``); an unsupported value is warned and ignored."""
    for variable in _per_signal(signal, "PROTOCOL"):
        raw = os.environ.get(variable)
        if raw:
            value = raw.strip().lower()
            if value in PROTOCOLS:
                return value
            warn_once(
                f"protocol:{variable}",
                "otel-hicache: %s=%r is not supported (grpc, http/protobuf); ignoring it",
                variable,
                raw,
            )
    return GRPC


@dataclass
class ExporterSettings:
    """Keyword arguments for one OTLP exporter, and the per-signal variables its own
    ``__init__`` must not see (the gRPC exporters parse some of them even when the
    keyword argument is given, and raise)."""

    kwargs: dict[str, Any] = field(default_factory=dict)
    hidden: set[str] = field(default_factory=set)


def _per_signal_value(signal: str, suffix: str, parse: Callable[[str], Any], default: Any,
                      shown_default: str) -> tuple[Any, bool, bool]:
    """(value to use, whether a malformed value was involved, whether the per-signal one is malformed).

    A malformed per-signal value is ignored (the general one applies), as a
    malformed general one is (the default applies)."""
    per, general = _per_signal(signal, suffix)
    general_value = _value(general, parse, f"the default {shown_default}")
    fallback = default if general_value in (_UNSET, _BAD) else general_value
    shown_fallback = (f"the default {shown_default}" if general_value in (_UNSET, _BAD)
                      else f"the value of {general} ({fallback})")
    per_value = _value(per, parse, shown_fallback)
    if per_value not in (_UNSET, _BAD):
        return per_value, False, False
    return fallback, _BAD in (general_value, per_value), per_value is _BAD


def _endpoint(signal: str, protocol_: str) -> tuple[str | None, str]:
    """(the endpoint to pass, or None to let the exporter read it; the endpoint it will use)."""
    per, general = _per_signal(signal, "ENDPOINT")
    parse = _endpoint_parser(protocol_)
    path = f"/v1/{signal}" if protocol_ == HTTP_PROTOBUF else ""
    default = "http://localhost:4317" if protocol_ == GRPC else "http://localhost:4318"
    general_value = _value(general, parse, f"the default {default}")
    base = default if general_value in (_UNSET, _BAD) else general_value
    derived = base.rstrip("/") + path if path else base  # the specification's rule for the general endpoint
    shown = (f"the default {derived}" if general_value in (_UNSET, _BAD)
             else f"the value of {general} ({derived})")
    per_value = _value(per, parse, shown)
    if per_value not in (_UNSET, _BAD):
        return (None if per_value == os.environ.get(per) else per_value), per_value
    explicit = _BAD in (general_value, per_value) or (
        general_value is not _UNSET and general_value != os.environ.get(general))
    return (derived if explicit else None), derived


def _timeout(signal: str) -> tuple[float | None, bool]:
    """(the timeout to pass, or None to let the exporter read it; whether the per-signal one is malformed)."""
    value, malformed, per_malformed = _per_signal_value(signal, "TIMEOUT", _POSITIVE_NUMBER, 10.0, "10")
    return (value if malformed else None), per_malformed


def _compression(signal: str, protocol_: str) -> Any:
    if protocol_ == GRPC:
        from grpc import Compression

        options = {"gzip": Compression.Gzip, "none": Compression.NoCompression}
        what = "supported by the gRPC exporter"
    else:
        from opentelemetry.exporter.otlp.proto.http import Compression  # type: ignore[no-redef]

        options = {"gzip": Compression.Gzip, "deflate": Compression.Deflate, "none": Compression.NoCompression}
        what = "supported by the HTTP exporter"
    per, general = _per_signal(signal, "COMPRESSION")
    if _raw(per) is None and _raw(general) is None:
        return None
    # always explicit when set: the gRPC exporter raises on "none", a valid value
    name, _, _ = _per_signal_value(signal, "COMPRESSION", _choice(tuple(options), what), "none", "none")
    return options[name]


_HEADER = re.compile(
    r"[ \t]*[\x21\x23-\x27\x2a\x2b\x2d\x2e\x30-\x39\x41-\x5a\x5e-\x7a\x7c\x7e]+[ \t]*=[ \t]*"
    r"[\x20\x21\x23-\x2b\x2d-\x3a\x3c-\x5b\x5d-\x7e]*[ \t]*"
)  # the exporters' own (liberal) name=value rule


def _headers_of(name: str) -> dict[str, str] | None:
    """The valid entries of ``name`` when some are malformed (warned once; values are
    never logged, headers carry credentials), else None."""
    from opentelemetry.util.re import parse_env_headers

    raw = _raw(name)
    if raw is None:
        return None
    entries = [e for e in re.split(r"[ \t]*,[ \t]*", raw) if e]
    bad = [i + 1 for i, e in enumerate(entries) if not _HEADER.fullmatch(e.strip())]
    if not bad:
        return None
    good = parse_env_headers(",".join(e for e in entries if _HEADER.fullmatch(e.strip())), liberal=True)
    _warn(name, f"<{len(entries)} entries, not shown>",
          f"has malformed entries (number {', '.join(map(str, bad))}; expected name=value, the value URL-encoded)",
          f"the valid entries only ({', '.join(good) or 'none'})")
    return dict(good)


def _headers(signal: str) -> dict[str, str] | None:
    per, general = _per_signal(signal, "HEADERS")
    general_headers = _headers_of(general)
    if _raw(per) is not None:  # the per-signal variable replaces the general one
        return _headers_of(per)
    return general_headers


def _uses_tls(protocol_: str, signal: str, endpoint: str) -> bool:
    """Whether the exporter will connect with TLS (the exporters' own rules)."""
    scheme = endpoint.partition("://")[0].lower() if "://" in endpoint else ""
    if protocol_ == HTTP_PROTOBUF:
        return scheme == "https"
    if scheme == "https":
        return True
    for variable in _per_signal(signal, "INSECURE"):
        insecure = os.environ.get(variable)
        if insecure is not None:
            return insecure.lower() != "true"
    return scheme != "http"


def _unreadable(path: str, protocol_: str) -> str | None:
    """Why ``path`` cannot serve as a CA certificate, or None."""
    if protocol_ == HTTP_PROTOBUF and os.path.isdir(path):
        return None  # requests takes a directory of CA certificates
    try:
        with open(path, "rb") as file:
            file.read(1)
    except OSError as exc:
        return f"cannot be read ({type(exc).__name__}: {exc.strerror or exc})"
    return None


def _certificate(signal: str, protocol_: str, endpoint: str, settings: ExporterSettings) -> bool:
    """False when the signal must not be exported: its CA certificate cannot be read and the
    connection uses TLS (there is no safe default for a certificate)."""
    per, general = _per_signal(signal, "CERTIFICATE")
    variable = per if _raw(per) is not None else general
    path = _raw(variable)
    if path is None:
        return True
    problem = _unreadable(path, protocol_)
    if problem is None:
        return True
    warn_once(  # once per variable, whichever signals use it
        f"otel_environment:{variable}={path!r}",
        "otel-hicache: %s=%r %s; there is no safe default for a CA certificate, so what would be exported over "
        "TLS with it is not exported (no fallback to the system CA certificates or to plain text); over plain "
        "text it is unused",
        variable, path, problem,
    )
    if _uses_tls(protocol_, signal, endpoint):
        return False
    if protocol_ == GRPC:
        settings.hidden.add(per)  # the gRPC exporter reads a per-signal certificate even over plain text
    return True


def otlp_exporter(signal: str, protocol_: str) -> ExporterSettings | None:
    """The keyword arguments for the OTLP exporter of ``signal`` (``traces`` or
    ``metrics``) over ``protocol_``; None when it must not be built (warned)."""
    settings = ExporterSettings()
    endpoint, effective = _endpoint(signal, protocol_)
    if endpoint is not None:
        settings.kwargs["endpoint"] = endpoint
    timeout, per_timeout_malformed = _timeout(signal)
    if timeout is not None:
        settings.kwargs["timeout"] = timeout
    if per_timeout_malformed and protocol_ == GRPC:
        settings.hidden.add(_per_signal(signal, "TIMEOUT")[0])  # parsed by float() whatever timeout= says
    compression = _compression(signal, protocol_)
    if compression is not None:
        settings.kwargs["compression"] = compression
    headers = _headers(signal)
    if headers is not None:
        settings.kwargs["headers"] = headers
    if not _certificate(signal, protocol_, effective, settings):
        return None
    if signal == "metrics":
        settings.kwargs.update(_otlp_metric_preferences())
    return settings


def construct(cls: Any, settings: ExporterSettings) -> Any:
    """``cls(**settings.kwargs)``, with the variables in ``settings.hidden`` invisible to
    ``cls.__init__``'s own reads of ``environ`` (a private copy of its globals; nothing
    shared is modified, ``os.environ`` included)."""
    init = cls.__init__
    namespace = getattr(init, "__globals__", None)
    if not settings.hidden or namespace is None or namespace.get("environ") is not os.environ:
        return cls(**settings.kwargs)
    view = {k: v for k, v in os.environ.items() if k not in settings.hidden}
    private_init = types.FunctionType(init.__code__, {**namespace, "environ": view}, init.__name__,
                                      init.__defaults__, init.__closure__)
    private_init.__kwdefaults__ = init.__kwdefaults__
    exporter = cls.__new__(cls)
    private_init(exporter, **settings.kwargs)
    return exporter


# -- metric exporters, reader, meter provider -----------------------------------------------------

_TEMPORALITY = "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE"
_HISTOGRAM_AGGREGATION = "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION"
_AGGREGATIONS = ("explicit_bucket_histogram", "base2_exponential_bucket_histogram")


def _otlp_metric_preferences() -> dict[str, Any]:
    """Cumulative temporality / explicit buckets, explicitly, instead of a malformed preference
    (the OTLP exporters read the variables themselves and log their own line as well)."""
    from opentelemetry.sdk.metrics import (
        Counter,
        Histogram,
        ObservableCounter,
        ObservableGauge,
        ObservableUpDownCounter,
        UpDownCounter,
    )
    from opentelemetry.sdk.metrics.export import AggregationTemporality
    from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation

    kwargs: dict[str, Any] = {}
    if _value(_TEMPORALITY, _choice(("cumulative", "delta", "lowmemory")), "cumulative") is _BAD:
        instruments = (Counter, UpDownCounter, Histogram, ObservableCounter, ObservableUpDownCounter,
                       ObservableGauge)
        kwargs["preferred_temporality"] = {i: AggregationTemporality.CUMULATIVE for i in instruments}
    if _value(_HISTOGRAM_AGGREGATION, _choice(_AGGREGATIONS), _AGGREGATIONS[0]) is _BAD:
        kwargs["preferred_aggregation"] = {Histogram: ExplicitBucketHistogramAggregation()}
    return kwargs


def console_metric_exporter() -> dict[str, Any]:
    """The histogram aggregation preference for the console exporter (which reads no variable)."""
    from opentelemetry.sdk.metrics import Histogram
    from opentelemetry.sdk.metrics.view import ExponentialBucketHistogramAggregation

    if _value(_HISTOGRAM_AGGREGATION, _choice(_AGGREGATIONS), _AGGREGATIONS[0]) == _AGGREGATIONS[1]:
        return {"preferred_aggregation": {Histogram: ExponentialBucketHistogramAggregation()}}
    return {}  # explicit buckets: the instruments' second-based advisory boundaries


_NUMBERS: dict[str, tuple[str, Callable[[str], Any], Any]] = {
    # variable: (constructor keyword, parser, default)
    "OTEL_METRIC_EXPORT_INTERVAL": ("export_interval_millis", _POSITIVE_NUMBER, 60000.0),
    "OTEL_METRIC_EXPORT_TIMEOUT": ("export_timeout_millis", _POSITIVE_NUMBER, 30000.0),
    "OTEL_BSP_SCHEDULE_DELAY": ("schedule_delay_millis", _POSITIVE_INT, 5000),
    "OTEL_BSP_EXPORT_TIMEOUT": ("export_timeout_millis", _POSITIVE_INT, 30000),
    "OTEL_BSP_MAX_QUEUE_SIZE": ("max_queue_size", _POSITIVE_INT, 2048),
}  # OTEL_BSP_MAX_EXPORT_BATCH_SIZE: see batch_span_processor()


def _numbers(*variables: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(keyword arguments for the malformed ones, the value in effect for each variable)."""
    kwargs, effective = {}, {}
    for variable in variables:
        keyword, parse, default = _NUMBERS[variable]
        value = _value(variable, parse, f"the default {default:g}")
        if value is _BAD:
            kwargs[keyword] = default
        effective[variable] = default if value in (_UNSET, _BAD) else value
    return kwargs, effective


def metric_reader() -> dict[str, Any]:
    """Keyword arguments for ``PeriodicExportingMetricReader``."""
    return _numbers("OTEL_METRIC_EXPORT_INTERVAL", "OTEL_METRIC_EXPORT_TIMEOUT")[0]


def batch_span_processor() -> dict[str, Any]:
    """Keyword arguments for ``BatchSpanProcessor`` (the batch size at most the queue size:
    the SDK raises otherwise)."""
    kwargs, effective = _numbers("OTEL_BSP_SCHEDULE_DELAY", "OTEL_BSP_EXPORT_TIMEOUT", "OTEL_BSP_MAX_QUEUE_SIZE")
    queue = effective["OTEL_BSP_MAX_QUEUE_SIZE"]
    default = min(512, queue)
    shown = "the default 512" if default == 512 else f"the queue size {queue}"
    batch = _value("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", _POSITIVE_INT, shown)
    if batch not in (_UNSET, _BAD) and batch > queue:
        _warn("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", repr(os.environ["OTEL_BSP_MAX_EXPORT_BATCH_SIZE"]),
              f"is larger than the queue size ({queue})", shown)
        batch = _BAD
    if batch is _BAD or (batch is _UNSET and default != 512):
        kwargs["max_export_batch_size"] = default
    return kwargs


_EXEMPLAR_FILTERS = ("trace_based", "always_on", "always_off")


def meter_provider() -> dict[str, Any]:
    """Keyword arguments for ``MeterProvider`` (the SDK raises on an unknown exemplar
    filter, and on a valid one in capitals)."""
    from opentelemetry.sdk.metrics import (
        AlwaysOffExemplarFilter,
        AlwaysOnExemplarFilter,
        TraceBasedExemplarFilter,
    )

    value = _value("OTEL_METRICS_EXEMPLAR_FILTER", _choice(_EXEMPLAR_FILTERS), "trace_based")
    if value is _UNSET:
        return {}
    filters = {"trace_based": TraceBasedExemplarFilter, "always_on": AlwaysOnExemplarFilter,
               "always_off": AlwaysOffExemplarFilter}
    return {"exemplar_filter": filters["trace_based" if value is _BAD else value]()}


# -- tracer provider: sampler and span limits ------------------------------------------------------

_SAMPLERS = ("always_on", "always_off", "traceidratio", "parentbased_always_on", "parentbased_always_off",
             "parentbased_traceidratio")


def _sampler() -> Any:
    """The sampler, explicitly whenever ``OTEL_TRACES_SAMPLER`` is set; None when it is not."""
    from opentelemetry.sdk.trace import sampling

    name = _value("OTEL_TRACES_SAMPLER", _choice(_SAMPLERS), "parentbased_always_on")
    if name is _UNSET:
        return None
    if name is _BAD:
        name = "parentbased_always_on"
    if name.endswith("traceidratio"):
        rate = _value("OTEL_TRACES_SAMPLER_ARG", _ratio, "1.0")
        rate = 1.0 if rate in (_UNSET, _BAD) else rate
        return sampling.TraceIdRatioBased(rate) if name == "traceidratio" else sampling.ParentBasedTraceIdRatio(rate)
    return {"always_on": sampling.ALWAYS_ON, "always_off": sampling.ALWAYS_OFF,
            "parentbased_always_on": sampling.DEFAULT_ON, "parentbased_always_off": sampling.DEFAULT_OFF}[name]


_SPAN_LIMITS: dict[str, tuple[str, int | None, str | None]] = {
    # variable: (SpanLimits keyword, default (None: no limit), the variable whose value it defaults to)
    "OTEL_ATTRIBUTE_COUNT_LIMIT": ("max_attributes", 128, None),
    "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT": ("max_span_attributes", 128, "OTEL_ATTRIBUTE_COUNT_LIMIT"),
    "OTEL_EVENT_ATTRIBUTE_COUNT_LIMIT": ("max_event_attributes", 128, "OTEL_ATTRIBUTE_COUNT_LIMIT"),
    "OTEL_LINK_ATTRIBUTE_COUNT_LIMIT": ("max_link_attributes", 128, "OTEL_ATTRIBUTE_COUNT_LIMIT"),
    "OTEL_SPAN_EVENT_COUNT_LIMIT": ("max_events", 128, None),
    "OTEL_SPAN_LINK_COUNT_LIMIT": ("max_links", 128, None),
    "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": ("max_attribute_length", None, None),
    "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT": ("max_span_attribute_length", None, "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT"),
}


def _span_limits() -> Any:
    """Explicit ``SpanLimits`` when a limit is malformed (the SDK raises), else None."""
    from opentelemetry.sdk.trace import SpanLimits

    values: dict[str, Any] = {}
    kwargs: dict[str, Any] = {}
    for variable, (keyword, default, parent) in _SPAN_LIMITS.items():  # parents come first
        parent_value = values.get(parent, _UNSET) if parent else _UNSET
        fallback = default if parent_value in (_UNSET, _BAD) else parent_value
        if fallback is None:
            shown = "no limit"
        elif parent_value in (_UNSET, _BAD):
            shown = f"the default {fallback}"
        else:
            shown = f"the value of {parent} ({fallback})"
        values[variable] = value = _value(variable, _COUNT, shown)
        if value is _BAD:
            kwargs[keyword] = SpanLimits.UNSET if fallback is None else fallback
    return SpanLimits(**kwargs) if kwargs else None


def tracer_provider() -> dict[str, Any]:
    """Keyword arguments for ``TracerProvider``: the sampler, and span limits when one is malformed."""
    kwargs = {}
    sampler = _sampler()
    if sampler is not None:
        kwargs["sampler"] = sampler
    limits = _span_limits()
    if limits is not None:
        kwargs["span_limits"] = limits
    return kwargs


# -- resource and OTEL_SDK_DISABLED ---------------------------------------------------------------


def _resource_attributes() -> dict[str, str]:
    """The valid entries of ``OTEL_RESOURCE_ATTRIBUTES``; malformed ones warned about (the
    SDK drops the same entries, with a line of its own for each)."""
    from urllib.parse import unquote

    raw = _raw("OTEL_RESOURCE_ATTRIBUTES")
    if raw is None:
        return {}
    good: dict[str, str] = {}
    bad = []
    for entry in raw.split(","):
        key, sep, value = entry.partition("=")
        if not sep or not key.strip():
            bad.append(entry)
        else:
            good[key.strip()] = unquote(value.strip())
    if bad:
        _warn("OTEL_RESOURCE_ATTRIBUTES", repr(raw),
              f"has malformed entries {', '.join(map(repr, bad))} (expected key=value)",
              f"the valid entries only ({', '.join(good) or 'none'})")
    return good


def resource() -> Any:
    """The resource from ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` (SDK rules)."""
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    attributes = _resource_attributes()
    built = Resource.create()
    raw = os.environ.get("OTEL_SERVICE_NAME")
    if raw and not raw.strip():  # the SDK would use the blanks as the name
        name = attributes.get(SERVICE_NAME) or f"unknown_service:{os.path.basename(sys.executable or 'python')}"
        _warn("OTEL_SERVICE_NAME", repr(raw), "is blank", repr(name))
        built = built.merge(Resource({SERVICE_NAME: name}))
    return built
