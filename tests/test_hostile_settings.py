"""Hostile settings: whatever a variable holds, configure() never raises, never blocks, never
floods a log line, never loses a signal the value did not concern, and never logs a secret.

An empty or blank value means unset (the specification's rule). The table test is in-process
(no export per case); the signal cases run the paced workload against the real receivers of
``otlp_receiver`` and count what arrived.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading

import pytest

import otel_hicache
from otel_hicache import configuration
from otel_hicache.environment_variables import DEFAULTS
from otel_hicache.capture.poller import PollerSettings
from otlp_receiver import GrpcReceiver, HttpReceiver, closed_port
from paced_runs import final_counters, otlp_env, run_workload

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROTOCOLS = {"grpc": GrpcReceiver, "http/protobuf": HttpReceiver}
LONGEST_RECORD = 1000  # characters of one formatted log record, traceback included
BOUND_S = 20.0  # a hang fails the test instead of the suite

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_configuration", "embedded")]

OTLP_SUFFIXES = ("ENDPOINT", "HEADERS", "TIMEOUT", "COMPRESSION", "CERTIFICATE", "CLIENT_KEY",
                 "CLIENT_CERTIFICATE", "INSECURE", "PROTOCOL")
FILE_SUFFIXES = ("CERTIFICATE", "CLIENT_KEY", "CLIENT_CERTIFICATE")
STANDARD = [
    "OTEL_SDK_DISABLED", "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_TRACES_EXPORTER",
    "OTEL_METRICS_EXPORTER", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG", "OTEL_METRIC_EXPORT_INTERVAL",
    "OTEL_METRIC_EXPORT_TIMEOUT", "OTEL_METRICS_EXEMPLAR_FILTER", "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE",
    "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION", "OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED",
    "OTEL_BSP_SCHEDULE_DELAY", "OTEL_BSP_EXPORT_TIMEOUT", "OTEL_BSP_MAX_QUEUE_SIZE", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE",
    "OTEL_ATTRIBUTE_COUNT_LIMIT", "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "OTEL_EVENT_ATTRIBUTE_COUNT_LIMIT",
    "OTEL_LINK_ATTRIBUTE_COUNT_LIMIT", "OTEL_SPAN_EVENT_COUNT_LIMIT", "OTEL_SPAN_LINK_COUNT_LIMIT",
    "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT",
    *(f"OTEL_EXPORTER_OTLP_{form}{suffix}" for suffix in OTLP_SUFFIXES for form in ("", "TRACES_", "METRICS_")),
]
HOSTILE = {"empty": "", "blank": " \t ", "superscript": "²", "arabic": "١٢٣", "digits": "9" * 5000,
           "10MB": "x" * 10_000_000}


class _Records(logging.Handler):
    """Every record of every logger, formatted as a handler of the host would print it."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture
def records():
    handler, root = _Records(), logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


@pytest.fixture(scope="module")
def special_files(tmp_path_factory):
    fifo = tmp_path_factory.mktemp("fifo") / "ca.pem"
    os.mkfifo(fifo)  # open() of it waits for a writer forever
    return {"fifo": str(fifo), "/dev/zero": "/dev/zero"}  # a device whose read never ends


def _bounded(call):
    """call() on a thread: what it returned, or what it raised, within BOUND_S."""
    done: list = []

    def run():
        try:
            done.append(("returned", call()))
        except BaseException as exc:  # pylint: disable=broad-except  # the test reports it
            done.append(("raised", exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(BOUND_S)
    assert done, f"did not return within {BOUND_S} s (blocked)"
    return done[0]


def _everything():
    conf = otel_hicache.configure(force=True)
    PollerSettings()
    return conf


@pytest.mark.parametrize("variable", STANDARD + sorted(DEFAULTS))
def test_configure_survives_every_hostile_value(monkeypatch, records, special_files, variable):
    """Empty, blank, Unicode digits, 5,000 digits, 10 MB (and a FIFO and a device for a file
    variable): configure() returns, raises nothing, and no record of otel-hicache is long. (The
    SDK's own records here are the host's: its loggers get no filter; in the telemetry process,
    ours, they are cut: the test below.)"""
    values = dict(HOSTILE)
    if variable.endswith(FILE_SUFFIXES):
        values.update(special_files)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"https://localhost:{closed_port()}")  # TLS: files used
    else:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("OTEL_HICACHE_SHUTDOWN_TIMEOUT_S", "0.2")
    for protocol in ("grpc", "http/protobuf"):
        if protocol != "grpc" and "OTLP" not in variable:
            continue
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
        for label, value in values.items():
            monkeypatch.setenv(variable, value)
            records.lines.clear()
            how, result = _bounded(_everything)
            assert how == "returned", (label, protocol, result)
            _bounded(lambda: configuration.shutdown(0.2))
            longest = max((line for line in records.lines if line.split(" ", 2)[1].startswith("otel_hicache")),
                          key=len, default="")
            assert len(longest) <= LONGEST_RECORD, (label, protocol, longest[:300], len(longest))


LONG = {"OTEL_TRACES_SAMPLER": "9" * 5000, "OTEL_EXPORTER_OTLP_HEADERS": "9" * 5000,
        "OTEL_EXPORTER_OTLP_TIMEOUT": "x" * 100_000, "OTEL_EXPORTER_OTLP_COMPRESSION": "9" * 5000,
        "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE": "9" * 5000,
        "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION": "9" * 5000,
        "OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED": "9" * 5000}
"""Values the SDK quotes whole in a log line of its own (the resource's would be quoted by the host's SDK)."""


def test_the_telemetry_process_cuts_the_sdks_long_lines(tmp_path):
    """In the telemetry process, which is ours, every record of the SDK's loggers too is short."""
    script = tmp_path / "host.py"
    script.write_text(HOST)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(LONG, PYTHONPATH=ROOT, OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf", OTEL_HICACHE_SHUTDOWN_TIMEOUT_S="1",
               OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{closed_port()}")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Couldn't recognize sampler" in done.stderr and "(100000 characters)" in done.stderr  # cut, not left out
    assert max(map(len, done.stderr.splitlines())) <= LONGEST_RECORD, max(done.stderr.splitlines(), key=len)[:300]


# -- a value never costs a signal it did not concern ----------------------------------------------

SIGNAL_CASES = [
    # (protocol, variables, the signals that must arrive)
    ("grpc", {"OTEL_EXPORTER_OTLP_COMPRESSION": ""}, {"spans", "metrics"}),
    ("http/protobuf", {"OTEL_EXPORTER_OTLP_COMPRESSION": ""}, {"spans", "metrics"}),
    ("grpc", {"OTEL_EXPORTER_OTLP_TIMEOUT": ""}, {"spans", "metrics"}),
    ("http/protobuf", {"OTEL_EXPORTER_OTLP_TIMEOUT": " "}, {"spans", "metrics"}),
    ("grpc", {"OTEL_METRICS_EXEMPLAR_FILTER": ""}, {"spans", "metrics"}),
    ("grpc", {"OTEL_EXPORTER_OTLP_INSECURE": ""}, {"spans", "metrics"}),  # over a plain endpoint
    ("grpc", {"OTEL_EXPORTER_OTLP_TRACES_INSECURE": " "}, {"spans", "metrics"}),
    ("http/protobuf", {"OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": " "}, {"spans", "metrics"}),
    ("http/protobuf", {"OTEL_EXPORTER_OTLP_METRICS_CLIENT_KEY": " ", "OTEL_EXPORTER_OTLP_CERTIFICATE": " "},
     {"spans", "metrics"}),
    ("grpc", {"OTEL_EXPORTER_OTLP_HEADERS": " "}, {"spans", "metrics"}),
    # one signal's bad value: the other signal is exported (and this one with its default)
    ("grpc", {"OTEL_EXPORTER_OTLP_METRICS_COMPRESSION": "zstd"}, {"spans", "metrics"}),
    ("http/protobuf", {"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "soon"}, {"spans", "metrics"}),
    # the gRPC exporters float() their per-signal timeout whatever they are given: that signal is left out
    ("grpc", {"OTEL_EXPORTER_OTLP_METRICS_TIMEOUT": ""}, {"spans"}),
    ("grpc", {"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "nan?"}, {"metrics"}),
]


@pytest.mark.parametrize("protocol, variables, arriving", SIGNAL_CASES,
                         ids=[f"{p}-{','.join(f'{k}={v!r}' for k, v in e.items())}" for p, e, _ in SIGNAL_CASES])
def test_a_value_never_loses_a_signal_it_did_not_concern(tmp_path, protocol, variables, arriving):
    receiver = PROTOCOLS[protocol]()
    try:
        run = run_workload(tmp_path, otlp_env("hicache-hostile", protocol, receiver.endpoint, **variables),
                           "--rate", "200", "--seconds", "1")
    finally:
        receiver.stop()
    spans = [span for _, span in receiver.received.spans() if span.name.startswith("hicache.")]
    if "spans" in arriving:
        assert len(spans) == run.result["ops"] > 0, (len(spans), run.result["ops"], run.stderr[-2000:])
    else:
        assert not spans
    if "metrics" in arriving:
        assert final_counters(receiver.received.metrics) == run.result["truth"], run.stderr[-2000:]
    else:
        assert not receiver.received.metrics
    for name in (name for name, value in variables.items() if not value.strip()):  # blank means unset
        assert not [line for line in run.stderr.splitlines() if line.startswith(f"otel-hicache: {name}")]


# -- secrets ----------------------------------------------------------------------------------------

SECRETS = ("s3cr3t", "hunter22", "tenant-token-value")
HOST = textwrap.dedent(
    """
    import logging, sys
    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)  # every logger, every level
    import otel_hicache
    otel_hicache.configure()
    tel = otel_hicache.TransferTelemetry(attributes={"tp_rank": 0})
    for _ in range(20):
        tel.submit("offload", {"kv": 64}, 4096, page_size=64, expect_ack=False, host_start_ns=0, host_end_ns=1_000)
    tel.force_flush(3)
    tel.shutdown()
    otel_hicache.shutdown(2)
    """
)


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_no_header_value_or_userinfo_reaches_a_log_line(tmp_path, protocol):
    """A malformed header entry (a colon for '='), a valid one, and an endpoint with userinfo
    the collector refuses: every record of every logger (stderr of the process) is free of them."""
    script = tmp_path / "host.py"
    script.write_text(HOST)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(PYTHONPATH=ROOT, OTEL_EXPORTER_OTLP_PROTOCOL=protocol, OTEL_EXPORTER_OTLP_TIMEOUT="0.5",
               OTEL_EXPORTER_OTLP_HEADERS="Authorization:Bearer-s3cr3t,x-tenant=tenant-token-value",
               OTEL_EXPORTER_OTLP_TRACES_HEADERS="Authorization:Bearer-s3cr3t",
               OTEL_EXPORTER_OTLP_ENDPOINT=f"http://admin:hunter22@127.0.0.1:{closed_port()}",
               OTEL_HICACHE_SHUTDOWN_TIMEOUT_S="1")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Failed to export" in done.stderr or "failed" in done.stderr.lower(), done.stderr[-3000:]
    for secret in SECRETS:
        assert secret not in done.stderr + done.stdout, (secret, done.stderr[-3000:])
    [warned] = [line for line in done.stderr.splitlines() if "OTEL_EXPORTER_OTLP_TRACES_HEADERS:" in line]
    assert "entry 1 (not key=value)" in warned


def test_in_process_records_hold_no_secret_and_the_host_loggers_get_no_filter(monkeypatch, records):
    """Embedded, in the host's own process: no record of ours holds a secret, and the host's
    ``opentelemetry*`` loggers get no filter (what the SDK logs there is the host's business)."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "Authorization:Bearer-s3cr3t,x-tenant=tenant-token-value")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://admin:hunter22@127.0.0.1:{closed_port()}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "0.5")
    conf = otel_hicache.configure()
    [processor] = conf.span_processors
    assert processor.span_exporter._client._headers["x-tenant"] == "tenant-token-value"  # still sent
    tracer = conf.tracer_provider.get_tracer("t")
    tracer.start_span("s").end()
    conf.tracer_provider.force_flush(3000)
    ours = "\n".join(line for line in records.lines if "otel_hicache" in line or "otel-hicache" in line)
    assert "not key=value" in ours
    for secret in SECRETS:
        assert secret not in ours, (secret, ours[-2000:])
    import logging
    from otel_hicache.diagnostics import _withhold  # pylint: disable=protected-access
    assert _withhold in logging.getLogger("otel_hicache").filters  # the filter looked for below
    filtered = [name for name, found in logging.root.manager.loggerDict.items() if name.startswith("opentelemetry")
                and isinstance(found, logging.Logger) and _withhold in found.filters]
    assert filtered == []
