"""A real SGLang server on CPU (real_server/) into the stack: what reaches Jaeger and Prometheus
equals SGLang's own counters."""
from types import SimpleNamespace

import pytest
from helpers import DIRECTIONS, GPU_ONLY, settle, shipped_queries
from real_server import server as rs

pytestmark = pytest.mark.real_server
CASES = {  # policy, page size, tensor parallelism, SGLang's request tracing, shared prefix
    "write_through": ("write_through", 1, 1, True, 400),  # links to SGLang's requests
    # not a multiple of the page; two schedulers, two telemetry processes
    "write_back-page16-tp2": ("write_back", 16, 2, False, 410),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return rs.make_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module", params=list(CASES))
def run(request, stack, jaeger, model, tmp_path_factory):
    policy, page, tp, trace, prefix = CASES[request.param]
    service = f"sglang-real-{request.param}"
    server = rs.Server(model, tmp_path_factory.mktemp("server") / "server.log", policy=policy, page_size=page,
                       tp=tp, trace=trace, service=service)
    with server:
        rs.workload(server, prefix=prefix)
        sglang = server.settled_counters()
        schedulers, telemetry = server.schedulers(), server.telemetry_processes()
    return SimpleNamespace(policy=policy, page=page, tp=tp, trace=trace, service=service, sglang=sglang,
                           schedulers=schedulers, telemetry=telemetry, left=server.alive(),
                           spans=rs.transfer_spans(jaeger, service, sglang))


def test_spans_equal_sglang_counters(run):
    """Per direction and rank, span tokens and bytes equal SGLang's own counters."""
    assert run.sglang.get(("offload", "tokens", "0")) and run.sglang.get(("onboard", "tokens", "0")), run.sglang
    assert {k[2] for k in run.sglang} == {str(r) for r in range(run.tp)}
    assert rs.span_sums(run.spans) == run.sglang


def test_causes_pages_and_ranks(run):
    assert {s["attrs"]["hicache.cause"] for s in run.spans["offload"]} == {run.policy}
    assert {s["attrs"]["hicache.cause"] for s in run.spans["onboard"]} == {"prefix_hit"}
    attrs = [s["attrs"] for d in DIRECTIONS for s in run.spans[d]]
    assert {a["hicache.page_size"] for a in attrs} == {run.page}
    assert [a for a in attrs if a["hicache.blocks"] != -(-a["hicache.tokens"] // run.page)] == []
    assert [a for a in attrs if not {"tp_rank", "pp_rank", "dp_rank"} <= set(a)] == []


def test_prometheus_series_equal_spans(run, prom):
    want = rs.span_sums(run.spans)

    def read() -> dict:
        return {(d, what, rank): v for what in ("tokens", "bytes") for (d, rank), v in prom.by(
            f'sum by (hicache_direction, tp_rank) (hicache_transfer_{what}_total{{job="{run.service}"}})',
            "hicache_direction", "tp_rank").items()}

    assert settle(read, lambda got: got == want, 90, every=2) == want


def test_telemetry_process_per_scheduler(run):
    """One telemetry process per scheduler, its child; nothing of the server left after."""
    assert len(run.schedulers) == run.tp, run.schedulers
    assert sorted(run.telemetry.values()) == sorted(run.schedulers)
    assert run.left == []


def test_request_links(run, jaeger):
    """With SGLang's request tracing, every hicache span links to an SGLang request span; without, to
    none (a load-back's links to the offloads that wrote its pages open hicache spans)."""
    spans = [s for d in DIRECTIONS for s in run.spans[d]]
    names = {(tid, sid): s["operationName"] for tid in {r["traceID"] for s in spans for r in s["references"]}
             for sid, s in jaeger.trace(tid).items()}
    targets = [[names.get((r["traceID"], r["spanID"]), "(not found)") for r in s["references"]] for s in spans]
    assert [t for t in targets if "(not found)" in t or any(not n.startswith("hicache.") for n in t) != run.trace] == []


def test_dashboard_and_alerts_evaluate(run, prom):
    """Every query evaluates on this data; transfer panels (not GPU-only) have this server's."""
    queries = shipped_queries()
    for _, _, expr in queries:
        prom.query(expr)
    transfer = [expr for kind, _, expr in queries if kind == "panel" and not any(g in expr for g in GPU_ONLY)
                and ("hicache_transfer_bytes" in expr or "hicache_transfer_duration" in expr)]
    jobs = lambda e: {s["metric"].get("job", run.service) for s in prom.query(e)}  # noqa: E731
    empty = settle(lambda: [e for e in transfer if run.service not in jobs(e)], lambda e: not e, 90, every=2)
    assert transfer and empty == []
