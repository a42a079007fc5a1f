"""The real Collector, Jaeger and Prometheus from the shipped configs (`bash deploy/local/stack.sh
install`), their API clients, and a workload sending into them with its ground truth."""

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT, SERVICE, STACK, Jaeger, Proc, Prom, clean_env

sys.path.insert(0, str(ROOT / "tests"))  # helpers shared with tests/ (otlp_receiver...)


@pytest.fixture(scope="session")
def stack(request, tmp_path_factory):
    """stack.sh up in a temp dir (until Prometheus scrapes); down -v after, logs shown on failure."""
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


@pytest.fixture(scope="session")
def truth(stack, tmp_path_factory) -> dict:
    """The example workload's ground truth: 600 ops at 40/s, for rate() to see several scrapes."""
    out = tmp_path_factory.mktemp("workload")
    args = "--ops 600 --rate 40 --layers 2 --pool-tokens 2048 --truth-json".split()
    workload = Proc("workload", [sys.executable, "examples/hicache_workload.py", *args, str(out / "truth")], clean_env(
        OTEL_SERVICE_NAME=SERVICE, OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:4317",
        OTEL_METRIC_EXPORT_INTERVAL="1000", OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED="true"), out)
    try:
        workload.start()
        workload.wait(300)
    finally:
        workload.stop()
    return json.loads((out / "truth").read_text())
