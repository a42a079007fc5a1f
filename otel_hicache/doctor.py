"""``otel-hicache doctor [--timeout 10] [--skip-adapters]``: what to check when nothing shows up.

The settings as the telemetry process resolves them (the same functions) with the warnings resolving
emits; one span and one metric point exported through exporters built by the same code, naming the
variable to fix for each one not accepted; each adapter's section. Exit status 0 when every exporter
accepted (or none exports), 1 when not, 2 for a usage error. Header values and userinfo are masked."""

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
from typing import Any, TextIO

from . import adapters, configuration
from . import environment_variables as ev
from .settings import env_bool, sdk_disabled
from .sinks import otel_environment as oe, providers
from .sinks.http_session import REFUSAL, WANTS_TLS
from .sinks.redaction import userinfo_parts, without_userinfo
from .version import __version__

CAP_S = 10.0
"""How long the doctor waits for the test exports, at most (``--timeout``)."""
SPAN_NAME, METRIC_NAME = "otel_hicache.doctor", "otel_hicache.doctor.checks"
_NOT_CHECKED = ("console", "prometheus")  # they write to, or serve from, the instrumented process
_PORT = {"grpc": 4317, "http/protobuf": 4318}


class _Captured(logging.Handler):
    """While entered: the records of our and the SDK's loggers, to the report only (this process is the
    doctor's), with the OTLP/HTTP session's transport errors (the exporters log them only on retry)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.loggers = [logging.getLogger(name) for name in ("otel_hicache", "opentelemetry", "otel_hicache.http")]

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def since(self, start: int, thread: int) -> list[str]:
        return [_message(r) for r in self.records[start:] if r.thread == thread and
                (r.levelno >= logging.WARNING or r.name == "otel_hicache.http")]

    def __enter__(self) -> _Captured:
        self.saved = [(lg.level, lg.propagate) for lg in self.loggers]
        for lg in self.loggers[:2]:
            lg.addHandler(self)
            lg.propagate = False
            lg.setLevel(logging.WARNING)
        self.loggers[2].setLevel(logging.DEBUG)  # (to our logger's handler)
        return self

    def __exit__(self, *_: Any) -> None:
        for lg, (level, propagate) in zip(self.loggers, self.saved):
            lg.removeHandler(self)
            lg.setLevel(level)
            lg.propagate = propagate


def _message(record: logging.LogRecord) -> str:
    try:
        text = record.getMessage()
    except Exception:  # pylint: disable=broad-except
        text = str(record.msg)
    error = record.exc_info[1] if record.exc_info else None
    return text + (f" ({type(error).__name__}: {error})" if error is not None else "")


# -- the settings, resolved by the telemetry process's own functions -------------------------------

def _source(name: str) -> str:
    return f"({name})" if oe.raw(name) else "(default)"


class Otlp:
    """One OTLP exporter's settings, as the exporter it builds resolves them."""

    def __init__(self, signal: str, protocol: str) -> None:
        self.signal, self.protocol = signal, protocol
        self.endpoint, self.tls = oe.endpoint(signal, protocol), oe.tls(signal, protocol)

    def variable(self, suffix: str) -> str:
        """The variable to fix: the one set, else the general one."""
        found = oe.first(self.signal, suffix)
        return found[0] if found else f"OTEL_EXPORTER_OTLP_{suffix}"

    def show(self, p: Any) -> Otlp:
        pairs, _ = oe.headers(self.signal)
        headers = "none" if pairs is None else (", ".join(f"{k}=***" for k in pairs) or "none parsed") + \
            f" ({self.variable('HEADERS')}; values masked)"
        p(f"      endpoint      {self.endpoint} {_source(self.variable('ENDPOINT'))}")
        p(f"      TLS           {'yes' if self.tls else 'no'}\n      headers       {headers}")
        for suffix, name, path, problem in oe.tls_files(self.signal, self.protocol):
            p(f"      {suffix.lower().replace('_', ' '):<13} {path} ({name}): "
              + (f"NOT readable: {problem}" if problem else "readable"))
        return self


def _configuration(p: Any, notes: list[str]) -> list[tuple[str, str, Otlp | None]]:
    """Print what the variables resolve to; the exporters to check: (signal, name, OTLP settings)."""
    p(f"Configuration\n  OTEL_SDK_DISABLED   {str(sdk_disabled()).lower()} {_source('OTEL_SDK_DISABLED')}")
    attributes = oe.resource().attributes
    if str(attributes.get("service.name")).startswith("unknown_service"):
        notes.append("service.name is unknown_service: set OTEL_SERVICE_NAME to find the data under your name")
    p("  resource            " + ", ".join(f"{k}={v}" for k, v in attributes.items() if not k.startswith("telemetry.")))
    planned = []
    for signal in ("traces", "metrics"):
        names = list(dict.fromkeys(providers.exporter_names(signal))) or ["none"]
        p(f"  {signal}\n    exporter        {', '.join(names)} {_source(providers.EXPORTER_GROUPS[signal][0])}")
        for name in names if names != ["none"] else ():
            if (protocol := providers.otlp_protocol(signal, name)) is None:
                checked = name not in _NOT_CHECKED
                p(f"    {name:<15} " + ("checked by exporting to it" if checked else "not checked (in the "
                                        "instrumented process)"))
                planned += [(signal, name, None)] if checked else []
                continue
            otlp = Otlp(signal, protocol)
            p(f"    {name:<15} OTLP over {protocol} {_source(otlp.variable('PROTOCOL'))}")
            planned.append((signal, name, otlp.show(p)))
        if signal == "traces":
            _sampler(p, notes, names != ["none"])
    interval = oe.raw("OTEL_METRIC_EXPORT_INTERVAL")
    p(f"    export interval {interval.strip() + ' ms (OTEL_METRIC_EXPORT_INTERVAL)' if interval else '60000 ms'}")
    process = configuration.uses_telemetry_process()
    why = (ev.OTEL_HICACHE_TELEMETRY_PROCESS if oe.raw(ev.OTEL_HICACHE_TELEMETRY_PROCESS)
           else "an exporter sends over OTLP" if process else "no exporter sends over the network")
    p(f"  otel-hicache\n    sinks           {'a telemetry process of their own' if process else 'embedded'} ({why})")
    for name in ev.DEFAULTS:  # (a malformed value warns: Warnings, below)
        if oe.raw(name) is not None:
            p(f"    {name:<15} {os.environ[name]!r}")
    if not env_bool(ev.OTEL_HICACHE_ENABLED):
        notes.append("OTEL_HICACHE_ENABLED=false: otel-hicache records nothing (unset it to record)")
    p()
    return [] if sdk_disabled() else planned


def _sampler(p: Any, notes: list[str], exported: bool) -> None:
    name, arg = oe.raw("OTEL_TRACES_SAMPLER"), oe.raw("OTEL_TRACES_SAMPLER_ARG")
    try:
        from opentelemetry.sdk.trace import TracerProvider

        described = TracerProvider(sampler=oe.sampler(), shutdown_on_exit=False).sampler.get_description()
    except Exception as exc:  # pylint: disable=broad-except
        described = f"cannot be built ({type(exc).__name__}: {exc})"
    if exported and described.removeprefix("ParentBased{root:").startswith(("AlwaysOff", "TraceIdRatioBased{0.0}")):
        notes.append("the sampler keeps no root span: transfer spans without a sampled parent are dropped")
    given = (name.strip() if name else "parentbased_always_on") + (f", arg {arg.strip()}" if arg else "")
    p(f"    sampler         {given} {_source('OTEL_TRACES_SAMPLER')}: {described}")


# -- the test export ---------------------------------------------------------------------------

class Check:
    """One exporter's test export, run in a thread of its own."""

    def __init__(self, signal: str, name: str, exporter: Any, otlp: Otlp | None) -> None:
        self.signal, self.name, self.exporter, self.otlp = signal, name, exporter, otlp
        self.where = f"{otlp.endpoint} ({otlp.protocol})" if otlp else name
        self.ident: int | None = None
        self.error: BaseException | None = None
        self.seconds, self.done, self.accepted, self.messages = 0.0, False, False, []  # (messages: its thread's)

    def run(self, data: Any, cap_s: float) -> None:
        self.ident, start = threading.get_ident(), time.monotonic()
        try:
            result = self.exporter.export(data, **({} if self.signal == "traces" else {"timeout_millis": cap_s * 1e3}))
            self.accepted = getattr(result, "name", "") == "SUCCESS"
        except BaseException as exc:  # pylint: disable=broad-except
            self.error = exc
        self.seconds, self.done = time.monotonic() - start, True


def _test_data() -> tuple[list[Any], Any, str]:
    """One finished span and one metric point, of the resource the sinks use."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON

    resource, reader = oe.resource(), InMemoryMetricReader()
    span = TracerProvider(resource=resource, sampler=ALWAYS_ON, shutdown_on_exit=False).get_tracer(
        SPAN_NAME, __version__).start_span(SPAN_NAME, attributes={SPAN_NAME: True})
    span.end()
    meter_provider = MeterProvider(metric_readers=[reader], resource=resource, shutdown_on_exit=False)
    meter_provider.get_meter(SPAN_NAME, __version__).create_counter(METRIC_NAME, unit="{check}").add(1)
    metrics = reader.get_metrics_data()
    meter_provider.shutdown()
    return [span], metrics, f"{span.get_span_context().trace_id:032x}"


_WRONG_PROTOCOL = {"grpc": ("failed parsing http/2", "http1.x", "expected settings frame", "frame type"),
                   "http/protobuf": ("badstatusline",)}
_TLS_VERIFY = ("certificate verify failed", "certificate_verify_failed", "self signed", "self-signed",
               "unable to get local issuer", "unknown ca", "hostname mismatch", "doesn't match")
_TLS_MISMATCH = ("wrong_version_number", "wrong version number", "record layer failure", "unknown protocol",
                 "socket closed", "connection reset", "remote end closed", "remotedisconnected",
                 "connection aborted", "broken pipe", "eof occurred")
_UNREACHABLE = ("connection refused", "failed to connect to remote host", "name or service not known",
                "failed to resolve", "name resolution", "no route to host", "network is unreachable",
                "errors resolving", "newconnectionerror", "no address associated")


def _diagnose(check: Check, also: list[str]) -> tuple[str, str]:
    """(what went wrong, the fix naming the variable) for a test export not accepted; ``also``: what
    the other signal's exporter to the same server said."""
    said = check.messages[-1] if check.messages else (repr(check.error) if check.error else "")
    text = " ".join([*check.messages, *also, *([repr(check.error)] if check.error else [])]).lower()
    if (otlp := check.otlp) is None:
        return (f"the {check.name} exporter did not accept the test data: {said}",
                f"check its settings, or leave it out of {providers.EXPORTER_GROUPS[check.signal][0]}")
    ep, ep_var, protocol, ca_var = otlp.endpoint, otlp.variable("ENDPOINT"), otlp.protocol, otlp.variable("CERTIFICATE")
    protocol_var = otlp.variable("PROTOCOL")
    has = lambda words: any(w in text for w in words)  # noqa: E731
    if has(_WRONG_PROTOCOL[protocol]):
        other = "http/protobuf" if protocol == "grpc" else "grpc"
        return (f"{ep} does not speak {protocol}", f"set {protocol_var}={other}, or point {ep_var} at the "
                f"Collector's {protocol} port ({_PORT[protocol]} by default)")
    if has(_TLS_VERIFY):
        return ("the Collector's TLS certificate is not trusted for its host",
                f"set {ca_var} to the CA certificate (PEM) that signed the Collector's certificate")
    if has(_TLS_MISMATCH):  # before "refused": one of localhost's addresses may refuse while the other answers
        return (f"{ep} closed the connection ({'TLS' if otlp.tls else 'plain text'}: does the Collector serve it?)",
                f"use http:// in {ep_var}" if otlp.tls else f"use https:// in {ep_var} (and set {ca_var})")
    if has(_UNREACHABLE):
        return (f"nothing accepts connections at {ep}",
                f"check {ep_var} (host and port: {_PORT[protocol]} for {protocol}) and that the Collector is up")
    refusal = next((found.group(0) for m in [*check.messages, *also] if (found := REFUSAL.search(m))), None)
    status = re.search(r"error code: statuscode\.([a-z_]+)", text)
    if refusal or (status and status.group(1) not in ("unavailable", "deadline_exceeded")):
        return (f"REFUSED: {refusal or status.group(1).upper()}",  # type: ignore[union-attr]
                f"use https:// in {ep_var}" if refusal and WANTS_TLS in refusal else
                f"check the Collector's own logs (its pipeline for {check.signal}, its authentication: "
                f"{otlp.variable('HEADERS')}), and {ep_var}")
    if not check.done or has(("deadline", "timed out", "timeout")) or not text:
        return (f"{ep} sent no answer in time", f"check that {ep_var} is a Collector's OTLP {protocol} receiver; "
                f"if it is only slow, raise {otlp.variable('TIMEOUT')} (and --timeout)")
    return f"the export to {ep} failed: {said}", f"check {ep_var} and {protocol_var} ({protocol})"


def _build(planned: list[tuple[str, str, Otlp | None]], logs: _Captured) -> tuple[list[Check], list[tuple[str, ...]]]:
    """The exporters, built one at a time by the telemetry process's code (to tell which one failed);
    the problems: (signal, what went wrong, the fix)."""
    checks, problems = [], []
    for signal, name, otlp in planned:
        mark = len(logs.records)
        built = providers.exporters(signal, names=[name], own_process=True)
        checks += [Check(signal, name, exporter, otlp) for exporter in built]
        said = [_message(r) for r in logs.records[mark:] if r.levelno >= logging.WARNING]
        variable = providers.EXPORTER_GROUPS[signal][0]
        if built:
            continue
        if otlp is not None and not oe.certificate_usable(signal, otlp.protocol):
            problems.append((signal, f"the {signal} exporter is not built: a TLS file cannot be read",
                             f"fix the path in {otlp.variable('CERTIFICATE')}"))
        elif any("unknown exporter" in m for m in said):
            problems.append((signal, f"{variable} names {name!r}, which is not installed",
                             f"install the package providing it, or use otlp, console or none in {variable}"))
        else:
            problems.append((signal, f"the {name} {signal} exporter could not be built" + (
                f": {said[-1]}" if said else ""), "fix the variable the warning names"))
    return checks, problems


def _exports(p: Any, checks: list[Check], problems: list[tuple[str, ...]], logs: _Captured, cap_s: float,
             notes: list[str]) -> str:
    """Export the test data through every exporter at once, waiting at most ``cap_s``; the trace id."""
    p(f"Test export (span '{SPAN_NAME}', metric '{METRIC_NAME}'; waiting at most {cap_s:g} s)")
    if sdk_disabled():
        notes.append("nothing is exported: OTEL_SDK_DISABLED=true (unset it to export)")
    elif not checks and not problems:
        notes.append("nothing to check: no push exporter in OTEL_TRACES_EXPORTER, OTEL_METRICS_EXPORTER")
    for signal, what, _ in problems:
        p(f"  {signal:<8} not checked: {what}")
    if not checks:
        return ""
    spans, metrics, trace_id = _test_data()
    for name, found in list(logging.Logger.manager.loggerDict.items()):  # it would drop the other signal's error
        if name.startswith("opentelemetry") and isinstance(found, logging.Logger):
            found.filters = [f for f in found.filters if type(f).__name__ != "DuplicateFilter"]
    mark, deadline = len(logs.records), time.monotonic() + cap_s
    threads = [threading.Thread(target=c.run, args=(spans if c.signal == "traces" else metrics, cap_s),
                                name=f"otel-hicache-doctor-{c.signal}", daemon=True) for c in checks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    for check in checks:
        check.messages = logs.since(mark, check.ident) if check.ident else []
    base = lambda c: c.otlp and (c.otlp.protocol, c.otlp.endpoint.rsplit("/v1/", 1)[0])  # noqa: E731
    for check in checks:
        if check.accepted:
            p(f"  {check.signal:<8} ACCEPTED by {check.where} in {check.seconds:.2f} s")
        else:
            what, fix = _diagnose(check, [m for c in checks if c is not check and base(c) == base(check)
                                          for m in c.messages])
            p(f"  {check.signal:<8} {'NOT accepted' if check.done else 'no answer yet'} by {check.where}: {what}")
            if check.messages:
                p(f"           the exporter said: {check.messages[-1][:400]}")
            problems.append((check.signal, what, fix))
        with contextlib.suppress(Exception):
            check.exporter.shutdown()
    if (problem := _telemetry_process(p, cap_s)) is not None:
        problems.append(("traces", *problem))
    return trace_id


def _telemetry_process(p: Any, cap_s: float) -> tuple[str, str] | None:
    """Where the sinks would run in a telemetry process: start one as the capture would and have it
    flush; (what, fix) when it does not answer."""
    if not configuration.uses_telemetry_process():
        return None
    from .capture.channel import ProcessChannel, telemetry_process_command

    started, channel = time.monotonic(), ProcessChannel(configuration.hello({}), 1, lambda: None)
    try:
        answered = channel.flush(cap_s)
        pid = channel.process.pid if channel.process is not None else None
    except Exception:  # pylint: disable=broad-except
        answered, pid = False, None
    finally:
        with contextlib.suppress(Exception):
            channel.stop(1.0)
    if answered:
        p(f"  sinks    the telemetry process (pid {pid}) started and flushed in {time.monotonic() - started:.2f} s")
        return None
    what = "the telemetry process " + ("could not be started" if pid is None else f"did not answer in {cap_s:g} s")
    p(f"  sinks    NOT working: {what} (the serving process would fall back to exporting itself)")
    return what, (f"run `{shlex.join(telemetry_process_command())} < /dev/null` to see its error, "
                  f"or set {ev.OTEL_HICACHE_TELEMETRY_PROCESS}=false")


def _verdict(p: Any, notes: list[str], problems: list[tuple[str, ...]], checks: list[Check], trace_id: str) -> int:
    p("\nResult")
    for note in notes:
        p(f"  NOTE: {note}")
    merged: dict[tuple[str, ...], list[tuple[str, ...]]] = {}  # one line for both signals when alike
    for problem in problems:
        key = tuple(re.sub(r"\b(traces|metrics)\b", "{traces,metrics}", t) for t in problem[1:])
        merged.setdefault(key, []).append(problem)
    for key, alike in merged.items():
        what, fix = alike[0][1:] if len(alike) == 1 else key
        p(f"  PROBLEM ({', '.join(problem[0] for problem in alike)}): {what}\n  FIX: {fix}")
    if checks and not problems:
        p(f"  OK: every configured exporter accepted the test data (trace {trace_id}, metric {METRIC_NAME})")
    return 1 if problems else 0


class _Redacted:
    """``out`` with every header value and URL userinfo masked, also where an SDK message quotes them."""

    def __init__(self, out: TextIO) -> None:
        secrets = {s for signal in ("traces", "metrics") for s in oe.headers(signal)[1]}
        secrets.update(part for name, value in os.environ.items() if name.startswith("OTEL_")
                       for part in userinfo_parts(value))
        self.out, self.secrets = out, sorted((s for s in secrets if len(s) >= 3), key=len, reverse=True)

    def write(self, text: str) -> int:
        text = without_userinfo(text)
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return self.out.write(text)

    def __getattr__(self, name: str) -> Any:  # flush, encoding...: what code writing to stderr may ask
        return getattr(self.out, name)


def doctor(timeout_s: float = CAP_S, check_adapters: bool = True, out: TextIO | None = None) -> int:
    """Print the report to ``out`` (stdout); the exit status (see the module's docstring)."""
    import opentelemetry.sdk.version as sdk_version

    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # grpc's C-core lines would repeat the errors
    with _Captured() as logs, contextlib.redirect_stderr(_Redacted(sys.stderr)):
        report: Any = _Redacted(out or sys.stdout)
        p = lambda *a: print(*a, file=report)  # noqa: E731
        p(f"otel-hicache doctor {__version__} (OpenTelemetry SDK {sdk_version.__version__}, "
          f"Python {platform.python_version()})\n")
        notes: list[str] = []
        checks, problems = _build(_configuration(p, notes), logs)
        lines = dict.fromkeys(f"  {r.levelname} {r.name}: {_message(r)}" for r in logs.records
                              if r.levelno >= logging.WARNING)
        p("\n".join(["Warnings while resolving", *(lines or ["  (none)"]), ""]))
        trace_id = _exports(p, checks, problems, logs, cap_s=timeout_s, notes=notes)
        p()
        _adapters(report, check_adapters)
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
                        help="do not import the frameworks' modules to check the adapters' patches")
    parser.add_argument("--skip-sglang", action="store_true", dest="skip_adapters", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``otel-hicache`` console script: ``otel-hicache doctor [options]``."""
    parser = argparse.ArgumentParser(prog="otel-hicache", description="otel-hicache tools.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("doctor", parents=[_parser("doctor")], add_help=False,
                        help="check the configuration and the export: what to run when nothing shows up")
    args = parser.parse_args(argv)
    if not args.timeout > 0:
        parser.error("--timeout must be > 0")
    code = doctor(timeout_s=args.timeout, check_adapters=not args.skip_adapters)
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main(["doctor", *sys.argv[1:]]))
