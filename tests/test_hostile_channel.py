"""The boundary between the serving process and its telemetry process, tried as a hostile user
would, against the real OTLP/HTTP receiver: what crosses the pipe runs no code, a frame that is
not the capture's is counted and skipped, and the telemetry process starts clean of the serving
process's working directory and of an auto-instrumentation's start-up code.

A serving process here is a fresh interpreter configured by ``OTEL_*`` variables only; it
writes its telemetry process's pid and thread count to a JSON file the test reads.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from otlp_receiver import HttpReceiver, attributes

pytestmark = pytest.mark.slow  # processes, receivers, seconds each: CI's later step (pytest -m slow)

ROOT = Path(__file__).resolve().parents[1]
OPS = 40

SERVING = textwrap.dedent("""
    import json, os, pickle, struct, sys, time
    import otel_hicache

    OUT, HOSTILE = sys.argv[1], sys.argv[2]
    otel_hicache.configure()
    tel = otel_hicache.TransferTelemetry(attributes={"tp_rank": 0})

    def ops(n):
        for _ in range(n):
            now = time.time_ns()
            tel.ack(tel.submit("offload", {"kv": 64}, 4096, page_size=64, host_start_ns=now - 1000, host_end_ns=now))
        assert tel.force_flush(10.0)

    ops(%(ops)d)
    child = tel.channel.process.pid
    if HOSTILE:  # another process of the same user writes frames into the telemetry process's input
        class Plant:
            def __reduce__(self):
                return (os.system, (f"touch {HOSTILE}",))
        frames = [pickle.dumps([Plant()]), b'{"not": "a batch"}', b"[[99, 1]]", b"[[7]]", b"[1, 2",
                  b'[[2, 1, 1, "offload", [8, 64], 5, "other", 9]]']  # host slots beyond the frame
        with open(f"/proc/{child}/fd/0", "wb") as pipe:
            for data in frames:
                pipe.write(struct.pack("<II", len(data), 0) + data)
    ops(%(ops)d)
    seen = []  # the fewest threads over 0.2 s: an export thread comes and goes
    for _ in range(10):
        seen.append(len(os.listdir(f"/proc/{child}/task")))
        time.sleep(0.02)
    threads = min(seen)
    with open(OUT, "w") as f:
        json.dump({"child": child, "threads": threads}, f)
    tel.shutdown()
""") % {"ops": OPS}


def _run(tmp_path: Path, receiver: HttpReceiver, *, hostile: str = "", cwd: Path | None = None,
         wrapper: tuple[str, ...] = ()) -> dict:
    script = tmp_path / "serving.py"
    script.write_text(SERVING)
    out = tmp_path / "out.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_SERVICE_NAME="hostile-channel-test", OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
               OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf", OTEL_BSP_SCHEDULE_DELAY="50",
               OTEL_METRIC_EXPORT_INTERVAL="200", OTEL_HICACHE_SHUTDOWN_TIMEOUT_S="5")
    done = subprocess.run([*wrapper, sys.executable, str(script), str(out), hostile], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return {**json.loads(out.read_text()), "stderr": done.stderr}


def _dropped(receiver: HttpReceiver, reason: str) -> int:
    points = receiver.received.last_points("otel_hicache.records.dropped")
    return sum(int(p.as_int) for p in points if attributes(p.attributes).get("reason") == reason)


def test_frames_run_no_code_and_malformed_ones_are_counted(tmp_path):
    """A pickle that would run a command, JSON that is not a batch, an unknown message kind, a
    FLUSH without its token, a cut-off document, host slots placed beyond the frame: none runs anything or ends the telemetry
    process; each is counted, and every op before and after them arrives."""
    receiver = HttpReceiver()
    try:
        marker = tmp_path / "pwned"
        result = _run(tmp_path, receiver, hostile=str(marker))
        assert not marker.exists()
        assert len(receiver.received.spans()) == 2 * OPS
        assert _dropped(receiver, "malformed_frame") == 6
        assert result["stderr"].count("not the capture's") == 1, result["stderr"]  # warned once
    finally:
        receiver.stop()


def test_working_directory_is_not_on_the_telemetry_process_path(tmp_path):
    """An ``otel_hicache`` package planted in the serving process's working directory never runs
    in the telemetry process."""
    planted = tmp_path / "cwd" / "otel_hicache"
    (planted / "sinks").mkdir(parents=True)
    marker = tmp_path / "planted-ran"
    code = f"open({str(marker)!r}, 'w').close()\n"
    for init in (planted / "__init__.py", planted / "sinks" / "__init__.py", planted / "sinks" / "process.py"):
        init.write_text(code)
    receiver = HttpReceiver()
    try:
        _run(tmp_path, receiver, cwd=tmp_path / "cwd")
        assert not marker.exists()
        assert len(receiver.received.spans()) == 2 * OPS
    finally:
        receiver.stop()


def test_auto_instrumentation_stays_out_of_the_telemetry_process(tmp_path):
    """Under ``opentelemetry-instrument`` the telemetry process runs exactly as without it: no
    second SDK pipeline of the distro's (its threads: the fewest seen over 0.2 s, as an export
    thread comes and goes), every op delivered once."""
    instrument = shutil.which("opentelemetry-instrument", path=os.path.dirname(sys.executable))
    assert instrument, "opentelemetry-instrument is in requirements/dev.txt"
    counts = {}
    for name, wrapper in (("plain", ()), ("instrumented", (instrument,))):
        receiver = HttpReceiver()
        try:
            result = _run(tmp_path, receiver, wrapper=wrapper)
            spans = receiver.received.spans()
            counts[name] = result["threads"]
            assert sorted({s.name for _, s in spans}) == ["hicache.offload"], name
            assert len(spans) == 2 * OPS, name
        finally:
            receiver.stop()
    assert counts["instrumented"] == counts["plain"], counts


STALLED = textwrap.dedent("""
    import json, os, signal, sys, time
    import otel_hicache

    OUT, OPS = sys.argv[1], int(sys.argv[2])
    otel_hicache.configure()
    tel = otel_hicache.TransferTelemetry(attributes={"tp_rank": 0})
    assert tel.force_flush(10.0)
    child = tel.channel.process.pid
    blob = "b" * 200_000

    def rss():
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith("VmRSS:")).split()[1]) * 1024

    before = rss()
    os.kill(child, signal.SIGSTOP)  # the telemetry process frozen: nothing leaves the pipe
    try:
        for i in range(OPS):
            now = time.time_ns()
            tel.ack(tel.submit("offload", {"kv": 64}, 4096, page_size=64, host_start_ns=now - 1000,
                               host_end_ns=now, attributes={"x.blob": blob + str(i)}))  # (each its own)
            time.sleep(0.001)
        time.sleep(0.5)  # the poller's last sends
        grown = rss() - before
    finally:  # never a stopped orphan left behind, whatever failed
        os.kill(child, signal.SIGCONT)
    assert tel.force_flush(30.0)
    with open(OUT, "w") as f:
        json.dump({"grown": grown}, f)
    tel.shutdown()
""")


def test_a_frozen_telemetry_process_costs_bounded_bytes_and_every_op_is_accounted_for(tmp_path):
    """200 KB of caller attributes per op while the telemetry process is stopped: the serving
    process's memory stays within the backlog's byte bound (and a margin for the interpreter),
    and every op is delivered or counted as dropped."""
    from otel_hicache.capture.channel import MAX_BACKLOG_BYTES

    ops = 1000  # 200 MB of attributes, several times the bound
    script = tmp_path / "stalled.py"
    script.write_text(STALLED)
    receiver = HttpReceiver()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        # glibc returns a freed 200-KB string to the system at once: RSS is what is held, not what malloc kept
        env.update(MALLOC_MMAP_THRESHOLD_="131072")
        env.update(OTEL_SERVICE_NAME="hostile-channel-test", OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
                   OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf", OTEL_BSP_SCHEDULE_DELAY="50",
                   OTEL_METRIC_EXPORT_INTERVAL="200", OTEL_HICACHE_SHUTDOWN_TIMEOUT_S="10")
        done = subprocess.run([sys.executable, str(script), str(tmp_path / "out.json"), str(ops)], env=env,
                              capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr
        grown = json.loads((tmp_path / "out.json").read_text())["grown"]
        assert grown < MAX_BACKLOG_BYTES + (32 << 20), f"the serving process grew {grown >> 20} MiB"
        delivered = len(receiver.received.spans())
        assert delivered + _dropped(receiver, "queue_full") == ops
        assert delivered < ops  # (the bound was reached: not a test of nothing)
        print(f"grew {grown / 2**20:.1f} MiB; {delivered} delivered, {ops - delivered} counted queue_full")
    finally:
        receiver.stop()


def test_a_caller_that_explodes_a_label_gets_one_warning_and_bounded_state(harness, warnings_log):
    """Pool names made up per op: past the cap, one warning naming the attribute; the sinks keep at
    most the cap's series apart, the rest in one overflow series; the token total stays exact."""
    from otel_hicache.sinks.metrics import SERIES_CAP

    h = harness()
    n = SERIES_CAP + 500
    for i in range(n):
        h.tel.submit("offload", {f"pool-{i}": 1}, 10, page_size=1, expect_ack=False, host_start_ns=1, host_end_ns=2)
        if i % 500 == 0:
            assert h.flush()
    assert h.flush()
    warned = [r.getMessage() for r in warnings_log.records if "series by hicache.pool" in r.getMessage()]
    assert len(warned) == 1, warned
    points = h.points("hicache.transfer.tokens")
    assert sum(p.value for p in points) == n
    overflow = [p for p in points if p.attributes.get("otel.metric.overflow")]
    assert len(overflow) == 1 and len(points) <= SERIES_CAP + 1
