"""The standard ``OTEL_*`` variables: read by the SDK objects themselves, with the promises it lacks.

A constructor that rejects a value would raise into the host: :func:`build` retries with
that variable's default and warns once naming it. A blank value means unset (the
specification's rule; the SDK takes some as values): its default is passed, unwarned. Checked
ahead, as the SDK would go on silently: a time <= 0 or infinite, and a certificate or key file
that cannot be read or is not a regular file (a FIFO would block). The OTLP headers are parsed
here, so that no header value reaches a log line. ``os.environ`` is never modified.
"""

from __future__ import annotations

import os
import stat
from typing import Any, Callable, Mapping, NamedTuple
from urllib.parse import unquote

from ..diagnostics import WITHHELD, shown, warn_once, withhold
from .redaction import userinfo

Retry = tuple[str, Any, str]  # (the constructor's keyword, its default or a function giving it, as warned)

MEANT = {"OTEL_METRICS_EXEMPLAR_FILTER": ("trace_based", "always_on", "always_off"),
         "OTEL_EXPORTER_OTLP_COMPRESSION": ("none",)}
"""Values the specification allows that an SDK constructor rejects: passed as what they mean, unwarned."""


def raw(name: str) -> str | None:
    """The value of ``name``; None when unset or blank (the specification's "unset")."""
    value = os.environ.get(name)
    return value if value is not None and value.strip() else None


def blank(name: str) -> bool:
    """Whether ``name`` is set to an empty or blank value (which means unset)."""
    value = os.environ.get(name)
    return value is not None and not value.strip()


def count(text: str | None) -> int | None:
    """The integer >= 0 ``text`` spells in ASCII digits (``int()`` takes other scripts' too), else None."""
    text = (text or "").strip()
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 18 else None


def _count_or(name: str, default: int | None) -> Callable[[], int | None]:
    """The integer >= 0 in ``name``, else ``default``: a per-kind limit defaults to the general one."""
    return lambda: value if (value := count(raw(name))) is not None else default


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


def resource() -> Any:
    """``Resource.create()``, a blank ``OTEL_SERVICE_NAME`` unset (the SDK would name the service blank)."""
    import sys

    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    if not blank("OTEL_SERVICE_NAME"):
        return Resource.create()
    named = [unquote(value.strip()) for key, _, value in (item.partition("=") for item in
             (raw("OTEL_RESOURCE_ATTRIBUTES") or "").split(",")) if key.strip() == SERVICE_NAME]
    name = named[-1] if named else "unknown_service" + (f":{os.path.basename(sys.executable)}" if sys.executable
                                                        else "")
    return Resource.create({SERVICE_NAME: name})


def sampler() -> Any:
    """None (the SDK reads ``OTEL_TRACES_SAMPLER``), or its default when the variable is blank."""
    if not blank("OTEL_TRACES_SAMPLER"):
        return None
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased

    return ParentBased(ALWAYS_ON)  # parentbased_always_on, the specified default


def signal_variable(signal: str, suffix: str) -> tuple[str, str]:
    """(the per-signal form, the general form) of ``OTEL_EXPORTER_OTLP_<suffix>``."""
    return f"OTEL_EXPORTER_OTLP_{signal.upper()}_{suffix}", f"OTEL_EXPORTER_OTLP_{suffix}"


def first(signal: str, suffix: str) -> tuple[str, str] | None:
    """(name, value) of the signal's variable if set and not blank, else of the general one."""
    return next(((n, v) for n in signal_variable(signal, suffix) if (v := raw(n)) is not None), None)


def endpoint(signal: str, protocol: str) -> str:
    """The endpoint the signal's OTLP exporter uses, as the exporters resolve it with blanks unset."""
    specific, general = signal_variable(signal, "ENDPOINT")
    if protocol == "grpc":
        return (raw(specific) or raw(general) or "http://localhost:4317").strip()
    if raw(specific) is not None:
        return raw(specific).strip()  # type: ignore[union-attr]
    return f"{(raw(general) or 'http://localhost:4318').strip().removesuffix('/')}/v1/{signal}"


def redacted(url: str) -> str:
    """``url`` without the userinfo (``user:password@``) it may hold, for a log line."""
    secret = userinfo(url)
    return url.replace(f"{secret}@", f"{WITHHELD}@", 1) if secret else url


def positive_float(text: str | None) -> float | None:
    try:
        value = float(text) if text is not None else None
    except ValueError:
        return None
    return value if value is not None and 0 < value < float("inf") else None


def timeout_s(signal: str) -> Callable[[], float]:
    """The signal's timeout as it would be read were the blank or rejected variables unset."""
    def value() -> float:
        for name in signal_variable(signal, "TIMEOUT"):
            if (seconds := positive_float(raw(name))) is not None:
                return seconds
        return 10.0
    return value


def _compression(signal: str, protocol: str) -> Callable[[], Any]:
    def value() -> Any:
        if protocol == "grpc":
            from grpc import Compression

            known = {"gzip": Compression.Gzip, "none": Compression.NoCompression}
        else:
            from opentelemetry.exporter.otlp.proto.http import Compression  # type: ignore[assignment]

            known = {"gzip": Compression.Gzip, "deflate": Compression.Deflate, "none": Compression.NoCompression}
        for name in signal_variable(signal, "COMPRESSION"):
            if (chosen := known.get((raw(name) or "").strip().lower())) is not None:
                return chosen
        return Compression.NoCompression
    return value


def _scheme(url: str) -> str:
    return url.partition("://")[0].lower() if "://" in url else ""


def insecure(signal: str) -> bool:
    """gRPC: whether the signal's exporter connects without TLS (``*_INSECURE``, else the endpoint's scheme)."""
    scheme = _scheme(endpoint(signal, "grpc"))
    if scheme == "https":
        return False
    found = first(signal, "INSECURE")
    return found[1].strip().lower() == "true" if found is not None else scheme == "http"


def otlp_exporter(signal: str, protocol: str) -> dict[str, Retry]:
    """What the OTLP exporter of ``signal`` (``traces``, ``metrics``) over ``protocol`` is retried with."""
    grpc = protocol == "grpc"
    default = "http://localhost:4317" if grpc else f"http://localhost:4318/v1/{signal}"
    retries: dict[str, Retry] = {}
    suffixes: list[tuple[str, Retry]] = [
        ("ENDPOINT", ("endpoint", lambda: endpoint(signal, protocol), default)),
        ("TIMEOUT", ("timeout", timeout_s(signal), "10")),
        ("COMPRESSION", ("compression", _compression(signal, protocol), "none"))]
    if grpc:
        suffixes.append(("INSECURE", ("insecure", lambda: insecure(signal), "by the endpoint's scheme")))
    for suffix, (keyword, value, shown_as) in suffixes:
        specific, general = signal_variable(signal, suffix)
        retries[specific] = (keyword, value, f"{general}, else {shown_as}")  # as if it were unset
        retries[general] = (keyword, value, shown_as)
    return retries


class Headers(dict):  # type: ignore[type-arg]
    """Pairs an exporter takes even when empty (it would read the variable, and log its bad entries)."""

    def __bool__(self) -> bool:
        return True


_TOKEN = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def headers(signal: str) -> tuple[Headers | None, list[str]]:
    """The signal's ``*_HEADERS`` pairs (None when unset) and the secrets they hold. Malformed entries
    are left out with one warning that names their keys or places, never their text."""
    found = first(signal, "HEADERS")
    if found is None:
        return (Headers() if any(blank(n) for n in signal_variable(signal, "HEADERS")) else None), []
    name, text = found
    pairs, bad, secrets = Headers(), [], []
    for place, entry in enumerate(text.split(","), 1):
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
        warn_once(f"headers:{name}", "otel-hicache: %s: %s left out (header values are never logged)", name,
                  ", ".join(bad[:10]) + (f" and {len(bad) - 10} more" if len(bad) > 10 else ""))
    return pairs, secrets


FILES = {"CERTIFICATE": "CA certificate", "CLIENT_KEY": "client key", "CLIENT_CERTIFICATE": "client certificate"}


def file_variables(signal: str) -> list[str]:
    """The signal's file variables, each per-signal form before its general one."""
    return [name for suffix in FILES for name in signal_variable(signal, suffix)]


class TlsFiles(NamedTuple):
    """The signal's CA certificate, client key and client certificate paths (None: unset or blank)."""

    certificate: str | None
    client_key: str | None
    client_certificate: str | None


def tls_files(signal: str) -> tuple[TlsFiles, bool]:
    """The signal's files, blank variables unset, and whether one is blank (the SDK takes it as a path)."""
    paths = [found[1].strip() if (found := first(signal, suffix)) else None for suffix in FILES]
    blanks = any(blank(n) for n in file_variables(signal))
    return TlsFiles(*paths), blanks


def unreadable(path: str, directory_ok: bool = False) -> str | None:
    """Why ``path`` cannot be a certificate or key file, or None. A FIFO or a device is refused unread."""
    try:
        kind = os.stat(path).st_mode
        if stat.S_ISDIR(kind) and directory_ok:
            return None
        if not stat.S_ISREG(kind):
            return "is not a regular file"
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            os.read(descriptor, 1)
        finally:
            os.close(descriptor)
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        return f"cannot be read ({type(exc).__name__})"
    return None


def certificate_usable(signal: str, protocol: str) -> bool:
    """False, warned once, when a file of the signal cannot be read and the connection uses TLS: no
    default is safe (gRPC would trust the system's CAs, HTTP fail every export, either block on a FIFO)."""
    for suffix, what in FILES.items():
        found = first(signal, suffix)
        if found is None:
            continue
        name, path = found
        problem = unreadable(path.strip(), directory_ok=protocol != "grpc" and suffix == "CERTIFICATE")
        if problem is None:  # (requests takes a directory of CA certificates)
            continue
        if not tls(signal, protocol):
            return True  # plain text: the files are unused
        warn_once(f"certificate:{name}", "otel-hicache: %s=%s %s; there is no safe default for a %s, so what would "
                  "be exported with it over TLS is not exported", name, shown(path), problem, what)
        return False
    return True


def tls(signal: str, protocol: str) -> bool:
    """Whether the signal's exporter over ``protocol`` connects with TLS."""
    return not insecure(signal) if protocol == "grpc" else _scheme(endpoint(signal, protocol)) == "https"


def otlp_keywords(signal: str, protocol: str, sdk_loggers: bool) -> dict[str, Any]:
    """The signal's OTLP exporter's headers, parsed here, and gRPC credentials when a file variable is
    blank (the exporter would take it as a path). Their and the endpoints' secrets are withheld from now on."""
    pairs, secrets = headers(signal)
    withhold([*secrets, *(userinfo(os.environ.get(n, "")) for n in signal_variable(signal, "ENDPOINT"))],
             sdk_loggers)
    keywords: dict[str, Any] = {} if pairs is None else {"headers": pairs}
    files, blanks = tls_files(signal)
    if blanks and protocol == "grpc" and not insecure(signal):
        import grpc

        def read(path: str | None) -> bytes | None:
            if path is None:
                return None
            with open(path, "rb") as file:  # a regular file: checked by certificate_usable()
                return file.read()

        keywords["credentials"] = grpc.ssl_channel_credentials(read(files.certificate), read(files.client_key),
                                                               read(files.client_certificate))
    return keywords


def settle_session(session: Any, signal: str) -> None:
    """OTLP/HTTP: the session's files as resolved with blank variables unset (the SDK put a blank one on it)."""
    files, blanks = tls_files(signal)
    if not blanks:
        return
    session.verify = files.certificate or True
    cert, key = files.client_certificate, files.client_key
    session.cert = (cert, key) if cert and key else cert


def _value(default: Any) -> Any:
    return default() if callable(default) else default


def positive(text: str) -> bool:
    """Whether ``text`` is a time the SDK may take: > 0 and finite (not a number: the SDK's parse decides)."""
    try:
        return 0 < float(text) < float("inf")
    except ValueError:  # not a number: the SDK's own parse decides
        return True


def _quoted(name: str) -> str:
    value = os.environ.get(name, "")
    return shown(redacted(value) if name.endswith("_ENDPOINT") else value)


def build(what: str, make: Callable[..., Any], retries: Mapping[str, Retry]) -> Any:
    """``make()`` with the default of each blank variable of ``retries``, each time <= 0 or infinite, and
    while it raises, of the variable whose default cures the error. One warning per variable replaced
    but a blank one; None (warned) if none helps."""
    given = [name for name in retries if raw(name) is not None]
    blanks = [name for name in retries if blank(name)]
    chosen = {n: "is not > 0" for n in given if n.endswith(("TIMEOUT", "INTERVAL", "DELAY"))
              and not positive(os.environ[n])}

    def attempt(names: Any) -> tuple[Any, Exception | None]:
        defaults = {retries[n][0]: retries[n][1] for n in [*blanks, *names]}  # (a keyword's forms share one)
        try:
            return make(**{keyword: _value(default) for keyword, default in defaults.items()}), None
        except Exception as exc:  # pylint: disable=broad-except  # never into the host
            return None, exc

    built, error = attempt(chosen)
    while error is not None:
        for n in (n for n in given if n not in chosen):
            built, after = attempt([*chosen, n])
            if after is None or str(after) != str(error):  # n was what the constructor rejected
                chosen[n] = f"is rejected by the SDK ({type(error).__name__}: {shown(error)})"
                error = after
                break
        else:
            read = "".join(f"; check {name}={_quoted(name)}" for name in [*given, *blanks])
            warn_once(f"otel_environment:{what}", "otel-hicache: cannot create the %s (%s: %s)%s; it is left out",
                      what, type(error).__name__, shown(error), read)
            return None
    for n, problem in chosen.items():
        if os.environ[n].strip().lower() not in MEANT.get(n.replace("_OTLP_TRACES_", "_OTLP_")
                                                          .replace("_OTLP_METRICS_", "_OTLP_"), ()):
            warn_once(f"otel_environment:{n}", "otel-hicache: %s=%s %s; using %s instead", n, _quoted(n), problem,
                      retries[n][2])
    return built
