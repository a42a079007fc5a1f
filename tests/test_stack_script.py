"""deploy/local/stack.sh against hostile settings and pid files it did not write.

No binary is needed: every case fails (or is refused) before the stack would start, and the
pid files are crafted in a private HICACHE_STACK_STATE beside a ``sleep`` this test starts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STACK = ROOT / "deploy" / "local" / "stack.sh"
NUMERIC = ("HICACHE_STACK_WAIT_S", "JAEGER_OTLP_GRPC_PORT", "JAEGER_HEALTH_PORT", "JAEGER_METRICS_PORT")

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="stack.sh reads /proc")


def _stack(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HICACHE_", "JAEGER_", "OTELCOL_"))}
    base["HICACHE_STACK_STATE"] = str(tmp_path / "state")
    # binaries that must never run: a case that got as far as starting one has already failed
    for name in ("OTELCOL", "JAEGER", "PROMETHEUS", "PROMTOOL"):
        base[f"HICACHE_{name}_BIN"] = "/bin/false"
    return subprocess.run(["bash", str(STACK), *args], cwd=tmp_path, env={**base, **env},
                          capture_output=True, text=True, timeout=60)


def _start_time(pid: int) -> str:
    """Field 22 of /proc/PID/stat (after the parenthesised command name, which may hold spaces)."""
    stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii")
    return stat.rsplit(")", 1)[1].split()[19]


@pytest.fixture
def sleeper():
    """A process the stack did not start; killed by the test however it ends."""
    process = subprocess.Popen(["sleep", "1000"])
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(5)


def _alive(process: subprocess.Popen, wait_s: float = 0.0) -> bool:
    """Still running after `wait_s` (a signal sent just before needs a moment to land)."""
    deadline = time.monotonic() + wait_s
    while True:
        if process.poll() is not None:
            return False
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.05)


# -- numeric settings ----------------------------------------------------------------------

INJECTION = "SERVICES[$(id>owned.txt)]"


@pytest.mark.parametrize("command", ["up", "status", "down"])
@pytest.mark.parametrize("variable", NUMERIC)
def test_an_injected_command_never_runs(tmp_path, variable, command):
    """Bash arithmetic on an unchecked value expands array subscripts, command substitution
    included: the value is refused by name before any arithmetic, and the command never runs."""
    out = _stack(tmp_path, command, **{variable: INJECTION})
    assert not (tmp_path / "owned.txt").exists(), f"{variable} ran a command ({command})"
    assert out.returncode != 0
    assert variable in out.stderr, out.stderr
    assert "owned" not in out.stderr  # the value is not echoed back whole


@pytest.mark.parametrize("value", ["abc", "1e3", "-5", "0x10", "\u0663", "12 34", "9" * 40, "1;id"])
@pytest.mark.parametrize("variable", NUMERIC)
def test_a_value_that_is_not_a_plain_number_is_refused(tmp_path, variable, value):
    out = _stack(tmp_path, "status", **{variable: value})
    assert out.returncode != 0
    assert f"{variable}" in out.stderr and "not a" in out.stderr, out.stderr


@pytest.mark.parametrize("variable", [v for v in NUMERIC if v.endswith("_PORT")])
@pytest.mark.parametrize("value", ["0", "65536", "99999"])
def test_a_port_out_of_range_is_refused(tmp_path, variable, value):
    out = _stack(tmp_path, "status", **{variable: value})
    assert out.returncode != 0
    assert variable in out.stderr and "1 to 65535" in out.stderr, out.stderr


def test_plain_numbers_and_empty_values_are_accepted(tmp_path):
    """Empty means unset (the default); a valid number passes the check."""
    out = _stack(tmp_path, "status", HICACHE_STACK_WAIT_S="", JAEGER_OTLP_GRPC_PORT="14317",
                 JAEGER_HEALTH_PORT="", JAEGER_METRICS_PORT="65535")
    assert "not a" not in out.stderr and "1 to 65535" not in out.stderr, out.stderr
    assert "otel-collector" in out.stdout and "stopped" in out.stdout, out.stdout


# -- pid files -----------------------------------------------------------------------------

def _pid_file(tmp_path: Path, name: str, text: str) -> Path:
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    path = state / f"{name}.pid"
    path.write_text(text, encoding="utf-8")
    return path


def _sleep_exe(process: subprocess.Popen) -> str:
    return os.readlink(f"/proc/{process.pid}/exe")


def test_down_stops_the_process_a_matching_pid_file_names(tmp_path, sleeper):
    """pid, start time and executable as `up` records them: this is the stack's process."""
    _pid_file(tmp_path, "jaeger", f"{sleeper.pid} {_start_time(sleeper.pid)} {_sleep_exe(sleeper)}\n")
    status = _stack(tmp_path, "status")
    assert f"pid {sleeper.pid}" in status.stdout and "running" in status.stdout, status.stdout
    out = _stack(tmp_path, "down")
    assert out.returncode == 0, out.stderr
    assert not _alive(sleeper, 5.0), "down left the stack's own process running"
    assert f"jaeger({sleeper.pid})" in out.stdout, out.stdout
    assert not (tmp_path / "state" / "jaeger.pid").exists()


@pytest.mark.parametrize("case", ["older stack.sh", "wrong start time", "wrong executable", "bad pid"])
def test_down_leaves_a_process_it_did_not_start_alone(tmp_path, sleeper, case):
    start, exe = _start_time(sleeper.pid), _sleep_exe(sleeper)
    text = {
        # what an older stack.sh wrote: the pid and the binary path, no start time
        "older stack.sh": f"{sleeper.pid} {exe}\n",
        # the pid reused by another process since `up`
        "wrong start time": f"{sleeper.pid} {int(start) + 1} {exe}\n",
        "wrong executable": f"{sleeper.pid} {start} {shutil.which('true') or '/bin/true'}\n",
        # kill -TERM -1 would signal every process of the user
        "bad pid": f"-1 {start} {exe}\n",
    }[case]
    _pid_file(tmp_path, "otel-collector", text)
    status = _stack(tmp_path, "status")
    assert "stale" in status.stdout + status.stderr, status.stdout + status.stderr
    assert "running" not in status.stdout
    out = _stack(tmp_path, "down")
    assert _alive(sleeper, 1.0), f"down killed a process it did not start ({case})"
    assert "stale" in out.stdout + out.stderr, out.stdout + out.stderr
    if case == "older stack.sh":
        assert "older" in out.stdout + out.stderr
    assert "stopped nothing" in out.stdout, out.stdout
    assert not (tmp_path / "state" / "otel-collector.pid").exists()  # a stale file is of no further use


def test_up_refuses_nothing_for_a_stale_pid_file(tmp_path, sleeper):
    """A stale pid file does not make `up` believe the stack runs (it fails later, on /bin/false)."""
    _pid_file(tmp_path, "prometheus", f"{sleeper.pid} {_sleep_exe(sleeper)}\n")
    out = _stack(tmp_path, "up", HICACHE_STACK_WAIT_S="1")
    assert "already running" not in out.stderr, out.stderr
    assert _alive(sleeper), "up killed a process it did not start"
