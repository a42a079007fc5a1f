"""The spans in Jaeger, read through the API its UI uses, equal the workloads' ground truth
(e2e/conftest.py): one span per op with the documented attributes, its parent and links, and
the exemplars of Prometheus' duration histogram open the very span they name."""
from __future__ import annotations

import json
import re
import time
from collections import Counter

import pytest
from helpers import DIRECTIONS, ROOT, SERVICES, SPAN_NAMES, refs, settle

pytestmark = pytest.mark.stack
TIERS = {"offload": ("L1", "L2"), "onboard": ("L2", "L1")}
RANKS = ("tp_rank", "pp_rank", "dp_rank")
# the rows of docs/reference.md's span attribute table that every transfer span carries
ALWAYS = re.findall(r"^\| `(hicache\.[\w.]+)` \| [\w\[\]]+ \| always", (ROOT / "docs/reference.md").read_text(), re.M)


def spans_of(jaeger, service: str, want: dict[str, int]) -> dict[str, list[dict]]:
    """Each direction's transfer spans, waited for until Jaeger has want[direction] of them."""
    fetch = lambda: {d: jaeger.spans(service, SPAN_NAMES[d]) for d in DIRECTIONS}  # noqa: E731
    return settle(fetch, lambda got: all(len(got[d]) >= want[d] for d in DIRECTIONS), 90, every=2)


@pytest.fixture(scope="module")
def example(jaeger, truth) -> dict[str, list[dict]]:
    return spans_of(jaeger, SERVICES["example"], {d: truth["example"][d]["ops"] for d in DIRECTIONS})


@pytest.fixture(scope="module")
def sglang(jaeger, truth) -> dict[str, list[dict]]:
    s = truth["sglang"]
    return spans_of(jaeger, SERVICES["sglang"], {d: s["merged"][d]["ops"] + s["direct"][d]["ops"] for d in DIRECTIONS})


def problems(d: str, a: dict) -> list[str]:
    """What is inconsistent in one transfer span's attributes."""
    return [what for what, bad in (
        ("documented attributes missing", not set(ALWAYS) <= set(a)),
        ("direction", a.get("hicache.direction") != d),
        ("tiers", (a.get("hicache.src_tier"), a.get("hicache.dst_tier")) != TIERS[d]),
        ("blocks != ceil(tokens/page_size)", a.get("hicache.blocks") != -(-a.get("hicache.tokens", 0) // a.get("hicache.page_size", 1))),
        ("anchor pool tokens", (json.loads(a.get("hicache.pool.tokens", "[]")) or [a.get("hicache.tokens")])[0]
         != a.get("hicache.tokens")),
        ("timing_source", a.get("hicache.timing_source") not in ("device_event", "host_clock")),
        ("tp_rank", str(a.get("tp_rank")) != "0"),
        ("kind", a.get("span.kind", "internal") != "internal"),
    ) if bad]


def test_one_span_per_op_under_its_step_span(example, truth):
    t = truth["example"]
    assert {d: len(example[d]) for d in DIRECTIONS} == {d: t[d]["ops"] for d in DIRECTIONS}
    spans = example["offload"] + example["onboard"]
    assert len({s["traceID"] for s in spans}) == len(spans), "a trace holds several ops"
    assert {s["service"] for s in spans} == {SERVICES["example"]}
    assert Counter(s["parent"] for s in spans) == {"example.scheduler_step": len(spans)}


def test_example_attributes_sum_to_truth(example, truth):
    for d in DIRECTIONS:
        assert [(s["spanID"], p) for s in example[d] for p in problems(d, s["attrs"])] == []
        sums = {k: sum(s["attrs"][f"hicache.{k}"] for s in example[d]) for k in ("bytes", "blocks", "tokens")}
        t = truth["example"][d]
        assert sums == {"bytes": t["bytes"], "blocks": t["blocks"], "tokens": t["tokens"]["kv"]}


def test_example_links(example, truth, jaeger):
    """A load-back links to the offload spans that wrote its pages (one per residence value);
    write-throughs and prefix hits link to the example.request span each served, a root."""
    offloads = {(s["traceID"], s["spanID"]) for s in example["offload"]}
    links = {d: [r for s in example[d] for r in refs(s)] for d in DIRECTIONS}
    assert len([r for r in links["onboard"] if r in offloads]) == truth["example"]["onboard"]["residence_count"]
    to_requests = {d: [r for r in links[d] if r not in offloads] for d in DIRECTIONS}
    with_request = {d: sum(any(r not in offloads for r in refs(s)) for s in example[d]) for d in DIRECTIONS}
    assert with_request == {d: truth["example"][d]["request_links"] for d in DIRECTIONS}
    targets = [jaeger.trace(tid).get(sid) for tid, sid in {r for d in DIRECTIONS for r in to_requests[d]}]
    assert [(t or {}).get("operationName") for t in targets if not t or t["references"]
            or t["operationName"] != "example.request"] == []


def test_sglang_spans_by_origin_sum_to_truth(sglang, truth):
    s = truth["sglang"]
    origins = Counter((d, x["attrs"].get("hicache.origin")) for d in DIRECTIONS for x in sglang[d])
    assert origins == {**{(d, "merged_op"): s["merged"][d]["ops"] for d in DIRECTIONS},
                       **{(d, "direct"): s["direct"][d]["ops"] for d in DIRECTIONS}}
    for d in DIRECTIONS:
        assert [(x["spanID"], p) for x in sglang[d] for p in problems(d, x["attrs"])
                + ["ranks"] * (not all(r in x["attrs"] for r in RANKS))] == []
        merged = [x["attrs"] for x in sglang[d] if x["attrs"]["hicache.origin"] == "merged_op"]
        assert {k: sum(a[f"hicache.{k}"] for a in merged) for k in ("bytes", "tokens")} == {
            k: s["merged"][d][k] for k in ("bytes", "tokens")}


def test_sglang_transfers_link_to_their_requests(sglang, truth, jaeger):
    """docs/sglang.md "Links to requests", as a user follows them in Jaeger: a tag search for a
    request's trace id finds its one transfer, whose link opens SGLang's own request span."""
    requests = truth["sglang"]["requests"]
    assert len(requests) == 4
    for want in requests:
        found = jaeger.spans(SERVICES["sglang"], tags=json.dumps({"hicache.request.trace_id": want["trace_id"]}))
        assert [s["attrs"]["hicache.cause"] for s in found] == [want["cause"]], want
        assert (want["trace_id"], want["span_id"]) in refs(found[0])
        root = jaeger.trace(want["trace_id"]).get(want["span_id"])
        assert root and root["service"] == truth["sglang"]["request_service"], want


def test_exemplars_open_their_span(example, prom, jaeger):
    expr = f'hicache_transfer_duration_seconds_bucket{{service_name="{SERVICES["example"]}"}}'
    data = prom.api("/api/v1/query_exemplars", query=expr, start=time.time() - 3600, end=time.time() + 60)
    exemplars = [(s["seriesLabels"], e) for s in data for e in s["exemplars"]]
    assert exemplars and all(re.fullmatch(r"[0-9a-f]{32}", e["labels"].get("trace_id", ""))
                             and re.fullmatch(r"[0-9a-f]{16}", e["labels"].get("span_id", "")) for _, e in exemplars)
    for series, e in exemplars[:: max(1, len(exemplars) // 5)]:  # spread over buckets and series
        span = jaeger.trace(e["labels"]["trace_id"]).get(e["labels"]["span_id"])
        assert span and span["operationName"] == SPAN_NAMES[series["hicache_direction"]], e
        # Jaeger keeps the span's duration in microseconds; the exemplar is the op's, in seconds
        assert abs(float(e["value"]) * 1e6 - span["duration"]) <= 2 and float(e["value"]) <= float(series["le"])
