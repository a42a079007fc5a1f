"""The standard ``OTEL_*`` variables, malformed ones replaced (warned), blank ones unset, TLS files checked."""

from __future__ import annotations

import os
import stat
import string
from pathlib import Path
from typing import Any, Callable, Mapping
from urllib.parse import unquote

from ..diagnostics import shown, userinfo, warn_once, withhold, without_userinfo

# (the constructor's keyword, the value of a valid text or None, the default or the variable tried next, as warned)
Variable = tuple[str, Callable[[str], Any], Any, str]
FILES = {"CERTIFICATE": "CA certificate", "CLIENT_KEY": "client key", "CLIENT_CERTIFICATE": "client certificate"}


def raw(name: str) -> str | None:
    """Stripped; None when unset or blank (the specification's "unset")."""
    return (os.environ.get(name) or "").strip() or None


def blank(name: str) -> bool:
    return name in os.environ and raw(name) is None


def _count(text: str) -> int | None:
    # ASCII digits: int() takes other scripts' and raises past 4,300 digits
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 18 else None


def _positive(text: str) -> int | None:
    return _count(text) or None


def _time(text: str) -> float | None:
    try:
        return value if 0 < (value := float(text)) < float("inf") else None
    except ValueError:
        return None


def _queue_size() -> int:
    return _positive(raw("OTEL_BSP_MAX_QUEUE_SIZE") or "") or 2048


def _batch_size(text: str) -> int | None:
    return value if (value := _positive(text)) and value <= _queue_size() else None


def _exemplar_filter(text: str) -> Any:
    from opentelemetry.sdk import metrics
    return {"trace_based": metrics.TraceBasedExemplarFilter, "always_on": metrics.AlwaysOnExemplarFilter,
            "always_off": metrics.AlwaysOffExemplarFilter}.get(text.lower(), lambda: None)()


EXPECTED = {_count: "an integer >= 0", _positive: "an integer > 0", _time: "a number > 0",
            _batch_size: "an integer > 0 and at most the queue size"}
_COUNT, _LENGTH = "OTEL_ATTRIBUTE_COUNT_LIMIT", "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT"
SPAN_LIMITS: dict[str, Variable] = {  # SpanLimits keywords (-1: SpanLimits.UNSET)
    _COUNT: ("max_attributes", _count, 128, "128"),
    **{f"OTEL_{kind}_ATTRIBUTE_COUNT_LIMIT": (f"max_{kind.lower()}_attributes", _count, _COUNT, f"{_COUNT}, else 128")
       for kind in ("SPAN", "EVENT", "LINK")},
    "OTEL_SPAN_EVENT_COUNT_LIMIT": ("max_events", _count, 128, "128"),
    "OTEL_SPAN_LINK_COUNT_LIMIT": ("max_links", _count, 128, "128"),
    _LENGTH: ("max_attribute_length", _count, -1, "no limit"),
    "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT": ("max_span_attribute_length", _count, _LENGTH,
                                               f"{_LENGTH}, else no limit"),
}
BATCH_SPAN_PROCESSOR: dict[str, Variable] = {
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": ("max_export_batch_size", _batch_size, lambda: min(512, _queue_size()),
                                       "512, or the queue size when that is smaller"),
    "OTEL_BSP_SCHEDULE_DELAY": ("schedule_delay_millis", _positive, 5000, "5000"),
    "OTEL_BSP_EXPORT_TIMEOUT": ("export_timeout_millis", _positive, 30000, "30000"),
    "OTEL_BSP_MAX_QUEUE_SIZE": ("max_queue_size", _positive, 2048, "2048"),
}
METRIC_READER: dict[str, Variable] = {
    "OTEL_METRIC_EXPORT_INTERVAL": ("export_interval_millis", _time, 60000.0, "60000"),
    "OTEL_METRIC_EXPORT_TIMEOUT": ("export_timeout_millis", _time, 30000.0, "30000"),
}
METER_PROVIDER: dict[str, Variable] = {
    "OTEL_METRICS_EXEMPLAR_FILTER": ("exemplar_filter", _exemplar_filter, lambda: _exemplar_filter("trace_based"),
                                     "trace_based")}


def _value(table: Mapping[str, Variable], name: str, invalid: dict[str, str]) -> Any:
    _, parse, instead, _ = table[name]
    if (text := raw(name)) is not None:
        if (value := parse(text)) is not None:
            return value
        invalid[name] = EXPECTED.get(parse, "supported")
    if instead in table:
        return _value(table, instead, invalid)
    return instead() if callable(instead) else instead


def build(what: str, make: Callable[..., Any], table: Mapping[str, Variable] | None = None) -> Any:
    """``make()`` given the variables of ``table`` that are set (a malformed one replaced); None if it raises."""
    table, keywords, invalid = table or {}, {}, {}
    for name, (keyword, *_) in table.items():  # (a per-signal form before its general one)
        if name in os.environ and keyword not in keywords:
            keywords[keyword] = _value(table, name, invalid)

    def quoted(name: str) -> str:
        return shown(without_userinfo(os.environ.get(name, "")))

    try:
        built = make(**keywords)
    except Exception as exc:  # never into the host
        read = "".join(f"; check {name}={quoted(name)}" for name in table if name in os.environ)
        warn_once(f"otel_environment:{what}", "otel-hicache: cannot create the %s (%s: %s)%s; it is left out",
                  what, type(exc).__name__, shown(exc), read)
        return None
    for name, expected in invalid.items():
        warn_once(f"otel_environment:{name}", "otel-hicache: %s=%s is not %s; using %s instead", name,
                  quoted(name), expected, table[name][3])
    return built


def resource() -> Any:
    """``Resource.create()`` with a blank ``OTEL_SERVICE_NAME`` unset."""
    import sys
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    if not blank("OTEL_SERVICE_NAME"):
        return Resource.create()
    named = [unquote(value.strip()) for key, _, value in (item.partition("=") for item in
             (raw("OTEL_RESOURCE_ATTRIBUTES") or "").split(",")) if key.strip() == SERVICE_NAME]
    return Resource.create({SERVICE_NAME: (named or [f"unknown_service:{os.path.basename(sys.executable)}"])[-1]})


def sampler() -> Any:
    """None (the SDK reads ``OTEL_TRACES_SAMPLER``), or its default when blank."""
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
    return ParentBased(ALWAYS_ON) if blank("OTEL_TRACES_SAMPLER") else None


def signal_variable(signal: str, suffix: str) -> tuple[str, str]:
    return f"OTEL_EXPORTER_OTLP_{signal.upper()}_{suffix}", f"OTEL_EXPORTER_OTLP_{suffix}"


def first(signal: str, suffix: str) -> tuple[str, str] | None:
    """The per-signal variable's (name, value) if set, else the general one's."""
    return next(((n, v) for n in signal_variable(signal, suffix) if (v := raw(n)) is not None), None)


def endpoint(signal: str, protocol: str) -> str:
    specific, general = signal_variable(signal, "ENDPOINT")
    if protocol == "grpc" or raw(specific) is not None:
        return raw(specific) or raw(general) or "http://localhost:4317"
    return f"{(raw(general) or 'http://localhost:4318').removesuffix('/')}/v1/{signal}"


def tls(signal: str, protocol: str) -> bool:
    """gRPC: by ``*_INSECURE``, else by the endpoint's scheme."""
    url = endpoint(signal, protocol).lower()
    if protocol != "grpc" or url.startswith("https://"):
        return url.startswith("https://")
    found = first(signal, "INSECURE")
    return found[1].lower() != "true" if found is not None else not url.startswith("http://")


def _compression(protocol: str, text: str) -> Any:
    if protocol == "grpc":
        from grpc import Compression
    else:
        from opentelemetry.exporter.otlp.proto.http import Compression  # type: ignore[assignment]
    names = {"gzip": "Gzip", "none": "NoCompression", "deflate": "Deflate" if protocol != "grpc" else "?"}
    return getattr(Compression, names.get(text.lower(), "?"), None)


def otlp_exporter(signal: str, protocol: str) -> dict[str, Variable]:
    url, insecure = lambda _="": endpoint(signal, protocol), lambda _="": not tls(signal, protocol)
    forms = {"ENDPOINT": ("endpoint", url, url, "http://localhost:4317" if protocol == "grpc" else
                          f"http://localhost:4318/v1/{signal}"),
             "TIMEOUT": ("timeout", _time, 10.0, "10"),
             "COMPRESSION": ("compression", lambda text: _compression(protocol, text),
                             lambda: _compression(protocol, "none"), "none")}
    if protocol == "grpc":
        forms["INSECURE"] = ("insecure", insecure, insecure, "by the endpoint's scheme")
    table: dict[str, Variable] = {}
    for suffix, (keyword, parse, default, as_shown) in forms.items():
        specific, general = signal_variable(signal, suffix)
        table[specific] = (keyword, parse, general, f"{general}, else {as_shown}")
        table[general] = (keyword, parse, default, as_shown)
    return table


class Headers(dict):  # type: ignore[type-arg]
    """Taken even when empty (else the exporter reads the variable, logging bad entries whole)."""

    def __bool__(self) -> bool:
        return True


_TOKEN = frozenset("!#$%&'*+-.^_`|~" + string.ascii_letters + string.digits)


def headers(signal: str) -> tuple[Headers | None, list[str]]:
    """The ``*_HEADERS`` pairs (None when unset) and their secrets; a malformed entry is left out."""
    if (found := first(signal, "HEADERS")) is None:
        return (Headers() if any(blank(n) for n in signal_variable(signal, "HEADERS")) else None), []
    pairs, bad, secrets = Headers(), [], []
    for place, entry in enumerate(found[1].split(","), 1):
        if not entry.strip():
            continue
        key, sep, value = entry.partition("=")
        key, value = unquote(key).strip(), unquote(value).strip()
        secrets += [entry.strip(), value]
        if not sep or not key or not _TOKEN.issuperset(key):
            bad.append(f"entry {place} (not key=value)")
        elif not all(" " <= c <= "~" or c == "\t" for c in value):
            bad.append(f"{shown(key.lower())} (a value that is not printable ASCII)")
        else:
            pairs[key.lower()] = value
    if bad:
        warn_once(f"headers:{found[0]}", "otel-hicache: %s: %s left out (header values are never logged)", found[0],
                  ", ".join(bad[:10]) + (f" and {len(bad) - 10} more" if len(bad) > 10 else ""))
    return pairs, secrets


def file_variables(signal: str) -> list[str]:
    return [name for suffix in FILES for name in signal_variable(signal, suffix)]


def _unreadable(path: str, directory_ok: bool) -> str | None:
    try:
        kind = os.stat(path).st_mode
        if stat.S_ISDIR(kind) and directory_ok:
            return None
        if not stat.S_ISREG(kind):  # a FIFO would block, a device never end
            return "is not a regular file"
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        return f"cannot be read ({type(exc).__name__})"
    return None


def tls_files(signal: str, protocol: str) -> list[tuple[str, str, str, str | None]]:
    """(suffix, variable, path, why it cannot be used or None) of each file variable set."""
    found = [(suffix, *pair) for suffix in FILES if (pair := first(signal, suffix))]
    return [(*f, _unreadable(f[2], protocol != "grpc" and f[0] == "CERTIFICATE")) for f in found]  # requests: a dir


def _file(signal: str, suffix: str) -> str | None:
    return (first(signal, suffix) or ("", None))[1]


def otlp_keywords(signal: str, protocol: str, sdk_loggers: bool) -> dict[str, Any] | None:
    """Headers, and gRPC credentials when a file variable is blank; None (warned) if a TLS file is unreadable."""
    for suffix, name, path, problem in tls_files(signal, protocol):
        if problem is not None and tls(signal, protocol):  # over plain text the files are unused
            warn_once(f"certificate:{name}", "otel-hicache: %s=%s %s; there is no safe default for a %s, so what "
                      "would be exported with it over TLS is not exported", name, shown(path), problem, FILES[suffix])
            return None
    pairs, secrets = headers(signal)
    withhold([*secrets, *(userinfo(os.environ.get(n, "")) for n in signal_variable(signal, "ENDPOINT"))],
             sdk_loggers)
    keywords: dict[str, Any] = {} if pairs is None else {"headers": pairs}
    if protocol == "grpc" and tls(signal, protocol) and any(blank(n) for n in file_variables(signal)):
        import grpc
        files = [(p := _file(signal, suffix)) and Path(p).read_bytes() for suffix in FILES]  # checked above
        keywords["credentials"] = grpc.ssl_channel_credentials(*files)
    return keywords


def settle_session(session: Any, signal: str) -> None:
    """The session's files with blank variables unset (the SDK took a blank one as a path)."""
    if any(blank(n) for n in file_variables(signal)):
        ca, key, cert = (_file(signal, suffix) for suffix in FILES)
        session.verify, session.cert = ca or True, (cert, key) if cert and key else cert
