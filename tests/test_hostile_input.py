"""Hostile input against real OTLP receivers: one bad value never costs another op's data.

Each case runs a host process configured only by ``OTEL_*`` variables (spans at 100%,
exports to a receiver in this process, gRPC and HTTP/protobuf), submits valid ops around
one poison op, and asserts what a user needs: every valid op's span and counters arrive
exactly, metric exports go on after the poison op, nothing is raised into the host, and
the poison op is counted (``invalid_input``) and named in one warning, or reported with
what it got wrong said in the data.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from otlp_receiver import GrpcReceiver, HttpReceiver, attributes

pytestmark = pytest.mark.slow  # processes, receivers, seconds each: CI's later step (pytest -m slow)

PROTOCOLS = {"grpc": GrpcReceiver, "http/protobuf": HttpReceiver}
VALID_OPS, OP_BYTES, OP_TOKENS = 120, 1000, 10

HOST = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    import otel_hicache
    from otel_hicache import TransferTelemetry, configure
    class Event:  # a duck-typed timing event whose elapsed_time() is what the case says
        def __init__(self, ms): self.ms = ms
        def query(self): return True
        def elapsed_time(self, other): return self.ms

    POISON = {
        "uint64_underflow": dict(num_bytes=np.uint64(0) - np.uint64(1)),
        "bytes_2_63": dict(num_bytes=2**63),
        "tokens_2_64": dict(tokens_by_pool={"kv": 2**64}),
        "page_size_huge": dict(page_size=2**70),
        "host_start_float": dict(host_start_ns=1.7e18),
        "host_start_negative": dict(host_start_ns=-5),
        "host_start_huge": dict(host_start_ns=2**70),
        "host_end_float": dict(host_end_ns=float("nan")),
        "host_end_huge": dict(host_end_ns=2**64 + 3),
        "pool_surrogate": dict(tokens_by_pool={"kv\\ud800": 10}),
        "io_backend_surrogate": dict(io_backend="direct\\udcff"),
        # reported, with the bad part said or left out
        "elapsed_huge": dict(start_event=Event(1.9e12), finish_event=Event(1.9e12)),
        "elapsed_nan": dict(start_event=Event(float("nan")), finish_event=Event(float("nan"))),
        "attribute_huge_int": dict(attributes={"x.count": 2**64, "x.ok": 1}),
        "attribute_surrogate": dict(attributes={"x.name": "a\\ud800", "x.ok": 1}),
    }
    case = sys.argv[1]
    configure()
    tel = TransferTelemetry(attributes={"tp_rank": 0})
    tel.force_flush()  # the telemetry process is up: the metric exports counted below happen after this
    raised = []
    for i in range(%(ops)d):
        if i == %(ops)d // 2:
            try:
                tel.ack(tel.submit("offload", **{"tokens_by_pool": {"kv": %(tokens)d}, "num_bytes": %(bytes)d,
                                                **POISON[case]}))
            except BaseException as exc:  # must never happen
                raised.append(repr(exc))
            time.sleep(0.3)  # a metric export or two after the poison op, before the rest
        tel.ack(tel.submit("offload", tokens_by_pool={"kv": %(tokens)d}, num_bytes=%(bytes)d))
        time.sleep(0.002)
    time.sleep(0.3)
    print(json.dumps({"raised": raised}))
""") % {"ops": VALID_OPS, "tokens": OP_TOKENS, "bytes": OP_BYTES}

REJECTED = {  # case -> the field its one warning names
    "uint64_underflow": "num_bytes", "bytes_2_63": "num_bytes", "tokens_2_64": "tokens_by_pool",
    "page_size_huge": "page_size", "host_start_float": "host_start_ns", "host_start_negative": "host_start_ns",
    "host_start_huge": "host_start_ns", "host_end_float": "host_end_ns", "host_end_huge": "host_end_ns",
    "pool_surrogate": "tokens_by_pool keys", "io_backend_surrogate": "io_backend",
}
REPORTED = ("elapsed_huge", "elapsed_nan", "attribute_huge_int", "attribute_surrogate")


def _run(protocol: str, case: str) -> tuple[object, dict, str]:
    receiver = PROTOCOLS[protocol]()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.update(OTEL_SERVICE_NAME="hicache-hostile", OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
                   OTEL_EXPORTER_OTLP_PROTOCOL=protocol, OTEL_METRIC_EXPORT_INTERVAL="100",
                   OTEL_BSP_SCHEDULE_DELAY="100")
        done = subprocess.run([sys.executable, "-c", HOST, case], env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        return receiver.received, json.loads(done.stdout.strip().splitlines()[-1]), done.stderr
    finally:
        receiver.stop()


def _counter(received, name: str, **match: str) -> int:
    return sum(p.as_int for p in received.last_points(name)
               if all(attributes(p.attributes).get(k) == v for k, v in match.items()))


def _metric_requests_with(received, name: str) -> int:
    with received.lock:
        return sum(1 for req in received.metrics for rm in req.resource_metrics for sm in rm.scope_metrics
                   if any(m.name == name for m in sm.metrics))


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
@pytest.mark.parametrize("case", sorted(REJECTED) + list(REPORTED))
def test_one_poison_op_never_costs_the_others_their_data(protocol, case):
    received, result, stderr = _run(protocol, case)
    assert result["raised"] == []
    spans = [span for _, span in received.spans() if span.name == "hicache.offload"]
    reported = case in REPORTED
    assert len(spans) == VALID_OPS + reported  # not one span of a batch lost
    # counters exact, and exports went on after the poison op (several requests carried them)
    assert _counter(received, "hicache.transfer.bytes", **{"hicache.cause": "other"}) == \
        (VALID_OPS + reported) * OP_BYTES
    assert _counter(received, "hicache.transfer.tokens") == (VALID_OPS + reported) * OP_TOKENS
    assert _metric_requests_with(received, "hicache.transfer.bytes") >= 3
    invalid = _counter(received, "otel_hicache.records.dropped", reason="invalid_input")
    if reported:
        assert invalid == 0
        poison = [s for s in spans if len(attributes(s.attributes)) != len(attributes(spans[0].attributes))
                  or attributes(s.attributes)["hicache.timing_source"] == "host_clock"]
        if case.startswith("elapsed"):  # said in the data: the host clock timed it
            timed = [attributes(s.attributes)["hicache.timing_source"] for s in spans]
            assert timed.count("host_clock") == VALID_OPS + 1  # the valid ops have no events: host clock too
            assert "elapsed_time() returned" in stderr
        else:  # the bad attribute is left out, the good one kept
            marked = [attributes(s.attributes) for s in spans if "x.ok" in attributes(s.attributes)]
            assert len(marked) == 1 and not {"x.count", "x.name"} & set(marked[0]), poison
    else:
        assert invalid == 1
        warnings = [line for line in stderr.splitlines() if "dropped a transfer record" in line]
        assert len(warnings) == 1 and REJECTED[case] in warnings[0], stderr
        assert len(warnings[0]) < 400  # a short quote of the value, whatever its size


def test_spans_stay_encodable_when_events_place_an_op_beyond_the_wall_clock():
    """The anchor's own elapsed_time() returns nonsense: the op is placed where the worker
    saw it end, not at a time no exporter can encode."""
    from otel_hicache.capture.timing import WallClockAnchor
    from otel_hicache.capture.records import INT64_MAX, TransferRecord, validate
    from harness import submission
    from otel_hicache.capture.timing import resolve

    class Wild:
        def query(self):
            return True

        def elapsed_time(self, other):
            return 5.0 if isinstance(other, Wild) else float("inf")

    anchor = WallClockAnchor(lambda: Wild(), clock=lambda: 10**18)
    anchor.event, anchor.wall_ns = type("A", (), {"elapsed_time": lambda self, e: 1e15})(), 10**18
    record = TransferRecord(submission("offload", {"kv": 1}, 10, start_event=Wild(), finish_event=Wild(),
                                       submit_ns=10**18))
    validate(record)
    resolve(record, 10**18 + 5_000_000, anchor)
    assert 0 <= record.start_ns <= record.end_ns <= INT64_MAX
    assert record.placement == "host_completion" and record.duration_ns == 5_000_000


HUNG_HOST = textwrap.dedent("""
    import json, sys, threading, time
    from otel_hicache import TransferTelemetry, configure
    forever = threading.Event()
    class Hung:  # an event whose query() never returns
        def query(self): forever.wait(); return True

    configure()
    tel = TransferTelemetry(attributes={"tp_rank": 0})
    accepted = refused = 0
    hung = tel.submit("onboard", tokens_by_pool={"kv": 8}, num_bytes=64, finish_event=Hung())
    time.sleep(0.2)  # the worker takes it in and blocks on it
    for _ in range(%(submits)d):
        if tel.submit("onboard", tokens_by_pool={"kv": 8}, num_bytes=64) is None:
            refused += 1
        else:
            accepted += 1
    time.sleep(1.5)  # several metric exports
    print(json.dumps({"accepted": accepted + 1, "refused": refused}), flush=True)
""")


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_a_hung_event_costs_no_refused_submit_its_count(protocol):
    receiver = PROTOCOLS[protocol]()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.update(OTEL_SERVICE_NAME="hicache-hung", OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
                   OTEL_EXPORTER_OTLP_PROTOCOL=protocol, OTEL_METRIC_EXPORT_INTERVAL="200",
                   OTEL_HICACHE_MAX_QUEUE_SIZE="1000", OTEL_HICACHE_SHUTDOWN_TIMEOUT_S="1")
        done = subprocess.run([sys.executable, "-c", HUNG_HOST % {"submits": 5000}], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        result = json.loads(done.stdout.strip().splitlines()[-1])
        received = receiver.received
        assert result["refused"] > 0 and result["accepted"] + result["refused"] == 5001
        # the stuck transfer shows in the gauge (written at exit)
        with received.lock:
            ages = [p.as_double for req in received.metrics for rm in req.resource_metrics
                    for sm in rm.scope_metrics for m in sm.metrics if m.name == "hicache.transfer.oldest_inflight_age"
                    for p in m.gauge.data_points if attributes(p.attributes)["hicache.direction"] == "onboard"]
        assert max(ages) >= 1.0
        # every refused submit, and what the stuck worker held, counted at exit
        assert _counter(received, "otel_hicache.records.dropped", reason="queue_full") == result["refused"]
        assert _counter(received, "otel_hicache.records.dropped", reason="shutdown") == result["accepted"]
        assert "were not reported" in done.stderr
    finally:
        receiver.stop()
