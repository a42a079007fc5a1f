"""The counters in Prometheus equal the workloads' ground truth (conftest.truth) per direction and
rank, through the shipped Collector config; SGLang's own counters agree; nothing was lost."""
from __future__ import annotations

import re

import pytest
from helpers import DIRECTIONS, ROOT, SERVICES, settle

pytestmark = pytest.mark.stack
EX, SG = (f'service_name="{SERVICES[k]}"' for k in ("example", "sglang"))
MERGED, DIRECT = f'{SG}, hicache_origin="merged_op"', f'{SG}, hicache_origin="direct"'
# test id: series, its selector, a label to sum by besides direction and rank, and the ground truth
# per direction (example's, SGLang harness', direction) -> {that label's value: count}
CASES = {
    "example bytes": ("transfer_bytes_total", EX, "", lambda t, s, d: {"": t[d]["bytes"]}),
    "example blocks": ("transfer_blocks_total", EX, "", lambda t, s, d: {"": t[d]["blocks"]}),
    "example ops": ("transfer_duration_seconds_count", EX, "", lambda t, s, d: {"": t[d]["ops"]}),
    "example tokens by pool": ("transfer_tokens_total", EX, "hicache_pool", lambda t, s, d: t[d]["tokens"]),
    "example bytes by cause": ("transfer_bytes_total", EX, "hicache_cause", lambda t, s, d: t[d]["bytes_by_cause"]),
    "example bytes reloaded": ("host_reloaded_bytes_total", EX, "", lambda t, s, d: {"": t[d]["host_bytes"] * (d == "onboard")}),
    "example bytes wasted": ("host_wasted_bytes_total", EX, "", lambda t, s, d: {"": t[d]["host_bytes"] * (d == "offload")}),
    "example residences": ("host_residence_time_seconds_count", EX, "", lambda t, s, d: {"": t[d]["residence_count"]}),
    "sglang merged bytes": ("transfer_bytes_total", MERGED, "", lambda t, s, d: {"": s["merged"][d]["bytes"]}),
    "sglang merged ops": ("transfer_duration_seconds_count", MERGED, "", lambda t, s, d: {"": s["merged"][d]["ops"]}),
    "sglang merged tokens": ("transfer_tokens_total", MERGED, "hicache_pool", lambda t, s, d: {"kv": s["merged"][d]["tokens"]}),
    "sglang direct ops": ("transfer_duration_seconds_count", DIRECT, "", lambda t, s, d: {"": s["direct"][d]["ops"]}),
    "sglang direct tokens": ("transfer_tokens_total", DIRECT, "hicache_pool", lambda t, s, d: {"kv": s["direct"][d]["tokens"]}),
}
# SGLang's own counters: the otel-hicache series docs/reference.md maps each one to, its labels renamed
MERGED_BY = 'hicache_origin="merged_op", hicache_direction='
SGLANG_MAP = {
    "sglang:hicache_backup_tokens_total": ("transfer_tokens_total", MERGED_BY + '"offload"', {"pool": "hicache_pool"}),
    "sglang:load_back_tokens_total": ("transfer_tokens_total", MERGED_BY + '"onboard"', {"pool": "hicache_pool"}),
    "sglang:hicache_backup_bytes_total": ("transfer_bytes_total", MERGED_BY + '"offload"', {}),
    "sglang:load_back_bytes_total": ("transfer_bytes_total", MERGED_BY + '"onboard"', {}),
    "sglang:evicted_tokens_total": ("evicted_tokens_total", 'hicache_tier="device"', {}),
    "sglang:hicache_dropped_tokens_total": ("dropped_tokens_total", "", {"reason": "reason", "pool": "hicache_pool"}),
    "sglang:cached_tokens_total": ("prefix_tokens_total", "", {"cache_source": "hicache_tier"}),
}


@pytest.mark.parametrize("case", CASES)
def test_counter_equals_ground_truth(case, prom, truth):
    series, sel, by, want_of = CASES[case]
    labels = ["hicache_direction", "tp_rank"] + [by] * bool(by)
    want = {("" if "host_" in series else d, "0", *[k] * bool(by)): n for d in DIRECTIONS  # host_*: no direction
            for k, n in want_of(truth["example"], truth["sglang"], d).items() if n}
    expr = f"sum by ({', '.join(labels)}) (hicache_{series}{{{sel}}})"
    assert want and settle(lambda: prom.by(expr, *labels), lambda got: got == want, 30) == want, expr


def test_sglang_own_counters_equal_ours(prom, truth):
    want = {}
    for name, labels, value in truth["sglang"]["sglang"]:
        series, fixed, renames = SGLANG_MAP[name]  # one SGLang moved with no counterpart fails here
        matchers = ", ".join(filter(None, [SG, fixed, *(f'{renames[k]}="{v}"' for k, v in labels.items())]))
        want[f"sum(hicache_{series}{{{matchers}}})"] = value
    assert len(want) >= 5 and settle(lambda: {e: prom.by(e).get((), 0.0) for e in want}, lambda g: g == want, 30) == want


def test_sglang_series_carry_the_ranks(prom, truth):
    series = prom.query(f'{{__name__=~"(otel_)?hicache_.+", {SG}}}')
    assert series and [s for s in series if not all(s["metric"].get(r) for r in ("tp_rank", "pp_rank", "dp_rank"))] == []


@pytest.mark.parametrize("service", SERVICES.values())
def test_nothing_lost(service, prom, truth):
    """otel-hicache's loss counters are there and 0; the SDK's self-metrics count spans and points
    delivered, none lost (a loss has an error_type)."""
    sel = f'service_name="{service}"'
    losses = prom.query(f'{{__name__=~"otel_hicache_records_(dropped|failed)_total", {sel}}}')
    assert {s["metric"]["__name__"] for s in losses} == {f"otel_hicache_records_{k}_total" for k in ("dropped", "failed")}
    assert [s for s in losses if s["value"][1] != "0"] == []
    delivered = f'sum by (__name__) ({{__name__=~"otel_sdk_exporter_.+_exported_total", error_type="", {sel}}})'
    assert len(prom.by(delivered, "__name__")) == 2  # spans and metric data points
    assert prom.query(f'{{__name__=~"otel_sdk_.+", error_type!="", {sel}}} > 0') == []


def test_collector_passed_every_span_on(prom, truth):
    """The Collector's own metrics that deploy/README.md lists exist: it accepted every span the
    workloads made (each example op a transfer and a step span), sent on as many, refused none."""
    section = (ROOT / "deploy/README.md").read_text().split("### The Collector's own metrics")[1]
    listed = re.findall(r"`(otelcol_\w+)`", section.split("Failures appear")[0])
    s, t = truth["sglang"], truth["example"]
    made = sum(2 * t[d]["ops"] + s["merged"][d]["ops"] + s["direct"][d]["ops"] for d in DIRECTIONS)
    got = settle(lambda: {n: prom.by(f'sum({n}{{job="otel-collector-self"}})').get((), 0.0) for n in listed},
                 lambda g: g["otelcol_receiver_accepted_spans"] == g["otelcol_exporter_sent_spans"] >= made, 30)
    assert len(listed) >= 8 and [n for n in listed if not prom.query(f'{n}{{job="otel-collector-self"}}')] == []
    assert got["otelcol_receiver_accepted_spans"] == got["otelcol_exporter_sent_spans"] >= made
    assert got["otelcol_receiver_refused_spans"] == got["otelcol_receiver_refused_metric_points"] == 0
    assert got["otelcol_exporter_queue_size"] == 0


def test_every_series_name_is_documented(prom, truth):
    """Every hicache_*/otel_hicache_* name Prometheus stores is in docs/reference.md."""
    ours = [n for n in prom.api("/api/v1/label/__name__/values") if re.match(r"(otel_)?hicache_", n)]
    assert len(ours) > 20 and [n for n in ours if not re.search(rf"\b{n}\b", (ROOT / "docs/reference.md").read_text())] == []
