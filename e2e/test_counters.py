"""The counters in Prometheus equal the example workload's ground truth per direction and rank;
nothing was lost on the way."""
import re

import pytest
from helpers import DIRECTIONS, ROOT, SERVICE, settle

pytestmark = pytest.mark.stack
SEL = f'service_name="{SERVICE}"'
# test id: series, a label to sum by beside direction and rank, (truth, direction) -> {value: n}
CASES = {
    "bytes": ("transfer_bytes_total", "", lambda t, d: {"": t[d]["bytes"]}),
    "blocks": ("transfer_blocks_total", "", lambda t, d: {"": t[d]["blocks"]}),
    "ops": ("transfer_duration_seconds_count", "", lambda t, d: {"": t[d]["ops"]}),
    "tokens by pool": ("transfer_tokens_total", "hicache_pool", lambda t, d: t[d]["tokens"]),
    "bytes by cause": ("transfer_bytes_total", "hicache_cause", lambda t, d: t[d]["bytes_by_cause"]),
    "host bytes reloaded": ("host_reloaded_bytes_total", "", lambda t, d: {"": t[d]["host_bytes"] * (d == "onboard")}),
    "host bytes wasted": ("host_wasted_bytes_total", "", lambda t, d: {"": t[d]["host_bytes"] * (d == "offload")}),
    "host residences": ("host_residence_time_seconds_count", "", lambda t, d: {"": t[d]["residence_count"]}),
}


@pytest.mark.parametrize("case", CASES)
def test_counter_equals_ground_truth(case, prom, truth):
    series, by, want_of = CASES[case]
    labels = ["hicache_direction", "tp_rank"] + [by] * bool(by)
    want = {("" if "host_" in series else d, "0", *[k] * bool(by)): n  # host_* have no direction
            for d in DIRECTIONS for k, n in want_of(truth, d).items() if n}
    expr = f"sum by ({', '.join(labels)}) (hicache_{series}{{{SEL}}})"
    assert want and settle(lambda: prom.by(expr, *labels), lambda got: got == want, 30) == want, expr


def test_nothing_lost(prom, truth):
    """otel-hicache's loss counters are 0; the SDK's count spans and points delivered, none lost."""
    losses = prom.query(f'{{__name__=~"otel_hicache_records_(dropped|failed)_total", {SEL}}}')
    assert {s["metric"]["__name__"][21:] for s in losses} == {"dropped_total", "failed_total"}
    assert [s for s in losses if s["value"][1] != "0"] == []
    delivered = f'sum by (__name__) ({{__name__=~"otel_sdk_exporter_.+_exported_total", error_type="", {SEL}}})'
    assert len(prom.by(delivered, "__name__")) == 2  # spans and metric data points
    assert prom.query(f'{{__name__=~"otel_sdk_.+", error_type!="", {SEL}}} > 0') == []


def test_collector_passed_every_span_on(prom, truth):
    """By the Collector's own metrics deploy/README.md lists, every span made (2 per op, and the
    requests') was accepted and sent on, none refused."""
    section = (ROOT / "deploy/README.md").read_text().split("### The Collector's own metrics")[1]
    listed = re.findall(r"`(otelcol_\w+)`", section.split("Failures appear")[0])
    made = 2 * sum(truth[d]["ops"] for d in DIRECTIONS)
    got = settle(lambda: {n: prom.by(f'sum({n}{{job="otel-collector-self"}})').get((), 0.0) for n in listed},
                 lambda g: g["otelcol_receiver_accepted_spans"] == g["otelcol_exporter_sent_spans"] >= made, 30)
    assert len(listed) >= 8 and [n for n in listed if not prom.query(f'{n}{{job="otel-collector-self"}}')] == []
    assert got["otelcol_receiver_accepted_spans"] == got["otelcol_exporter_sent_spans"] >= made
    assert got["otelcol_receiver_refused_spans"] == got["otelcol_receiver_refused_metric_points"] == 0
    assert got["otelcol_exporter_queue_size"] == 0


def test_every_series_name_is_documented(prom, truth):
    """Every hicache_*/otel_hicache_* name in Prometheus is in docs/reference.md."""
    reference = (ROOT / "docs/reference.md").read_text()
    ours = [n for n in prom.api("/api/v1/label/__name__/values") if re.match(r"(otel_)?hicache_", n)]
    assert len(ours) > 20 and [n for n in ours if not re.search(rf"\b{n}\b", reference)] == []
