"""otel-hicache on a real SGLang server, the way its users run it.

``python -m sglang.launch_server --enable-hierarchical-cache`` on CPU (a tiny local model, the
stand-ins of ``real_server/cpu/``), the plugin loaded by SGLang itself in each scheduler
process, configured only by ``OTEL_*``, exporting to the real Collector, Jaeger and Prometheus
started from the shipped configs (``deploy/local/stack.sh``). Real requests force offload and
load-back; everything is read back through Jaeger's and Prometheus' HTTP APIs and compared
with SGLang's own counters on its ``/metrics``.

Run by CI after the stack is installed: ``pytest e2e/test_real_server.py`` (marked
``real_server``; not part of the README's test command).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import check_pipeline as cp  # noqa: E402  (the stack's API clients and the dashboard helpers)
from real_server import server as rs  # noqa: E402

pytestmark = pytest.mark.real_server
STACK = ROOT / "deploy" / "local" / "stack.sh"
SPAN_NAMES = rs.SPAN_NAMES
WAIT_S = 90.0  # spans and the last metric export through the Collector, on 2 busy cores


@dataclass
class Case:
    policy: str
    page_size: int = 1
    tp: int = 1
    trace: bool = False
    prefix: int = 400


CASES = {
    # SGLang's request tracing on: the links of hicache spans to its request spans
    "write_through": Case("write_through", trace=True),
    # a page size above 1 and a prefix that is not a multiple of it
    "write_back-page16": Case("write_back", page_size=16, prefix=410),
    # two scheduler processes, two telemetry processes
    "tp2": Case("write_through", tp=2),
}


@dataclass
class Run:
    name: str
    case: Case
    service: str
    sglang: dict[tuple[str, str, str], float]  # (direction, tokens|bytes, tp_rank) -> value
    schedulers: dict[int, str]
    telemetry: dict[int, int]  # telemetry process pid -> parent pid
    left_running: list[int]
    spans: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # direction -> span tags


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("real-server")


@pytest.fixture(scope="module")
def stack(workdir):
    env = {**os.environ, "HICACHE_STACK_STATE": str(workdir / "stack")}
    subprocess.run(["bash", str(STACK), "up"], env=env, check=True)
    started_us = int(time.time() * 1e6)
    try:
        yield cp.Prometheus("http://127.0.0.1:9090"), cp.Jaeger("http://127.0.0.1:16686", started_us)
    finally:
        subprocess.run(["bash", str(STACK), "down", "-v"], env=env, check=False)


@pytest.fixture(scope="module")
def model(workdir) -> Path:
    return rs.make_model(workdir / "model")


@pytest.fixture(scope="module", params=list(CASES))
def run(request, stack, model, workdir) -> Run:
    name, case = request.param, CASES[request.param]
    service = f"sglang-real-{name}"
    server = rs.Server(model, workdir / f"{name}.log", policy=case.policy, page_size=case.page_size,
                       tp=case.tp, trace=case.trace, service=service)
    with server:
        rs.workload(server, prefix=case.prefix)
        time.sleep(2.0)  # the last acks of the round: SGLang's counters and ours catch up
        sglang = server.hicache_counters()
        schedulers, telemetry = server.schedulers(), server.telemetry_processes()
    result = Run(name, case, service, sglang, schedulers, telemetry, server.alive())
    result.spans = rs.transfer_spans(stack[1], service, sglang)
    return result


def test_spans_equal_sglang_counters(run: Run):
    """Per direction and rank, span tokens and bytes equal SGLang's own counters exactly."""
    assert run.sglang.get(("offload", "tokens", "0")), f"SGLang backed nothing up: {run.sglang}"
    assert run.sglang.get(("onboard", "tokens", "0")), f"SGLang loaded nothing back: {run.sglang}"
    assert {k[2] for k in run.sglang} == {str(r) for r in range(run.case.tp)}
    assert rs.span_sums(run.spans) == run.sglang


def test_causes(run: Run):
    offload = Counter(t["hicache.cause"] for t in run.spans["offload"])
    onboard = Counter(t["hicache.cause"] for t in run.spans["onboard"])
    assert set(offload) == {run.case.policy}, offload
    assert set(onboard) == {"prefix_hit"}, onboard


def test_page_size(run: Run):
    sizes = {int(t["hicache.page_size"]) for d in SPAN_NAMES for t in run.spans[d]}
    assert sizes == {run.case.page_size}
    for d in SPAN_NAMES:
        for t in run.spans[d]:
            assert int(t["hicache.blocks"]) == -(-int(t["hicache.tokens"]) // run.case.page_size)


def test_prometheus_series_equal_spans(run: Run, stack):
    """The counters in Prometheus, per direction and rank, equal the spans in Jaeger."""
    prom, _ = stack
    want = rs.span_sums(run.spans)
    got: dict[tuple[str, str, str], float] = {}

    def settled() -> bool:
        got.clear()
        for what in ("tokens", "bytes"):
            q = f'sum by (hicache_direction, tp_rank) (hicache_transfer_{what}_total{{job="{run.service}"}})'
            for (d, rank), v in prom.by_labels(q, ("hicache_direction", "tp_rank")).items():
                got[(d, what, rank)] = v
        return got == want

    cp.wait_until(settled, WAIT_S, 2.0)
    assert got == want


def test_telemetry_process_per_scheduler(run: Run):
    """One telemetry process per scheduler, its child; nothing of the server left after it stopped."""
    assert len(run.schedulers) == run.case.tp, run.schedulers
    assert sorted(run.telemetry.values()) == sorted(run.schedulers), (run.telemetry, run.schedulers)
    assert run.left_running == []


def test_request_links(run: Run, stack):
    """With SGLang's request tracing on, every hicache span links to an SGLang request span that
    opens in Jaeger; without it, none does (a load-back also links to the offloads that wrote
    its pages: those links open hicache spans)."""
    _, jaeger = stack
    names: dict[tuple[str, str], str] = {}  # (trace, span) -> its operation in Jaeger
    for trace_id in {r["traceID"] for d in SPAN_NAMES for t in run.spans[d] for r in t["_references"]}:
        tr, _ = jaeger.trace(trace_id)
        names.update({(trace_id, s["spanID"]): s["operationName"] for s in (tr or {}).get("spans") or []})
    problems = []
    for d in SPAN_NAMES:
        for t in run.spans[d]:
            targets = [names.get((r["traceID"], r["spanID"]), "(not found)") for r in t["_references"]]
            to_requests = [name for name in targets if not name.startswith("hicache.")]
            if "(not found)" in targets or bool(to_requests) != run.case.trace:
                problems.append((d, t["hicache.cause"], targets))
    assert not problems, f"{len(problems)} spans whose links are not as expected: {problems[:5]}"


def test_dashboard_and_alerts_evaluate(run: Run, stack):
    """Every query of the shipped dashboard and every alert expression evaluates without error;
    the transfer panels return data for this run's service (but those that need NVML or device
    timing, which a CPU cannot give: check_pipeline.NVML_ONLY and DEVICE_ONLY), once rate()
    has two scrapes of it."""
    import yaml

    prom, _ = stack
    exprs = [(panel.get("title"), cp.grafana_to_promql(str(target["expr"])))
             for path in cp.dashboard_files(str(ROOT))
             for panel in cp._panels(json.loads(Path(path).read_text()).get("panels") or [])
             for target in panel.get("targets") or [] if "expr" in target]
    transfer = {i for i, (_, expr) in enumerate(exprs)  # panels: an alert's expression may well be empty
                if ("hicache_transfer_bytes" in expr or "hicache_transfer_duration" in expr)
                and not any(name in expr for name in (*cp.NVML_ONLY, *cp.DEVICE_ONLY))}
    exprs += [(rule.get("alert") or rule.get("record"), str(rule["expr"]))
              for path in cp.rule_files(str(ROOT))
              for group in (yaml.safe_load(Path(path).read_text()) or {}).get("groups") or []
              for rule in group.get("rules") or []]
    errors: list[tuple[str, str]] = []
    empty: set[str] = set()

    def evaluated() -> bool:
        errors.clear()
        empty.clear()
        for i, (title, expr) in enumerate(exprs):
            ok, result, err = prom.query(expr)
            if not ok:
                errors.append((title, err))
            elif i in transfer and run.service not in {s["metric"].get("job", run.service) for s in result}:
                empty.add(title)
        return not errors and not empty

    cp.wait_until(evaluated, WAIT_S, 2.0)
    assert not errors, errors
    assert not empty, f"transfer panels without data for {run.service}: {sorted(empty)}"
