"""The real Collector (tests/collector_process.py) before the test's OTLP receiver: killed and
restarted mid-run; TLS with its certificate and a wrong one."""
import time

import pytest
from collector_process import Collector
from helpers import settle
from otlp_receiver import HttpReceiver, make_certificates
from paced_runs import EXPORT_FAILED_LOG, QUEUE_FULL_LOG, final_counters, otlp_env, quantile, run_workload

pytestmark = [pytest.mark.faults, pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])]


@pytest.fixture
def sink():
    receiver = HttpReceiver()
    yield receiver
    receiver.stop()


def env(protocol: str, collector: Collector, **extra: str) -> dict[str, str]:
    return otlp_env("hicache-collector-faults", protocol, collector.endpoint(protocol),
                    OTEL_HICACHE_SHUTDOWN_TIMEOUT_S="5", **extra)


def op_ids(sink: HttpReceiver) -> set[int]:
    return {kv.value.int_value for _, s in sink.received.spans() for kv in s.attributes if kv.key == "workload.op"}


def test_collector_killed_and_restarted(protocol, sink, tmp_path):
    collector, times = Collector(tmp_path, sink.endpoint), {}
    collector.start()

    def outage(process, _t0):  # once spans flow, 3 s without the Collector
        settle(lambda: len(op_ids(sink)) >= 300 or process.poll() is not None, bool, 30)
        times["kill"] = collector.kill()
        settle(lambda: time.time() - times["kill"] >= 3.0, bool, 5)
        times["ready"] = collector.start()

    try:
        run = run_workload(tmp_path, env(protocol, collector, OTEL_EXPORTER_OTLP_TIMEOUT="2"),
                           "--rate", "200", "--seconds", "10", during=outage)
        truth = run.result["truth"]
        counters = settle(lambda: final_counters(sink.received.metrics), lambda got: got == truth, 20)
    finally:
        collector.stop()
    kill_ms, ready_ms = ((times[k] - run.result["start_unix_ns"] / 1e9) * 1e3 for k in ("kill", "ready"))
    assert 500 < kill_ms < ready_ms < run.result["elapsed_s"] * 1e3 - 2000, (kill_ms, ready_ms)
    assert counters == truth, collector.log()  # metrics resumed, cumulative counters exact
    # after the restart, from the first span that arrives none is missing
    arrived, submit_ms = op_ids(sink), run.result["submit"]["ms"]
    after = [i for i, t in enumerate(submit_ms) if t >= ready_ms]
    first = next(i for i in after if i in arrived)
    assert [i for i in after if i >= first and i not in arrived] == []
    # every span delivered, or counted lost by the SDK, which said so
    counts = {k: run.spans(k) for k in ("exported", "export_failed", "queue_full", "queued", "in_export")}
    assert counts["queued"] == counts["in_export"] == 0 and len(arrived) <= counts["exported"], counts
    assert counts["exported"] + counts["export_failed"] + counts["queue_full"] == run.result["ops"], counts
    lost = counts["export_failed"] + counts["queue_full"]
    assert not lost or EXPORT_FAILED_LOG in run.stderr or QUEUE_FULL_LOG in run.stderr
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    # submit() costs what it did before (second worst: one preemption is not its cost)
    before, during = run.costs_ns(0, kill_ms), run.costs_ns(kill_ms, ready_ms + 2000)
    assert quantile(during, 0.99) <= 3 * quantile(before, 0.99) + 20_000
    assert during[-2] <= 5 * before[-1] + 2_000_000


def test_tls_to_the_collector(protocol, sink, tmp_path):
    tls = make_certificates(tmp_path)
    collector = Collector(tmp_path, sink.endpoint, tls=tls)
    collector.start()
    try:
        run = run_workload(tmp_path, env(protocol, collector, OTEL_EXPORTER_OTLP_CERTIFICATE=tls["ca"],
                                         OTEL_EXPORTER_OTLP_HEADERS="x-tenant=a"), "--rate", "200", "--seconds", "1.5")
        truth = run.result["truth"]
        assert settle(lambda: final_counters(sink.received.metrics), lambda got: got == truth, 20) == truth
        ops = run.result["ops"]
        assert settle(lambda: len(op_ids(sink)), lambda n: n == ops, 20) == run.spans("exported") == ops
        assert EXPORT_FAILED_LOG not in run.stderr
        wrong = run_workload(tmp_path, env(protocol, collector, OTEL_EXPORTER_OTLP_CERTIFICATE=tls["wrong_ca"],
                                           OTEL_EXPORTER_OTLP_TIMEOUT="1", OTEL_SERVICE_NAME="wrong-certificate"),
                             "--rate", "200", "--seconds", "2", "--no-provider-flush", "--exit-without-shutdown")
    finally:
        collector.stop()
    # a wrong certificate fails visibly: nothing delivered, failures counted and logged
    assert "wrong-certificate" not in {kv.value.string_value for r, _ in sink.received.spans() for kv in r.attributes}
    assert wrong.spans("exported") == 0 < wrong.spans("export_failed")
    assert EXPORT_FAILED_LOG in wrong.stderr, wrong.stderr[-3000:]
