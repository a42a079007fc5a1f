"""benchmarks/serving_cpu.py runs end to end (one round of short turns) and reports what it claims;
no time is asserted."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "serving_cpu.py"


def test_serving_cpu_runs_every_variant_and_subtracts_the_control(tmp_path):
    out = tmp_path / "serving.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--seconds", "1.5", "--warmup-s", "0.5",
                          "--rate", "200", "--rounds", "1", "--json", str(out)],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    results = json.loads(out.read_text())
    variants = results["variants"]
    assert list(variants) == ["control", "embedded", "telemetry process"]
    assert results["complete"] is True

    control = variants["control"]
    assert control["enabled"] is False  # OTEL_HICACHE_ENABLED=false: the loop without telemetry
    assert "serving_cpu_us_per_op" not in control
    for name in ("embedded", "telemetry process"):
        f = variants[name]
        assert f["enabled"] is True and f["flushed"] is True
        # spans at 100%, each op one span: the receiver process counted every op submitted
        assert f["received_spans"] == f["ops_submitted"] and f["ops_submitted"][0] > f["ops_per_round"][0] > 0
        raw, net, total = (f[k]["rounds"] for k in ("host_cpu_us_per_op", "serving_cpu_us_per_op",
                                                    "total_cpu_us_per_op"))
        # the control of the same round is subtracted from the whole host process's CPU per op
        assert all(math.isclose(n, r - c) for n, r, c in zip(net, raw, control["host_cpu_us_per_op"]["rounds"]))
        assert all(x > 0 for x in raw + net + total)
        cycles = f["stretch_us"]["worker_cycle"]
        assert cycles["calls"] > 0 and 0 < cycles["p50"] <= cycles["p99"] <= cycles["p999"] <= cycles["max"]
    # embedded, the serving process exports; with the telemetry process, it never does
    assert variants["embedded"]["stretch_us"]["span_export"]["calls"] > 0
    assert variants["telemetry process"]["stretch_us"]["span_export"]["calls"] == 0
    embedded, helper = variants["embedded"], variants["telemetry process"]
    assert embedded["helper_cpu_us_per_op"] is None
    assert embedded["total_cpu_us_per_op"]["rounds"] == embedded["serving_cpu_us_per_op"]["rounds"]
    # the telemetry process's own CPU is measured apart and added to the total
    helper_cpu = helper["helper_cpu_us_per_op"]["rounds"]
    assert all(h > 0 for h in helper_cpu)
    assert all(math.isclose(t, s + h) for t, s, h in zip(helper["total_cpu_us_per_op"]["rounds"],
                                                          helper["serving_cpu_us_per_op"]["rounds"], helper_cpu))

    # the goals, each said met or not from this run's figures (a short run on a shared machine: not judged here)
    assert len(results["goals"]) == 4
    for goal in results["goals"]:
        assert goal["result"] in ("met", "NOT met") and goal["measured"] in run.stdout
    for heading in ("serving (net)", "total (net)", "per cycle", "per export() call", "p99.9"):
        assert heading in run.stdout
