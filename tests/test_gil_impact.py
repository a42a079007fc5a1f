"""benchmarks/gil_impact.py runs end to end (tiny turns) and reports what it claims; no time is asserted."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gil_impact.py"


def gil_impact(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """One tiny run (one round of 0.3 s turns) with ``args``: its output and its JSON results."""
    out = tmp_path / "gil.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "1", "--turn-s", "0.3", *args, "--json", str(out)],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    return run, json.loads(out.read_text())


def test_gil_impact_runs_and_every_span_is_encoded(tmp_path):
    run, results = gil_impact(tmp_path, "--rates", "200", "--sections", "--attribute-waits", "--late-us", "50")
    assert {"idle", "paced 200", "hicache 200"} <= set(results["variants"])
    hicache = results["variants"]["hicache 200"]
    assert hicache["ops"] > 0 and hicache["flushed"] and hicache["samples"] > 0
    assert results["received_spans"] >= hicache["ops"]  # spans at 100%: each encoded by the sink
    assert set(hicache["cpu_share"]) == {"worker", "span_processor", "metric_reader"}
    assert "sections" in hicache and "added p99.9" in run.stdout
    if (shutil.which("cc") or shutil.which("gcc")) and Path("/proc/self/task").exists():
        waits = hicache["long_gil_waits"]  # each GIL wait over 50 us, sorted by what our threads did
        roles = ("worker", "span_processor", "metric_reader", "submitter")
        kinds = {f"{r} ran" for r in (*roles, "several")} | {"neither"}
        kinds |= {f"{r} waited for a CPU" for r in (*roles, "probe", "several")}
        assert set(waits) <= kinds and all(n > 0 for n in waits.values())
        assert "long_gil_waits" not in results["variants"]["idle"]  # no threads of ours to read
        assert "GIL waits over 50 us, by what otel-hicache's threads did meanwhile" in run.stdout


def test_gil_impact_runs_the_telemetry_process_beside_embedded_and_every_span_arrives(tmp_path):
    run, results = gil_impact(tmp_path, "--rates", "1000", "--no-outliers", "--hold-us", "60")
    names = set(results["variants"])
    assert "hicache 1000 telemetry process" in names and not any("slice" in name for name in names)
    process = results["variants"]["hicache 1000 telemetry process"]
    embedded = results["variants"]["hicache 1000"]
    assert process["ops"] > 0 and process["flushed"] and embedded["ops"] > 0 and embedded["flushed"]
    assert process["telemetry_process_cpu_share"] is not None  # its own CPU, from /proc by the channel's pid
    assert embedded["telemetry_process_cpu_share"] is None
    # in the serving process only the poller runs: no span processor, no metric reader there
    assert process["cpu_share"]["worker"] > 0
    assert process["cpu_share"]["span_processor"] == process["cpu_share"]["metric_reader"] == 0
    # spans at 100%: the embedded variant's encoded by the sink, the telemetry process's received over OTLP
    assert results["received_spans"] >= process["ops"] + embedded["ops"]
    assert set(results["goal"]) == {"hicache 1000", "hicache 1000 telemetry process"}
    # both modes side by side
    side = results["side_by_side"]
    assert [row["channel"] for row in side] == ["embedded", "telemetry process"]
    assert side[0]["telemetry_process_cpu_us_per_op"] is None and side[1]["telemetry_process_cpu_us_per_op"] >= 0
    assert "## Embedded vs telemetry process, 1000 ops/s" in run.stdout
    assert "the telemetry process" in run.stdout and "--gil-slice-us" not in run.stdout
    # the floor: the GIL held 60 us per wake-up by the submitting thread, no otel-hicache
    assert results["variants"]["hold 60 us"]["ops"] > 0 and set(results["hold_floor"]) == {"hold 60 us"}
    assert "floor: the GIL held 60 us per wake-up" in run.stdout
    if Path("/proc/pressure/cpu").exists():  # the machine's part, per variant
        assert "## The machine's part" in run.stdout
        for name, variant in results["variants"].items():
            assert 0 <= variant["cpu_pressure_share"] <= 1.01  # "some": a share of the wall time
            assert variant["probe_preempted_per_s"] >= 0
            assert variant["steal_share"] is None or 0 <= variant["steal_share"] <= 1.01
            assert (variant["worker_preempted_per_s"] is not None) == name.startswith("hicache")
    if shutil.which("cc") or shutil.which("gcc"):  # the probe's C sleep: the GIL wait apart from the OS's lateness
        assert "the wait for the GIL after the OS woke the probe" in run.stdout
        for variant in results["variants"].values():
            wait = variant["gil_wait_us"]
            assert 0 <= wait["p50"] <= wait["p99"] <= wait["p999"]
            assert wait["p999"] <= variant["p999_us"] + 1.0  # a part of each wake-up's lateness, one clock


def load(monkeypatch):
    import importlib.util

    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # its sibling bench_common
    spec = importlib.util.spec_from_file_location("gil_impact_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_the_goal_needs_the_gil_wait_within_it_too(monkeypatch):
    """A lateness below its floor (this VM's wake-up jitter) is no PASS while the GIL wait is over."""
    module = load(monkeypatch)
    goal = module.GOAL_P999_ADDED_US
    assert module.goal_met(-314.3, None)  # no GIL stamp (no C compiler): the lateness alone
    assert not module.goal_met(-314.3, goal + 192.5)
    assert module.goal_met(goal, goal) and module.goal_met(goal - 1, -3.0)
    assert not module.goal_met(goal + 1, goal - 50)


def test_preemptions_are_read_per_thread(monkeypatch):
    """The probe's own count, a named thread's, and none for a worker that does not run."""
    import threading

    module = load(monkeypatch)
    if not Path("/proc/thread-self/status").exists():
        assert module.preemptions() is None  # not Linux: no count, no crash
        return
    assert module.preemptions() >= 0
    assert module.worker_preemptions() is None  # no completion worker in this thread's sight
    release = threading.Event()
    worker = threading.Thread(target=release.wait, name="otel-hicache-poller")
    worker.start()
    try:
        assert module.worker_preemptions() == module.preemptions(worker.native_id) >= 0
    finally:
        release.set()
        worker.join()
    assert module.preemptions(2**31 - 1) is None  # no such thread


def test_a_long_gil_wait_is_the_machines_when_our_thread_waited_for_a_cpu(monkeypatch):
    module = load(monkeypatch)
    wait = 1_000_000
    assert module.classify_wait(wait, {"worker": (900_000, 0)}) == "worker ran"
    assert module.classify_wait(wait, {"worker": (100_000, 600_000)}) == "worker waited for a CPU"
    # a CPU wait of any thread of ours comes first: the GIL holder may be the one preempted
    assert module.classify_wait(wait, {"worker": (800_000, 0), "span_processor": (0, 500_000)}) == (
        "span_processor waited for a CPU")
    assert module.classify_wait(wait, {"worker": (400_000, 400_000)}) == "neither"
    assert module.classify_wait(wait, {"worker": (0, 300_000), "submitter": (0, 300_000)}) == (
        "several waited for a CPU")
    assert module.classify_wait(wait, {"worker": (300_000, 100_000), "submitter": (300_000, 100_000)}) == (
        "several ran")
    assert module.classify_wait(wait, {"worker": (200_000, 100_000), "probe": (600_000, 0)}) == "neither"
    # the probe only waits: preempted once woken, it is the machine's; on a CPU, it is nobody's work
    assert module.classify_wait(wait, {"worker": (0, 0), "submitter": (0, 0), "probe": (0, 700_000)}) == (
        "probe waited for a CPU")
    assert module.classify_wait(wait, {"worker": (0, 0), "probe": (900_000, 0)}) == "neither"
    assert module.classify_wait(wait, {"worker": (0, 0), "submitter": (800_000, 0)}) == "submitter ran"
    assert module.classify_wait(wait, {}) == "neither"
    # what may have fallen outside the wait (the probe's sleep, the reads) does not count
    assert module.classify_wait(wait, {"worker": (700_000, 0)}, outside_ns=300_000) == "neither"
    assert module.classify_wait(wait, {"worker": (700_000, 0), "span_processor": (400_000, 0)},
                                outside_ns=300_000) == "several ran"
    assert module.classify_wait(wait, {"worker": (0, 800_000)}, outside_ns=300_000) == "worker waited for a CPU"


def test_schedstat_reads_a_threads_cpu_and_run_queue_time(monkeypatch):
    import threading

    module = load(monkeypatch)
    if not Path(f"/proc/self/task/{threading.get_native_id()}/schedstat").exists():
        assert module.schedstat(threading.get_native_id(), threading.get_ident()) is None  # no reader, no crash
        return
    read = module.schedstat(threading.get_native_id(), threading.get_ident())
    try:
        on_cpu0, waiting0 = read()
        end = time.thread_time_ns() + 20_000_000
        while time.thread_time_ns() < end:  # 20 ms on a CPU
            pass
        on_cpu1, waiting1 = read()
        assert on_cpu1 - on_cpu0 >= 15_000_000 and waiting1 >= waiting0 >= 0
    finally:
        read.close()
    assert module.schedstat(2**31 - 1, threading.get_ident()) is None
