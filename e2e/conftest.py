"""Fixtures of the e2e tests: the real Collector, Jaeger and Prometheus from the shipped configs
(deploy/local/stack.sh, its state in a temp dir), the workloads that send into them with their
ground truth, clients of the APIs the UIs use, and child processes stopped by pid at the end.
Run `bash deploy/local/stack.sh install` first."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT, SERVICES, STACK, Jaeger, Proc, Prom, clean_env


@pytest.fixture(scope="session")
def stack(request, tmp_path_factory):
    """The stack up (waited until Prometheus scrapes the Collector), down -v after; its logs
    printed when a test failed."""
    state = tmp_path_factory.mktemp("stack")
    env = {**os.environ, "HICACHE_STACK_STATE": str(state)}
    up = subprocess.run(["bash", str(STACK), "up"], env=env, capture_output=True, text=True)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield state
    finally:
        subprocess.run(["bash", str(STACK), "down", "-v"], env=env, capture_output=True)
        if request.session.testsfailed:
            for log in sorted(state.glob("*.log")):
                print(f"---- {log}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-20:]))


@pytest.fixture(scope="session")
def prom(stack) -> Prom:
    return Prom()


@pytest.fixture(scope="session")
def jaeger(stack) -> Jaeger:
    return Jaeger()


@pytest.fixture
def spawn(tmp_path):
    """spawn(name, cmd, env, health) -> a Proc, not yet started; every one stopped at the end."""
    procs: list[Proc] = []

    def make(name: str, cmd: list[str], env: dict[str, str], health: str = "") -> Proc:
        procs.append(Proc(name, cmd, env, tmp_path, health))
        return procs[-1]

    yield make
    for proc in reversed(procs):
        proc.stop()


@pytest.fixture(scope="session")
def truth(stack, tmp_path_factory) -> dict[str, dict]:
    """The example workload (600 ops at 40/s: rate() gets several scrapes) and the real SGLang
    HiCache code on CPU, at once, configured only by OTEL_*; each one's ground truth."""
    out = tmp_path_factory.mktemp("workloads")
    commands = {
        "example": [str(ROOT / "examples/hicache_workload.py"), "--ops", "600", "--rate", "40", "--layers", "2",
                    "--pool-tokens", "2048"],
        "sglang": [str(ROOT / "e2e/sglang_workload.py")],
    }
    procs = [Proc(name, [sys.executable, *cmd, "--truth-json", str(out / f"{name}.json")],
                  clean_env(OTEL_SERVICE_NAME=SERVICES[name], OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:4317",
                            # every second: the final values reach Prometheus within a scrape or two
                            OTEL_METRIC_EXPORT_INTERVAL="1000", OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED="true"),
                  out) for name, cmd in commands.items()]
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.wait(300, tuple(procs))
    finally:
        for proc in procs:
            proc.stop()
    return {name: json.loads((out / f"{name}.json").read_text()) for name in commands}
