"""The standard ``OTEL_*`` variables, read by the SDK objects themselves, with the promises the SDK lacks.

A constructor that rejects a value would raise into the host: :func:`build` retries with that
variable's default and warns once. A blank value means unset (the specification's rule; the SDK
takes some as values). Checked ahead, as the SDK would go on silently: a time <= 0 or infinite, and
a certificate or key file that cannot be read or is not a regular file (a FIFO would block). The
OTLP headers are parsed here, so that no header value reaches a log line. ``os.environ`` is never
modified (in the host, it is not ours).
"""

from __future__ import annotations

import os
import stat
import string
from typing import Any, Callable, Mapping
from urllib.parse import unquote

from ..diagnostics import shown, warn_once, withhold
from .redaction import userinfo, without_userinfo

Retry = tuple[str, Any, str]  # (the constructor's keyword, its default or a function giving it, as warned)

MEANT = {"OTEL_METRICS_EXEMPLAR_FILTER": ("trace_based", "always_on", "always_off"),
         "OTEL_EXPORTER_OTLP_COMPRESSION": ("none",)}
"""Values the specification allows that an SDK constructor rejects: passed as what they mean, unwarned."""
FILES = {"CERTIFICATE": "CA certificate", "CLIENT_KEY": "client key", "CLIENT_CERTIFICATE": "client certificate"}


def raw(name: str) -> str | None:
    """The value of ``name``; None when unset or blank (the specification's "unset")."""
    value = os.environ.get(name)
    return value if value is not None and value.strip() else None


def blank(name: str) -> bool:
    return name in os.environ and raw(name) is None


def _number(text: str | None) -> bool:
    try:
        return float(text) is not None  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False


def _seconds(text: str | None) -> float | None:
    """``text`` as a time > 0 and finite; None when it is not one."""
    return value if _number(text) and 0 < (value := float(text)) < float("inf") else None  # type: ignore[arg-type]


def _count_or(name: str, default: int) -> Callable[[], int]:
    """The integer >= 0 in ``name`` (ASCII digits: ``int()`` takes other scripts'), else ``default``."""
    def value() -> int:
        text = (raw(name) or "").strip()
        return int(text) if text.isascii() and text.isdigit() and len(text) <= 18 else default
    return value


def _exemplar_filter() -> Any:
    from opentelemetry.sdk import metrics

    name = (raw("OTEL_METRICS_EXEMPLAR_FILTER") or "").strip().lower()
    return {"always_on": metrics.AlwaysOnExemplarFilter, "always_off": metrics.AlwaysOffExemplarFilter}.get(
        name, metrics.TraceBasedExemplarFilter)()


_COUNT, _LENGTH = "OTEL_ATTRIBUTE_COUNT_LIMIT", "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT"
SPAN_LIMITS: dict[str, Retry] = {  # SpanLimits keywords; the general limits first (-1: SpanLimits.UNSET)
    _COUNT: ("max_attributes", 128, "128"),
    **{f"OTEL_{kind}_ATTRIBUTE_COUNT_LIMIT": (f"max_{kind.lower()}_attributes", _count_or(_COUNT, 128),
                                             f"{_COUNT}, else 128") for kind in ("SPAN", "EVENT", "LINK")},
    "OTEL_SPAN_EVENT_COUNT_LIMIT": ("max_events", 128, "128"),
    "OTEL_SPAN_LINK_COUNT_LIMIT": ("max_links", 128, "128"),
    _LENGTH: ("max_attribute_length", -1, "no limit"),
    "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT": ("max_span_attribute_length", _count_or(_LENGTH, -1),
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
METER_PROVIDER: dict[str, Retry] = {"OTEL_METRICS_EXEMPLAR_FILTER": ("exemplar_filter", _exemplar_filter, "trace_based")}


def resource() -> Any:
    """``Resource.create()``, a blank ``OTEL_SERVICE_NAME`` unset (the SDK would name the service blank)."""
    import sys

    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    if not blank("OTEL_SERVICE_NAME"):
        return Resource.create()
    named = [unquote(value.strip()) for key, _, value in (item.partition("=") for item in
             (raw("OTEL_RESOURCE_ATTRIBUTES") or "").split(",")) if key.strip() == SERVICE_NAME]
    executable = f":{os.path.basename(sys.executable)}" if sys.executable else ""
    return Resource.create({SERVICE_NAME: named[-1] if named else f"unknown_service{executable}"})


def sampler() -> Any:
    """None (the SDK reads ``OTEL_TRACES_SAMPLER``), or its default when the variable is blank."""
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased

    return ParentBased(ALWAYS_ON) if blank("OTEL_TRACES_SAMPLER") else None


def signal_variable(signal: str, suffix: str) -> tuple[str, str]:
    """(the per-signal form, the general form) of ``OTEL_EXPORTER_OTLP_<suffix>``."""
    return f"OTEL_EXPORTER_OTLP_{signal.upper()}_{suffix}", f"OTEL_EXPORTER_OTLP_{suffix}"


def first(signal: str, suffix: str) -> tuple[str, str] | None:
    """(name, value) of the signal's variable if set and not blank, else of the general one."""
    return next(((n, v) for n in signal_variable(signal, suffix) if (v := raw(n)) is not None), None)


def endpoint(signal: str, protocol: str) -> str:
    """The endpoint the signal's OTLP exporter uses, as the exporters resolve it with blanks unset."""
    specific, general = signal_variable(signal, "ENDPOINT")
    if protocol == "grpc" or raw(specific) is not None:
        return (raw(specific) or raw(general) or "http://localhost:4317").strip()
    return f"{(raw(general) or 'http://localhost:4318').strip().removesuffix('/')}/v1/{signal}"


def tls(signal: str, protocol: str) -> bool:
    """Whether the signal's exporter connects with TLS (gRPC: ``*_INSECURE``, else the endpoint's scheme)."""
    url = endpoint(signal, protocol).lower()
    if protocol != "grpc" or url.startswith("https://"):
        return url.startswith("https://")
    found = first(signal, "INSECURE")
    return found[1].strip().lower() != "true" if found is not None else not url.startswith("http://")


def _compression(signal: str, protocol: str) -> Any:
    if protocol == "grpc":
        from grpc import Compression
    else:
        from opentelemetry.exporter.otlp.proto.http import Compression  # type: ignore[assignment]
    known = {"gzip": Compression.Gzip, "none": Compression.NoCompression}
    known.update({"deflate": Compression.Deflate} if protocol != "grpc" else {})
    values = (known.get((raw(name) or "").strip().lower()) for name in signal_variable(signal, "COMPRESSION"))
    return next((v for v in values if v is not None), Compression.NoCompression)


def otlp_exporter(signal: str, protocol: str) -> dict[str, Retry]:
    """What the OTLP exporter of ``signal`` (``traces``, ``metrics``) over ``protocol`` is retried with."""
    default = "http://localhost:4317" if protocol == "grpc" else f"http://localhost:4318/v1/{signal}"
    timeout = lambda: next((t for n in signal_variable(signal, "TIMEOUT") if (t := _seconds(raw(n)))), 10.0)  # noqa
    suffixes = {"ENDPOINT": ("endpoint", lambda: endpoint(signal, protocol), default),
                "TIMEOUT": ("timeout", timeout, "10"),
                "COMPRESSION": ("compression", lambda: _compression(signal, protocol), "none")}
    if protocol == "grpc":
        suffixes["INSECURE"] = ("insecure", lambda: not tls(signal, protocol), "by the endpoint's scheme")
    retries: dict[str, Retry] = {}
    for suffix, (keyword, value, shown_as) in suffixes.items():
        specific, general = signal_variable(signal, suffix)
        retries[specific] = (keyword, value, f"{general}, else {shown_as}")  # as if it were unset
        retries[general] = (keyword, value, shown_as)
    return retries


class Headers(dict):  # type: ignore[type-arg]
    """Pairs an exporter takes even when empty (else it would read the variable, and log its bad entries)."""

    def __bool__(self) -> bool:
        return True


_TOKEN = frozenset("!#$%&'*+-.^_`|~" + string.ascii_letters + string.digits)


def headers(signal: str) -> tuple[Headers | None, list[str]]:
    """The signal's ``*_HEADERS`` pairs (None when unset) and the secrets they hold. Malformed entries
    are left out with one warning that names their keys or places, never their text."""
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
    """The signal's certificate and key variables, each per-signal form before its general one."""
    return [name for suffix in FILES for name in signal_variable(signal, suffix)]


def unreadable(path: str, directory_ok: bool = False) -> str | None:
    """Why ``path`` cannot be a certificate or key file, or None. A FIFO or a device is refused unread."""
    try:
        kind = os.stat(path).st_mode
        if stat.S_ISDIR(kind) and directory_ok:
            return None
        if not stat.S_ISREG(kind):
            return "is not a regular file"
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        return f"cannot be read ({type(exc).__name__})"
    return None


def tls_files(signal: str, protocol: str) -> list[tuple[str, str, str, str | None]]:
    """(suffix, variable, path, why it cannot be used or None) of each file variable set for the signal."""
    found = [(suffix, *pair) for suffix in FILES if (pair := first(signal, suffix)) is not None]
    return [(suffix, name, path.strip(), unreadable(path.strip(), directory_ok=protocol != "grpc" and
                                                    suffix == "CERTIFICATE"))  # (requests takes a directory)
            for suffix, name, path in found]


def certificate_usable(signal: str, protocol: str) -> bool:
    """False, warned once, when a file of the signal cannot be read and the connection uses TLS: no
    default is safe (gRPC would trust the system's CAs, HTTP fail every export, either block on a FIFO)."""
    for suffix, name, path, problem in tls_files(signal, protocol):
        if problem is not None:
            if tls(signal, protocol):
                warn_once(f"certificate:{name}", "otel-hicache: %s=%s %s; there is no safe default for a %s, so what "
                          "would be exported with it over TLS is not exported", name, shown(path), problem,
                          FILES[suffix])
            return not tls(signal, protocol)  # plain text: the files are unused
    return True


def _file(signal: str, suffix: str) -> str | None:
    return found[1].strip() if (found := first(signal, suffix)) else None


def otlp_keywords(signal: str, protocol: str, sdk_loggers: bool) -> dict[str, Any]:
    """The signal's OTLP exporter's headers, parsed here, and gRPC credentials when a file variable is
    blank (the exporter would take it as a path). Their and the endpoints' secrets are withheld from now on."""
    pairs, secrets = headers(signal)
    withhold([*secrets, *(userinfo(os.environ.get(n, "")) for n in signal_variable(signal, "ENDPOINT"))],
             sdk_loggers)
    keywords: dict[str, Any] = {} if pairs is None else {"headers": pairs}
    if protocol == "grpc" and tls(signal, protocol) and any(blank(n) for n in file_variables(signal)):
        import grpc

        def read(suffix: str) -> bytes | None:
            if (path := _file(signal, suffix)) is None:
                return None
            with open(path, "rb") as file:  # a regular file: checked by certificate_usable()
                return file.read()

        keywords["credentials"] = grpc.ssl_channel_credentials(*map(read, FILES))
    return keywords


def settle_session(session: Any, signal: str) -> None:
    """OTLP/HTTP: the session's files as resolved with blank variables unset (the SDK put a blank one on it)."""
    if any(blank(n) for n in file_variables(signal)):
        ca, key, cert = (_file(signal, suffix) for suffix in FILES)
        session.verify, session.cert = ca or True, (cert, key) if cert and key else cert


def build(what: str, make: Callable[..., Any], retries: Mapping[str, Retry]) -> Any:
    """``make()`` with the default of each blank variable of ``retries``, each time <= 0 or infinite, and
    while it raises, of the variable whose default cures the error. One warning per variable replaced
    but a blank one; None (warned) if none helps."""
    given = [name for name in retries if raw(name) is not None]
    blanks = [name for name in retries if blank(name)]
    chosen = {n: "is not > 0" for n in given if n.endswith(("TIMEOUT", "INTERVAL", "DELAY"))
              and _seconds(os.environ[n]) is None and _number(os.environ[n])}  # (not a number: the SDK's parse)

    def attempt(names: Any) -> tuple[Any, Exception | None]:
        defaults = {retries[n][0]: retries[n][1] for n in [*blanks, *names]}  # (a keyword's forms share one)
        try:
            return make(**{k: d() if callable(d) else d for k, d in defaults.items()}), None
        except Exception as exc:  # pylint: disable=broad-except  # never into the host
            return None, exc

    def quoted(name: str) -> str:
        return shown(without_userinfo(os.environ.get(name, "")))

    built, error = attempt(chosen)
    while error is not None:
        for n in (n for n in given if n not in chosen):
            built, after = attempt([*chosen, n])
            if after is None or str(after) != str(error):  # n was what the constructor rejected
                chosen[n] = f"is rejected by the SDK ({type(error).__name__}: {shown(error)})"
                error = after
                break
        else:
            read = "".join(f"; check {name}={quoted(name)}" for name in [*given, *blanks])
            warn_once(f"otel_environment:{what}", "otel-hicache: cannot create the %s (%s: %s)%s; it is left out",
                      what, type(error).__name__, shown(error), read)
            return None
    for n, problem in chosen.items():
        general = n.replace("_OTLP_TRACES_", "_OTLP_").replace("_OTLP_METRICS_", "_OTLP_")
        if os.environ[n].strip().lower() not in MEANT.get(general, ()):
            warn_once(f"otel_environment:{n}", "otel-hicache: %s=%s %s; using %s instead", n, quoted(n), problem,
                      retries[n][2])
    return built
