"""The spans in Jaeger (its UI's API) equal the workloads' ground truth (conftest.truth): one per op,
with the documented attributes, parent and links; exemplars open the very span they name."""
from __future__ import annotations

import json
import re
import time
from collections import Counter

import pytest
from helpers import DIRECTIONS, ROOT, SERVICES, SPAN_NAMES, refs, settle

pytestmark = pytest.mark.stack
TIERS = {"offload": ("L1", "L2"), "onboard": ("L2", "L1")}
# the span attributes docs/reference.md's table says every transfer span carries
ALWAYS = re.findall(r"^\| `(hicache\.[\w.]+)` \| [\w\[\]]+ \| always", (ROOT / "docs/reference.md").read_text(), re.M)


def spans_of(jaeger, service: str, ops: dict[str, int]) -> dict[str, list[dict]]:
    """Each direction's transfer spans, once Jaeger has ops[direction] of them (or 90 s)."""
    return settle(lambda: {d: jaeger.spans(service, SPAN_NAMES[d]) for d in DIRECTIONS},
                  lambda got: all(len(got[d]) >= ops[d] for d in DIRECTIONS), 90, every=2)


@pytest.fixture(scope="module")
def example(jaeger, truth) -> dict[str, list[dict]]:
    return spans_of(jaeger, SERVICES["example"], {d: truth["example"][d]["ops"] for d in DIRECTIONS})


@pytest.fixture(scope="module")
def sglang(jaeger, truth) -> dict[str, list[dict]]:
    s = truth["sglang"]
    return spans_of(jaeger, SERVICES["sglang"], {d: s["merged"][d]["ops"] + s["direct"][d]["ops"] for d in DIRECTIONS})


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


def test_one_span_per_op_under_its_step_span(example, truth):
    assert {d: len(example[d]) for d in DIRECTIONS} == {d: truth["example"][d]["ops"] for d in DIRECTIONS}
    spans = example["offload"] + example["onboard"]
    assert len({s["traceID"] for s in spans}) == len(spans), "a trace holds several ops"
    assert Counter((s["service"], s["parent"]) for s in spans) == {(SERVICES["example"], "example.scheduler_step"): len(spans)}


def test_example_attributes_sum_to_truth(example, truth):
    for d, t in ((d, truth["example"][d]) for d in DIRECTIONS):
        assert [(s["spanID"], p) for s in example[d] for p in problems(d, s["attrs"])] == []
        assert {k: sum(s["attrs"][f"hicache.{k}"] for s in example[d]) for k in ("bytes", "blocks", "tokens")} == {
            "bytes": t["bytes"], "blocks": t["blocks"], "tokens": t["tokens"]["kv"]}


def test_example_links(example, truth, jaeger):
    """A load-back links to the offload spans that wrote its pages (one per residence value);
    write-throughs and prefix hits link to the example.request span each served, a root."""
    offloads = {(s["traceID"], s["spanID"]) for s in example["offload"]}
    links = {d: [[r for r in refs(s) if r not in offloads] for s in example[d]] for d in DIRECTIONS}
    assert sum(r in offloads for s in example["onboard"] for r in refs(s)) == truth["example"]["onboard"]["residence_count"]
    assert {d: sum(map(bool, links[d])) for d in DIRECTIONS} == {d: truth["example"][d]["request_links"] for d in DIRECTIONS}
    requests = [jaeger.trace(tid).get(sid) or {} for tid, sid in {r for d in DIRECTIONS for rs in links[d] for r in rs}]
    assert Counter((r.get("operationName"), bool(r.get("references"))) for r in requests) == {
        ("example.request", False): len(requests)}


def test_sglang_spans_by_origin_sum_to_truth(sglang, truth):
    s = truth["sglang"]
    assert Counter((d, x["attrs"].get("hicache.origin")) for d in DIRECTIONS for x in sglang[d]) == {
        **{(d, "merged_op"): s["merged"][d]["ops"] for d in DIRECTIONS}, **{(d, "direct"): s["direct"][d]["ops"] for d in DIRECTIONS}}
    for d in DIRECTIONS:
        assert [(x["spanID"], p) for x in sglang[d] for p in problems(d, x["attrs"]) + ["ranks"] * (
            not {"tp_rank", "pp_rank", "dp_rank"} <= set(x["attrs"]))] == []
        merged = [x["attrs"] for x in sglang[d] if x["attrs"]["hicache.origin"] == "merged_op"]
        assert [sum(a[f"hicache.{k}"] for a in merged) for k in ("bytes", "tokens")] == [s["merged"][d]["bytes"],
                                                                                      s["merged"][d]["tokens"]]


def test_sglang_transfers_link_to_their_requests(sglang, truth, jaeger):
    """docs/sglang.md "Links to requests" as a user follows them in Jaeger: a tag search for a
    request's trace id finds its one transfer, whose link opens SGLang's own request span."""
    assert len(truth["sglang"]["requests"]) == 4
    for want in truth["sglang"]["requests"]:
        found = jaeger.spans(SERVICES["sglang"], tags=json.dumps({"hicache.request.trace_id": want["trace_id"]}))
        assert [s["attrs"]["hicache.cause"] for s in found] == [want["cause"]], want
        assert (want["trace_id"], want["span_id"]) in refs(found[0])
        root = jaeger.trace(want["trace_id"]).get(want["span_id"]) or {}
        assert root.get("service") == truth["sglang"]["request_service"], want


def test_exemplars_open_their_span(example, prom, jaeger):
    data = prom.api("/api/v1/query_exemplars", start=time.time() - 3600, end=time.time() + 60,
                    query=f'hicache_transfer_duration_seconds_bucket{{service_name="{SERVICES["example"]}"}}')
    exemplars = [(s["seriesLabels"], e) for s in data for e in s["exemplars"]]
    assert exemplars and all(re.fullmatch(r"[0-9a-f]{32}", e["labels"].get("trace_id", ""))
                             and re.fullmatch(r"[0-9a-f]{16}", e["labels"].get("span_id", "")) for _, e in exemplars)
    for series, e in exemplars[:: max(1, len(exemplars) // 5)]:  # spread over buckets and series
        span = jaeger.trace(e["labels"]["trace_id"]).get(e["labels"]["span_id"]) or {}
        assert span.get("operationName") == SPAN_NAMES[series["hicache_direction"]], e
        # Jaeger keeps the span's duration in microseconds, the exemplar the op's in seconds
        assert abs(float(e["value"]) * 1e6 - span["duration"]) <= 2 and float(e["value"]) <= float(series["le"])
