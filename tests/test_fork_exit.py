"""Forked children that exit at once, against the real OTLP receivers.

A child forked from a process with a ``TransferTelemetry`` submits 100 ops and ends right away:
``sys.exit(0)``, ``os._exit(0)`` after an explicit flush, or a ``multiprocessing`` fork child
whose target returns. Its spans and counters must all reach the collector under its own
resource, its exit must stay bounded, and no child may hang, also while other threads of the
parent submit (or, with providers the caller built, export) at the instant of the fork.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from typing import Any

import pytest

from otlp_receiver import GrpcReceiver, HttpReceiver, attributes

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not hasattr(os, "fork"), reason="fork() is POSIX-only")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPS = 100
BYTES = 7  # per child op; the parent's own ops carry 1 byte
EXIT_BOUND_S = 10.0  # a generous bound on one child's exit (from its last submit to its end)
PROTOCOLS = {"grpc": GrpcReceiver, "http/protobuf": HttpReceiver}

SCRIPT = textwrap.dedent(
    """
    import faulthandler, json, multiprocessing, os, sys, threading, time
    import otel_hicache

    ENDING, CHILDREN, BUSY, OPS, HANG_S = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \\
        float(sys.argv[5])
    CALLER_PROVIDERS = os.environ.get("CALLER_PROVIDERS") == "1"

    CHILD_PROVIDERS = os.environ.get("CHILD_PROVIDERS") == "1"

    def caller_providers(attributes=None, on_exit=True):
        # what an application builds itself: the SDK's providers with OTLP exporters, exporting often.
        # Those a child inherits must not be shut down by the SDK's exit hook there (a lock their
        # export thread held at the fork stays held in the child): on_exit=False for the parent's
        # when the children build their own, as docs/configuration.md says.
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from otel_hicache.sinks import providers
        resource = Resource.create(attributes)
        tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=on_exit)
        for exporter in providers.exporters("traces"):
            tracer_provider.add_span_processor(BatchSpanProcessor(exporter))
        readers = [PeriodicExportingMetricReader(e, export_interval_millis=10)
                   for e in providers.exporters("metrics")]
        return tracer_provider, MeterProvider(metric_readers=readers, resource=resource, shutdown_on_exit=on_exit)

    if CALLER_PROVIDERS:
        tracer_provider, meter_provider = caller_providers(on_exit=not CHILD_PROVIDERS)
        tel = otel_hicache.TransferTelemetry(tracer_provider=tracer_provider, meter_provider=meter_provider)
    else:
        otel_hicache.configure()
        tel = otel_hicache.TransferTelemetry()

    def submit(n, nbytes):
        for _ in range(n):
            assert tel.submit("offload", {"kv": 64}, nbytes, page_size=64, expect_ack=False, host_start_ns=0,
                              host_end_ns=1000) is not None

    def child_ops(write_fd):
        submit(OPS, 7)
        os.write(write_fd, b"x")  # its last submit: the parent times the exit from here

    def in_child(write_fd):
        global tel
        faulthandler.dump_traceback_later(HANG_S, exit=True)  # a hang: its stacks, and exit code 1
        if CHILD_PROVIDERS:  # what the docs say to do with providers of one's own: build them after fork
            tracer_provider, meter_provider = caller_providers({"child": "own"})
            tel = otel_hicache.TransferTelemetry(tracer_provider=tracer_provider, meter_provider=meter_provider)
        child_ops(write_fd)
        if ENDING == "flush":
            tel.force_flush(10)
            os._exit(0)
        sys.exit(0)

    stop = threading.Event()

    def busy():
        while not stop.is_set():
            submit(1, 1)
            time.sleep(0.001)

    threads = [threading.Thread(target=busy) for _ in range(BUSY)]
    for t in threads:
        t.start()
    if BUSY:
        time.sleep(0.2)
    exits = {}
    for _ in range(CHILDREN):
        read_fd, write_fd = os.pipe()
        if ENDING == "multiprocessing":
            process = multiprocessing.get_context("fork").Process(target=child_ops, args=(write_fd,))
            process.start()
            pid = process.pid
        else:
            pid = os.fork()
            if pid == 0:
                os.close(read_fd)
                in_child(write_fd)
        os.close(write_fd)
        os.read(read_fd, 1)
        started = time.monotonic()
        if ENDING == "multiprocessing":
            process.join(HANG_S)
            code = process.exitcode
            if code is None:
                process.kill()
                process.join()
        else:
            code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        exits[pid] = dict(code=code, exit_s=time.monotonic() - started)
        os.close(read_fd)
    stop.set()
    for t in threads:
        t.join()
    print(json.dumps(exits))
    tel.shutdown()
    """
)


def _run(tmp_path: Any, receiver: Any, protocol: str, ending: str, children: int, busy: int = 0,
         caller_providers: bool = False, child_providers: bool = False,
         hang_s: float = 2 * EXIT_BOUND_S) -> dict[int, dict]:
    script = tmp_path / "app.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint, OTEL_EXPORTER_OTLP_PROTOCOL=protocol,
               OTEL_EXPERIMENTAL_RESOURCE_DETECTORS="otel,process",  # process.pid: whose data it is
               OTEL_METRIC_EXPORT_INTERVAL="600000",  # configure()'s: only flushes and exits export
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    if caller_providers:
        env["CALLER_PROVIDERS"] = "1"
    if child_providers:
        env["CHILD_PROVIDERS"] = "1"
    done = subprocess.run([sys.executable, str(script), ending, str(children), str(busy), str(OPS), str(hang_s)],
                          env=env, capture_output=True, text=True, timeout=120 + children * hang_s)
    assert done.returncode == 0, done.stdout + done.stderr[-8000:]
    exits = {int(pid): result for pid, result in json.loads(done.stdout.splitlines()[-1]).items()}
    print(f"\n{ending}, {children} children, {busy} busy parent threads: exit s "
          f"{sorted(round(e['exit_s'], 3) for e in exits.values())}")
    hung = {pid: e for pid, e in exits.items() if e["code"] != 0}
    assert not hung, (hung, done.stderr[-8000:])
    return exits


def _by_pid(received: Any, **resource_attributes: str) -> tuple[Counter, dict[int, tuple[int, int]]]:
    """Child spans (7 bytes) per ``process.pid``; per pid, the op count and the bytes of the
    last metric export it sent (cumulative); only resources with ``resource_attributes``."""
    def wanted(resource: Any) -> bool:
        return resource_attributes.items() <= attributes(resource.attributes).items()

    spans: Counter = Counter()
    for resource, span in received.spans():
        if attributes(span.attributes)["hicache.bytes"] == BYTES and wanted(resource):
            spans[attributes(resource.attributes).get("process.pid")] += 1
    last: dict[int, tuple[int, int]] = {}
    with received.lock:
        requests = list(received.metrics)
    for request in requests:
        for rm in request.resource_metrics:
            if not wanted(rm.resource):
                continue
            pid = attributes(rm.resource.attributes).get("process.pid")
            values = {}
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    if m.name == "hicache.transfer.duration":
                        values["ops"] = sum(p.count for p in m.histogram.data_points)
                    elif m.name == "hicache.transfer.bytes":
                        values["bytes"] = sum(p.as_int for p in m.sum.data_points)
            if "ops" in values:
                last[pid] = (values["ops"], values.get("bytes"))
    return spans, last


@pytest.fixture(params=sorted(PROTOCOLS))
def protocol(request: Any) -> Any:
    return request.param


@pytest.fixture
def receiver(protocol: str) -> Any:
    made = PROTOCOLS[protocol]()
    yield made
    made.stop()


@pytest.mark.parametrize("ending", ["exit", "flush", "multiprocessing"])
def test_a_child_that_exits_at_once_delivers_every_op(tmp_path, receiver, protocol, ending):
    """100 submits, then sys.exit(0) / os._exit(0) after force_flush / a multiprocessing target
    returning: exactly 100 spans and counters of 100 ops (700 bytes) under the child's pid."""
    exits = _run(tmp_path, receiver, protocol, ending, children=1)
    spans, last = _by_pid(receiver.received)
    (pid,) = exits
    assert spans == {pid: OPS}, (spans, last)
    assert last.get(pid) == (OPS, OPS * BYTES), last
    assert exits[pid]["exit_s"] < EXIT_BOUND_S


def test_children_forked_beside_busy_threads_deliver_every_op(tmp_path, receiver, protocol):
    """Four parent threads submit in a loop while the parent forks 12 children, one after
    another, each exiting with sys.exit(0) right after its 100 submits: every child's ops
    arrive under its own pid, the parent's never under a child's, and each exit is bounded."""
    exits = _run(tmp_path, receiver, protocol, "exit", children=12, busy=4)
    spans, last = _by_pid(receiver.received)
    assert {pid: spans.get(pid) for pid in exits} == dict.fromkeys(exits, OPS), spans
    assert {pid: last.get(pid) for pid in exits} == dict.fromkeys(exits, (OPS, OPS * BYTES)), last
    assert all(e["exit_s"] < EXIT_BOUND_S for e in exits.values()), exits


def test_children_that_build_their_own_providers_deliver_every_op(tmp_path):
    """What the docs say to do with providers of one's own and fork: each child builds its providers
    (and a TransferTelemetry on them) after the fork. Beside the parent's busy threads and its own
    providers exporting every 10 ms, each child's 100 ops arrive exactly, under its own resource."""
    receiver = HttpReceiver()
    try:
        exits = _run(tmp_path, receiver, "http/protobuf", "exit", children=10, busy=4, caller_providers=True,
                     child_providers=True, hang_s=EXIT_BOUND_S)
        spans, last = _by_pid(receiver.received, child="own")
    finally:
        receiver.stop()
    assert {pid: spans.get(pid) for pid in exits} == dict.fromkeys(exits, OPS), spans
    assert {pid: last.get(pid) for pid in exits} == dict.fromkeys(exits, (OPS, OPS * BYTES)), last
    assert all(e["exit_s"] < EXIT_BOUND_S for e in exits.values()), exits
