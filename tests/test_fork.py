"""Per process: a forked child gets its own poller and exporters, not the parent's frozen data."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap

import pytest

from otel_hicache.capture import fork
SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import otel_hicache

    otel_hicache.configure()
    tel = otel_hicache.TransferTelemetry(attributes={"tp_rank": 0})

    def report(n, nbytes):
        for _ in range(n):
            tel.submit("offload", {"kv": 64}, nbytes, page_size=64, expect_ack=False, host_start_ns=0,
                       host_end_ns=1000)

    report(2, 1000)                       # the parent's own ops, before the fork
    assert tel.force_flush(5)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:                          # child: console exporters write to fd 1
        os.close(read_fd)
        out = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(out, 1)
        report(3, 7)
        tel.shutdown()
        otel_hicache.shutdown()
        sys.stdout.flush()
        os.write(write_fd, b"done")
        os._exit(0)
    os.close(write_fd)
    assert os.read(read_fd, 4) == b"done"
    os.waitpid(pid, 0)
    report(1, 1000)
    tel.shutdown()
    """
)


def _json_documents(text: str) -> list:
    decoder = json.JSONDecoder()
    docs, i = [], 0
    while i < len(text):
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            break
        doc, i = decoder.raw_decode(text, i)
        docs.append(doc)
    return docs


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork() is POSIX-only")
def test_forked_child_exports_only_its_own_ops(tmp_path):
    script = tmp_path / "app.py"
    script.write_text(SCRIPT)
    child_out = tmp_path / "child.txt"
    env = dict(os.environ, OTEL_TRACES_EXPORTER="console", OTEL_METRICS_EXPORTER="console",
               OTEL_METRIC_EXPORT_INTERVAL="600000", OTEL_HICACHE_POLL_INTERVAL_MS="1")
    done = subprocess.run([sys.executable, str(script), str(child_out)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    docs = _json_documents(child_out.read_text())
    spans = [d for d in docs if "name" in d and "context" in d]
    metrics = [d for d in docs if "resource_metrics" in d]
    assert [s["name"] for s in spans] == ["hicache.offload"] * 3
    assert {s["attributes"]["hicache.bytes"] for s in spans} == {7}
    assert metrics, child_out.read_text()[:2000]
    last = metrics[-1]
    values = {}
    for rm in last["resource_metrics"]:
        for sm in rm["scope_metrics"]:
            for m in sm["metrics"]:
                for p in m["data"]["data_points"]:
                    if m["name"] == "hicache.transfer.bytes":
                        values[p["attributes"]["hicache.direction"]] = p["value"]
    # the child's own 3 x 7 bytes: not the parent's 2 x 1000 carried over
    assert values == {"offload": 21, "onboard": 0}
    # the parent's spans went to its own stdout, with distinct trace ids
    parent_spans = [d for d in _json_documents(done.stdout) if "context" in d]
    assert len(parent_spans) == 3
    child_ids = {s["context"]["trace_id"] for s in spans}
    assert not child_ids & {s["context"]["trace_id"] for s in parent_spans}


# -- the registry: weak handles, dead ones dropped in the parent too ---------------------------------

class _Part:
    def after_fork(self) -> None:
        pass


def test_dead_handles_are_dropped_and_live_ones_kept():
    kept = [_Part() for _ in range(10)]
    for part in kept:
        fork.after_fork_in_child(part.after_fork)
    for _ in range(2000):  # short-lived parts: each gone before the next registers
        fork.after_fork_in_child(_Part().after_fork)
    gc.collect()
    alive = [handle() for handle in fork._callbacks if handle() is not None]
    assert all(any(a == part.after_fork for a in alive) for part in kept)
    assert len(fork._callbacks) < 2 * len(alive) + 64 + 1  # bounded by the live ones, not by 2,010


def test_a_forked_child_gets_its_own_span_id_key_and_counter_start():
    """Span ids come from (key, op seq): a child keeping its parent's key could give its ops the
    ids of the parent's; its counters start when it does."""
    from otel_hicache.capture.channel import ProcessChannel

    channel = ProcessChannel({"attributes": {}}, 10, lambda: None)
    parent = dict(channel._hello)  # pylint: disable=protected-access
    channel.forget_in_child()
    child = channel._hello  # pylint: disable=protected-access
    assert child["key"] != parent["key"] and child["start_ns"] >= parent["start_ns"]
