"""Two spawned scheduler-like processes of one TP=2 server with attention DP (a plain TP=2 server
is the real server's case tp2 in e2e/), each publishing its ranks through SGLang's runtime context as its scheduler does: each process's
resource carries its own rank labels (not each span and point), per-rank counters are exact,
nothing is summed."""

from __future__ import annotations

import multiprocessing
from typing import Any

import pytest
from otlp_receiver import GrpcReceiver, attributes

pytestmark = pytest.mark.slow  # processes, receivers, seconds each: CI's later step (pytest -m slow)

SPAWN_TIMEOUT_S = 180
TOKENS = {0: 12, 1: 16}  # per tp_rank: a sum over ranks (28) matches neither


RANKS = {"tp_rank", "pp_rank", "dp_rank", "attn_cp_rank"}


def _last_points(received: Any, name: str) -> list[tuple[dict[str, Any], Any]]:
    """``(labels, value)`` of metric ``name``'s points from each process's last export that had it
    (cumulative), the labels as Prometheus gets them: resource and point attributes; the
    receiver's ``last_points`` keeps one request, of whichever process exported last."""
    seen: dict[str, list[Any]] = {}
    with received.lock:
        for request in reversed(received.metrics):
            for rm in request.resource_metrics:
                resource = attributes(rm.resource.attributes)
                points = [p for sm in rm.scope_metrics for m in sm.metrics if m.name == name
                          for p in (m.sum.data_points if m.HasField("sum") else m.histogram.data_points)]
                if points and resource["service.instance.id"] not in seen:
                    assert RANKS <= set(resource) and not any(RANKS & set(attributes(p.attributes)) for p in points)
                    seen[resource["service.instance.id"]] = [
                        ({**resource, **attributes(p.attributes)}, getattr(p, p.WhichOneof("value"))) for p in points]
    return [p for points in seen.values() for p in points]


def _spawn_ranks(dp_attention: bool) -> list[dict[str, Any]]:
    import sglang_child

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    children = [ctx.Process(target=sglang_child.scheduler_rank, args=(results, rank, dp_attention, TOKENS[rank]))
                for rank in TOKENS]
    for child in children:
        child.start()
    try:
        reports = sglang_child.collect(results, children, SPAWN_TIMEOUT_S)
    finally:
        for child in children:
            child.join(SPAWN_TIMEOUT_S)
    assert [child.exitcode for child in children] == [0, 0]
    return sorted(reports, key=lambda r: r["tp_rank"])


# Plain TP=2 runs on the real server in CI (e2e/test_real_server.py, case tp2); attention DP here.
def test_each_rank_reports_its_own_labels_and_exact_counts_under_attention_dp(monkeypatch):
    receiver = GrpcReceiver()
    try:
        monkeypatch.setenv("OTEL_SERVICE_NAME", "sglang")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
        monkeypatch.setenv("SGLANG_PLUGINS", "otel_hicache")
        reports = _spawn_ranks(dp_attention=True)
        # SGLang's labels for its own series (radix_cache_metric_labels): under attention DP,
        # tp_rank is the attention-TP rank and dp_rank the attention-DP rank
        want = {r["tp_rank"]: {"tp_rank": 0, "dp_rank": r["tp_rank"]} for r in reports}
        assert [r["published"]["attn_dp_rank"] for r in reports] == [0, 1]
        received = receiver.received
        spans = received.spans()
        assert len(spans) == 4  # one write-through and one load-back per rank
        instances = {}
        for resource, span in spans:
            res = attributes(resource.attributes)
            assert RANKS <= set(res) and not RANKS & set(attributes(span.attributes))
            a = {**res, **attributes(span.attributes)}
            rank = next(r for r, labels in want.items()
                        if all(a[k] == v for k, v in labels.items()) and a["hicache.tokens"] == TOKENS[r])
            instances.setdefault(rank, set()).add(res["service.instance.id"])
        assert sorted(instances) == [0, 1] and all(len(v) == 1 for v in instances.values())
        assert instances[0] != instances[1]  # one process per rank, told apart
        # every metric point's resource has the rank labels; per rank, the counters are that rank's own
        points = _last_points(received, "hicache.transfer.tokens")
        assert points
        for rank, labels in want.items():
            got = {}
            for a, value in points:
                if all(a[k] == v for k, v in labels.items()) and a["hicache.pool"] == "kv":
                    key = a["hicache.direction"]
                    got[key] = got.get(key, 0) + value
            report = reports[rank]
            assert got == {"offload": report["offload_tokens"], "onboard": report["onboard_tokens"]} == {
                "offload": TOKENS[rank], "onboard": TOKENS[rank]}, (rank, got)
        by_rank_bytes = {}
        for a, value in _last_points(received, "hicache.transfer.bytes"):
            if a["hicache.direction"] == "offload":
                key = (a["tp_rank"], a["dp_rank"])
                by_rank_bytes[key] = by_rank_bytes.get(key, 0) + value
        assert {k: v for k, v in by_rank_bytes.items() if v} == {
            (want[r["tp_rank"]]["tp_rank"], want[r["tp_rank"]]["dp_rank"]): r["offload_bytes"] for r in reports}
    finally:
        receiver.stop()
