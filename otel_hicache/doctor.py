"""``otel-hicache doctor``: what to check when nothing shows up, in one command.

It prints the configuration resolved from the ``OTEL_*`` and ``OTEL_HICACHE_*``
variables (header values and URL userinfo masked in everything it prints), with
every otel-hicache warning the resolution emits; exports one test span and one
test metric point through exporters built by :mod:`otel_hicache.configuration`'s
own code path, to the configured endpoint, and says whether each was accepted
(an answer outside 2xx never is); reports SGLang (version, the adapter's version
guard, which patch groups would apply).

Exit status: 0 when every configured exporter accepted its test data, or when
nothing is configured to be exported (``OTEL_SDK_DISABLED=true``, or ``none``
for both signals: said so, with the variable); 1 when an export was not
accepted or an exporter could not be built, with the cause and the variable to
fix; 2 for a usage error. SGLang is reported, never the exit status.

    otel-hicache doctor [--timeout 10] [--skip-sglang]
    python -m otel_hicache.doctor [--timeout 10] [--skip-sglang]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import platform
import re
import shlex
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, TextIO

from . import adapters, configuration
from . import environment_variables as ev
from . import semconv as sc
from .sinks import otel_environment, providers
from .environment_variables import (
    DEFAULTS,
    OTEL_HICACHE_ANCHOR_INTERVAL_S,
    OTEL_HICACHE_ENABLED,
    OTEL_HICACHE_POLL_INTERVAL_MS,
)
from .sinks.http_session import REFUSAL, RETRYABLE, WANTS_TLS
from .sinks.redaction import userinfo_parts, without_userinfo
from .settings import env_bool, env_float, env_int, sdk_disabled
from .version import __version__

CAP_S = 10.0
"""How long the doctor waits for the test exports, at most (``--timeout``)."""

SPAN_NAME = "otel_hicache.doctor"
METRIC_NAME = "otel_hicache.doctor.checks"
_NOT_CHECKED = {"console": "writes to the instrumented process's stdout; not checked",
                "prometheus": "a pull reader serving OTEL_EXPORTER_PROMETHEUS_HOST:PORT (default localhost:9464) "
                              "in the instrumented process; not checked (scrape it there)"}
_MINIMUM = {OTEL_HICACHE_POLL_INTERVAL_MS: 0.01, OTEL_HICACHE_ANCHOR_INTERVAL_S: 0.01}  # as pipeline.py reads them
_PORT = {"grpc": 4317, "http/protobuf": 4318}


# -- log records: otel-hicache's warnings, and what the exporters said ----------------------------

class _Captured(logging.Handler):
    """Every record of the ``otel_hicache`` and ``opentelemetry`` loggers, with its thread."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.lock_ = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        with self.lock_:
            self.records.append(record)

    def since(self, start: int, thread: int | None = None, level: int = logging.WARNING) -> list[logging.LogRecord]:
        with self.lock_:
            return [r for r in self.records[start:] if r.levelno >= level and (thread is None or r.thread == thread)]

    def mark(self) -> int:
        with self.lock_:
            return len(self.records)


@contextlib.contextmanager
def _capturing() -> Iterator[_Captured]:
    handler = _Captured()
    loggers = [logging.getLogger(name) for name in ("otel_hicache", "opentelemetry")]
    saved = [(lg.level, lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.propagate = False  # reported once, in the report
        if lg.level == logging.NOTSET or lg.level > logging.WARNING:
            lg.setLevel(logging.WARNING)
    try:
        yield handler
    finally:
        for lg, (level, propagate) in zip(loggers, saved):
            lg.removeHandler(handler)
            lg.setLevel(level)
            lg.propagate = propagate


@contextlib.contextmanager
def _every_message() -> Iterator[None]:
    """The SDK's exporter loggers without their ``DuplicateFilter`` (which drops the second signal's
    error, the same text within 20 s), in this process, while the test exports run."""
    lifted = {}
    for name, found in list(logging.Logger.manager.loggerDict.items()):
        if name.startswith("opentelemetry") and isinstance(found, logging.Logger) and found.filters:
            lifted[found] = list(found.filters)
            found.filters = [f for f in found.filters if type(f).__name__ != "DuplicateFilter"]
    try:
        yield
    finally:
        for found, filters in lifted.items():
            found.filters = filters


@contextlib.contextmanager
def _http_errors(sink: list[tuple[int, str]]) -> Iterator[None]:
    """Each exception a ``requests`` transport raised, with its thread, in this process, while the
    test exports run: the OTLP/HTTP exporters log the cause only when they retry."""
    try:
        from requests.adapters import HTTPAdapter
    except ImportError:
        yield
        return
    original = HTTPAdapter.send

    def send(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        except Exception as exc:
            sink.append((threading.get_ident(), f"{type(exc).__name__}: {exc}"))
            raise

    HTTPAdapter.send = send  # type: ignore[method-assign]
    try:
        yield
    finally:
        HTTPAdapter.send = original  # type: ignore[method-assign]


def _message(record: logging.LogRecord) -> str:
    try:
        text = record.getMessage()
    except Exception:  # pylint: disable=broad-except
        text = str(record.msg)
    if record.exc_info and record.exc_info[1] is not None:
        text += f" ({type(record.exc_info[1]).__name__}: {record.exc_info[1]})"
    return text


# -- the configuration, as the SDK objects will read it --------------------------------------------

def _first(*names: str) -> tuple[str | None, str | None]:
    """(the first of ``names`` that is set, its value)."""
    for name in names:
        value = otel_environment.raw(name)
        if value is not None:
            return name, value.strip()
    return None, None


def _source(name: str | None) -> str:
    return f"({name})" if name else "(default)"


def _protocol_of(signal: str, name: str) -> str | None:
    """The OTLP protocol of exporter ``name`` (configure()'s reading), None when it is not OTLP."""
    return providers.otlp_protocol(signal, name)


def _names(signal: str) -> tuple[str, list[str]]:
    variable = providers.EXPORTER_GROUPS[signal][0]
    names = [n.strip().lower() for n in os.environ.get(variable, "otlp").split(",") if n.strip()] or ["otlp"]
    return variable, list(dict.fromkeys(names))


@dataclass
class Otlp:
    """One OTLP exporter's settings, resolved from the variables as the SDK's exporters read them."""

    signal: str
    protocol: str
    protocol_variable: str
    endpoint: str
    endpoint_variable: str | None
    tls: bool
    tls_why: str
    timeout_s: float
    timeout_variable: str | None
    timeout_text: str
    compression: str
    headers: str
    headers_variable: str
    certificate: str | None
    certificate_variable: str | None
    certificate_state: str
    client_files: list[str] = field(default_factory=list)

    @property
    def fix_endpoint_variable(self) -> str:
        return self.endpoint_variable or "OTEL_EXPORTER_OTLP_ENDPOINT"

    @property
    def certificate_fix_variable(self) -> str:
        return self.certificate_variable or "OTEL_EXPORTER_OTLP_CERTIFICATE"


def _server(otlp: Otlp) -> tuple[str, str]:
    """(protocol, scheme://host:port): what two signals' exporters may share."""
    scheme, _, rest = otlp.endpoint.partition("://")
    return otlp.protocol, f"{scheme}://{rest.partition('/')[0]}" if rest else otlp.endpoint


def _readable(path: str, directory_ok: bool) -> str:
    """The telemetry process's own check (a FIFO or a device is refused unread, never waited on)."""
    problem = otel_environment.unreadable(path, directory_ok)
    if problem is not None:
        return f"NOT readable: {problem}"
    return "readable (a directory)" if os.path.isdir(path) else "readable"


def _otlp(signal: str, protocol: str) -> Otlp:
    up = signal.upper()
    protocol_variable = next((n for n in (f"OTEL_EXPORTER_OTLP_{up}_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
                              if (otel_environment.raw(n) or "").strip().lower() == protocol),
                             "OTEL_EXPORTER_OTLP_PROTOCOL")
    grpc = protocol == "grpc"
    variable, endpoint = _first(f"OTEL_EXPORTER_OTLP_{up}_ENDPOINT")
    if endpoint is None:
        variable, endpoint = _first("OTEL_EXPORTER_OTLP_ENDPOINT")
        if endpoint is None:
            endpoint = "http://localhost:4317" if grpc else "http://localhost:4318"
        if not grpc:
            endpoint = f"{endpoint.removesuffix('/')}/v1/{signal}"
    scheme = endpoint.partition("://")[0].lower() if "://" in endpoint else ""
    if grpc:
        insecure_variable, insecure = _first(f"OTEL_EXPORTER_OTLP_{up}_INSECURE", "OTEL_EXPORTER_OTLP_INSECURE")
        if scheme == "https":
            tls, why = True, "https://"
        elif insecure is not None:
            tls, why = insecure.lower() != "true", f"{insecure_variable}={insecure}"
        else:
            tls, why = scheme != "http", "http://" if scheme == "http" else "no http:// scheme"
    else:
        tls, why = scheme == "https", f"{scheme}://" if scheme else "no scheme"
    timeout_variable, timeout = _first(f"OTEL_EXPORTER_OTLP_{up}_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT")
    try:
        timeout_s = float(timeout) if timeout is not None else 10.0
        if not 0 < timeout_s < float("inf"):
            raise ValueError(timeout)
        timeout_text = f"{timeout_s:g} s {_source(timeout_variable)}"
    except ValueError:
        timeout_s, timeout_text = 10.0, f"10 s (the default: {timeout_variable}={timeout!r} is not a time > 0)"
    compression_variable, compression = _first(f"OTEL_EXPORTER_OTLP_{up}_COMPRESSION", "OTEL_EXPORTER_OTLP_COMPRESSION")
    headers_variable, headers = _first(f"OTEL_EXPORTER_OTLP_{up}_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS")
    certificate_variable, certificate = _first(f"OTEL_EXPORTER_OTLP_{up}_CERTIFICATE", "OTEL_EXPORTER_OTLP_CERTIFICATE")
    if certificate is None:
        state = "none: the system's CA certificates" if tls else "none (plain text)"
    else:
        state = _readable(certificate, directory_ok=not grpc) + ("" if tls else "; unused over plain text")
    clients = []
    for kind in ("CLIENT_KEY", "CLIENT_CERTIFICATE"):
        name, path = _first(f"OTEL_EXPORTER_OTLP_{up}_{kind}", f"OTEL_EXPORTER_OTLP_{kind}")
        if path is not None:
            clients.append(f"{kind.lower().replace('_', ' ')} {path} ({name}): {_readable(path, False)}")
    return Otlp(signal, protocol, protocol_variable, endpoint, variable, tls, why, timeout_s, timeout_variable,
                timeout_text, f"{compression.lower()} ({compression_variable})" if compression else "none (default)",
                _masked(headers, headers_variable), headers_variable or "OTEL_EXPORTER_OTLP_HEADERS", certificate,
                certificate_variable, state, clients)


def _masked(headers: str | None, variable: str | None) -> str:
    """Header names, never their values."""
    if headers is None:
        return "none"
    try:
        from opentelemetry.util.re import parse_env_headers

        names = list(parse_env_headers(headers, liberal=True))
    except Exception:  # pylint: disable=broad-except
        names = [part.partition("=")[0].strip() for part in headers.split(",") if part.strip()]
    return (", ".join(f"{name}=***" for name in names) or "none parsed") + f" ({variable}; values masked)"


def _hicache_value(name: str) -> str:
    """The effective value, by the reader of the default's type (a malformed value warns, as at run time)."""
    default = DEFAULTS[name]
    raw = otel_environment.raw(name)
    try:
        if isinstance(default, bool):
            value: Any = env_bool(name)
        elif isinstance(default, int):
            value = env_int(name)
        elif isinstance(default, float):
            value = env_float(name, minimum=_MINIMUM.get(name, 0.0))
        else:
            value = raw.strip() if raw is not None else default  # read (and checked) where it is used
    except Exception:  # pylint: disable=broad-except
        value = raw
    shown = str(value).lower() if isinstance(value, bool) else f"{value:g}" if isinstance(value, float) else value
    if shown is None:
        shown = "auto"  # decided at configure(): the sinks line above says how
    return f"{shown} " + ("(default)" if raw is None else f"(set: {raw!r})")


def _sampler() -> str:
    variable, name = _first("OTEL_TRACES_SAMPLER")
    _, arg = _first("OTEL_TRACES_SAMPLER_ARG")
    try:
        from opentelemetry.sdk.trace import TracerProvider

        described = TracerProvider(shutdown_on_exit=False).sampler.get_description()
    except Exception as exc:  # pylint: disable=broad-except
        described = f"cannot be built ({type(exc).__name__}: {exc})"
    given = (name or "parentbased_always_on") + (f", arg {arg}" if arg else "")
    return f"{given} {_source(variable)}: {described}"


def _samples_nothing() -> bool:
    """Whether ``OTEL_TRACES_SAMPLER`` drops every root span (``always_off``, or a ratio of 0)."""
    name = (otel_environment.raw("OTEL_TRACES_SAMPLER") or "").strip().lower()
    if name in ("always_off", "parentbased_always_off"):
        return True
    try:
        return name in ("traceidratio", "parentbased_traceidratio") and float(
            otel_environment.raw("OTEL_TRACES_SAMPLER_ARG") or "1") == 0
    except ValueError:
        return False


def _millis(name: str, default: str) -> str:
    value = otel_environment.raw(name)
    if value is None:
        return f"{default} ms (default)"
    if not otel_environment.positive(value):
        return f"{default} ms (the default: {name}={value!r} is not > 0)"
    return f"{value.strip()} ms ({name})"


# -- the test export ---------------------------------------------------------------------------

@dataclass
class Check:
    """One exporter's test export."""

    signal: str
    name: str
    exporter: Any
    otlp: Otlp | None
    thread: threading.Thread | None = None
    ident: int | None = None
    result: Any = None
    error: BaseException | None = None
    seconds: float = 0.0
    done: bool = False
    messages: list[str] = field(default_factory=list)
    probe: str = ""

    @property
    def accepted(self) -> bool:
        return self.done and self.error is None and getattr(self.result, "name", "") == "SUCCESS"

    @property
    def where(self) -> str:
        return f"{self.otlp.endpoint} ({self.otlp.protocol})" if self.otlp else self.name


def _test_data() -> tuple[list[Any], Any, str]:
    """One finished span and one metric point, of the resource ``configure()`` uses."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON

    resource = Resource.create()  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, as configure() does
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider(resource=resource, sampler=ALWAYS_ON, shutdown_on_exit=False)
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    span = tracer_provider.get_tracer("otel_hicache.doctor", __version__).start_span(
        SPAN_NAME, attributes={"otel_hicache.doctor": True})
    span.end()
    trace_id = f"{span.get_span_context().trace_id:032x}"
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader], resource=resource, shutdown_on_exit=False)
    meter_provider.get_meter("otel_hicache.doctor", __version__).create_counter(
        METRIC_NAME, unit="{check}", description="Test points sent by otel-hicache doctor").add(1)
    metrics = reader.get_metrics_data()
    meter_provider.shutdown()
    return list(spans.get_finished_spans()), metrics, trace_id


def _export(check: Check, data: Any, cap_s: float) -> None:
    check.ident = threading.get_ident()
    start = time.monotonic()
    try:
        if check.signal == "traces":
            check.result = check.exporter.export(data)
        else:
            check.result = check.exporter.export(data, timeout_millis=cap_s * 1e3)
    except BaseException as exc:  # pylint: disable=broad-except
        check.error = exc
    check.seconds = time.monotonic() - start
    check.done = True


def _probe(otlp: Otlp, timeout_s: float) -> str:
    """A plain TCP connection to the endpoint's host and port: the cause when the exporter's own
    messages have none (the HTTP exporters name it only when they retry)."""
    import socket
    from urllib.parse import urlsplit

    endpoint = otlp.endpoint if "://" in otlp.endpoint else f"//{otlp.endpoint}"
    try:
        parts = urlsplit(endpoint)
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" or (otlp.tls and not parts.scheme)
                                                    else 80 if parts.scheme == "http" else _PORT[otlp.protocol])
    except ValueError as exc:
        return f"the endpoint cannot be parsed ({exc})"
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as connection:
            if not otlp.tls:
                return f"a TCP connection to {host}:{port} opens"
            import ssl

            cafile = otlp.certificate if otlp.certificate and os.path.isfile(otlp.certificate) else None
            context = ssl.create_default_context(cafile=cafile)
            try:
                with context.wrap_socket(connection, server_hostname=host):
                    return f"a TCP connection to {host}:{port} opens, and its TLS handshake succeeds"
            except (ssl.SSLError, OSError) as exc:
                return f"a TCP connection to {host}:{port} opens; its TLS handshake fails ({exc})"
    except socket.gaierror as exc:
        return f"TCP to {host}:{port}: name resolution failed ({exc})"
    except OSError as exc:
        return f"TCP to {host}:{port}: {type(exc).__name__}: {exc.strerror or exc}"


# -- what went wrong, and the fix --------------------------------------------------------------

_WRONG_PROTOCOL = {"grpc": ("failed parsing http/2", "http1.x", "expected settings frame", "frame type"),
                   "http/protobuf": ("badstatusline",)}
_TLS_PLAIN_SERVER = ("wrong_version_number", "wrong version number", "record layer failure", "unknown protocol")
_TLS_VERIFY = ("certificate_verify_failed", "certificate verify failed", "self signed", "self-signed",
               "unable to get local issuer", "unknown ca")
_TLS_HOSTNAME = ("hostname mismatch", "doesn't match", "ip address mismatch", "peer name")
_UNREACHABLE = ("connection refused", "failed to connect to remote host", "name or service not known",
                "domain name not found", "failed to resolve", "nodename nor servname", "name resolution",
                "no route to host", "network is unreachable", "errors resolving", "newconnectionerror",
                "no address associated")
_CLOSED = ("socket closed", "connection reset", "remote end closed", "remotedisconnected", "connection aborted",
           "broken pipe", "eof occurred")
_TIMEOUT = ("deadline_exceeded", "deadline exceeded", "timed out", "timeout")
_TLS_ANY = ("ssl", "tls handshake", "handshake failed")


def _diagnose(check: Check, cap_s: float, also: list[str] = ()) -> tuple[str, str]:  # type: ignore[assignment]
    """(what went wrong, the fix naming the variable) for a test export that was not accepted;
    ``also``: what the exporters of the other signal to the same server said."""
    said = check.messages[-1] if check.messages else (repr(check.error) if check.error else "")
    text = " ".join([*check.messages, *also, *([repr(check.error)] if check.error else []), check.probe]).lower()
    otlp = check.otlp
    if otlp is None:
        return (f"the {check.name} exporter did not accept the test data" + (f": {said}" if said else ""),
                f"check the {check.name} exporter's own settings, or leave it out of "
                f"{providers.EXPORTER_GROUPS[check.signal][0]}")
    ep, ep_var, protocol = otlp.endpoint, otlp.fix_endpoint_variable, otlp.protocol
    other = "http/protobuf" if protocol == "grpc" else "grpc"
    has = lambda words: any(w in text for w in words)
    if has(_WRONG_PROTOCOL[protocol]):
        heard = "HTTP/1.1, as an OTLP/HTTP receiver does" if protocol == "grpc" else "HTTP/2, as a gRPC receiver does"
        return (f"{ep} does not speak {protocol}: it answered in {heard}",
                f"set {otlp.protocol_variable}={other}, or point {ep_var} at the Collector's {protocol} port "
                f"({_PORT[protocol]} by default)")
    if has(_TLS_PLAIN_SERVER):
        return (f"{ep} does not serve TLS, but the exporter connects with TLS ({otlp.tls_why})",
                f"use http:// in {ep_var}" + (" (or set OTEL_EXPORTER_OTLP_INSECURE=true)" if protocol == "grpc"
                                              else ""))
    if has(_TLS_HOSTNAME):
        return (f"the Collector's TLS certificate is not for the host in {ep}",
                f"use a host name the certificate names in {ep_var}")
    if has(_TLS_VERIFY):
        state = f"{otlp.certificate_variable}={otlp.certificate!r}" if otlp.certificate else "no CA certificate set"
        return (f"the Collector's TLS certificate is not trusted ({state})",
                f"set {otlp.certificate_fix_variable} to the CA certificate (PEM) that signed the Collector's "
                f"certificate")
    if has(_CLOSED):  # before "refused": one of localhost's addresses may refuse while the other answers
        tls = (f"if the Collector serves TLS, use https:// in {ep_var} and set {otlp.certificate_fix_variable}"
               if not otlp.tls else f"if the Collector serves plain text, use http:// in {ep_var}")
        return (f"{ep} accepted the connection and closed it",
                f"{tls}; if it is the Collector's {other} port, set {otlp.protocol_variable}={other}")
    if has(_UNREACHABLE):
        return (f"nothing accepts connections at {ep}",
                f"check {ep_var} (host and port: {_PORT[protocol]} for {protocol}) and that the Collector is up")
    refusal = next((found.group(0) for m in [*check.messages, *also] for found in [REFUSAL.search(m)] if found),
                   None)  # otel_hicache.http_session names every answer outside 2xx
    code = REFUSAL.search(refusal) if refusal else re.search(r"batch code: (\d{3})", text)
    status = re.search(r"error code: statuscode\.([a-z_]+)", text)
    http_status = int(code.group(1)) if code else None
    grpc_status = status.group(1).upper() if status else None
    answered = refusal or (f"HTTP {http_status}" if http_status else grpc_status)
    if http_status is not None and 300 <= http_status < 400:
        if refusal and WANTS_TLS in refusal:
            fix = (f"use https:// in {ep_var} (and set {otlp.certificate_fix_variable} if the Collector's "
                   f"certificate is self-signed)")
        else:
            fix = (f"set {ep_var} to the URL the redirect points to: no redirect is followed, an export is "
                   f"delivered only where it is sent")
        return f"REFUSED: {answered}", fix
    if http_status in (401, 403) or grpc_status in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
        return (f"the Collector at {ep} refused the credentials ({http_status or grpc_status})",
                f"check the authentication header in {otlp.headers_variable} (values are masked above)")
    if http_status == 404:
        if otlp.endpoint_variable and otlp.endpoint_variable != "OTEL_EXPORTER_OTLP_ENDPOINT":
            fix = f"give the full URL, ending in /v1/{check.signal}, in {ep_var}"
        else:
            fix = (f"give only the base URL (http://host:4318) in {ep_var}: /v1/{check.signal} is appended to it")
        return (f"{ep} has no OTLP {check.signal} receiver (HTTP 404)", fix)
    if grpc_status == "UNIMPLEMENTED":
        return (f"the gRPC server at {ep} has no OTLP {check.signal} service (UNIMPLEMENTED)",
                f"check the port in {ep_var}: the Collector's OTLP gRPC receiver listens on 4317 by default")
    if http_status in (400, 415):
        return (f"{ep} rejected the request (HTTP {http_status}): {said}",
                f"check that {ep_var} is a Collector's OTLP/HTTP receiver; else set {otlp.protocol_variable}={other}")
    if http_status is not None or grpc_status not in (None, "UNAVAILABLE", "DEADLINE_EXCEEDED"):
        busy = http_status in RETRYABLE or grpc_status == "RESOURCE_EXHAUSTED"
        return (f"REFUSED: {answered}" + ("" if refusal else f": {said}"),
                "check the Collector's own logs (" + ("overloaded? the exporters retry this answer within their "
                                                      "timeout)" if busy else "no pipeline for this signal?)"))
    if has(_TLS_ANY):
        return (f"TLS to {ep} failed: {said}", f"check {otlp.certificate_fix_variable} and the scheme in {ep_var}")
    if not check.done or has(_TIMEOUT) or not text:
        if check.done:
            waited = f"within the exporter's timeout, {otlp.timeout_text}"
        elif otlp.timeout_s > cap_s:
            waited = (f"within the doctor's cap of {cap_s:g} s (the exporter's own timeout is longer, "
                      f"{otlp.timeout_text}: rerun with --timeout {otlp.timeout_s:g})")
        else:
            waited = f"within the doctor's cap of {cap_s:g} s"
        return (f"{ep} accepted the connection but sent no answer {waited}",
                f"check that {ep_var} is a Collector's OTLP {protocol} receiver; if the Collector is only slow, "
                f"raise {otlp.timeout_variable or 'OTEL_EXPORTER_OTLP_TIMEOUT'}")
    return (f"the export to {ep} failed: {said}", f"check {ep_var} and {otlp.protocol_variable} ({protocol})")


def _not_built(signal: str, name: str, otlp: Otlp | None, warnings: list[str]) -> tuple[str, str]:
    variable = providers.EXPORTER_GROUPS[signal][0]
    text = " ".join(warnings)
    if otlp is not None and not otel_environment.certificate_usable(signal, otlp.protocol):
        return (f"the {name} {signal} exporter is not built: its CA certificate {otlp.certificate!r} cannot be "
                f"read, and the connection would use TLS",
                f"fix the path in {otlp.certificate_fix_variable}")
    if "unknown exporter" in text:
        return (f"{variable} names {name!r}, which is not installed",
                f"install the package providing it, or use otlp, console or none in {variable}")
    return (f"the {name} {signal} exporter could not be built" + (f": {warnings[-1]}" if warnings else ""),
            "fix the variable the warning names (Warnings while resolving, above)")


# -- adapters ---------------------------------------------------------------------------

def _adapters(out: TextIO, check: bool) -> None:
    """Each installed adapter's own section (entry-point group ``otel_hicache.adapters``)."""
    for name, registration in adapters.registered():
        try:
            registration.doctor(out, check)
        except Exception as exc:  # pylint: disable=broad-except
            print(f"  adapter {name}: its section failed ({type(exc).__name__}: {exc})", file=out)


# -- the report --------------------------------------------------------------------------------

class _Redacted:
    """``out`` with every header value of the ``OTEL_EXPORTER_OTLP_*HEADERS`` variables and the userinfo
    of every URL masked (``http://***@host``), also where an SDK message or an exception quotes them, a
    malformed header (``key:value``) or an endpoint's user and password on their own."""

    def __init__(self, out: TextIO) -> None:
        from urllib.parse import unquote

        self.out = out
        secrets = set()
        for name in ("OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
                     "OTEL_EXPORTER_OTLP_METRICS_HEADERS"):
            for part in (otel_environment.raw(name) or "").split(","):
                key, equals, value = part.partition("=")
                values = [value] if equals else [key, key.partition(":")[2]]
                secrets.update(text for v in values for text in (v.strip(), unquote(v).strip()))
        for name, value in os.environ.items():
            if name.startswith("OTEL_"):
                secrets.update(userinfo_parts(value))
        self.secrets = sorted((s for s in secrets if len(s) >= 3), key=len, reverse=True)

    def write(self, text: str) -> int:
        text = without_userinfo(text)
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()

    def __getattr__(self, name: str) -> Any:  # encoding, isatty, ...: what code writing to stderr may ask
        return getattr(self.out, name)


def doctor(timeout_s: float = CAP_S, check_sglang: bool = True, out: TextIO | None = None) -> int:
    """Print the report to ``out`` (stdout); the exit status (see the module's docstring)."""
    redacted: Any = _Redacted(out or sys.stdout)
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # grpc's own C-core lines would repeat the errors
    with _capturing() as logs, contextlib.redirect_stderr(_Redacted(sys.stderr)):
        return _doctor(logs, timeout_s, check_sglang, redacted)


Planned = tuple[str, str, "Otlp | None", "str | None"]
"""(signal, exporter name, its OTLP settings, why it is not checked)."""


def _doctor(logs: _Captured, cap_s: float, check_sglang: bool, out: TextIO) -> int:
    import opentelemetry.sdk.version as sdk_version

    p = lambda *a: print(*a, file=out)
    p(f"otel-hicache doctor {__version__} (OpenTelemetry SDK {sdk_version.__version__}, "
      f"Python {platform.python_version()})")
    p()
    notes: list[str] = []
    disabled = sdk_disabled()
    planned = _configuration(p, disabled, notes)
    checks, problems = _build(planned if not disabled else [], logs)
    _warnings(p, logs)
    trace_id = _exports(p, checks, problems, logs, cap_s, disabled, notes)
    _adapters(out, check_sglang)
    p()
    p()
    return _verdict(p, notes, problems, checks, trace_id)


def _configuration(p: Any, disabled: bool, notes: list[str]) -> list[Planned]:
    """Print what the variables resolve to; the exporters to check."""
    p("Configuration (from the OTEL_* variables)")
    p(f"  OTEL_SDK_DISABLED                          {str(disabled).lower()} "
      f"{_source('OTEL_SDK_DISABLED' if otel_environment.raw('OTEL_SDK_DISABLED') else None)}")
    internal = otel_environment.raw("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED")
    p(f"  OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED   {str((internal or '').strip().lower() == 'true').lower()} "
      f"{_source('OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED' if internal else None)}")
    try:
        from opentelemetry.sdk.resources import Resource

        attributes = Resource.create().attributes  # as configure() makes it
        service = attributes.get("service.name")
        if str(service).startswith("unknown_service"):
            notes.append(f"service.name is {service}: set OTEL_SERVICE_NAME to find the data under your "
                         f"service's name")
        p(f"  resource                                   service.name={service}"
          + "".join(f", {k}={v}" for k, v in attributes.items()
                    if k != "service.name" and not k.startswith("telemetry.sdk.")))
    except Exception as exc:  # pylint: disable=broad-except
        p(f"  resource                                   cannot be built ({type(exc).__name__}: {exc})")
    planned: list[Planned] = []
    for signal in ("traces", "metrics"):
        variable, names = _names(signal)
        p(f"  {signal}")
        p(f"    exporter        {', '.join(names)} {_source(variable if otel_environment.raw(variable) else None)}")
        if "none" in names:
            p(f"                    none: {signal} are not exported")
        for name in names if "none" not in names else ():
            protocol = _protocol_of(signal, name)
            if protocol is None:
                p(f"    {name:<15} {_NOT_CHECKED.get(name, 'not OTLP: checked by exporting to it')}")
                planned.append((signal, name, None, _NOT_CHECKED.get(name)))
                continue
            otlp = _otlp(signal, protocol)
            chosen = otlp.protocol_variable if otel_environment.raw(otlp.protocol_variable) else "default"
            p(f"    {name:<15} OTLP over {protocol} ({chosen})")
            p(f"      endpoint      {otlp.endpoint} {_source(otlp.endpoint_variable)}")
            p(f"      TLS           {'yes' if otlp.tls else 'no'} ({otlp.tls_why})")
            p(f"      timeout       {otlp.timeout_text}")
            p(f"      compression   {otlp.compression}")
            p(f"      headers       {otlp.headers}")
            p("      certificate   " + (f"{otlp.certificate} ({otlp.certificate_variable}): " if otlp.certificate
                                        else "") + otlp.certificate_state)
            for line in otlp.client_files:
                p(f"      {line}")
            planned.append((signal, name, otlp, None))
        if signal == "traces":
            p(f"    sampler         {_sampler()}")
            if "none" not in names and _samples_nothing():
                arg = otel_environment.raw("OTEL_TRACES_SAMPLER_ARG")
                notes.append(f"OTEL_TRACES_SAMPLER={os.environ.get('OTEL_TRACES_SAMPLER')}"
                             + (f" (OTEL_TRACES_SAMPLER_ARG={arg})" if arg else "")
                             + " keeps no root span: transfer spans without a sampled parent are dropped "
                               "(metrics are exported either way)")
        else:
            p(f"    export interval {_millis('OTEL_METRIC_EXPORT_INTERVAL', '60000')}; "
              f"export timeout {_millis('OTEL_METRIC_EXPORT_TIMEOUT', '30000')}")
    import opentelemetry.sdk.version as sdk_version

    p("  otel-hicache")
    channel = configuration.uses_telemetry_process()
    why = (f"{ev.OTEL_HICACHE_TELEMETRY_PROCESS}" if otel_environment.raw(ev.OTEL_HICACHE_TELEMETRY_PROCESS)
           else "an exporter sends over OTLP" if channel else "no exporter sends over the network")
    p(f"    sinks           {'a telemetry process of their own' if channel else 'embedded in the serving process'}"
      f" ({why}); OpenTelemetry SDK {sdk_version.__version__}")
    if channel:
        p("                    (one that cannot start or keeps dying: embedded after all, their cost then on the"
          " serving process; otel_hicache_sinks{location=\"embedded_fallback\"} says so)")
    width = max(map(len, DEFAULTS))
    for name in DEFAULTS:
        p(f"    {name:<{width}}  {_hicache_value(name)}")
    for feature, state in _features():
        p(f"    {feature:<15} {state}")
    if not env_bool(OTEL_HICACHE_ENABLED):
        notes.append("OTEL_HICACHE_ENABLED=false: otel-hicache records nothing (unset it to record)")
    p()
    return planned


def _features() -> list[tuple[str, str]]:
    """What is on in this process, and for what is off, why."""
    import importlib.util

    if not env_bool(ev.OTEL_HICACHE_HOST_RESIDENCE):
        residence = f"off ({ev.OTEL_HICACHE_HOST_RESIDENCE}=false)"
    elif importlib.util.find_spec("numpy") is None:
        residence = "off: NumPy is not importable (pip install numpy)"
    else:
        residence = "on"
    try:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        timing = (f"device events (torch {torch.__version__}, {gpus} CUDA device(s))" if gpus else
                  f"host clock: torch {torch.__version__} sees no CUDA device, so ops carry "
                  f"{sc.TIMING_SOURCE}=host_clock")
    except Exception as exc:  # pylint: disable=broad-except
        timing = f"whatever events the caller passes (torch is not importable: {type(exc).__name__})"
    return [("host residence", residence), ("timing", timing)]


def _build(planned: list[Planned], logs: _Captured) -> tuple[list[Check], list[tuple[str, str, str]]]:
    """The exporters, built as configure() builds them, one at a time (to tell which one failed);
    (the checks, the problems: (signal, what, fix))."""
    checks: list[Check] = []
    problems: list[tuple[str, str, str]] = []
    for signal, name, otlp, skipped in planned:
        if skipped is not None:
            continue
        mark = logs.mark()
        built = providers.exporters(signal, names=[name])
        if not built:
            problems.append((signal, *_not_built(signal, name, otlp, [_message(r) for r in logs.since(mark)])))
        checks += [Check(signal, name, exporter, otlp) for exporter in built]
    return checks, problems


def _warnings(p: Any, logs: _Captured) -> None:
    p("Warnings while resolving")
    seen: dict[str, int] = {}
    for record in logs.since(0):
        line = f"  {record.levelname} {record.name}: {_message(record)}"
        seen[line] = seen.get(line, 0) + 1
    for line, times in seen.items():
        p(line + (f" ({times} times)" if times > 1 else ""))
    if not seen:
        p("  (none)")
    p()


def _exports(p: Any, checks: list[Check], problems: list[tuple[str, str, str]], logs: _Captured, cap_s: float,
             disabled: bool, notes: list[str]) -> str:
    """Export the test data through every exporter at once, waiting at most ``cap_s``; the trace id."""
    p(f"Test export (one span '{SPAN_NAME}', one point of '{METRIC_NAME}'; waiting at most {cap_s:g} s: "
      f"the doctor's cap)")
    if disabled:
        p("  skipped: OTEL_SDK_DISABLED=true: configure() builds no-op providers and nothing is exported")
        notes.append("nothing is exported: OTEL_SDK_DISABLED=true (unset it, or set it to false, to export)")
    elif not checks and not problems:
        p("  skipped: no exporter to check")
        notes.append("nothing to check: no OTLP or other push exporter is configured (OTEL_TRACES_EXPORTER, "
                     "OTEL_METRICS_EXPORTER)")
    for signal, what, _ in problems:
        p(f"  {signal:<8} not checked: {what}")
    if not checks:
        p()
        return ""
    spans, metrics, trace_id = _test_data()
    mark = logs.mark()
    http_errors: list[tuple[int, str]] = []
    with _every_message(), _http_errors(http_errors):
        for check in checks:
            check.thread = threading.Thread(target=_export, args=(check, spans if check.signal == "traces"
                                                                  else metrics, cap_s),
                                            name=f"otel-hicache-doctor-{check.signal}", daemon=True)
            check.thread.start()
        deadline = time.monotonic() + cap_s
        for check in checks:
            check.thread.join(max(0.0, deadline - time.monotonic()))
    for check in checks:
        check.messages = [_message(r) for r in logs.since(mark, check.ident)] if check.ident else []
        check.messages += [error for ident, error in list(http_errors) if ident == check.ident]
    for check in checks:
        if check.accepted:
            what = f"trace_id {trace_id}" if check.signal == "traces" else f"metric {METRIC_NAME}"
            p(f"  {check.signal:<8} ACCEPTED by {check.where} in {check.seconds:.2f} s ({what})")
        else:
            also = [m for c in checks if c is not check and c.otlp and check.otlp
                    and _server(c.otlp) == _server(check.otlp) for m in c.messages]
            what, fix = _diagnose(check, cap_s, also)
            if check.otlp is not None and (" sent no answer " in what or what.startswith("the export to ")):
                check.probe = _probe(check.otlp, min(2.0, cap_s))  # no cause in what the exporter said
                what, fix = _diagnose(check, cap_s, also)
            p(f"  {check.signal:<8} {'NOT accepted' if check.done else 'no answer yet'} by {check.where}: {what}")
            telling = [m for m in check.messages if "due to timeout, max retries" not in m] or check.messages
            if telling:
                p(f"           the exporter said: {telling[-1][:400]}")
            if check.probe:
                p(f"           probe: {check.probe}")
            problems.append((check.signal, what, fix))
        with contextlib.suppress(Exception):
            check.exporter.shutdown()
    problem = _telemetry_process(p, cap_s)
    if problem is not None:
        problems.append(("traces", *problem))
    p()
    return trace_id


def _telemetry_process(p: Any, cap_s: float) -> tuple[str, str] | None:
    """When configure() would run the sinks in a telemetry process: start one as the capture
    would and have it flush its exporters; (what, fix) when it does not answer."""
    if not configuration.uses_telemetry_process():
        return None
    from .capture.channel import ProcessChannel, telemetry_process_command

    started = time.monotonic()
    channel = ProcessChannel(configuration.hello({}), 1, lambda: None)
    try:
        answered = channel.flush(cap_s)
        pid = channel.process.pid if channel.process is not None else None
    except Exception:  # pylint: disable=broad-except  # (the fallback above returns nothing to write to)
        answered, pid = False, None
    finally:
        with contextlib.suppress(Exception):
            channel.stop(1.0)
    if answered:
        p(f"  sinks    the telemetry process (pid {pid}) started and flushed its exporters in "
          f"{time.monotonic() - started:.2f} s")
        return None
    what = ("the telemetry process " + ("could not be started" if pid is None else
                                        f"did not answer within {cap_s:g} s")
            + " (the serving process would fall back to exporting itself)")
    p(f"  sinks    NOT working: {what}")
    return what, (f"run `{shlex.join(telemetry_process_command())} < /dev/null` in this environment to see its "
                  f"error, or set {ev.OTEL_HICACHE_TELEMETRY_PROCESS}=false")


def _verdict(p: Any, notes: list[str], problems: list[tuple[str, str, str]], checks: list[Check],
             trace_id: str) -> int:
    p("Result")
    for note in notes:
        p(f"  NOTE: {note}")
    if problems:
        merged: dict[tuple[str, ...], list[tuple[str, str, str]]] = {}  # one line for both signals if alike
        for problem in problems:
            key = tuple(re.sub(r"\b(traces|metrics)\b", "{traces,metrics}", text) for text in problem[1:])
            merged.setdefault(key, []).append(problem)
        for key, alike in merged.items():
            what, fix = alike[0][1:] if len(alike) == 1 else key
            p(f"  PROBLEM ({', '.join(signal for signal, _, _ in alike)}): {what}")
            p(f"  FIX: {fix}")
        return 1
    if checks:
        p(f"  OK: every configured exporter accepted the test data (look for trace {trace_id} and "
          f"{METRIC_NAME} in your backend)")
    return 0


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Check what otel-hicache would export, and where to.")
    parser.add_argument("--timeout", type=float, default=CAP_S, metavar="SECONDS",
                        help=f"wait at most this long for the test exports (default {CAP_S:g})")
    parser.add_argument("--skip-sglang", action="store_true",
                        help="do not import SGLang's modules to check the patch groups (that takes seconds)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``otel-hicache`` console script: ``otel-hicache doctor [options]``."""
    parser = argparse.ArgumentParser(prog="otel-hicache", description="otel-hicache tools.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("doctor", parents=[_parser("doctor")], add_help=False,
                        help="check the configuration and the export: what to run when nothing shows up")
    args = parser.parse_args(argv)
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    if not args.timeout > 0:
        print("otel-hicache doctor: --timeout must be > 0", file=sys.stderr)
        return 2
    code = doctor(timeout_s=args.timeout, check_sglang=not args.skip_sglang)
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(_run(_parser("python -m otel_hicache.doctor").parse_args()))
