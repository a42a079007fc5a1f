"""``otel-hicache doctor``, run as the command a user runs: against the in-process OTLP
receiver (accepted, header values masked), an unreachable endpoint, the wrong protocol,
TLS problems and nothing to export, each failure in the exporter's own words; its SGLang
section in-process."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from otlp_receiver import GrpcReceiver, HttpReceiver, closed_port

pytestmark = pytest.mark.slow  # processes, receivers, seconds each: CI's later step (pytest -m slow)

ROOT = Path(__file__).resolve().parents[1]
ADAPTER_TESTS = ROOT / "instrumentation" / "otel-hicache-sglang" / "tests"
SCRIPT = Path(sys.executable).parent / "otel-hicache"
FAST = {"OTEL_EXPORTER_OTLP_TIMEOUT": "1"}  # the exporters give up after 1 s (gRPC retries once)


def doctor(*args: str, script: bool = False, **env: str) -> subprocess.CompletedProcess:
    """The doctor in a fresh process, with only these OTEL_* variables."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SGLANG_PLUGINS"))}
    command = [str(SCRIPT), "doctor"] if script else [sys.executable, "-m", "otel_hicache.doctor"]
    return subprocess.run([*command, "--skip-adapters", "--timeout", "5", *args], env={**clean, **env},
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def result(done: subprocess.CompletedProcess) -> str:
    """The report's last section (the verdict)."""
    return done.stdout.rpartition("\nResult\n")[2]


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_accepted_by_the_receiver_with_header_values_masked(protocol):
    receiver = GrpcReceiver() if protocol == "grpc" else HttpReceiver()
    try:
        done = doctor(script=protocol == "grpc", OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
                      OTEL_EXPORTER_OTLP_PROTOCOL=protocol, OTEL_EXPORTER_OTLP_HEADERS="authorization=secret",
                      OTEL_SERVICE_NAME="doctor-test", **FAST)
        out = done.stdout + done.stderr
        assert done.returncode == 0, out
        assert "traces   ACCEPTED" in done.stdout and "metrics  ACCEPTED" in done.stdout, out
        assert f"OTLP over {protocol} (OTEL_EXPORTER_OTLP_PROTOCOL)" in done.stdout
        assert "authorization=*** (OTEL_EXPORTER_OTLP_HEADERS; values masked)" in done.stdout
        assert "secret" not in out
        assert "service.name=doctor-test" in done.stdout
        assert "OK: every configured exporter accepted the test data" in result(done)
        # what the receiver got: the test span and point, with the header itself
        assert [span.name for _, span in receiver.received.spans()] == ["otel_hicache.doctor"]
        assert [p.as_int for p in receiver.received.last_points("otel_hicache.doctor.checks")] == [1]
        assert all(h.get("authorization") == "secret" for h in receiver.received.headers)
    finally:
        receiver.stop()


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_unreachable_endpoint_names_the_endpoint_variable(protocol):
    endpoint = f"http://127.0.0.1:{closed_port()}"
    done = doctor(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_EXPORTER_OTLP_PROTOCOL=protocol, **FAST)
    verdict = result(done)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "NOT accepted" in done.stdout
    assert "PROBLEM (traces, metrics): export failed: " in verdict and "Connection refused" in verdict, verdict
    assert "FIX: check OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_PROTOCOL" in verdict
    assert "Collector is up" in verdict


def test_per_signal_endpoint_is_the_variable_named():
    receiver = GrpcReceiver()
    try:
        done = doctor(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
                      OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=f"http://127.0.0.1:{closed_port()}", **FAST)
        verdict = result(done)
        assert done.returncode == 1
        assert "metrics  ACCEPTED" in done.stdout
        assert "PROBLEM (traces):" in verdict and "FIX: check OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" in verdict
        assert "metrics" not in verdict
    finally:
        receiver.stop()


@pytest.mark.parametrize("protocol, said", [("grpc", "Failed parsing HTTP/2"), ("http/protobuf", "BadStatusLine")])
def test_wrong_protocol_names_the_protocol_variable(protocol, said):
    """gRPC to the HTTP receiver's port, or HTTP to the gRPC receiver's."""
    receiver = HttpReceiver() if protocol == "grpc" else GrpcReceiver()
    try:
        done = doctor(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint, OTEL_EXPORTER_OTLP_PROTOCOL=protocol, **FAST)
        verdict = result(done)
        assert done.returncode == 1, done.stdout + done.stderr
        assert "PROBLEM (traces, metrics): export failed: " in verdict and said in verdict, verdict
        assert "OTEL_EXPORTER_OTLP_PROTOCOL" in verdict.split("FIX: ")[1]
    finally:
        receiver.stop()


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from otlp_receiver import make_certificates

    try:
        return make_certificates(tmp_path_factory.mktemp("tls"))
    except RuntimeError as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_tls(protocol, certificates):
    tls = (certificates["cert"], certificates["key"])
    receiver = GrpcReceiver(tls=tls) if protocol == "grpc" else HttpReceiver(tls=tls)
    env = dict(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint, OTEL_EXPORTER_OTLP_PROTOCOL=protocol, **FAST)
    try:
        good = doctor(OTEL_EXPORTER_OTLP_CERTIFICATE=certificates["ca"], **env)
        assert good.returncode == 0, good.stdout + good.stderr
        assert f"certificate   {certificates['ca']} (OTEL_EXPORTER_OTLP_CERTIFICATE): readable" in good.stdout
        wrong = doctor(OTEL_EXPORTER_OTLP_CERTIFICATE=certificates["wrong_ca"], **env)
        assert wrong.returncode == 1
        assert "CERTIFICATE_VERIFY_FAILED" in result(wrong), result(wrong)
        assert "OTEL_EXPORTER_OTLP_CERTIFICATE and that the Collector is up" in result(wrong)
        missing = doctor(OTEL_EXPORTER_OTLP_CERTIFICATE="/nonexistent/ca.pem", **env)
        assert missing.returncode == 1
        assert "NOT readable: cannot be read (FileNotFoundError)" in missing.stdout
        assert "cannot be read" in missing.stdout.split("Warnings while resolving")[1]  # configure()'s warning
        assert ("PROBLEM (traces): the otlp traces exporter is not built: otel-hicache: "
                "OTEL_EXPORTER_OTLP_CERTIFICATE='/nonexistent/ca.pem' cannot be read") in result(missing)
        assert "FIX: fix what the warning names" in result(missing)
        fifo = Path(certificates["ca"]).parent / f"ca-{protocol.replace('/', '-')}.fifo"  # open() would wait forever
        os.mkfifo(fifo)
        started = time.monotonic()
        blocked = doctor(OTEL_EXPORTER_OTLP_CERTIFICATE=str(fifo), **env)
        assert blocked.returncode == 1 and time.monotonic() - started < 30
        assert "NOT readable: is not a regular file" in blocked.stdout
        plain = doctor(**{**env, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint.replace("https", "http")})
        assert plain.returncode == 1 and "NOT accepted" in plain.stdout
        assert "FIX: check OTEL_EXPORTER_OTLP_ENDPOINT" in result(plain)
    finally:
        receiver.stop()


def test_nothing_to_export_exits_0_and_says_why():
    none = doctor(OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none")
    assert none.returncode == 0 and "NOTE: nothing to check" in result(none)
    disabled = doctor(OTEL_SDK_DISABLED="true")
    assert disabled.returncode == 0
    assert "OTEL_SDK_DISABLED   true (OTEL_SDK_DISABLED)" in disabled.stdout
    assert "NOTE: nothing is exported: OTEL_SDK_DISABLED=true" in result(disabled)


def test_where_the_sinks_run_is_said_with_why():
    default = doctor(OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none")
    assert "    sinks           embedded (no exporter sends over the network)\n" in default.stdout
    forced = doctor(OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none", OTEL_HICACHE_TELEMETRY_PROCESS="true")
    assert "    sinks           a telemetry process of their own (OTEL_HICACHE_TELEMETRY_PROCESS)" in forced.stdout


def test_settings_and_otel_hicache_warnings_are_reported():
    receiver = HttpReceiver()
    try:
        done = doctor(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint, OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
                      OTEL_METRICS_EXPORTER="otlp,prometheus", OTEL_TRACES_EXPORTER="otlp,zipkin",
                      OTEL_HICACHE_MAX_QUEUE_SIZE="lots", OTEL_HICACHE_ACK_TIMEOUT_S="2.5",
                      OTEL_TRACES_SAMPLER="traceidratio", OTEL_TRACES_SAMPLER_ARG="0.25",
                      OTEL_METRIC_EXPORT_INTERVAL="1500", OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED="true", **FAST)
        out = done.stdout
        assert "OTEL_HICACHE_MAX_QUEUE_SIZE 'lots'" in out and "OTEL_HICACHE_ACK_TIMEOUT_S '2.5'" in out
        assert "unknown exporter 'zipkin'" in out
        assert "traceidratio, arg 0.25 (OTEL_TRACES_SAMPLER): TraceIdRatioBased{0.25}" in out
        assert "export interval 1500 ms (OTEL_METRIC_EXPORT_INTERVAL)" in out
        assert "prometheus      not checked" in out
        assert "traces   ACCEPTED" in out and "metrics  ACCEPTED" in out
        assert done.returncode == 1  # zipkin is not installed
        assert "PROBLEM (traces): the zipkin traces exporter is not built: otel-hicache: " \
            "OTEL_TRACES_EXPORTER='otlp,zipkin': unknown exporter 'zipkin'" in result(done)
        assert "FIX: fix what the warning names, or leave zipkin out of OTEL_TRACES_EXPORTER" in result(done)
    finally:
        receiver.stop()


def test_usage_errors_exit_2():
    assert subprocess.run([str(SCRIPT)], capture_output=True).returncode == 2
    assert subprocess.run([sys.executable, "-m", "otel_hicache.doctor", "--timeout", "0"],
                          capture_output=True).returncode == 2


def test_console_script_is_declared_and_installed():
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert '[project.scripts]\notel-hicache = "otel_hicache.doctor:main"' in pyproject
    assert SCRIPT.exists(), "reinstall: pip install --no-deps --no-build-isolation -e ."


# -- SGLang, in-process ---------------------------------------------------------------

def _adapter_section(check: bool) -> str:
    """The doctor's adapter sections, as it prints them (entry-point group otel_hicache.adapters)."""
    from otel_hicache.doctor import _adapters

    out = io.StringIO()
    _adapters(out, check)
    return out.getvalue()


def test_sglang_patch_groups_on_the_real_sglang(monkeypatch):
    pytest.importorskip("otel_hicache_sglang")
    monkeypatch.syspath_prepend(str(ADAPTER_TESTS))
    sglang_cpu = pytest.importorskip("sglang_cpu")
    sglang_cpu.install_cpu_support()  # importing SGLang 0.5.23 on CPU (seconds, once per session)
    text = _adapter_section(check=True)
    assert "sglang          0.5.23 (supported; the adapter instruments sglang >= 0.5.20, < 0.5.24)" in text
    assert "SGLang plugin entry point registered" in text
    for group in ("L1<->L2 transfers", "transfer causes", "host residence"):
        assert f"{group}: would apply" in text, text
    monkeypatch.setenv("SGLANG_PLUGINS", "something_else")
    text = _adapter_section(check=False)
    assert "does not list otel_hicache" in text and "patch groups    not checked" in text


def test_sglang_not_installed(monkeypatch):
    import importlib.metadata

    pytest.importorskip("otel_hicache_sglang")

    def version(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert "sglang          not installed" in _adapter_section(check=True)


def test_skip_adapters_and_its_old_name(monkeypatch, capsys):
    from otel_hicache import doctor as doctor_module

    monkeypatch.setattr(doctor_module, "doctor", lambda timeout_s, check_adapters: check_adapters)
    for flag in ("--skip-adapters", "--skip-sglang"):
        assert doctor_module.main(["doctor", flag]) is False
    assert doctor_module.main(["doctor"]) is True
    with pytest.raises(SystemExit):
        doctor_module.main(["doctor", "--help"])
    shown = capsys.readouterr().out
    assert "--skip-adapters" in shown and "--skip-sglang" not in shown


def test_why_not_applied_is_the_patchers_check():
    patching = pytest.importorskip("otel_hicache_sglang.patching")

    def too_old() -> None:
        raise patching.Incompatible("HiCacheAck has no field num_bytes")

    assert patching.why_not_applied(patching.Group("ok", [("json", "JSONDecoder.decode", None)])) is None
    gone = patching.Group("gone", [("json", "Nope.decode", None)])
    assert patching.why_not_applied(gone) == "json.Nope.decode not found"
    assert patching.why_not_applied(patching.Group("guard", [("json", "JSONDecoder.decode", None)],
                                                   check=too_old)) == "HiCacheAck has no field num_bytes"


def test_the_telemetry_process_is_checked_when_configure_would_use_it():
    receiver = HttpReceiver()
    try:
        done = doctor(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint, OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
                      **FAST)
        out = done.stdout + done.stderr
        assert done.returncode == 0, out
        assert "sinks           a telemetry process of their own (an exporter sends over OTLP)" in done.stdout, out
        assert re.search(r"the telemetry process \(pid \d+\) started and flushed", done.stdout), out
    finally:
        receiver.stop()


def test_embedded_sinks_start_no_telemetry_process():
    done = doctor(OTEL_TRACES_EXPORTER="console", OTEL_METRICS_EXPORTER="none", **FAST)
    assert "sinks           embedded (no exporter sends over the network)" in done.stdout
    assert "telemetry process (pid" not in done.stdout


def test_a_telemetry_process_that_fails_is_a_problem_with_a_fix(monkeypatch):
    from otel_hicache import doctor as doctor_module
    from otel_hicache.capture import channel

    lines: list[str] = []
    for command in (["/nonexistent/python"], [sys.executable, "-c", "raise SystemExit(3)"]):
        monkeypatch.setattr(channel, "telemetry_process_command", lambda command=command: command)
        report = doctor_module._Report(io.StringIO())  # noqa: SLF001
        doctor_module._telemetry_process(report, 2.0)  # noqa: SLF001
        lines.append(report.out.getvalue())
        [(where, what, fix)] = report.problems
        assert where == "sinks" and "telemetry process" in what and "OTEL_HICACHE_TELEMETRY_PROCESS=false" in fix
        assert "NOT working" in lines[-1]
    assert "could not be started" in lines[0]


# -- a collector that answers outside 2xx, and secrets ------------------------------------------

@pytest.mark.parametrize("status, headers, refused", [
    (308, {"Location": "https://127.0.0.1:4318/otlp"},
     "HTTP 308 Permanent Redirect (to https://127.0.0.1:4318/otlp: the collector wants TLS; set an https endpoint)"),
    (429, {}, "HTTP 429 Too Many Requests"),
    (500, {}, "HTTP 500 Internal Server Error"),
])
def test_a_collector_answering_outside_2xx_is_refused_with_the_status(status, headers, refused):
    receiver = HttpReceiver(status=status, headers=headers)
    try:
        done = doctor(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint, OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
                      **FAST)
    finally:
        receiver.stop()
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "ACCEPTED" not in out and "OK: every configured exporter" not in out, out
    assert receiver.received.refused_items("traces") >= 1 and receiver.received.refused_items("metrics") >= 1
    for signal in ("traces", "metrics"):
        line = next(line for line in done.stdout.splitlines() if line.startswith(f"  {signal:<8} NOT accepted by "
                                                                                  f"{receiver.endpoint}/v1/{signal}"))
        assert "(http/protobuf): export failed: " in line and refused in line, line
    assert "PROBLEM (traces, metrics): export failed: " in result(done) and refused in result(done), result(done)
    assert "FIX: check OTEL_EXPORTER_OTLP_ENDPOINT" in result(done)


SECRETS = ("alice", "pa55w0rd", "t0psecret", "Bearer-s3cr3t", "s3cr3t")


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
@pytest.mark.parametrize("reachable", [True, False])
def test_no_credential_or_header_value_appears_anywhere(protocol, reachable):
    receiver = (GrpcReceiver() if protocol == "grpc" else HttpReceiver()) if reachable else None
    endpoint = receiver.endpoint if receiver else f"http://127.0.0.1:{closed_port()}"
    with_userinfo = endpoint.replace("http://", "http://alice:pa55w0rd@")
    try:
        done = doctor(OTEL_EXPORTER_OTLP_ENDPOINT=with_userinfo, OTEL_EXPORTER_OTLP_PROTOCOL=protocol,
                      OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=with_userinfo + ("" if protocol == "grpc" else "/v1/traces"),
                      # one header well formed, one with a colon for the equals sign (a warning quotes it)
                      OTEL_EXPORTER_OTLP_HEADERS="authorization=Bearer%20t0psecret,x-tenant:Bearer-s3cr3t", **FAST)
    finally:
        if receiver is not None:
            receiver.stop()
    out = done.stdout + done.stderr
    assert "endpoint      http://***@127.0.0.1:" in done.stdout, out  # scheme, host and port kept
    assert "authorization=***" in done.stdout, out  # the key kept
    for secret in SECRETS:
        assert secret not in out, (secret, out)
