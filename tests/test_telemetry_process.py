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
        tel.ack(tel.submit("offload", {"kv": 64}, %(bytes)d, 64, host_start_ns=now - 1000, host_end_ns=now))
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


def _dropped(receiver: HttpReceiver, reason: str) -> int:
    """The sum over every resource's last export of ``otel_hicache.records.dropped{reason}``."""
    last: dict[str, int] = {}
    with receiver.received.lock:
        requests = list(receiver.received.metrics)
    for request in requests:
        for rm in request.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    if m.name == "otel_hicache.records.dropped":
                        key = str(sorted(attributes(rm.resource.attributes).items())) + str(id(request))
                        last[key] = sum(p.as_int for p in m.sum.data_points
                                        if attributes(p.attributes)["reason"] == reason)
    return max(last.values(), default=0)


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


def test_a_telemetry_process_killed_mid_run_is_replaced_and_its_loss_counted(tmp_path, receiver):
    """The telemetry process stopped (SIGSTOP) for a second, then SIGKILLed, at 1,000 ops/s: the next
    write starts another, which counts what the dead one never read (telemetry_process_lost); the
    ops after it arrive; both processes end."""
    out = tmp_path / "serving"
    serving = subprocess.Popen([sys.executable, "-c", SERVING, str(out), "4"], env=_env(receiver),
                               stderr=subprocess.PIPE, text=True)
    first = _wait_for(lambda: (_read(Path(str(out) + ".written")) or {}).get("pid"), 60)
    time.sleep(0.5)
    os.kill(first, signal.SIGSTOP)  # it reads nothing more: what is written meanwhile waits in the pipe
    before = _read(Path(str(out) + ".written"))["written"]
    time.sleep(1.0)
    os.kill(first, signal.SIGKILL)
    killed_ns = time.time_ns()
    _, stderr = serving.communicate(timeout=120)
    assert serving.returncode == 0, stderr
    done = _read(Path(str(out) + ".done"))
    submitted = done["submitted"]
    second = _read(Path(str(out) + ".written"))["pid"]
    assert second != first and not _alive(first)  # reaped by the serving process: no zombie
    _wait_for(lambda: not _alive(second), 30)
    lost = _dropped(receiver, "telemetry_process_lost")
    spans = [s for _, s in receiver.received.spans() if s.name == "hicache.offload"]
    assert "the telemetry process ended" in stderr and "telemetry_process_lost" in stderr
    # about a second of ops waited in the pipe: each of them is counted, none of them arrived
    assert 800 <= lost <= 1300, (lost, before)
    assert len(spans) + lost <= submitted
    # the stream resumed: the second process exported every op submitted once the first was gone
    # (half a second after the kill; those before it that the first had read and not exported yet,
    # its span queue, are lost uncounted)
    arrived = {s.end_time_unix_nano for s in spans}
    late = [t for t in done["times"] if t > killed_ns + 500_000_000]
    assert len(late) > 1000 and not [t for t in late if t not in arrived], (len(spans), submitted, lost)


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
def test_the_loss_of_a_dead_telemetry_process_is_exactly_what_it_never_read(monkeypatch, receiver, broken_pipe):
    """At the channel: a telemetry process that reads nothing more (stopped), then is killed; of the
    ops written to it then, each is counted by its successor, and the later ones are exported by it.
    With its input still held open elsewhere (as its exiting threads do for a moment), no write
    fails: the end of its answers tells, the last ops are counted lost too, and the successor
    answers the flush."""
    from otel_hicache import configuration
    from otel_hicache.capture.channel import ProcessChannel

    for key, value in _env(receiver).items():
        if key.startswith("OTEL_"):
            monkeypatch.setenv(key, value)
    channel = ProcessChannel(configuration.hello({"tp_rank": 0}, None), 10_000, lambda: None)
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
    spans = len([s for _, s in receiver.received.spans()])
    lost = _dropped(receiver, "telemetry_process_lost")
    assert (spans, lost) == ((15, 70) if broken_pipe else (10, 75))  # (the first 10, and the last 5 or none)


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
            tel.submit("offload", {"kv": 64}, BYTES, 64, expect_ack=False, host_start_ns=now - 1000, host_end_ns=now)
        assert tel.force_flush(10)
    finally:
        tel.shutdown()
        configuration.shutdown(2.0)
    spans = len([s for _, s in receiver.received.spans() if s.name == "hicache.offload"])
    assert spans + _dropped(receiver, "telemetry_process_lost") == 50
    ours = [r.getMessage() for r in warnings_log.records if "telemetry process" in r.getMessage()]
    assert len(ours) == 1 and why in ours[0] and "the sinks run embedded" in ours[0], ours
    where = [attributes(p.attributes) for p in receiver.received.last_points("otel_hicache.sinks")]
    assert [a["location"] for a in where] == ["embedded_fallback"], where  # visible, not only in a log line


def test_a_telemetry_process_that_keeps_dying_gives_way_to_embedded_sinks(monkeypatch, receiver, warnings_log):
    """A telemetry process that ends soon after it is ready, three times: embedded from then on; what
    the dead ones were written and never read is counted as lost, the rest exported."""
    from otel_hicache import configuration
    from otel_hicache.capture import channel as channel_module

    for key, value in _env(receiver).items():
        if key.startswith("OTEL_"):
            monkeypatch.setenv(key, value)
    # ready (its hello answered), then it ends at the first byte after that
    # (unbuffered reads: it takes from the pipe only the hello, then one byte)
    dies = ("import os; n = int.from_bytes(os.read(0, 4), 'little'); os.read(0, n); "
            "os.write(1, b'hello\\n'); os.read(0, 1)")
    monkeypatch.setattr(channel_module, "telemetry_process_command", lambda: [sys.executable, "-c", dies])
    configuration._configured = None  # pylint: disable=protected-access
    import otel_hicache

    otel_hicache.configure()
    tel = otel_hicache.TransferTelemetry(attributes={"tp_rank": 0})
    try:
        for _ in range(20):
            for _ in range(20):
                now = time.time_ns()
                tel.submit("offload", {"kv": 64}, BYTES, 64, expect_ack=False, host_start_ns=now - 1000,
                           host_end_ns=now)
            tel._pipeline.flush(5)  # pylint: disable=protected-access  # written, and sent
            time.sleep(0.1)
        assert tel.force_flush(10)
    finally:
        tel.shutdown()
        configuration.shutdown(2.0)
    spans = len([s for _, s in receiver.received.spans() if s.name == "hicache.offload"])
    lost = _dropped(receiver, "telemetry_process_lost")
    assert spans + lost == 400 and spans > 0, (spans, lost)
    assert any("it ended 3 times" in r.getMessage() for r in warnings_log.records)


