"""The fleet of deploy/fleet.md from the shipped files, each part on a loopback address of its own;
A node alone: `python e2e/test_fleet.py OUT [RATE SECONDS]`."""

import json
import random
import re
import secrets
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

from helpers import DIRECTIONS, ROOT, Jaeger, Proc, Prom, binary, clean_env, settle

SERVICE, PAGE, DECISION_WAIT_S = "hicache-fleet-test", 64, 5  # 10 s shipped
RATE, SECONDS, KILL_AT_S, DOWN_S = 200, 36.0, 18.0, 4.0  # per node; kill after their start
SERIES = {"ops": "duration_seconds_count", "bytes": "bytes_total", "blocks": "blocks_total", "tokens": "tokens_total"}


def node(out: str, rate: str = RATE, seconds: str = SECONDS) -> None:
    """Paced ops, a trace each (step and transfer spans), 1% failed, 1% over the gateways' 50 ms; writes
    the ground truth and each op's (trace id, kind, end)."""
    sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]
    import otel_hicache
    from bench_common import wait_until
    from sdk_delivery import read_sdk_delivery
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()  # the SDK's self-metrics: what it delivered
    config = otel_hicache.configuration.configure(metric_readers=[reader])
    tracer, tel = config.tracer_provider.get_tracer("fleet"), otel_hicache.TransferTelemetry(attributes={"tp_rank": 0})
    rng, truth, ops, last, start = random.Random(out), Counter(), [], None, time.perf_counter_ns()
    for i in range(int(float(rate) * float(seconds))):
        wait_until(start + int(i * 1e9 / float(rate)))  # a late op delays no other
        d, pages, roll, end = DIRECTIONS[i % 2], 1 + rng.randrange(8), rng.random(), time.time_ns()
        kind = "error" if roll < 0.01 else "slow" if roll < 0.02 else "plain"
        begin = end - (int(rng.uniform(60e6, 150e6)) if kind == "slow" else 20_000 * pages)
        with tracer.start_as_current_span("example.scheduler_step", start_time=begin) as step:
            op = (d, {"kv": pages * PAGE}, pages * PAGE * 4096)
            if kind == "error":  # its finish event raises, like a device fault
                tel.submit(*op, page_size=PAGE, finish_event=SimpleNamespace(query=lambda: 1 / 0), host_start_ns=begin)
            else:
                tel.ack(last)  # the consumer acks the previous op
                last = tel.submit(*op, page_size=PAGE, host_start_ns=begin, host_end_ns=end)
                truth.update({f"{k} {d}": n for k, n in zip(SERIES, (1, op[2], pages, pages * PAGE))})
        ops.append((f"{step.get_span_context().trace_id:032x}", kind, end))
    tel.ack(last)
    tel._pipeline.flush(10.0)  # every op's span to the SDK
    tel.force_flush(10.0)
    config.tracer_provider.force_flush(10_000)
    exported = read_sdk_delivery(reader)["spans"]["exported"]
    otel_hicache.configuration.shutdown()
    Path(out).write_text(json.dumps({"truth": truth, "ops": ops, "exported": exported}))


if __name__ == "__main__":
    sys.exit(node(*sys.argv[1:]))

import grpc  # noqa: E402  (node() needs neither)
import pytest  # noqa: E402

pytestmark = pytest.mark.fleet
NODES = ("node-a", "node-b")
NAMES = ("gateway-1", "gateway-2", "jaeger", *(f"agent-{n}" for n in NODES), "prometheus")
HELD = "otelcol_processor_tail_sampling_sampling_traces_on_memory"  # a gateway's undecided traces


def export(host: str, auth: str | None, ca: str | None) -> str:
    """What an empty OTLP/gRPC traces export to host gets (plaintext without ca)."""
    with grpc.secure_channel(f"{host}:4317", grpc.ssl_channel_credentials(Path(ca).read_bytes())) if ca \
            else grpc.insecure_channel(f"{host}:4317") as channel:
        try:
            channel.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")(
                b"", metadata=[("authorization", auth)] if auth else None, timeout=5)
            return "OK"
        except grpc.RpcError as error:
            return error.code().name


def scrape(host: str, port: int = 8888) -> dict[str, float]:
    """A Collector's metrics {name{labels}: value}, less _total (Jaeger's Collector adds it)."""
    text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).read().decode()
    samples = re.finditer(r"^(\w+)(\{.*\})? (\S+)$", text, re.M)
    return {m[1].removesuffix("_total") + (m[2] or ""): float(m[3]) for m in samples}


def total(metrics: list[dict[str, float]], name: str, having: str = "") -> float:
    return sum(v for m in metrics for k, v in m.items() if k.split("{")[0] == name and having in k)


def in_namespace(hosts_file: Path) -> list[str]:
    """A command prefix with hosts_file as /etc/hosts (as deploy/local/stack.sh does)."""
    script = ["sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts_file)]
    for unshare in (["unshare", "--mount"], ["unshare", "--user", "--map-root-user", "--mount"]):
        if subprocess.run([*unshare, *script, "true"], capture_output=True).returncode == 0:
            return [*unshare, *script]
    pytest.fail("no private mount namespace (unshare --mount) to resolve fleet.yml's gateway names")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> dict:
    """Each part's address (NAMES), started and healthy; their "procs"."""
    from otlp_receiver import make_certificates

    tmp, net = tmp_path_factory.mktemp("fleet"), f"127.{random.randrange(64, 250)}.{random.randrange(250)}."
    at = {name: net + str(i) for i, name in enumerate(NAMES, 1)}  # each its default ports
    (tmp / "tls").mkdir()
    tls = make_certificates(tmp / "tls", hosts=(at["gateway-1"], at["gateway-2"]))
    (tmp / "token").write_text(token := secrets.token_urlsafe(32))
    (tmp / "hosts").write_text("".join(f"{a} {name}\n" for name, a in {"localhost": "127.0.0.1", **at}.items()))
    env = clean_env(HICACHE_FLEET_TOKEN_FILE=str(tmp / "token"), HICACHE_FLEET_CA_FILE=tls["ca"],
                    HICACHE_FLEET_TLS_CERT=tls["cert"], HICACHE_FLEET_TLS_KEY=tls["key"], JAEGER_HOST=at["jaeger"],
                    HICACHE_TAIL_DECISION_WAIT=f"{DECISION_WAIT_S}s",
                    HICACHE_GATEWAYS=f"{at['gateway-1']}:4317,{at['gateway-2']}:4317")
    cmds = {"jaeger": [binary("jaeger"), f"--config={ROOT}/deploy/jaeger/config.yaml"], "prometheus": [
        *in_namespace(tmp / "hosts"), binary("prometheus"), f"--config.file={ROOT}/deploy/prometheus/fleet.yml",
        f"--storage.tsdb.path={tmp}/tsdb", f"--web.listen-address={at['prometheus']}:9090"]}
    health = {"jaeger": "13133/status", "prometheus": "9090/-/ready"}
    otelcol, conf = binary("otelcol"), f"--config={ROOT}/deploy/otel-collector/"  # agent.yaml, gateway.yaml
    cmds |= {n: [otelcol, conf + n.split("-")[0] + ".yaml"] for n in NAMES if n not in cmds}
    listen = ("JAEGER_LISTEN_HOST", "OTELCOL_LISTEN_HOST", "OTELCOL_OTLP_LISTEN_HOST")  # all on its address
    procs = {n: Proc(n, cmds[n], env | dict.fromkeys(listen, a), tmp, f"http://{a}:{health.get(n, '13133/')}")
             for n, a in at.items()}
    try:
        for proc in procs.values():
            proc.start()
        prom = Prom(f"http://{at['prometheus']}:9090")
        assert len(settle(lambda: prom.by('up{job="otel-gateway"}', "instance"), lambda up: len(up) == 2, 30)) == 2
        yield at | {"procs": procs, "token": token, "ca": tls["ca"]}
    finally:
        for proc in procs.values():
            proc.stop()


def test_gateways_take_only_tls_with_the_token(fleet):
    token, ca = fleet["token"], fleet["ca"]
    for gateway in NAMES[:2]:
        answers = [export(fleet[gateway], auth, tls) for auth, tls in [
            (f"Bearer {token}", ca), (None, ca), (f"Bearer {token[::-1]}", ca), (token, ca), (f"Bearer {token}", None)]]
        assert answers == ["OK"] + ["UNAUTHENTICATED"] * 3 + ["UNAVAILABLE"], gateway  # last: plaintext


@pytest.fixture(scope="module")
def run(fleet, tmp_path_factory) -> SimpleNamespace:
    """The nodes' workloads; the gateway carrying node-a's metrics killed mid-run, restarted."""
    tmp, procs = tmp_path_factory.mktemp("nodes"), fleet["procs"]
    nodes = [Proc(n, [sys.executable, __file__, str(tmp / n)], clean_env(
        OTEL_SERVICE_NAME=SERVICE, OTEL_RESOURCE_ATTRIBUTES=f"host.name={n}", OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://{fleet['agent-' + n]}:4317", OTEL_METRIC_EXPORT_INTERVAL="1000",
        OTEL_BSP_SCHEDULE_DELAY="200", OTEL_HICACHE_SHUTDOWN_TIMEOUT_S="10",
        OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED="true"),
        tmp) for n in NODES]  # the SDK's self-metrics count spans exported
    every = (*procs.values(), *nodes)
    try:
        t0 = time.time_ns()
        for proc in nodes:
            proc.start()
        carriers = lambda: [g for g in NAMES[:2] if 'host_name="node-a"' in str(scrape(fleet[g], 8889))]  # noqa: E731
        victim = settle(carriers, bool, 20, every)[0]
        settle(lambda: time.time_ns() - t0 >= KILL_AT_S * 1e9, bool, KILL_AT_S + 5, every)  # mid-run
        before, t_kill = scrape(fleet[victim]), time.time_ns()
        procs[victim].process.kill()
        procs[victim].process.wait()
        others = [p for p in every if p is not procs[victim]]
        settle(lambda: time.time_ns() - t_kill >= DOWN_S * 1e9, bool, DOWN_S + 5, others)  # the outage
        procs[victim].start()
        for proc in nodes:
            proc.wait(SECONDS + 60, every)
    finally:
        for proc in nodes:
            proc.stop()
    return SimpleNamespace(nodes=[json.loads((tmp / n).read_text()) for n in NODES], victim=victim,
                           t_kill=t_kill, before=before, every=every)


def test_metrics_lose_nothing(fleet, run):
    """The agents queue and retry per gateway: the counters equal the nodes' truth."""
    prom, sel = Prom(f"http://{fleet['prometheus']}:9090"), f'service_name="{SERVICE}"'
    failed = Counter(failed=sum(k == "error" for r in run.nodes for _, k, _ in r["ops"]))
    want = sum((Counter(r["truth"]) for r in run.nodes), failed)
    got = lambda: {f"{k} {d}": v for k, s in SERIES.items() for (d,), v in prom.by(  # noqa: E731
        f"sum by (hicache_direction) (hicache_transfer_{s}{{{sel}}})", "hicache_direction").items()} | {
        "failed": prom.by(f'sum(otel_hicache_records_failed_total{{{sel}, reason="event_error"}})').get((), 0)}
    assert settle(got, lambda g: g == want, 45, run.every) == want


def test_the_traces_the_policy_keeps(fleet, run):
    """Every error and slow trace is in Jaeger, whole, but those the dead gateway held; the base rate
    holds."""
    def state() -> tuple:  # the gateways decided every trace, Jaeger stored all it took
        traces = Jaeger(f"http://{fleet['jaeger']}:16686").traces(SERVICE, limit=15000)
        stored = {int(t["traceID"], 16): len(t["spans"]) for t in traces}
        return [scrape(fleet[g]) for g in NAMES[:2]], scrape(fleet["jaeger"]), stored
    gateways, jaeger, stored = settle(state, lambda s: total(s[0], HELD) == 0 and total(
        [s[1]], "otelcol_receiver_accepted_spans") == sum(s[2].values()), 60, run.every, 2)
    assert total([jaeger], "otelcol_receiver_accepted_spans") == sum(stored.values())
    ops = [(int(tid, 16), kind, run.t_kill - (DECISION_WAIT_S + 7) * 1e9 <= end <= run.t_kill + 5e8)
           for r in run.nodes for tid, kind, end in r["ops"]]
    assert [tid for tid, kind, inside in ops if kind != "plain" and not inside and stored.get(tid) != 2] == []
    assert min(Counter(kind for _, kind, inside in ops if not inside)[k] for k in ("error", "slow")) >= 20
    plain = [tid in stored for tid, kind, inside in ops if kind == "plain" and not inside]
    assert abs(sum(plain) - len(plain) / 100) <= 5 * (len(plain) / 100) ** 0.5 + 5  # base rate 1%
    lost = sum(kind != "plain" and inside and tid not in stored for tid, kind, inside in ops)
    assert lost <= total([run.before], HELD)
    assert total(gateways, "otelcol_exporter_send_failed_spans") == 0


def test_the_agents_passed_every_span_on(fleet, run):
    """By their own metrics, to the gateways that were up, retrying the dead one."""
    agents = [scrape(fleet["agent-" + n]) for n in NODES]
    sent = total(agents, "otelcol_exporter_sent_spans", "load_balancing/traces")
    assert sum(r["exported"] for r in run.nodes) == sum(2 * len(r["ops"]) for r in run.nodes) == sent
    assert total(agents, "otelcol_receiver_accepted_spans") == sent
    assert total(agents, "otelcol_exporter_send_failed_spans") == 0
    assert total(agents, "otelcol_loadbalancer_backend_outcome", 'success="false"') == 0
    assert re.search(rf"Exporting failed\. Will retry.*{fleet[run.victim]}", fleet["procs"]["agent-node-a"].log(0))
