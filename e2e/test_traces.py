"""The spans in Jaeger equal the example workload's ground truth: one per op, its attributes, parent
and links; exemplars open the span they name."""
import json
import re
import time
from collections import Counter

import pytest
from helpers import DIRECTIONS, ROOT, SERVICE, SPAN_NAMES, refs, settle

pytestmark = pytest.mark.stack
TIERS = {"offload": ("L1", "L2"), "onboard": ("L2", "L1")}
# the attributes every transfer span carries, per docs/reference.md's table
ALWAYS = re.findall(r"^\| `(hicache\.[\w.]+)` \| [\w\[\]]+ \| always", (ROOT / "docs/reference.md").read_text(), re.M)


@pytest.fixture(scope="module")
def spans(jaeger, truth) -> dict[str, list[dict]]:
    """Each direction's transfer spans, once Jaeger has one per op (or after 90 s)."""
    return settle(lambda: {d: jaeger.spans(SERVICE, SPAN_NAMES[d]) for d in DIRECTIONS},
                  lambda got: all(len(got[d]) >= truth[d]["ops"] for d in DIRECTIONS), 90, every=2)


def problems(d: str, a: dict) -> list[str]:
    """What is wrong with one transfer span's attributes."""
    pools = json.loads(a.get("hicache.pool.tokens", "[]")) or [a.get("hicache.tokens")]
    return [what for what, bad in (
        ("documented attributes missing", not set(ALWAYS) <= set(a)), ("direction", a.get("hicache.direction") != d),
        ("tiers", (a.get("hicache.src_tier"), a.get("hicache.dst_tier")) != TIERS[d]),
        ("blocks", a.get("hicache.blocks") != -(-a.get("hicache.tokens", 0) // a.get("hicache.page_size", 1))),
        ("anchor pool", pools[0] != a.get("hicache.tokens")), ("tp_rank", str(a.get("tp_rank")) != "0"),
        ("timing_source", a.get("hicache.timing_source") not in ("device_event", "host_clock")),
        ("kind", a.get("span.kind", "internal") != "internal")) if bad]


def test_one_span_per_op_under_its_step_span(spans, truth):
    assert {d: len(spans[d]) for d in DIRECTIONS} == {d: truth[d]["ops"] for d in DIRECTIONS}
    both = spans["offload"] + spans["onboard"]
    assert len({s["traceID"] for s in both}) == len(both), "a trace holds several ops"
    assert Counter((s["service"], s["parent"]) for s in both) == {(SERVICE, "example.scheduler_step"): len(both)}


def test_attributes_sum_to_truth(spans, truth):
    assert len(ALWAYS) > 8, "no span attribute table in docs/reference.md"
    for d, t in ((d, truth[d]) for d in DIRECTIONS):
        assert [(s["spanID"], p) for s in spans[d] for p in problems(d, s["attrs"])] == []
        assert {k: sum(s["attrs"][f"hicache.{k}"] for s in spans[d]) for k in ("bytes", "blocks", "tokens")} == {
            "bytes": t["bytes"], "blocks": t["blocks"], "tokens": t["tokens"]["kv"]}


def test_links(spans, truth, jaeger):
    """A load-back links to the offloads that wrote its pages (one per residence); write-throughs and
    prefix hits to the example.request root each served."""
    offloads = {(s["traceID"], s["spanID"]) for s in spans["offload"]}
    links = {d: [[r for r in refs(s) if r not in offloads] for s in spans[d]] for d in DIRECTIONS}
    assert sum(r in offloads for s in spans["onboard"] for r in refs(s)) == truth["onboard"]["residence_count"]
    assert {d: sum(map(bool, links[d])) for d in DIRECTIONS} == {d: truth[d]["request_links"] for d in DIRECTIONS}
    requests = [jaeger.trace(tid).get(sid) or {} for tid, sid in {r for d in DIRECTIONS for rs in links[d] for r in rs}]
    assert Counter((r.get("operationName"), bool(r.get("references"))) for r in requests) == {
        ("example.request", False): len(requests)}


def test_exemplars_open_their_span(spans, prom, jaeger):
    data = prom.api("/api/v1/query_exemplars", start=time.time() - 3600, end=time.time() + 60,
                    query=f'hicache_transfer_duration_seconds_bucket{{service_name="{SERVICE}"}}')
    exemplars = [(s["seriesLabels"], e) for s in data for e in s["exemplars"]]
    assert exemplars and all({"trace_id", "span_id"} <= set(e["labels"]) for _, e in exemplars)
    for series, e in exemplars[:: max(1, len(exemplars) // 5)]:  # over buckets and series
        span = jaeger.trace(e["labels"]["trace_id"]).get(e["labels"]["span_id"]) or {}
        assert span.get("operationName") == SPAN_NAMES[series["hicache_direction"]], e
        # Jaeger keeps the duration in microseconds, the exemplar in seconds
        assert abs(float(e["value"]) * 1e6 - span["duration"]) <= 2 and float(e["value"]) <= float(series["le"])
