"""benchmarks/serving_cpu.py runs end to end (three rounds of tiny windows), subtracts its
controls, and its exit status is its goals' verdict; no time is asserted."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # processes, receivers, seconds each: CI's later step (pytest -m slow)

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "serving_cpu.py"


def load_script():
    sys.path.insert(0, str(SCRIPT.parent))  # its sibling bench_common
    try:
        spec = importlib.util.spec_from_file_location("serving_cpu_under_test", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return module


def test_serving_cpu_runs_every_variant_and_gates_on_its_goals(tmp_path):
    pytest.importorskip("sglang")
    out = tmp_path / "serving.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "3", "--rate", "200", "--seconds", "0.3",
                          "--slow-seconds", "0.4", "--warmup-s", "0.2", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode in (0, 1), run.stdout + run.stderr
    results = json.loads(out.read_text())
    assert results["complete"] is True, run.stdout  # spans at 100%: the counter got one per op
    assert results["received_spans"] == results["submitted"] > 0
    turns, figures = results["turns"], results["figures"]
    assert [len(turns[v]) for v in ("core control", "core", "sglang control", "sglang")] == [3, 3, 3, 3]
    assert all(t["submitted"] == 0 for v in ("core control", "sglang control") for t in turns[v])
    for name in ("core", "sglang"):  # the control of the same round is subtracted, per op
        f = figures[name]
        for net, raw, control in zip(*(f[k]["rounds"] for k in ("net_us_per_op", "serving_us_per_op",
                                                                 "control_us_per_op"))):
            assert math.isclose(net, raw - control)
        assert all(x > 0 for x in f["poller_us_per_op"]["rounds"] + f["telemetry_us_per_op"]["rounds"])
    reference = figures["reference_op_us"]["rounds"]
    assert len(reference) == 3 and all(r > 0 for r in reference)
    for phase in ("slow", "idle"):
        for both, serving, telemetry in zip(*(figures[f"{phase}_{k}_pct"]["rounds"]
                                              for k in ("both", "serving", "telemetry"))):
            assert math.isclose(both, serving + telemetry)
    goals, module = results["goals"], load_script()
    assert [g["key"] for g in goals] == [key for key, _, _ in module.GOALS]
    for key, text in module.REPORTED:  # printed with its spread, gating nothing
        assert len(figures[key]["rounds"]) == 3 and text in run.stdout
    for goal in goals:
        assert goal["median"] == figures[goal["key"]]["median"] and goal["goal"] in run.stdout
    assert (run.returncode == 0) == all(g["met"] for g in goals)  # a missed goal fails the run


def test_a_figure_over_its_limit_misses_its_goal():
    module = load_script()
    figures = {key: {"median": limit} for key, _, limit in module.GOALS}
    assert all(g["met"] for g in module.judge(figures))
    figures["idle_serving_pct"]["median"] *= 1.01
    assert [g["key"] for g in module.judge(figures) if not g["met"]] == ["idle_serving_pct"]
