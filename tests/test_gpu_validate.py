"""benchmarks/gpu_validate.py in its dry mode (CPU stand-in backend): wired, and a broken
wiring is caught."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_validate.py"

WIRING = ("spans: one per op, device_event, anchored", "span duration == stand-in truth",
          "metrics: duration histogram, bytes == spans", "poller running during the run", "results json")
TARGETS = ("duration / independent, offload", "duration / independent, onboard",
           "anchor error, median |span start - host before|", "anchor error, max",
           "caller: submit() per op, real events, net", "runtime")


def load_script() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_validate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def table_after_header(stdout: str) -> list[str]:
    """The lines of the final table, header included; asserts nothing follows it."""
    lines = stdout.rstrip("\n").splitlines()
    header = max(i for i, line in enumerate(lines) if line.startswith("check ") and line.rstrip().endswith("result"))
    assert set(lines[header + 1].replace(" ", "")) == {"-"}, lines[header + 1]
    body = lines[header + 2:]
    assert body and body[-1].startswith("overall "), body[-1:]
    for line in body:  # every line after the header is a row: check, measured, target, result
        assert len([c for c in line.split("  ") if c.strip()]) >= 3, line
    return lines[header:]


def checks(results: dict[str, Any]) -> dict[str, str]:
    return {row["check"]: row["status"] for row in results["checks"]}


def test_dry_run_is_wired(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry", "--out", str(out)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "DRY MODE" in proc.stdout
    table = table_after_header(proc.stdout)
    assert table[-1].split()[-1] == "PASS"

    results = json.loads(out.read_text())
    assert results["mode"] == "dry" and results["complete"] is True and results["exit_status"] == 0
    for key in ("torch", "otel_hicache", "timestamp_utc", "device_name", "python"):
        assert key in results["environment"], key
    status = checks(results)
    for name in WIRING:
        assert status[name] == "PASS", (name, status)
    for name in TARGETS:  # computed and labelled, whatever the CPU measured
        assert status[name].endswith("dry (not a GPU measurement)"), (name, status[name])
    assert not [s for s in status.values() if s == "ERROR"], status
    assert results["errors"] == []

    settings = results["settings"]
    sizes, reps = settings["sizes"], settings["reps"]
    copies = [op for op in results["ops"] if op["phase"] == "copies"]
    assert len(copies) == len(sizes) * 2 * reps
    assert {(op["direction"], op["bytes"]) for op in copies} == {
        (d, int(s * 2**20)) for d in ("offload", "onboard") for s in sizes}
    late = [op for op in results["ops"] if op["phase"] == "late_ack"]
    assert len(late) == 2 * settings["ack_reps"]
    overhead = [op for op in results["ops"] if op["phase"] == "overhead"]
    assert len(overhead) == settings["overhead_ops"] == len(results["overhead"]["submit_ns"])
    for op in results["ops"]:  # one span per op, device-timed, anchored, equal to the stand-in truth
        assert op["spans"] == 1, op
        assert op["timing_source"] == "device_event" and op["anchored"] is True, op
        assert op["ratio_events"] == pytest.approx(1.0, abs=1e-6), op
        assert abs(op["span_ns"] - op["events_ns"]) <= 1000, op
    # 1 ms of slack (the stand-in anchor's bracket can be stretched by a busy CPU), plus any step the wall
    # clock made against the stand-in device clock (perf_counter) during the run: placement follows the
    # wall clock only from the next anchor on
    offsets = [op["wall_minus_monotonic_ns"] for op in copies + late]
    slack = 1_000_000 + max(offsets) - min(offsets)
    for op in copies + late:  # inside its independent bracket, and placed at the copy on the wall clock
        assert 0 < op["ratio_ref"] <= 1.0, op
        assert op["host_before_ns"] - slack <= op["span_start_ns"] <= op["host_after_ns"] + slack, (op, slack)
    largest = [op["ratio_ref"] for op in copies if op["bytes"] == max(o["bytes"] for o in copies)]
    assert sorted(largest)[len(largest) // 2] > 0.9, largest
    for op in late:
        assert op["acked"] is True, op
        assert op["ack_delay_us"] >= settings["ack_delay_ms"] * 1e3 - 50, op
    assert results["analysis"]["bandwidth"]["peak_gbs"].keys() == {"offload", "onboard"}
    assert {b["direction"] for b in results["do_bench"]} == {"offload", "onboard"}


class LyingEvent:
    """Reports 25% more than the time that passed."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def elapsed_time(self, end: "LyingEvent") -> float:
        return self.inner.elapsed_time(end.inner) * 1.25


class FailingEvent(LyingEvent):
    """query() raises: otel-hicache reports error spans on the host clock."""

    def elapsed_time(self, end: "LyingEvent") -> float:
        return self.inner.elapsed_time(end.inner)

    def query(self) -> bool:
        raise RuntimeError("device lost")


@pytest.mark.parametrize("fault", ["lying_elapsed_time", "query_raises", "queue_full"])
def test_broken_wiring_fails(fault: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    gv = load_script()
    wrapper = {"lying_elapsed_time": LyingEvent, "query_raises": FailingEvent}.get(fault)

    class Backend(gv.DryBackend):
        def event(self) -> Any:
            inner = super().event()
            return wrapper(inner) if wrapper else inner

        def truth_ns(self, start: Any, finish: Any) -> int:
            unwrap = (lambda e: e.inner) if wrapper else (lambda e: e)
            return super().truth_ns(unwrap(start), unwrap(finish))

    if fault == "queue_full":  # submit() refuses: ops without a span
        monkeypatch.setenv("OTEL_HICACHE_MAX_QUEUE_SIZE", "1")
        # the poller waits out the overhead phase's ops (flushes still wake it): the queue fills
        monkeypatch.setenv("OTEL_HICACHE_POLL_INTERVAL_MS", "1000")
    out = tmp_path / "r.json"
    rc = gv.main(["--dry", "--out", str(out), "--sizes", "1,16", "--reps", "2", "--ack-reps", "1",
                  "--overhead-ops", "100", "--ack-delay-ms", "5", "--watchdog-s", "0"], backend=Backend())
    assert rc == 1
    table = table_after_header(capsys.readouterr().out)
    assert table[-1].split()[-1] == "FAIL"
    results = json.loads(out.read_text())
    assert results["exit_status"] == 1
    status = checks(results)
    expected_fail = {
        "lying_elapsed_time": "span duration == stand-in truth",
        "query_raises": "spans: one per op, device_event, anchored",
        "queue_full": "spans: one per op, device_event, anchored",
    }[fault]
    assert status[expected_fail] == "FAIL", status
    assert status["results json"] == "PASS"
