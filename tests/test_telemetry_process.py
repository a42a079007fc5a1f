"""The telemetry process, against the real OTLP/HTTP receiver: what either process's death costs,
the fallback to embedded sinks, and that no process is left behind.

A serving process here is a fresh interpreter configured by ``OTEL_*`` variables only, submitting
acked ops at 1,000 per second; it writes its telemetry process's pid, and after each send how many
ops it had written to the pipe, to files the test reads.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from otlp_receiver import HttpReceiver, attributes

pytestmark = pytest.mark.slow  # processes, receivers, seconds each: CI's later step (pytest -m slow)

ROOT = Path(__file__).resolve().parents[1]
BYTES = 4096

SERVING = textwrap.dedent("""
    import json, os, sys, time
    import otel_hicache
    from otel_hicache.capture import channel as channel_module

    OUT, SECONDS = sys.argv[1], float(sys.argv[2])
    send = channel_module.ProcessChannel.send

    def counted(self):
        send(self)
        with open(OUT + ".written.tmp", "w") as f:  # after the send: never more than was written
            json.dump({"written": self._written_ops, "pid": self.process.pid if self.process else None}, f)
        os.replace(OUT + ".written.tmp", OUT + ".written")

    channel_module.ProcessChannel.send = counted
    otel_hicache.configure()
    tel = otel_hicache.TransferTelemetry(attributes={"tp_rank": 0})
    start, i, times = time.monotonic(), 0, []
    while time.monotonic() - start < SECONDS:
        now = time.time_ns()
        tel.ack(tel.submit("offload", {"kv": 64}, %(bytes)d, page_size=64, host_start_ns=now - 1000, host_end_ns=now))
        times.append(now)
        i += 1
        time.sleep(max(0.0, start + i / 1000 - time.monotonic()))
    with open(OUT + ".done", "w") as f:
        json.dump({"submitted": i, "times": times}, f)
    tel.shutdown()
""") % {"bytes": BYTES}


def _env(receiver: HttpReceiver, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_SERVICE_NAME="telemetry-process-test", OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
               OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf", OTEL_BSP_SCHEDULE_DELAY="50",
               OTEL_METRIC_EXPORT_INTERVAL="200", OTEL_HICACHE_SHUTDOWN_TIMEOUT_S="5",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p), **extra)
    return env


def _read(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def _wait_for(predicate: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout_s} s")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def receiver() -> Any:
    made = HttpReceiver()
    yield made
    made.stop()


def test_a_serving_process_killed_mid_run_loses_nothing_it_had_written(tmp_path, receiver):
    """SIGKILL at 1,000 ops/s: the telemetry process reads to the end of its input, exports every op
    written to it and exits."""
    out = tmp_path / "serving"
    serving = subprocess.Popen([sys.executable, "-c", SERVING, str(out), "30"], env=_env(receiver),
                               stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: (_read(Path(str(out) + ".written")) or {}).get("written", 0) >= 1500, 60)
    finally:
        serving.kill()
        serving.wait()
    written = _read(Path(str(out) + ".written"))
    telemetry = written["pid"]
    _wait_for(lambda: not _alive(telemetry), 30)  # it saw the end of its input, exported, exited
    spans = [s for _, s in receiver.received.spans() if s.name == "hicache.offload"]
    assert written["written"] <= len(spans) <= written["written"] + 1000, (written, len(spans))
    assert len({s.span_id for s in spans}) == len(spans)
    sent = max((p.as_int for p in receiver.received.last_points("hicache.transfer.bytes")), default=0)
    assert sent == len(spans) * BYTES  # the counters of exactly those ops
    _assert_static_in_resource(receiver)


def _assert_static_in_resource(receiver: HttpReceiver) -> None:
    """The static attributes (tp_rank) are in the resource of every span and series, on none of them."""
    with receiver.received.lock:
        spans = [(rs.resource, ss.spans) for r in receiver.received.traces for rs in r.resource_spans
                 for ss in rs.scope_spans]
        metrics = [(rm.resource, [p for sm in rm.scope_metrics for m in sm.metrics
                                  for p in getattr(m, m.WhichOneof("data")).data_points])
                   for r in receiver.received.metrics for rm in r.resource_metrics]
    assert spans and metrics
    for resource, items in spans + metrics:
        assert attributes(resource.attributes)["tp_rank"] == 0
        assert not any("tp_rank" in attributes(item.attributes) for item in items)


def _books(receiver: HttpReceiver) -> dict[str, Any]:
    """What arrived: distinct spans (by their ids), the last byte counter and drop counts, and every
    start time the byte counter's points gave."""
    spans = [s for _, s in receiver.received.spans() if s.name == "hicache.offload"]
    starts = set()
    with receiver.received.lock:
        requests = list(receiver.received.metrics)
    for request in requests:
        for rm in request.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    if m.name == "hicache.transfer.bytes":
                        starts.update(p.start_time_unix_nano for p in m.sum.data_points)
    return {"spans": len(spans), "distinct": len({(s.trace_id, s.span_id) for s in spans}),
            "ends": {s.end_time_unix_nano for s in spans}, "starts": starts,
            "bytes": sum(p.as_int for p in receiver.received.last_points("hicache.transfer.bytes")),
            "dropped": sum(p.as_int for p in receiver.received.last_points("otel_hicache.records.dropped"))}


@pytest.mark.parametrize("frozen_s", [0.0, 1.0], ids=["killed", "stopped-then-killed"])
def test_a_telemetry_process_killed_three_times_loses_and_repeats_nothing(tmp_path, receiver, frozen_s):
    """At 1,000 ops/s, metric exports every 5 s and the SDK's default span batching, the telemetry
    process is SIGKILLed three times, 2 s apart (or first stopped for a second, so what is written
    meanwhile waits in the pipe): each successor goes on from its predecessor's checkpoint. Every op
    arrives as one span (one that arrived twice has the same ids), the byte counter equals the
    ops with one start time throughout (it went on, never restarted), nothing is counted lost,
    and no process is left."""
    out = tmp_path / "serving"
    env = _env(receiver)
    env.pop("OTEL_BSP_SCHEDULE_DELAY")
    env["OTEL_METRIC_EXPORT_INTERVAL"] = "5000"
    serving = subprocess.Popen([sys.executable, "-c", SERVING, str(out), "11"], env=env,
                               stderr=subprocess.PIPE, text=True)
    pids = [_wait_for(lambda: (_read(Path(str(out) + ".written")) or {}).get("pid"), 60)]
    for _ in range(3):
        time.sleep(2.0 - frozen_s)
        if frozen_s:
            os.kill(pids[-1], signal.SIGSTOP)
            time.sleep(frozen_s)
        os.kill(pids[-1], signal.SIGKILL)
        pids.append(_wait_for(lambda: (p := (_read(Path(str(out) + ".written")) or {}).get("pid")) != pids[-1] and p,
                              30))
    _, stderr = serving.communicate(timeout=120)
    assert serving.returncode == 0, stderr
    done = _read(Path(str(out) + ".done"))
    submitted = done["submitted"]
    for pid in pids:
        _wait_for(lambda: not _alive(pid), 30)  # (reaped by the serving process: no zombie)
    assert stderr.count("the telemetry process ended") == 3, stderr
    books = _books(receiver)
    assert books["distinct"] == submitted and books["dropped"] == 0, (books["distinct"], books["spans"], submitted)
    assert books["ends"] == set(done["times"])  # each op's own span
    assert books["bytes"] == submitted * BYTES
    assert len(books["starts"]) == 1, books["starts"]
    print(f"{submitted} ops; {books['spans']} spans arrived, {books['spans'] - submitted} of them twice")


def _ops(first: int, count: int) -> list[tuple]:
    from otel_hicache import record as rec

    now = time.time_ns()
    return [(rec.OP, seq, "offload", "direct", "other", None, 64, 1, ("kv",), (64,), BYTES, 64, None, None,
             "host_clock", None, now, now + 1000, 1000, None, None, now, None, False, None, (), 0)
            for seq in range(first, first + count)]


def _reader_gone(pipe: Any) -> bool:
    """No process reads the pipe any more (all its threads ended: a zombie's can still hold it)."""
    poll = select.poll()
    poll.register(pipe.fileno(), select.POLLOUT)
    return any(events & select.POLLERR for _, events in poll.poll(0))


@pytest.mark.parametrize("broken_pipe", [True, False], ids=["broken-pipe", "pipe-still-held"])
def test_a_successor_goes_on_from_the_checkpoint_with_every_frame_after_it(monkeypatch, receiver, broken_pipe):
    """At the channel: a telemetry process that reads nothing more (stopped), then is killed; its
    successor gets every op written since its last checkpoint, whether the pipe broke or its input
    is still held open elsewhere (as its exiting threads do for a moment: the end of its answers
    tells), and answers the flush. Every op arrives once by its ids; the counters go on."""
    from otel_hicache import configuration
    from otel_hicache.capture.channel import ProcessChannel

    for key, value in _env(receiver).items():
        if key.startswith("OTEL_"):
            monkeypatch.setenv(key, value)
    channel = ProcessChannel(configuration.hello({"tp_rank": 0}), 10_000, lambda: None)
    holder = None
    try:
        channel.write(_ops(0, 10), 10)
        assert channel.flush(30)  # read, and exported
        first = channel.process
        os.kill(first.pid, signal.SIGSTOP)
        for batch in range(7):
            channel.write(_ops(10 + 10 * batch, 10), 10)
            channel.send()
        holder = None if broken_pipe else open(  # pylint: disable=consider-using-with
            f"/proc/{first.pid}/fd/0", "rb", buffering=0)
        os.kill(first.pid, signal.SIGKILL)
        _wait_for(lambda: _reader_gone(first.stdin) or holder is not None and first.poll() is not None, 10)
        channel.write(_ops(80, 5), 5)
        assert channel.flush(30)
        assert channel.process.pid != first.pid
    finally:
        channel.stop(5)
        if holder is not None:
            holder.close()
    books = _books(receiver)
    assert (books["distinct"], books["bytes"], books["dropped"]) == (85, 85 * BYTES, 0), books


@pytest.mark.parametrize("command, why", [
    (["/nonexistent/python"], "cannot start it"),  # no such interpreter
    ([sys.executable, "-c", "pass"], "ended before it was ready"),  # one that is no telemetry process
])
def test_no_telemetry_process_means_embedded_sinks_at_once_warned_once(monkeypatch, receiver, warnings_log,
                                                                       command, why):
    """A telemetry process that cannot be started, or ends before it is ready: the sinks run embedded
    from then on, one warning, every op exported or counted, and the fallback visible as a series."""
    from otel_hicache import configuration
    from otel_hicache.capture import channel as channel_module

    for key, value in _env(receiver).items():
        if key.startswith("OTEL_"):
            monkeypatch.setenv(key, value)
    monkeypatch.setattr(channel_module, "telemetry_process_command", lambda: command)
    configuration._configured = None  # pylint: disable=protected-access
    import otel_hicache

    conf = otel_hicache.configure()
    assert conf.telemetry_process
    tel = otel_hicache.TransferTelemetry(attributes={"tp_rank": 0})
    try:
        for _ in range(50):
            now = time.time_ns()
            tel.submit("offload", {"kv": 64}, BYTES, page_size=64, expect_ack=False, host_start_ns=now - 1000,
                       host_end_ns=now)
        assert tel.force_flush(10)
    finally:
        tel.shutdown()
        configuration.shutdown(2.0)
    assert _books(receiver)["distinct"] == 50
    ours = [r.getMessage() for r in warnings_log.records if "telemetry process" in r.getMessage()]
    assert len(ours) == 1 and why in ours[0] and "the sinks run embedded" in ours[0], ours
    where = [attributes(p.attributes) for p in receiver.received.last_points("otel_hicache.sinks")]
    assert [a["location"] for a in where] == ["embedded_fallback"], where  # visible, not only in a log line
    _assert_static_in_resource(receiver)  # providers built for this TransferTelemetry alone, as there


def test_a_telemetry_process_that_keeps_dying_is_restarted_later_and_later(monkeypatch, receiver, warnings_log):
    """A telemetry process that ends as soon as it is ready, again and again: each death is warned,
    the next one starts after a growing delay (not a start per send), and the sinks never move
    into the serving process for it."""
    from otel_hicache import configuration
    from otel_hicache.capture import channel as channel_module

    for key, value in _env(receiver).items():
        if key.startswith("OTEL_"):
            monkeypatch.setenv(key, value)
    starts = []
    dies = "import os; n = int.from_bytes(os.read(0, 4), 'little'); os.read(0, n); os.write(1, b'hello\\n')"
    monkeypatch.setattr(channel_module, "telemetry_process_command",
                        lambda: starts.append(time.monotonic()) or [sys.executable, "-c", dies])
    configuration._configured = None  # pylint: disable=protected-access
    import otel_hicache

    otel_hicache.configure()
    tel = otel_hicache.TransferTelemetry(attributes={"tp_rank": 0})
    try:
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline:
            now = time.time_ns()
            tel.submit("offload", {"kv": 64}, BYTES, page_size=64, expect_ack=False, host_start_ns=now - 1000,
                       host_end_ns=now)
            time.sleep(0.01)
    finally:
        tel.shutdown()
        configuration.shutdown(1.0)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    # at once after the first death, then after 1 s and 2 s; 4 s more would be past the run (the last:
    # the shutdown's, for what waited)
    assert 4 <= len(starts) <= 5, gaps
    assert all(gap >= delay - 0.1 for gap, delay in zip(gaps[1:3], channel_module.RESTART_DELAYS_S[1:3])), gaps
    messages = [r.getMessage() for r in warnings_log.records]
    assert sum("the telemetry process ended" in m for m in messages) >= 2, messages
    assert not any("the sinks run embedded" in m for m in messages), messages
