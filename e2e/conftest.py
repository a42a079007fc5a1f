"""Fixtures of the e2e tests (after `bash deploy/local/stack.sh install`): the real Collector,
Jaeger and Prometheus from the shipped configs, the workloads sending into them with their ground
truth, API clients, child processes stopped by pid at the end."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import SERVICES, STACK, Jaeger, Proc, Prom, clean_env


@pytest.fixture(scope="session")
def stack(request, tmp_path_factory):
    """stack.sh up (it waits until Prometheus scrapes the Collector), its state in a temp dir;
    down -v after, the logs' ends printed when a test failed."""
    env = {**os.environ, "HICACHE_STACK_STATE": str(state := tmp_path_factory.mktemp("stack"))}
    up = subprocess.run(["bash", STACK, "up"], env=env, capture_output=True, text=True)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield state
    finally:
        subprocess.run(["bash", STACK, "down", "-v"], env=env, capture_output=True)
        for log in sorted(state.glob("*.log")) if request.session.testsfailed else []:
            print(f"---- {log}\n{log.read_text(errors='replace')[-2000:]}")


@pytest.fixture(scope="session")
def prom(stack) -> Prom:
    return Prom()


@pytest.fixture(scope="session")
def jaeger(stack) -> Jaeger:
    return Jaeger()


@pytest.fixture
def spawn(tmp_path):
    """spawn(name, cmd, env, health) -> a Proc, to start; each one stopped at the end."""
    procs: list[Proc] = []

    def make(name: str, cmd: list[str], env: dict, health: str = "") -> Proc:
        procs.append(Proc(name, cmd, env, tmp_path, health))
        return procs[-1]

    yield make
    for proc in reversed(procs):
        proc.stop()


@pytest.fixture(scope="session")
def truth(stack, tmp_path_factory) -> dict[str, dict]:
    """The example workload (600 ops at 40/s: rate() sees several scrapes) and the real SGLang
    HiCache code on CPU, side by side, configured only by OTEL_*: each one's ground truth."""
    out = tmp_path_factory.mktemp("workloads")
    cmds = {"example": ["examples/hicache_workload.py", "--ops", "600", "--rate", "40", "--layers", "2",
                        "--pool-tokens", "2048"], "sglang": ["e2e/sglang_workload.py"]}
    procs = [Proc(name, [sys.executable, *cmd, "--truth-json", str(out / name)], clean_env(
        OTEL_SERVICE_NAME=SERVICES[name], OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:4317",
        OTEL_METRIC_EXPORT_INTERVAL="1000", OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED="true"), out)
        for name, cmd in cmds.items()]
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.wait(300, tuple(procs))
    finally:
        for proc in procs:
            proc.stop()
    return {name: json.loads((out / name).read_text()) for name in cmds}
