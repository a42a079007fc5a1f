"""``otel-hicache doctor``: the settings as the telemetry process resolves them, a test export through each
exporter, each adapter's section."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import shlex
import sys
import threading
import time
from logging.handlers import BufferingHandler
from typing import Any, TextIO

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.sdk.version import __version__ as sdk

from . import adapters, configuration
from . import environment_variables as ev
from .diagnostics import userinfo_parts, without_userinfo
from .environment_variables import env_bool, sdk_disabled
from .sinks import otel_environment as oe, providers
from .version import __version__

SPAN_NAME, METRIC_NAME = "otel_hicache.doctor", "otel_hicache.doctor.checks"


def _source(name: str) -> str:
    return f"({name})" if oe.raw(name) else "(default)"


def _variable(signal: str, suffix: str) -> str:  # the one set, else the general one
    return (oe.first(signal, suffix) or [f"OTEL_EXPORTER_OTLP_{suffix}"])[0]


def _configuration(p: _Report, logs: list[Any]) -> list[Check]:
    """Print the settings; the exporters, built one by one to tell which failed."""
    p(f"Configuration\n  OTEL_SDK_DISABLED   {str(sdk_disabled()).lower()} {_source('OTEL_SDK_DISABLED')}")
    attributes = oe.resource().attributes
    if str(attributes.get("service.name")).startswith("unknown_service"):
        p.notes.append("service.name is unknown_service: set OTEL_SERVICE_NAME to find the data under your name")
    p("  resource            " + ", ".join(f"{k}={v}" for k, v in attributes.items() if not k.startswith("telemetry.")))
    planned = []
    for signal in ("traces", "metrics"):
        names, group = list(dict.fromkeys(providers.exporter_names(signal))), providers.EXPORTER_GROUPS[signal][0]
        p(f"  {signal}\n    exporter        {', '.join(names or ['none'])} {_source(group)}")
        for name in names:
            protocol = providers.otlp_protocol(signal, name)
            if checked := protocol or name not in ("console", "prometheus"):  # those two: in the serving process
                planned.append((signal, name, protocol, group))
            if protocol is None:
                p(f"    {name:<15} " + ("checked by exporting to it" if checked else "not checked (in the instrumented "
                                        "process)"))
                continue
            pairs = oe.headers(signal)[0]
            headers = f"{', '.join(f'{k}=***' for k in pairs or ())} ({_variable(signal, 'HEADERS')}; values masked)"
            p(f"    {name:<15} OTLP over {protocol} {_source(_variable(signal, 'PROTOCOL'))}")
            p(f"      endpoint      {oe.endpoint(signal, protocol)} {_source(_variable(signal, 'ENDPOINT'))}")
            p(f"      TLS           {'yes' if oe.tls(signal, protocol) else 'no'}\n      headers       "
              + (headers if pairs else "none"))
            for suffix, variable, path, problem in oe.tls_files(signal, protocol):
                p(f"      {suffix.lower().replace('_', ' '):<13} {path} ({variable}): "
                  + (f"NOT readable: {problem}" if problem else "readable"))
        if signal == "traces":
            sampler = TracerProvider(sampler=oe.sampler(), shutdown_on_exit=False).sampler.get_description()
            if names and sampler.removeprefix("ParentBased{root:").startswith(("AlwaysOff", "TraceIdRatioBased{0.0}")):
                p.notes.append("the sampler keeps no root span: transfer spans without a sampled parent are dropped")
            given, arg = oe.raw("OTEL_TRACES_SAMPLER") or "parentbased_always_on", oe.raw("OTEL_TRACES_SAMPLER_ARG")
            given = given.strip() + (f", arg {arg.strip()}" if arg else "")
            p(f"    sampler         {given} {_source('OTEL_TRACES_SAMPLER')}: {sampler}")
    interval = oe.raw("OTEL_METRIC_EXPORT_INTERVAL")
    p(f"    export interval {interval.strip() + ' ms (OTEL_METRIC_EXPORT_INTERVAL)' if interval else '60000 ms'}")
    process = configuration.uses_telemetry_process()
    why = (ev.OTEL_HICACHE_TELEMETRY_PROCESS if oe.raw(ev.OTEL_HICACHE_TELEMETRY_PROCESS)
           else "an exporter sends over OTLP" if process else "no exporter sends over the network")
    p(f"  otel-hicache\n    sinks           {'a telemetry process of their own' if process else 'embedded'} ({why})")
    for name in ev.DEFAULTS:
        if oe.raw(name) is not None:
            p(f"    {name:<15} {os.environ[name]!r}")
    if not env_bool(ev.OTEL_HICACHE_ENABLED):
        p.notes.append("OTEL_HICACHE_ENABLED=false: otel-hicache records nothing (unset it to record)")
    p()
    checks: list[Check] = []
    for signal, name, protocol, group in [] if sdk_disabled() else planned:
        mark = len(logs)
        if built := providers.exporters(signal, names=[name], own_process=True):
            checks.append(Check(signal, name, built[0], protocol))
            continue
        said = logs[-1].getMessage() if logs[mark:] else "see the warnings"
        p.problems.append((signal, f"the {name} {signal} exporter is not built: {said}",
                           f"fix what the warning names, or leave {name} out of {group}"))
    return checks


class Check(threading.Thread):
    def __init__(self, signal: str, name: str, exporter: Any, protocol: str | None) -> None:
        super().__init__(daemon=True)
        self.signal, self.exporter, self.protocol = signal, exporter, protocol
        self.where = f"{oe.endpoint(signal, protocol)} ({protocol})" if protocol else name
        self.accepted, self.error = False, ""

    def run(self) -> None:
        try:
            self.accepted = getattr(self.exporter.export(self.data), "name", "") == "SUCCESS"
        except BaseException as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        self.ended = time.monotonic()


def _exports(p: _Report, checks: list[Check], logs: list[Any], cap_s: float) -> str:
    """Export through every exporter at once; the trace id."""
    p(f"Test export (span '{SPAN_NAME}', metric '{METRIC_NAME}'; waiting at most {cap_s:g} s)")
    if not checks:
        return ""
    resource, reader = oe.resource(), InMemoryMetricReader()
    tracer = TracerProvider(resource=resource, sampler=ALWAYS_ON, shutdown_on_exit=False).get_tracer(SPAN_NAME)
    (span := tracer.start_span(SPAN_NAME)).end()
    meter = MeterProvider([reader], resource, shutdown_on_exit=False).get_meter(SPAN_NAME)
    meter.create_counter(METRIC_NAME, unit="{check}").add(1)
    metrics = reader.get_metrics_data()
    # its DuplicateFilter would drop the other signal's error
    logging.getLogger("opentelemetry.exporter.otlp.proto.grpc.exporter").filters.clear()
    mark, start = len(logs), time.monotonic()
    for c in checks:
        c.data = [span] if c.signal == "traces" else metrics
        c.start()
    for c in checks:
        c.join(max(0.0, start + cap_s - time.monotonic()))
    for c in checks:
        if c.accepted:
            p(f"  {c.signal:<8} ACCEPTED by {c.where} in {c.ended - start:.2f} s")
        else:
            mine = [r for r in logs[mark:] if r.thread == c.ident]
            ours = [r for r in mine if r.name.startswith("otel_hicache")][:1]  # a refusal, a transport error
            said = c.error or "".join(r.getMessage() for r in (ours or mine[-1:]))  # (later ones may time out)
            what = (f"no answer in {cap_s:g} s" if c.is_alive() else "export failed") + (f": {said[:400]}" * bool(said))
            fix = f"check {', '.join(_variable(c.signal, v) for v in ('ENDPOINT', 'PROTOCOL', 'CERTIFICATE'))} " \
                "and that the Collector is up" if c.protocol else f"check {c.where}'s settings"
            p(f"  {c.signal:<8} NOT accepted by {c.where}: {what}")
            p.problems.append((c.signal, what, fix))
        with contextlib.suppress(Exception):
            c.exporter.shutdown()
    _telemetry_process(p, cap_s)
    return f"{span.get_span_context().trace_id:032x}"


def _telemetry_process(p: _Report, cap_s: float) -> None:
    if not configuration.uses_telemetry_process():
        return
    from .capture.channel import ProcessChannel, telemetry_process_command

    started, channel = time.monotonic(), ProcessChannel(configuration.hello({}), 1, lambda: None)
    answered = pid = None
    with contextlib.suppress(Exception):  # its fallback (None) raises when it cannot start
        answered, pid = channel.flush(cap_s), getattr(channel.process, "pid", None)
    with contextlib.suppress(Exception):
        channel.stop(1.0)
    if answered:
        p(f"  sinks    the telemetry process (pid {pid}) started and flushed in {time.monotonic() - started:.2f} s")
        return
    what = "the telemetry process " + ("could not be started" if pid is None else f"did not answer in {cap_s:g} s")
    p(f"  sinks    NOT working: {what} (the serving process would fall back to exporting itself)")
    p.problems.append(("sinks", what, f"run `{shlex.join(telemetry_process_command())} < /dev/null` to see its "
                       f"error, or set {ev.OTEL_HICACHE_TELEMETRY_PROCESS}=false"))


class _Report:
    """``out`` with header values and URL userinfo masked; called, it prints a line."""

    def __init__(self, out: TextIO) -> None:
        secrets = {s for signal in ("traces", "metrics") for s in oe.headers(signal)[1]}
        secrets.update(part for name, value in os.environ.items() if name.startswith("OTEL_")
                       for part in userinfo_parts(value))
        self.out, self.secrets = out, sorted((s for s in secrets if len(s) >= 3), key=len, reverse=True)
        self.notes, self.problems = [], []  # type: list[str], list[tuple[str, ...]]

    def __call__(self, *text: str) -> None:
        print(*text, file=self)

    def write(self, text: str) -> int:
        text = without_userinfo(text)
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return self.out.write(text)

    def __getattr__(self, name: str) -> Any:  # flush, encoding...
        return getattr(self.out, name)


def doctor(timeout_s: float, check_adapters: bool) -> int:
    """Print the report; the exit status."""
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # grpc's C-core lines would repeat the errors
    logging.root.handlers = [handler := BufferingHandler(sys.maxsize)]  # the report's, till the exit
    logging.getLogger("otel_hicache.http").setLevel(logging.DEBUG)  # exporters log its errors on retry only
    logs = handler.buffer
    with contextlib.redirect_stderr(_Report(sys.stderr)):
        (p := _Report(sys.stdout))(f"otel-hicache doctor {__version__} (OpenTelemetry SDK {sdk}, "
                                   f"Python {sys.version.split()[0]})\n")
        checks = _configuration(p, logs)
        lines = dict.fromkeys(f"  {r.levelname} {r.name}: {r.getMessage()}" for r in logs)
        p("\n".join(["Warnings while resolving", *(lines or ["  (none)"]), ""]))
        trace_id = _exports(p, checks, logs, timeout_s)
        p()
        _adapters(p, check_adapters)
        p("\nResult")
        if sdk_disabled():
            p.notes.append("nothing is exported: OTEL_SDK_DISABLED=true (unset it to export)")
        elif not checks and not p.problems:
            p.notes.append("nothing to check: no push exporter in OTEL_TRACES_EXPORTER, OTEL_METRICS_EXPORTER")
        for note in p.notes:
            p(f"  NOTE: {note}")
        merged: dict = {}  # both signals' alike problems on one line
        for signal, *said in p.problems:
            merged.setdefault(tuple(re.sub(r"\b(traces|metrics|spans)\b", "{traces,metrics}", t) for t in said),
                              [said]).append(signal)
        for key, (said, *signals) in merged.items():
            what, fix = said if len(signals) == 1 else key
            p(f"  PROBLEM ({', '.join(signals)}): {what}\n  FIX: {fix}")
        if checks and not p.problems:
            p(f"  OK: every configured exporter accepted the test data (trace {trace_id}, metric {METRIC_NAME})")
        return 1 if p.problems else 0


def _adapters(out: TextIO, check: bool) -> None:
    for name, registration in adapters.registered():
        try:
            registration.doctor(out, check)
        except Exception as exc:
            print(f"  adapter {name}: its section failed ({type(exc).__name__}: {exc})", file=out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="otel-hicache", description="What to run when nothing shows up.")
    parser.add_argument("command", choices=["doctor"])
    parser.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS", help="cap on the test exports (10)")
    parser.add_argument("--skip-adapters", action="store_true", help="import no framework to check the patches")
    parser.add_argument("--skip-sglang", action="store_true", dest="skip_adapters", help=argparse.SUPPRESS)
    if not (args := parser.parse_args(argv)).timeout > 0:
        parser.error("--timeout must be > 0")
    return doctor(timeout_s=args.timeout, check_adapters=not args.skip_adapters)


if __name__ == "__main__":
    sys.exit(main(["doctor", *sys.argv[1:]]))
