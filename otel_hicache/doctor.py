"""``otel-hicache doctor``: what to check when nothing shows up, in one command.

It prints the settings as the telemetry process resolves them (:mod:`.sinks.otel_environment`,
the same functions: the two cannot diverge), with every warning that resolution emits; exports
one test span and one metric point through exporters built by the same code, and says whether
each was accepted, and if not, what to fix; then each installed adapter's section.
Exit status: 0 when every exporter accepted its test data (or nothing is to be exported), 1
when one did not or could not be built, 2 for a usage error. Header values and URL userinfo
are masked in everything it prints.

    otel-hicache doctor [--timeout 10] [--skip-adapters]
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
from .settings import env_bool, env_float, env_int, sdk_disabled
from .sinks import otel_environment as oe, providers
from .sinks.http_session import REFUSAL, RETRYABLE, WANTS_TLS
from .sinks.redaction import userinfo_parts, without_userinfo
from .version import __version__

CAP_S = 10.0
"""How long the doctor waits for the test exports, at most (``--timeout``)."""
SPAN_NAME, METRIC_NAME = "otel_hicache.doctor", "otel_hicache.doctor.checks"
_NOT_CHECKED = {"console": "writes to the instrumented process's stdout; not checked",
                "prometheus": "a pull reader serving OTEL_EXPORTER_PROMETHEUS_HOST:PORT (default localhost:9464) "
                              "in the instrumented process; not checked (scrape it there)"}
_PORT = {"grpc": 4317, "http/protobuf": 4318}


# -- log records: the warnings of the resolution, and what the exporters said ----------------------

class _Captured(logging.Handler):
    """Every record of the ``otel_hicache`` and ``opentelemetry`` loggers, with its thread."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)  # (list.append is atomic)

    def since(self, start: int, thread: int | None = None) -> list[str]:
        return [_message(r) for r in self.records[start:]
                if r.levelno >= logging.WARNING and thread in (None, r.thread)]


@contextlib.contextmanager
def _capturing() -> Iterator[_Captured]:
    """Our and the SDK's records to the report only, and the SDK's exporter loggers without their
    ``DuplicateFilter`` (it would drop the second signal's error): this process is the doctor's."""
    handler = _Captured()
    loggers = [logging.getLogger(name) for name in ("otel_hicache", "opentelemetry")]
    saved = [(lg.level, lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.propagate = False
        lg.setLevel(logging.WARNING if lg.level == logging.NOTSET or lg.level > logging.WARNING else lg.level)
    try:
        yield handler
    finally:
        for lg, (level, propagate) in zip(loggers, saved):
            lg.removeHandler(handler)
            lg.setLevel(level)
            lg.propagate = propagate


def _lift_duplicate_filters() -> None:
    for name, found in list(logging.Logger.manager.loggerDict.items()):
        if name.startswith("opentelemetry") and isinstance(found, logging.Logger):
            found.filters = [f for f in found.filters if type(f).__name__ != "DuplicateFilter"]


@contextlib.contextmanager
def _http_errors(sink: list[tuple[int, str]]) -> Iterator[None]:
    """Each exception a ``requests`` transport raised, with its thread: the OTLP/HTTP exporters log
    the cause only when they retry."""
    from requests.adapters import HTTPAdapter

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
    error = record.exc_info[1] if record.exc_info else None
    return text + (f" ({type(error).__name__}: {error})" if error is not None else "")


# -- the settings, resolved by the telemetry process's own functions -------------------------------

def _source(name: str | None) -> str:
    return f"({name})" if name else "(default)"


@dataclass
class Otlp:
    """One OTLP exporter's settings, as the exporter it builds resolves them."""

    signal: str
    protocol: str
    endpoint: str = ""
    endpoint_variable: str | None = None
    tls: bool = False
    tls_why: str = ""
    certificate: str | None = None
    certificate_variable: str | None = None
    lines: list[str] = field(default_factory=list)  # what the report prints of it

    def variable(self, suffix: str) -> str:
        """The variable to fix: the one set, else the general one."""
        found = oe.first(self.signal, suffix)
        return found[0] if found else f"OTEL_EXPORTER_OTLP_{suffix}"

    @property
    def fix_endpoint_variable(self) -> str:
        return self.endpoint_variable or "OTEL_EXPORTER_OTLP_ENDPOINT"


def _otlp(signal: str, protocol: str) -> Otlp:
    grpc = protocol == "grpc"
    otlp = Otlp(signal, protocol, oe.endpoint(signal, protocol))
    otlp.endpoint_variable = (oe.first(signal, "ENDPOINT") or (None,))[0]
    scheme = otlp.endpoint.partition("://")[0].lower() if "://" in otlp.endpoint else ""
    insecure = oe.first(signal, "INSECURE")
    if grpc and scheme != "https" and insecure is not None:
        otlp.tls, otlp.tls_why = oe.tls(signal, protocol), f"{insecure[0]}={insecure[1].strip()}"
    else:
        otlp.tls = oe.tls(signal, protocol)
        otlp.tls_why = f"{scheme}://" if scheme else "no http:// scheme" if grpc else "no scheme"
    timeout = oe.first(signal, "TIMEOUT")
    seconds = oe.timeout_s(signal)()
    timeout_text = (f"{seconds:g} s {_source(timeout and timeout[0])}" if timeout is None
                    or oe.positive_float(timeout[1]) else f"10 s (the default: {timeout[0]}={timeout[1]!r} is not a "
                                                          f"time > 0)")
    compression = oe.first(signal, "COMPRESSION")
    pairs, _ = oe.headers(signal)  # (its warning, if any, is the telemetry process's)
    header_variable = (oe.first(signal, "HEADERS") or ("OTEL_EXPORTER_OTLP_HEADERS",))[0]
    headers = "none" if pairs is None else (", ".join(f"{k}=***" for k in pairs) or "none parsed") + \
        f" ({header_variable}; values masked)"
    lines = [f"endpoint      {otlp.endpoint} {_source(otlp.endpoint_variable)}",
             f"TLS           {'yes' if otlp.tls else 'no'} ({otlp.tls_why})", f"timeout       {timeout_text}",
             "compression   " + (f"{compression[1].strip().lower()} ({compression[0]})" if compression
                                 else "none (default)"), f"headers       {headers}"]
    for suffix, what in oe.FILES.items():
        found = oe.first(signal, suffix)
        if found is None:
            if suffix == "CERTIFICATE":
                lines.append("certificate   " + ("none: the system's CA certificates" if otlp.tls
                                                 else "none (plain text)"))
            continue
        name, path = found[0], found[1].strip()
        problem = oe.unreadable(path, directory_ok=not grpc and suffix == "CERTIFICATE")
        state = f"NOT readable: {problem}" if problem else "readable (a directory)" if os.path.isdir(path) \
            else "readable"
        label = "certificate  " if suffix == "CERTIFICATE" else what
        lines.append(f"{label} {path} ({name}): {state}" + ("" if otlp.tls else "; unused over plain text"))
        if suffix == "CERTIFICATE":
            otlp.certificate, otlp.certificate_variable = path, name
    otlp.lines = lines
    return otlp


def _hicache_value(name: str) -> str:
    """The effective value, read as at run time (a malformed value warns)."""
    default, raw = ev.DEFAULTS[name], oe.raw(name)
    minimum = 0.01 if name in (ev.OTEL_HICACHE_POLL_INTERVAL_MS, ev.OTEL_HICACHE_ANCHOR_INTERVAL_S) else 0.0
    value: Any = (env_bool(name) if isinstance(default, bool) else env_int(name) if isinstance(default, int)
                  else env_float(name, minimum=minimum) if isinstance(default, float)
                  else raw.strip() if raw is not None else "auto")  # TELEMETRY_PROCESS: the sinks line says how
    shown = str(value).lower() if isinstance(value, bool) else f"{value:g}" if isinstance(value, float) else value
    return f"{shown} " + ("(default)" if raw is None else f"(set: {raw!r})")


def _sampler(notes: list[str], exported: bool) -> str:
    name, arg = oe.raw("OTEL_TRACES_SAMPLER"), oe.raw("OTEL_TRACES_SAMPLER_ARG")
    try:
        from opentelemetry.sdk.trace import TracerProvider

        described = TracerProvider(shutdown_on_exit=False).sampler.get_description()
        if exported and described.removeprefix("ParentBased{root:").startswith(("AlwaysOffSampler",
                                                                                 "TraceIdRatioBased{0.0}")):
            notes.append(f"OTEL_TRACES_SAMPLER={name}" + (f" (OTEL_TRACES_SAMPLER_ARG={arg})" if arg else "")
                         + " keeps no root span: transfer spans without a sampled parent are dropped "
                           "(metrics are exported either way)")
    except Exception as exc:  # pylint: disable=broad-except
        described = f"cannot be built ({type(exc).__name__}: {exc})"
    given = (name.strip() if name else "parentbased_always_on") + (f", arg {arg.strip()}" if arg else "")
    return f"{given} {_source('OTEL_TRACES_SAMPLER' if name else None)}: {described}"


def _millis(name: str, default: str) -> str:
    value = oe.raw(name)
    if value is None:
        return f"{default} ms (default)"
    if not oe.positive(value):
        return f"{default} ms (the default: {name}={value!r} is not > 0)"
    return f"{value.strip()} ms ({name})"


Planned = tuple[str, str, "Otlp | None", bool]
"""(signal, exporter name, its OTLP settings, whether it is checked by exporting to it)."""


def _configuration(p: Any, notes: list[str]) -> list[Planned]:
    """Print what the variables resolve to; the exporters to check."""
    p("Configuration (from the OTEL_* variables)")
    disabled, internal = sdk_disabled(), oe.raw("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED")
    p(f"  OTEL_SDK_DISABLED                          {str(disabled).lower()} "
      f"{_source('OTEL_SDK_DISABLED' if oe.raw('OTEL_SDK_DISABLED') else None)}")
    p(f"  OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED   {str((internal or '').strip().lower() == 'true').lower()} "
      f"{_source('OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED' if internal else None)}")
    attributes = oe.resource().attributes
    service = attributes.get("service.name")
    if str(service).startswith("unknown_service"):
        notes.append(f"service.name is {service}: set OTEL_SERVICE_NAME to find the data under your service's name")
    p(f"  resource                                   service.name={service}" + "".join(
        f", {k}={v}" for k, v in attributes.items() if k != "service.name" and not k.startswith("telemetry.sdk.")))
    planned: list[Planned] = []
    for signal in ("traces", "metrics"):
        variable = providers.EXPORTER_GROUPS[signal][0]
        names = list(dict.fromkeys(providers.exporter_names(signal))) or ["none"]
        p(f"  {signal}")
        p(f"    exporter        {', '.join(names)} {_source(variable if oe.raw(variable) else None)}")
        if names == ["none"]:
            p(f"                    none: {signal} are not exported")
        for name in names if names != ["none"] else ():
            protocol = providers.otlp_protocol(signal, name)
            if protocol is None:
                p(f"    {name:<15} {_NOT_CHECKED.get(name, 'not OTLP: checked by exporting to it')}")
                planned.append((signal, name, None, name not in _NOT_CHECKED))
                continue
            otlp = _otlp(signal, protocol)
            chosen = otlp.variable("PROTOCOL")
            p(f"    {name:<15} OTLP over {protocol} ({chosen if oe.raw(chosen) else 'default'})")
            for line in otlp.lines:
                p(f"      {line}")
            planned.append((signal, name, otlp, True))
        if signal == "traces":
            p(f"    sampler         {_sampler(notes, names != ['none'])}")
        else:
            p(f"    export interval {_millis('OTEL_METRIC_EXPORT_INTERVAL', '60000')}; "
              f"export timeout {_millis('OTEL_METRIC_EXPORT_TIMEOUT', '30000')}")
    import opentelemetry.sdk.version as sdk_version

    p("  otel-hicache")
    process = configuration.uses_telemetry_process()
    why = (ev.OTEL_HICACHE_TELEMETRY_PROCESS if oe.raw(ev.OTEL_HICACHE_TELEMETRY_PROCESS)
           else "an exporter sends over OTLP" if process else "no exporter sends over the network")
    p(f"    sinks           {'a telemetry process of their own' if process else 'embedded in the serving process'}"
      f" ({why}); OpenTelemetry SDK {sdk_version.__version__}")
    width = max(map(len, ev.DEFAULTS))
    for name in ev.DEFAULTS:
        p(f"    {name:<{width}}  {_hicache_value(name)}")
    for feature, state in _features():
        p(f"    {feature:<15} {state}")
    if not env_bool(ev.OTEL_HICACHE_ENABLED):
        notes.append("OTEL_HICACHE_ENABLED=false: otel-hicache records nothing (unset it to record)")
    p()
    return [] if disabled else planned


def _features() -> list[tuple[str, str]]:
    """What is on in this process, and for what is off, why."""
    import importlib.util

    if not env_bool(ev.OTEL_HICACHE_HOST_RESIDENCE):
        residence = f"off ({ev.OTEL_HICACHE_HOST_RESIDENCE}=false)"
    else:
        residence = "on" if importlib.util.find_spec("numpy") else "off: NumPy is not importable (pip install numpy)"
    try:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        timing = (f"device events (torch {torch.__version__}, {gpus} CUDA device(s))" if gpus else
                  f"host clock: torch {torch.__version__} sees no CUDA device, so ops carry "
                  f"{sc.TIMING_SOURCE}=host_clock")
    except Exception as exc:  # pylint: disable=broad-except
        timing = f"whatever events the caller passes (torch is not importable: {type(exc).__name__})"
    return [("host residence", residence), ("timing", timing)]


# -- the test export ---------------------------------------------------------------------------

@dataclass
class Check:
    """One exporter's test export."""

    signal: str
    name: str
    exporter: Any
    otlp: Otlp | None
    ident: int | None = None
    result: Any = None
    error: BaseException | None = None
    seconds: float = 0.0
    done: bool = False
    messages: list[str] = field(default_factory=list)

    @property
    def accepted(self) -> bool:
        return self.done and self.error is None and getattr(self.result, "name", "") == "SUCCESS"

    @property
    def where(self) -> str:
        return f"{self.otlp.endpoint} ({self.otlp.protocol})" if self.otlp else self.name

    def run(self, data: Any, cap_s: float) -> None:
        self.ident, start = threading.get_ident(), time.monotonic()
        try:
            self.result = self.exporter.export(data) if self.signal == "traces" else \
                self.exporter.export(data, timeout_millis=cap_s * 1e3)
        except BaseException as exc:  # pylint: disable=broad-except
            self.error = exc
        self.seconds, self.done = time.monotonic() - start, True


def _test_data() -> tuple[list[Any], Any, str]:
    """One finished span and one metric point, of the resource the sinks use."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON

    resource, spans = oe.resource(), InMemorySpanExporter()
    tracer_provider = TracerProvider(resource=resource, sampler=ALWAYS_ON, shutdown_on_exit=False)
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    span = tracer_provider.get_tracer(SPAN_NAME, __version__).start_span(SPAN_NAME, attributes={SPAN_NAME: True})
    span.end()
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader], resource=resource, shutdown_on_exit=False)
    meter_provider.get_meter(SPAN_NAME, __version__).create_counter(
        METRIC_NAME, unit="{check}", description="Test points sent by otel-hicache doctor").add(1)
    metrics = reader.get_metrics_data()
    meter_provider.shutdown()
    return list(spans.get_finished_spans()), metrics, f"{span.get_span_context().trace_id:032x}"


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


def _diagnose(check: Check, cap_s: float, also: list[str]) -> tuple[str, str]:
    """(what went wrong, the fix naming the variable) for a test export that was not accepted;
    ``also``: what the exporters of the other signal to the same server said."""
    said = check.messages[-1] if check.messages else (repr(check.error) if check.error else "")
    text = " ".join([*check.messages, *also, *([repr(check.error)] if check.error else [])]).lower()
    otlp = check.otlp
    if otlp is None:
        return (f"the {check.name} exporter did not accept the test data" + (f": {said}" if said else ""),
                f"check the {check.name} exporter's own settings, or leave it out of "
                f"{providers.EXPORTER_GROUPS[check.signal][0]}")
    ep, ep_var, protocol = otlp.endpoint, otlp.fix_endpoint_variable, otlp.protocol
    other, protocol_var, ca_var = ("http/protobuf" if protocol == "grpc" else "grpc", otlp.variable("PROTOCOL"),
                                   otlp.variable("CERTIFICATE"))
    has = lambda words: any(w in text for w in words)  # noqa: E731
    if has(_WRONG_PROTOCOL[protocol]):
        heard = "HTTP/1.1, as an OTLP/HTTP receiver does" if protocol == "grpc" else "HTTP/2, as a gRPC receiver does"
        return (f"{ep} does not speak {protocol}: it answered in {heard}", f"set {protocol_var}={other}, or point "
                f"{ep_var} at the Collector's {protocol} port ({_PORT[protocol]} by default)")
    if has(_TLS_PLAIN_SERVER):
        return (f"{ep} does not serve TLS, but the exporter connects with TLS ({otlp.tls_why})",
                f"use http:// in {ep_var}" + (" (or set OTEL_EXPORTER_OTLP_INSECURE=true)" if protocol == "grpc"
                                              else ""))
    if has(_TLS_HOSTNAME):
        return f"the Collector's TLS certificate is not for the host in {ep}", f"use a host name it names in {ep_var}"
    if has(_TLS_VERIFY):
        state = f"{otlp.certificate_variable}={otlp.certificate!r}" if otlp.certificate else "no CA certificate set"
        return (f"the Collector's TLS certificate is not trusted ({state})",
                f"set {ca_var} to the CA certificate (PEM) that signed the Collector's certificate")
    if has(_CLOSED):  # before "refused": one of localhost's addresses may refuse while the other answers
        tls = (f"if the Collector serves TLS, use https:// in {ep_var} and set {ca_var}" if not otlp.tls
               else f"if the Collector serves plain text, use http:// in {ep_var}")
        return f"{ep} accepted the connection and closed it", f"{tls}; if it is its {other} port, set " \
                                                              f"{protocol_var}={other}"
    if has(_UNREACHABLE):
        return (f"nothing accepts connections at {ep}",
                f"check {ep_var} (host and port: {_PORT[protocol]} for {protocol}) and that the Collector is up")
    refusal = next((found.group(0) for m in [*check.messages, *also] if (found := REFUSAL.search(m))), None)
    code = REFUSAL.search(refusal) if refusal else re.search(r"batch code: (\d{3})", text)
    status = re.search(r"error code: statuscode\.([a-z_]+)", text)
    http_status, grpc_status = int(code.group(1)) if code else None, status.group(1).upper() if status else None
    answered = refusal or (f"HTTP {http_status}" if http_status else grpc_status)
    if http_status is not None and 300 <= http_status < 400:
        return f"REFUSED: {answered}", (
            f"use https:// in {ep_var} (and set {ca_var} if the Collector's certificate is self-signed)"
            if refusal and WANTS_TLS in refusal else
            f"set {ep_var} to the URL the redirect points to: no redirect is followed")
    if http_status in (401, 403) or grpc_status in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
        return (f"the Collector at {ep} refused the credentials ({http_status or grpc_status})",
                f"check the authentication header in {otlp.variable('HEADERS')} (values are masked above)")
    if http_status == 404:
        fix = (f"give the full URL, ending in /v1/{check.signal}, in {ep_var}" if ep_var != "OTEL_EXPORTER_OTLP_ENDPOINT"
               else f"give only the base URL (http://host:4318) in {ep_var}: /v1/{check.signal} is appended to it")
        return f"{ep} has no OTLP {check.signal} receiver (HTTP 404)", fix
    if grpc_status == "UNIMPLEMENTED" or http_status in (400, 415):
        return (f"{ep} has no OTLP {check.signal} service ({answered})",
                f"check that {ep_var} is a Collector's OTLP {protocol} receiver ({_PORT[protocol]} by default)")
    if http_status is not None or grpc_status not in (None, "UNAVAILABLE", "DEADLINE_EXCEEDED"):
        busy = http_status in RETRYABLE or grpc_status == "RESOURCE_EXHAUSTED"
        return (f"REFUSED: {answered}" + ("" if refusal else f": {said}"), "check the Collector's own logs (" +
                ("overloaded? the exporters retry this answer within their timeout)" if busy
                 else "no pipeline for this signal?)"))
    if not check.done or not text or has(("deadline", "timed out", "timeout")):
        waited = "within the exporter's timeout" if check.done else f"within the doctor's cap of {cap_s:g} s"
        return (f"{ep} accepted the connection but sent no answer {waited}",
                f"check that {ep_var} is a Collector's OTLP {protocol} receiver; if the Collector is only slow, "
                f"raise {otlp.variable('TIMEOUT')} (and --timeout)")
    return f"the export to {ep} failed: {said}", f"check {ep_var} and {protocol_var} ({protocol})"


def _build(planned: list[Planned], logs: _Captured) -> tuple[list[Check], list[tuple[str, str, str]]]:
    """The exporters, built by the telemetry process's code one at a time (to tell which one failed);
    (the checks, the problems: (signal, what, fix))."""
    checks: list[Check] = []
    problems: list[tuple[str, str, str]] = []
    for signal, name, otlp, checked in planned:
        if not checked:
            continue
        mark = len(logs.records)
        built = providers.exporters(signal, names=[name], own_process=True)  # (the doctor is its own process)
        checks += [Check(signal, name, exporter, otlp) for exporter in built]
        if built:
            continue
        variable, said = providers.EXPORTER_GROUPS[signal][0], logs.since(mark)
        if otlp is not None and not oe.certificate_usable(signal, otlp.protocol):
            problems.append((signal, f"the {name} {signal} exporter is not built: its CA certificate "
                             f"{otlp.certificate!r} cannot be read, and the connection would use TLS",
                             f"fix the path in {otlp.variable('CERTIFICATE')}"))
        elif any("unknown exporter" in m for m in said):
            problems.append((signal, f"{variable} names {name!r}, which is not installed",
                             f"install the package providing it, or use otlp, console or none in {variable}"))
        else:
            problems.append((signal, f"the {name} {signal} exporter could not be built" + (
                f": {said[-1]}" if said else ""), "fix the variable the warning names (Warnings, above)"))
    return checks, problems


def _exports(p: Any, checks: list[Check], problems: list[tuple[str, str, str]], logs: _Captured,
             cap_s: float, notes: list[str]) -> str:
    """Export the test data through every exporter at once, waiting at most ``cap_s``; the trace id."""
    p(f"Test export (one span '{SPAN_NAME}', one point of '{METRIC_NAME}'; waiting at most {cap_s:g} s: "
      f"the doctor's cap)")
    if sdk_disabled():
        p("  skipped: OTEL_SDK_DISABLED=true: the providers are no-op and nothing is exported")
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
    mark, http_errors = len(logs.records), []
    _lift_duplicate_filters()
    with _http_errors(http_errors):
        threads = [threading.Thread(target=c.run, args=(spans if c.signal == "traces" else metrics, cap_s),
                                    name=f"otel-hicache-doctor-{c.signal}", daemon=True) for c in checks]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + cap_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
    for check in checks:
        check.messages = logs.since(mark, check.ident) if check.ident else []
        check.messages += [error for ident, error in list(http_errors) if ident == check.ident]
    for check in checks:
        if check.accepted:
            what = f"trace_id {trace_id}" if check.signal == "traces" else f"metric {METRIC_NAME}"
            p(f"  {check.signal:<8} ACCEPTED by {check.where} in {check.seconds:.2f} s ({what})")
        else:
            also = [m for c in checks if c is not check and c.otlp and check.otlp
                    and (c.otlp.protocol, c.otlp.endpoint.rsplit("/v1/", 1)[0])
                    == (check.otlp.protocol, check.otlp.endpoint.rsplit("/v1/", 1)[0]) for m in c.messages]
            what, fix = _diagnose(check, cap_s, also)
            p(f"  {check.signal:<8} {'NOT accepted' if check.done else 'no answer yet'} by {check.where}: {what}")
            telling = [m for m in check.messages if "due to timeout, max retries" not in m] or check.messages
            if telling:
                p(f"           the exporter said: {telling[-1][:400]}")
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
    what = ("the telemetry process " + ("could not be started" if pid is None else f"did not answer within "
                                        f"{cap_s:g} s") + " (the serving process would fall back to exporting itself)")
    p(f"  sinks    NOT working: {what}")
    return what, (f"run `{shlex.join(telemetry_process_command())} < /dev/null` in this environment to see its "
                  f"error, or set {ev.OTEL_HICACHE_TELEMETRY_PROCESS}=false")


def _verdict(p: Any, notes: list[str], problems: list[tuple[str, str, str]], checks: list[Check],
             trace_id: str) -> int:
    p("Result")
    for note in notes:
        p(f"  NOTE: {note}")
    merged: dict[tuple[str, ...], list[tuple[str, str, str]]] = {}  # one line for both signals if alike
    for problem in problems:
        merged.setdefault(tuple(re.sub(r"\b(traces|metrics)\b", "{traces,metrics}", t) for t in problem[1:]),
                          []).append(problem)
    for key, alike in merged.items():
        what, fix = alike[0][1:] if len(alike) == 1 else key
        p(f"  PROBLEM ({', '.join(signal for signal, _, _ in alike)}): {what}")
        p(f"  FIX: {fix}")
    if problems:
        return 1
    if checks:
        p(f"  OK: every configured exporter accepted the test data (look for trace {trace_id} and "
          f"{METRIC_NAME} in your backend)")
    return 0


# -- the report --------------------------------------------------------------------------------

class _Redacted:
    """``out`` with every header value and the userinfo of every URL masked (``http://***@host``),
    also where an SDK message quotes a malformed header (``key:value``) or a user or password alone."""

    def __init__(self, out: TextIO) -> None:
        from urllib.parse import unquote

        self.out, secrets = out, set()
        for name, value in os.environ.items():
            if name.startswith("OTEL_"):
                secrets.update(userinfo_parts(value))
            for entry in value.split(",") if name.startswith("OTEL_EXPORTER_OTLP_") and name.endswith("HEADERS") \
                    else ():
                key, equals, text = entry.partition("=")
                for part in [text] if equals else [key, key.partition(":")[2]]:  # a colon for '=': quoted whole
                    secrets.update((part.strip(), unquote(part).strip()))
        self.secrets = sorted((s for s in secrets if len(s) >= 3), key=len, reverse=True)

    def write(self, text: str) -> int:
        text = without_userinfo(text)
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return self.out.write(text)

    def __getattr__(self, name: str) -> Any:  # flush, encoding, isatty...: what code writing to stderr may ask
        return getattr(self.out, name)


def doctor(timeout_s: float = CAP_S, check_adapters: bool = True, out: TextIO | None = None) -> int:
    """Print the report to ``out`` (stdout); the exit status (see the module's docstring)."""
    import opentelemetry.sdk.version as sdk_version

    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # grpc's own C-core lines would repeat the errors
    with _capturing() as logs, contextlib.redirect_stderr(_Redacted(sys.stderr)):
        report: Any = _Redacted(out or sys.stdout)
        p = lambda *a: print(*a, file=report)  # noqa: E731
        p(f"otel-hicache doctor {__version__} (OpenTelemetry SDK {sdk_version.__version__}, "
          f"Python {platform.python_version()})\n")
        notes: list[str] = []
        checks, problems = _build(_configuration(p, notes), logs)
        p("Warnings while resolving")
        seen: dict[str, int] = {}
        for record in logs.records:
            line = f"  {record.levelname} {record.name}: {_message(record)}"
            seen[line] = seen.get(line, 0) + 1
        for line, times in seen.items():
            p(line + (f" ({times} times)" if times > 1 else ""))
        p("  (none)\n" if not seen else "")
        trace_id = _exports(p, checks, problems, logs, cap_s=timeout_s, notes=notes)
        _adapters(report, check_adapters)
        p("\n")
        return _verdict(p, notes, problems, checks, trace_id)


def _adapters(out: TextIO, check: bool) -> None:
    """Each installed adapter's own section (entry-point group ``otel_hicache.adapters``)."""
    for name, registration in adapters.registered():
        try:
            registration.doctor(out, check)
        except Exception as exc:  # pylint: disable=broad-except
            print(f"  adapter {name}: its section failed ({type(exc).__name__}: {exc})", file=out)


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Check what otel-hicache would export, and where to.")
    parser.add_argument("--timeout", type=float, default=CAP_S, metavar="SECONDS",
                        help=f"wait at most this long for the test exports (default {CAP_S:g})")
    parser.add_argument("--skip-adapters", action="store_true",
                        help="do not import the frameworks' modules to check the adapters' patches (seconds)")
    parser.add_argument("--skip-sglang", action="store_true", dest="skip_adapters", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``otel-hicache`` console script: ``otel-hicache doctor [options]``."""
    parser = argparse.ArgumentParser(prog="otel-hicache", description="otel-hicache tools.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("doctor", parents=[_parser("doctor")], add_help=False,
                        help="check the configuration and the export: what to run when nothing shows up")
    return _run(parser.parse_args(argv))


def _run(args: argparse.Namespace) -> int:
    if not args.timeout > 0:
        print("otel-hicache doctor: --timeout must be > 0", file=sys.stderr)
        return 2
    code = doctor(timeout_s=args.timeout, check_adapters=not args.skip_adapters)
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(_run(_parser("python -m otel_hicache.doctor").parse_args()))
