"""Two tiers of Collectors with the real binaries (deploy/fleet.md), a gateway killed mid-run.

    node-a workload --OTLP--> agent-a --+-- load_balancing --> gateway-1 --+--> Jaeger
    node-b workload --OTLP--> agent-b --+   (traces by trace id,  gateway-2 --+
                                             metrics by resource)     ^ :8889
                                                                   Prometheus (deploy/prometheus/fleet.yml)

Everything runs on 127.0.0.0/8 from the shipped files unchanged: deploy/jaeger/config.yaml
(ports moved by its variables), deploy/otel-collector/gateway.yaml twice (on two loopback
addresses with the default ports, so fleet.yml's targets gateway-1:8889 and gateway-2:8889
resolve through a private hosts file, as deploy/local/stack.sh does),
deploy/otel-collector/agent.yaml twice (HICACHE_GATEWAYS names the two gateways) and
deploy/prometheus/fleet.yml. The tail sampler's decision_wait is shortened to 5 s
(HICACHE_TAIL_DECISION_WAIT) to keep the test short. Agents and gateways talk over TLS with a
bearer token, as shipped (deploy/fleet.md, Security): a throw-away CA, a certificate for both
gateway addresses and a token file, given by the HICACHE_FLEET_* variables.

Before the workloads, each gateway is probed: a TLS client with the token gets through; one
without it, with a wrong token, with the token but no scheme, or in plaintext is refused,
over gRPC and HTTP (the refused data, an error span and a counter point of a service of its
own, is in neither Jaeger nor Prometheus at the end).

Each node is this file run as a script (``--node``): a paced workload through otel-hicache,
configured only by OTEL_* variables, one trace per op (an ``example.scheduler_step`` span and
its ``hicache.offload``/``hicache.onboard`` child), 1% of the ops failing (error spans) and 1%
slower than the slow threshold, with ground truth per op written to JSON.

Mid-run the gateway that carries node-a's metrics is killed with SIGKILL and restarted 4 s
later. Asserted and printed:

1. the counters in Prometheus, summed over both nodes, equal the workloads' ground truth
   exactly (bytes, blocks, tokens, ops, failed ops): the agents queued and retried;
2. every trace the policy must keep (errors, slow) is in Jaeger, complete, unless it was in
   flight in the killed gateway (sent within decision_wait + 7 s before the kill); the base
   rate is plausible; the traces lost to the kill are counted;
3. the Collectors' own metrics account for it: the spans the agents accepted and handed on,
   what the gateways accepted (the killed one scraped just before the kill), the tail
   sampler's traces in memory at the kill, its decisions, and what Jaeger stored.

Run by e2e/fleet.sh. Binaries: ``deploy/local/stack.sh path NAME``, else HICACHE_OTELCOL_BIN,
HICACHE_JAEGER_BIN, HICACHE_PROMETHEUS_BIN; the test is skipped without them, or where no
private mount namespace can be made for Prometheus.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SERVICE = "hicache-fleet-test"
STEP_SPAN = "example.scheduler_step"
PAGE = 64
BYTES_PER_TOKEN = 4096
DIRECTIONS = ("offload", "onboard")

# the load of one node, and the fault
RATE = 200.0              # ops per second per node
SECONDS = 36.0            # per node
ERROR_SHARE = 0.01        # ops whose finish event raises: error spans
SLOW_SHARE = 0.01         # ops slower than the gateway's slow threshold
SLOW_MS = (60.0, 150.0)   # their durations (threshold 50 ms, gateway.yaml)
KILL_AFTER_S = 18.0       # from the workloads' start: ops well before the kill window, and after it
DOWN_S = 4.0              # the gateway is down this long
DECISION_WAIT_S = 5       # HICACHE_TAIL_DECISION_WAIT for the test (production default 10 s)
BASE_PERCENT = 1.0        # gateway.yaml's default base rate
GATEWAY_PORTS = {"grpc": 4317, "http": 4318, "self": 8888, "prom": 8889, "health": 13133}


# ---------------------------------------------------------------------------------------
# The workload of one node (run as a script: python e2e/test_fleet.py --node NAME ...)
# ---------------------------------------------------------------------------------------

class _FailingEvent:
    """A finish event whose query() raises, as a CUDA event after a device fault: the op
    becomes an error span (error.type=event_error) and is counted in records.failed."""

    def query(self) -> bool:
        raise RuntimeError("simulated CUDA error: an illegal memory access was encountered")


class _MeasuringExporter:
    """Counts the OTLP protobuf bytes of the spans (ExportTraceServiceRequest, as sent by
    the SDK's OTLP exporter with no compression, and gzip-compressed, as the agents send)."""

    def __init__(self) -> None:
        import gzip

        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

        self._encode, self._gzip = encode_spans, gzip
        self.spans = self.raw = self.gz = self.batches = 0
        self.transfer_spans = self.transfer_raw = self.transfer_gz = 0  # hicache.* spans alone

    def _size(self, spans: Any) -> tuple[int, int]:
        payload = self._encode(spans).SerializeToString()
        return len(payload), len(self._gzip.compress(payload, 6))

    def export(self, spans: Any) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        raw, gz = self._size(spans)
        self.spans += len(spans)
        self.raw += raw
        self.gz += gz
        self.batches += 1
        transfers = [s for s in spans if s.name.startswith("hicache.")]
        if transfers:  # what an SGLang rank sends: otel-hicache's spans, one per op
            raw, gz = self._size(transfers)
            self.transfer_spans += len(transfers)
            self.transfer_raw += raw
            self.transfer_gz += gz
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def node_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="one node of the fleet test")
    parser.add_argument("--node", required=True)
    parser.add_argument("--rate", type=float, default=RATE)
    parser.add_argument("--seconds", type=float, default=SECONDS)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT / "tests"))

    import otel_hicache
    from bench_common import wait_until
    from sdk_delivery import read_sdk_delivery
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from otel_hicache import configuration
    reader = InMemoryMetricReader()  # the SDK's self-metrics: what the OTLP exporter delivered
    config = configuration.configure(metric_readers=[reader])
    measure = _MeasuringExporter()
    config.tracer_provider.add_span_processor(BatchSpanProcessor(measure, schedule_delay_millis=200))
    tracer = config.tracer_provider.get_tracer("otel_hicache_fleet_test")
    tel = otel_hicache.TransferTelemetry(attributes={"tp_rank": 0})
    rng = random.Random(args.seed)
    total = int(args.rate * args.seconds)
    truth = {d: {"ops": 0, "bytes": 0, "blocks": 0, "tokens": 0} for d in DIRECTIONS}
    failed = 0
    trace_ids: list[str] = []
    kinds: list[str] = []
    submit_ns: list[int] = []
    start_unix_ns = time.time_ns()
    start = time.perf_counter_ns()
    period = int(1e9 / args.rate)
    previous = None
    for i in range(total):
        wait_until(start + i * period)  # a fixed schedule: a late op does not delay the next ones
        direction = DIRECTIONS[i & 1]
        pages = 1 + rng.randrange(8)
        tokens = pages * PAGE
        num_bytes = tokens * BYTES_PER_TOKEN
        roll = rng.random()
        kind = "e" if roll < ERROR_SHARE else "s" if roll < ERROR_SHARE + SLOW_SHARE else "n"
        end = time.time_ns()
        duration_ns = int(rng.uniform(*SLOW_MS) * 1e6) if kind == "s" else 20_000 * pages
        begin = end - duration_ns
        with tracer.start_as_current_span(STEP_SPAN, start_time=begin, attributes={"workload.op": i}) as step:
            trace_ids.append(format(step.get_span_context().trace_id, "032x"))
            if kind == "e":
                tel.submit(direction, {"kv": tokens}, num_bytes, PAGE, finish_event=_FailingEvent(),
                           attributes={"workload.op": i}, host_start_ns=begin)
                failed += 1
            else:
                handle = tel.submit(direction, {"kv": tokens}, num_bytes, PAGE, attributes={"workload.op": i},
                                    host_start_ns=begin, host_end_ns=end)
                tel.ack(previous)  # the consumer takes the previous op's ack
                previous = handle
                row = truth[direction]
                row["ops"] += 1
                row["bytes"] += num_bytes
                row["blocks"] += pages
                row["tokens"] += tokens
        kinds.append(kind)
        submit_ns.append(end)
    tel.ack(previous)
    elapsed = (time.perf_counter_ns() - start) / 1e9
    tel._pipeline.flush(10.0)  # pylint: disable=protected-access  # every op's span to the SDK
    tel.force_flush(10.0)
    config.tracer_provider.force_flush(10_000)  # every span exported (or failed): nothing left for shutdown
    delivery = read_sdk_delivery(reader)
    tel.shutdown()
    configuration.shutdown()
    Path(args.out).write_text(json.dumps({
        "node": args.node, "ops": total, "elapsed_s": elapsed, "start_unix_ns": start_unix_ns,
        "truth": truth, "failed": failed, "trace_ids": trace_ids, "kinds": "".join(kinds),
        "submit_ns": submit_ns, "delivery": delivery,
        "measured": {"spans": measure.spans, "otlp_bytes": measure.raw, "otlp_gzip_bytes": measure.gz,
                     "batches": measure.batches, "transfer_spans": measure.transfer_spans,
                     "transfer_otlp_bytes": measure.transfer_raw, "transfer_otlp_gzip_bytes": measure.transfer_gz},
    }), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(node_main(sys.argv[1:]))


# ---------------------------------------------------------------------------------------
# The test
# ---------------------------------------------------------------------------------------

import pytest  # noqa: E402  (the node workload above needs no pytest)

INTRUDER = "hicache-fleet-intruder"  # the service name of the data sent without the right token


def _intruder_requests() -> tuple[Any, Any]:
    """An OTLP traces request (one ERROR span: the tail sampler would keep it) and a metrics
    request (one counter point) from INTRUDER, to send without the right token."""
    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
    from opentelemetry.proto.common.v1 import common_pb2
    from opentelemetry.proto.metrics.v1 import metrics_pb2
    from opentelemetry.proto.resource.v1 import resource_pb2
    from opentelemetry.proto.trace.v1 import trace_pb2

    resource = resource_pb2.Resource(attributes=[
        common_pb2.KeyValue(key="service.name", value=common_pb2.AnyValue(string_value=INTRUDER))])
    now = time.time_ns()
    span = trace_pb2.Span(trace_id=os.urandom(16), span_id=os.urandom(8), name="intruder",
                          start_time_unix_nano=now - 1000, end_time_unix_nano=now,
                          status=trace_pb2.Status(code=trace_pb2.Status.STATUS_CODE_ERROR))
    traces = trace_service_pb2.ExportTraceServiceRequest(resource_spans=[
        trace_pb2.ResourceSpans(resource=resource, scope_spans=[trace_pb2.ScopeSpans(spans=[span])])])
    point = metrics_pb2.NumberDataPoint(as_int=1, start_time_unix_nano=now - 1000, time_unix_nano=now)
    metric = metrics_pb2.Metric(name="intruder.points", sum=metrics_pb2.Sum(
        data_points=[point], is_monotonic=True,
        aggregation_temporality=metrics_pb2.AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE))
    metrics = metrics_service_pb2.ExportMetricsServiceRequest(resource_metrics=[
        metrics_pb2.ResourceMetrics(resource=resource, scope_metrics=[metrics_pb2.ScopeMetrics(metrics=[metric])])])
    return traces, metrics


def _grpc_export(endpoint: str, request: Any, authorization: str | None, ca: str | None) -> str:
    """One OTLP/gRPC Export to a gateway: over TLS trusting `ca` (plaintext when None), with this
    authorization header (none when None). The status code's name, OK included."""
    import grpc
    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    channel = (grpc.secure_channel(endpoint, grpc.ssl_channel_credentials(Path(ca).read_bytes())) if ca
               else grpc.insecure_channel(endpoint))
    stub = (trace_service_pb2_grpc.TraceServiceStub(channel)
            if isinstance(request, trace_service_pb2.ExportTraceServiceRequest)
            else metrics_service_pb2_grpc.MetricsServiceStub(channel))
    try:
        stub.Export(request, metadata=[("authorization", authorization)] if authorization is not None else None,
                    timeout=5)
        return "OK"
    except grpc.RpcError as error:
        return error.code().name  # pylint: disable=no-member
    finally:
        channel.close()


def _http_export(url: str, body: bytes, authorization: str | None, ca: str | None) -> str:
    """One OTLP/HTTP POST to a gateway: the HTTP status as a string, or the connection error."""
    import ssl
    import urllib.error

    headers = {"Content-Type": "application/x-protobuf"}
    if authorization is not None:
        headers["Authorization"] = authorization
    request = urllib.request.Request(url, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5,  # noqa: S310 (loopback only)
                                    context=ssl.create_default_context(cafile=ca) if ca else None) as response:
            return str(response.status)
    except urllib.error.HTTPError as error:
        return str(error.code)
    except OSError as error:
        return f"connection error ({type(error).__name__})"


def _probe_gateway(host: str, ports: dict[str, int], ca: str, token: str) -> tuple[dict[str, str], list[str]]:
    """What a gateway answers each kind of client, and what differs from what it must answer:
    only a TLS client with the fleet's token gets through, over gRPC and HTTP."""
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    traces, metrics = _intruder_requests()
    empty = trace_service_pb2.ExportTraceServiceRequest()  # passes auth, adds nothing to any count
    grpc_at, http_at = f"{host}:{ports['grpc']}", f"{host}:{ports['http']}"
    right, wrong_token = f"Bearer {token}", f"Bearer {token[::-1]}"
    cases = {  # name: (answer, what it must be)
        "gRPC, TLS, the token (empty request)": (_grpc_export(grpc_at, empty, right, ca), "OK"),
        "gRPC, TLS, no token": (_grpc_export(grpc_at, traces, None, ca), "UNAUTHENTICATED"),
        "gRPC, TLS, a wrong token": (_grpc_export(grpc_at, traces, wrong_token, ca), "UNAUTHENTICATED"),
        "gRPC, TLS, the token without its scheme": (_grpc_export(grpc_at, traces, token, ca), "UNAUTHENTICATED"),
        "gRPC metrics, TLS, no token": (_grpc_export(grpc_at, metrics, None, ca), "UNAUTHENTICATED"),
        "gRPC metrics, TLS, a wrong token": (_grpc_export(grpc_at, metrics, wrong_token, ca), "UNAUTHENTICATED"),
        "gRPC, plaintext, the token": (_grpc_export(grpc_at, traces, right, None), "UNAVAILABLE"),
        "HTTP, TLS, the token (empty request)": (_http_export(f"https://{http_at}/v1/traces",
                                                              empty.SerializeToString(), right, ca), "200"),
        "HTTP, TLS, no token": (_http_export(f"https://{http_at}/v1/traces", traces.SerializeToString(), None, ca),
                                "401"),
        "HTTP, TLS, a wrong token": (_http_export(f"https://{http_at}/v1/metrics", metrics.SerializeToString(),
                                                  wrong_token, ca), "401"),
        # Go's TLS server answers a plaintext HTTP request with 400 and closes
        "HTTP, plaintext, the token": (_http_export(f"http://{http_at}/v1/traces", traces.SerializeToString(),
                                                    right, None), "400"),
    }
    answers = {name: got for name, (got, _) in cases.items()}
    wrong = [f"{name}: {got}, want {want}" for name, (got, want) in cases.items() if got != want]
    return answers, wrong


def _binary(name: str, variable: str) -> str:
    try:
        out = subprocess.run(["bash", str(ROOT / "deploy" / "local" / "stack.sh"), "path", name],
                             capture_output=True, text=True, timeout=60)
        path = out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else ""
        if path and os.access(path, os.X_OK):
            return path
    except (OSError, subprocess.SubprocessError):
        pass
    path = os.environ.get(variable, "")
    if path and os.access(path, os.X_OK):
        return path
    _unavailable(f"no {name} binary: `deploy/local/stack.sh path {name}` failed and {variable} is not set "
                 f"(deploy/local/stack.sh install builds it)")


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _http(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (loopback only)
        return response.read().decode("utf-8", "replace")


def _ok(url: str) -> bool:
    try:
        _http(url, 2.0)
        return True
    except OSError:
        return False


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text exposition to (name, labels, value)."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)', line)
        if not m:
            continue
        labels = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        try:
            out.append((m.group(1), labels, float(m.group(4))))
        except ValueError:
            continue
    return out


def _sum(samples: list, name: str, **match: str) -> float:
    return sum(v for n, labels, v in samples
               if n in (name, name + "_total") and all(labels.get(k) == want for k, want in match.items()))


class Proc:
    """A process of the test, started, killed and stopped by its PID."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], tmp: Path, health: str | None) -> None:
        self.name, self.command, self.env, self.tmp, self.health = name, command, env, tmp, health
        self.process: subprocess.Popen | None = None
        self.starts = 0
        self.logs: list[Path] = []

    def start(self, wait_s: float = 60.0) -> float:
        self.starts += 1
        log = self.tmp / f"{self.name}-{self.starts}.log"
        self.logs.append(log)
        with open(log, "w", encoding="utf-8") as out:
            self.process = subprocess.Popen(self.command, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, cwd=ROOT)
        deadline = time.monotonic() + wait_s
        while self.health and not _ok(self.health):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{self.name} did not become healthy ({self.health}):\n{self.log()[-3000:]}")
            time.sleep(0.1)
        return time.time()

    def kill(self) -> int:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(10)
        return time.time_ns()

    def stop(self) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        try:
            os.kill(process.pid, signal.SIGTERM)
            process.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(5)
        except ProcessLookupError:
            pass

    def log(self) -> str:
        return "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in self.logs if p.exists())


def _namespace_prefix(hosts: Path) -> list[str]:
    """A command prefix running a program with `hosts` on /etc/hosts (deploy/local/stack.sh's way)."""
    script = 'mount --bind "$0" /etc/hosts && exec "$@"'
    for unshare in (["unshare", "--mount", "--propagation", "private"],
                    ["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"]):
        try:
            probe = subprocess.run([*unshare, "sh", "-c", script, str(hosts), "grep", "-q", "gateway-1", "/etc/hosts"],
                                   capture_output=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            continue
        if probe.returncode == 0:
            return [*unshare, "sh", "-c", script, str(hosts)]
    _unavailable("cannot make a private mount namespace (unshare --mount refused), so fleet.yml's gateway-1/"
                 "gateway-2 cannot resolve for Prometheus")


def _unavailable(reason: str) -> None:
    """Skip where the pieces are missing; in CI (CI=true, after stack.sh install) that is a failure."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(reason)
    pytest.skip(reason)


def _gateway_addresses() -> tuple[str, str] | None:
    """Two loopback addresses on which every default port of gateway.yaml is free."""
    rng = random.Random()
    for _ in range(30):
        a, b = rng.randrange(64, 250), rng.randrange(1, 250)
        hosts = (f"127.{a}.{b}.1", f"127.{a}.{b}.2")
        if all(_port_free(h, p) for h in hosts for p in GATEWAY_PORTS.values()):
            return hosts
    return None


class Prom:
    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str) -> list[dict[str, Any]]:
        body = json.loads(_http(f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"))
        return body["data"]["result"]

    def by(self, expr: str, label: str) -> dict[str, float]:
        return {r["metric"].get(label, ""): float(r["value"][1]) for r in self.query(expr)}


def _prometheus_counters(prom: Prom) -> dict[str, dict[str, int]]:
    sel = f'service_name="{SERVICE}"'
    queries = {
        "bytes": f"sum by (hicache_direction) (hicache_transfer_bytes_total{{{sel}}})",
        "blocks": f"sum by (hicache_direction) (hicache_transfer_blocks_total{{{sel}}})",
        "tokens": f'sum by (hicache_direction) (hicache_transfer_tokens_total{{{sel},hicache_pool="kv"}})',
        "ops": f"sum by (hicache_direction) (hicache_transfer_duration_seconds_count{{{sel}}})",
    }
    out: dict[str, dict[str, int]] = {d: {} for d in DIRECTIONS}
    for key, expr in queries.items():
        for direction, value in prom.by(expr, "hicache_direction").items():
            if direction in out:
                out[direction][key] = int(value)
    failed = prom.query(f'sum(otel_hicache_records_failed_total{{{sel},reason="event_error"}})')
    out["failed"] = {"ops": int(float(failed[0]["value"][1])) if failed else -1}
    return out


def _jaeger_traces(url: str, since_ns: int) -> dict[int, list[dict[str, Any]]]:
    # limit: below the memstore max_traces of deploy/jaeger/config.yaml (20,000), or Jaeger answers 500
    params = {"service": SERVICE, "limit": "15000", "start": str(since_ns // 1000),
              "end": str(time.time_ns() // 1000 + 60_000_000)}
    body = json.loads(_http(f"{url}/api/traces?{urllib.parse.urlencode(params)}", timeout=30))
    return {int(t["traceID"], 16): t["spans"] for t in body.get("data") or []}


def test_fleet_gateway_killed(tmp_path):
    otelcol = _binary("otelcol", "HICACHE_OTELCOL_BIN")
    jaeger_bin = _binary("jaeger", "HICACHE_JAEGER_BIN")
    prometheus_bin = _binary("prometheus", "HICACHE_PROMETHEUS_BIN")
    t_begin = time.monotonic()
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "JAEGER_", "HICACHE_"))}

    # -- addresses ----------------------------------------------------------------------
    hosts = _gateway_addresses()
    fleet_yml = ROOT / "deploy" / "prometheus" / "fleet.yml"
    gw_ports = [dict(GATEWAY_PORTS), dict(GATEWAY_PORTS)]
    if hosts is None:  # a default port is taken on every loopback address: free ports, a copy of fleet.yml
        hosts = ("127.0.0.1", "127.0.0.1")
        gw_ports = [{k: _free_port() for k in GATEWAY_PORTS} for _ in range(2)]
        text = fleet_yml.read_text(encoding="utf-8").replace("- rules/", f"- {fleet_yml.parent}/rules/")
        for i, ports in enumerate(gw_ports, 1):
            text = (text.replace(f'"gateway-{i}:8889"', f'"gateway-{i}:{ports["prom"]}"')
                        .replace(f'"gateway-{i}:8888"', f'"gateway-{i}:{ports["self"]}"'))
        fleet_yml = tmp_path / "fleet.yml"
        fleet_yml.write_text(text, encoding="utf-8")
        print(f"fleet: the default gateway ports are taken on every loopback address; "
              f"Prometheus runs from a copy of fleet.yml with free ports ({fleet_yml})")
    # -- TLS and the token between agents and gateways (deploy/fleet.md, Security) ------------
    sys.path.insert(0, str(ROOT / "tests"))
    from otlp_receiver import make_certificates  # pylint: disable=import-outside-toplevel

    (tmp_path / "tls").mkdir()
    tls = make_certificates(tmp_path / "tls", hosts=("localhost", "127.0.0.1", *hosts))
    token = secrets.token_urlsafe(32)
    token_file = tmp_path / "tls" / "fleet-token"
    token_file.write_text(f"{token} the fleet test's token\n", encoding="ascii")
    token_file.chmod(0o600)

    hosts_file = tmp_path / "hosts"
    hosts_file.write_text(f"127.0.0.1 localhost\n::1 localhost\n{hosts[0]} gateway-1\n{hosts[1]} gateway-2\n",
                          encoding="utf-8")
    ns = _namespace_prefix(hosts_file)

    jaeger_ports = {k: _free_port() for k in ("otlp", "health", "metrics", "http", "grpc")}
    jaeger_url = f"http://127.0.0.1:{jaeger_ports['http']}"
    jaeger = Proc("jaeger", [jaeger_bin, f"--config={ROOT / 'deploy' / 'jaeger' / 'config.yaml'}",
                             f"--set=extensions::jaeger_query::http::endpoint=127.0.0.1:{jaeger_ports['http']}",
                             f"--set=extensions::jaeger_query::grpc::endpoint=127.0.0.1:{jaeger_ports['grpc']}"],
                  {**base_env, "JAEGER_LISTEN_HOST": "127.0.0.1", "JAEGER_OTLP_GRPC_PORT": str(jaeger_ports["otlp"]),
                   "JAEGER_HEALTH_PORT": str(jaeger_ports["health"]),
                   "JAEGER_METRICS_PORT": str(jaeger_ports["metrics"])},
                  tmp_path, f"http://127.0.0.1:{jaeger_ports['health']}/status")

    gateways = []
    for i, (host, ports) in enumerate(zip(hosts, gw_ports), 1):
        env = {**base_env, "OTELCOL_LISTEN_HOST": host, "OTELCOL_OTLP_GRPC_PORT": str(ports["grpc"]),
               "OTELCOL_OTLP_HTTP_PORT": str(ports["http"]), "OTELCOL_METRICS_PORT": str(ports["self"]),
               "OTELCOL_PROMETHEUS_PORT": str(ports["prom"]), "OTELCOL_HEALTH_PORT": str(ports["health"]),
               "JAEGER_HOST": "127.0.0.1", "JAEGER_OTLP_GRPC_PORT": str(jaeger_ports["otlp"]),
               "HICACHE_TAIL_DECISION_WAIT": f"{DECISION_WAIT_S}s",
               "HICACHE_FLEET_TLS_CERT": tls["cert"], "HICACHE_FLEET_TLS_KEY": tls["key"],
               "HICACHE_FLEET_TOKEN_FILE": str(token_file)}
        gw = Proc(f"gateway-{i}", [otelcol, f"--config={ROOT / 'deploy' / 'otel-collector' / 'gateway.yaml'}"],
                  env, tmp_path, f"http://{host}:{ports['health']}/")
        gw.self_url = f"http://{host}:{ports['self']}/metrics"  # type: ignore[attr-defined]
        gw.prom_url = f"http://{host}:{ports['prom']}/metrics"  # type: ignore[attr-defined]
        gw.endpoint = f"{host}:{ports['grpc']}"  # type: ignore[attr-defined]
        gateways.append(gw)
    gateway_list = ",".join(g.endpoint for g in gateways)  # type: ignore[attr-defined]

    agents = {}
    for node in ("node-a", "node-b"):
        ports = {k: _free_port() for k in ("grpc", "http", "self", "health")}
        env = {**base_env, "OTELCOL_LISTEN_HOST": "127.0.0.1", "OTELCOL_OTLP_GRPC_PORT": str(ports["grpc"]),
               "OTELCOL_OTLP_HTTP_PORT": str(ports["http"]), "OTELCOL_METRICS_PORT": str(ports["self"]),
               "OTELCOL_HEALTH_PORT": str(ports["health"]), "HICACHE_GATEWAYS": gateway_list,
               "HICACHE_FLEET_CA_FILE": tls["ca"], "HICACHE_FLEET_TOKEN_FILE": str(token_file)}
        agent = Proc(f"agent-{node}", [otelcol, f"--config={ROOT / 'deploy' / 'otel-collector' / 'agent.yaml'}"],
                     env, tmp_path, f"http://127.0.0.1:{ports['health']}/")
        agent.self_url = f"http://127.0.0.1:{ports['self']}/metrics"  # type: ignore[attr-defined]
        agent.otlp = f"http://127.0.0.1:{ports['grpc']}"  # type: ignore[attr-defined]
        agents[node] = agent

    prom_port = _free_port()
    prom_url = f"http://127.0.0.1:{prom_port}"
    (tmp_path / "prometheus-data").mkdir()
    prometheus = Proc("prometheus", [*ns, prometheus_bin, f"--config.file={fleet_yml}",
                                     f"--storage.tsdb.path={tmp_path / 'prometheus-data'}",
                                     "--enable-feature=exemplar-storage",
                                     f"--web.listen-address=127.0.0.1:{prom_port}"],
                      base_env, tmp_path, f"{prom_url}/-/ready")
    prom = Prom(prom_url)
    workloads: dict[str, subprocess.Popen] = {}
    try:
        for proc in (jaeger, *gateways, *agents.values(), prometheus):
            proc.start()
        deadline = time.monotonic() + 30
        while True:  # Prometheus scrapes both gateways by name
            up = prom.by('up{job="otel-gateway"}', "instance")
            if len(up) == 2 and all(v == 1 for v in up.values()):
                break
            assert time.monotonic() < deadline, f"Prometheus does not scrape the gateways: {up}\n{prometheus.log()[-2000:]}"
            time.sleep(0.5)
        print(f"\nfleet: stack up in {time.monotonic() - t_begin:.1f} s: Jaeger, gateways at "
              f"{gateway_list} (gateway-1, gateway-2 for Prometheus), agents at "
              f"{', '.join(a.otlp for a in agents.values())}")  # type: ignore[attr-defined]

        # -- only a TLS client with the token gets through to a gateway ------------------------
        for host, ports in zip(hosts, gw_ports):
            answers, wrong = _probe_gateway(host, ports, tls["ca"], token)
            print(f"fleet: gateway {host}: " + "; ".join(f"{name} -> {got}" for name, got in answers.items()))
            assert not wrong, f"gateway {host} answered:\n" + "\n".join(wrong)

        # -- the two nodes ---------------------------------------------------------------
        outs = {}
        t0 = time.time_ns()
        for seed, (node, agent) in enumerate(agents.items(), 1):
            outs[node] = tmp_path / f"{node}.json"
            env = {**base_env, "OTEL_SERVICE_NAME": SERVICE, "OTEL_RESOURCE_ATTRIBUTES": f"host.name={node}",
                   "OTEL_EXPORTER_OTLP_ENDPOINT": agent.otlp, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",  # type: ignore[attr-defined]
                   "OTEL_METRIC_EXPORT_INTERVAL": "1000", "OTEL_BSP_SCHEDULE_DELAY": "200",
                   "OTEL_HICACHE_SHUTDOWN_TIMEOUT_S": "10", "PYTHONUNBUFFERED": "1",
                   "OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED": "true"}  # the SDK's self-metrics: spans exported
            err = open(tmp_path / f"{node}.stderr", "w", encoding="utf-8")
            workloads[node] = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--node", node,
                                                "--seed", str(seed), "--out", str(outs[node])],
                                               env=env, stdout=err, stderr=subprocess.STDOUT, cwd=ROOT)
            err.close()

        # -- the victim: the gateway that carries node-a's metrics ---------------------------
        victim = None
        deadline = time.monotonic() + 20
        while victim is None:
            for gw in gateways:
                try:
                    text = _http(gw.prom_url)  # type: ignore[attr-defined]
                except OSError:
                    continue
                if re.search(r'hicache_transfer_bytes_total\{[^}]*host_name="node-a"', text):
                    victim = gw
                    break
            assert victim is not None or time.monotonic() < deadline, "no gateway exposes node-a's metrics"
            time.sleep(0.3)
        node_b_on_victim = bool(re.search(r'host_name="node-b"', _http(victim.prom_url)))  # type: ignore[attr-defined]
        while (time.time_ns() - t0) / 1e9 < KILL_AFTER_S:
            time.sleep(0.05)
        pre_kill_text = _http(victim.self_url)  # type: ignore[attr-defined]
        pre_kill = _samples(pre_kill_text)
        t_kill = victim.kill()
        time.sleep(DOWN_S)
        t_ready = victim.start()
        carried = "node-a's and node-b's" if node_b_on_victim else "node-a's (node-b's were on the other)"
        print(f"fleet: killed {victim.name} (SIGKILL) {(t_kill - t0) / 1e9:.1f} s into the run, healthy again "
              f"{t_ready - t_kill / 1e9:.1f} s later; it carried {carried} metrics")

        for node, process in workloads.items():
            rc = process.wait(SECONDS + 60)
            assert rc == 0, f"{node} workload failed (rc {rc}):\n{(tmp_path / f'{node}.stderr').read_text()[-3000:]}"
        t_done = time.monotonic()
        runs = {node: json.loads(path.read_text(encoding="utf-8")) for node, path in outs.items()}

        # -- (1) counters in Prometheus vs ground truth ---------------------------------------
        want: dict[str, dict[str, int]] = {d: {k: sum(r["truth"][d][k] for r in runs.values())
                                               for k in ("ops", "bytes", "blocks", "tokens")} for d in DIRECTIONS}
        want["failed"] = {"ops": sum(r["failed"] for r in runs.values())}
        got: dict[str, dict[str, int]] = {}
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline:
            got = _prometheus_counters(prom)
            if got == want:
                break
            time.sleep(1.0)
        counters_s = time.monotonic() - t_done
        per_node = prom.by(f'sum by (host_name) (hicache_transfer_bytes_total{{service_name="{SERVICE}"}})',
                           "host_name")

        # -- (2) traces in Jaeger -------------------------------------------------------------
        settle = DECISION_WAIT_S + 4
        time.sleep(max(0.0, settle - (time.monotonic() - t_done)))
        stored: dict[int, list] = {}
        for _ in range(20):
            now_stored = _jaeger_traces(jaeger_url, t0 - 60 * 10**9)
            if stored and len(now_stored) == len(stored):
                break
            stored = now_stored
            time.sleep(1.5)
        stored = now_stored
        for _ in range(5):  # Jaeger's own count and its store, read when they agree
            jaeger_text = _http(f"http://127.0.0.1:{jaeger_ports['metrics']}/metrics")
            spans_in_jaeger = sum(len(s) for s in stored.values())
            if _sum(_samples(jaeger_text), "otelcol_receiver_accepted_spans") == spans_in_jaeger:
                break
            time.sleep(1.0)
            stored = _jaeger_traces(jaeger_url, t0 - 60 * 10**9)

        # in flight at the kill: sent (agent batch, 1 s) but not yet decided (decision_wait, a 1 s
        # tick) and handed to Jaeger (batch, 1 s) when the gateway died; with room for a slow machine
        window = (t_kill - (DECISION_WAIT_S + 7) * 10**9, t_kill + 500_000_000)
        must = {"e": [0, 0, 0, 0], "s": [0, 0, 0, 0]}  # outside window: sent, kept; inside: sent, kept
        normal_out = [0, 0]
        normal_in = [0, 0]
        incomplete_must = 0
        missing_outside: list[str] = []
        sent_spans = 0
        for run in runs.values():
            sent_spans += run["delivery"]["spans"]["exported"]
            for tid, kind, at in zip(run["trace_ids"], run["kinds"], run["submit_ns"]):
                inside = window[0] <= at <= window[1]
                spans = stored.get(int(tid, 16))
                kept = spans is not None
                if kind in must:
                    row = must[kind]
                    row[2 if inside else 0] += 1
                    row[3 if inside else 1] += kept
                    if not inside and not kept:
                        missing_outside.append(f"{run['node']}:{tid}:{kind}")
                    if not inside and kept and len(spans) != 2:
                        incomplete_must += 1
                else:
                    target = normal_in if inside else normal_out
                    target[0] += 1
                    target[1] += kept
        lost_must = (must["e"][2] - must["e"][3]) + (must["s"][2] - must["s"][3])

        # what the gateways refused is nowhere: its error span would have been kept, its point
        # scraped (a range, as the victim's series went stale at the kill)
        services = json.loads(_http(f"{jaeger_url}/api/services")).get("data") or []
        intruder_series = prom.query(f'count_over_time({{service_name="{INTRUDER}"}}[15m])')

        # -- (3) the Collectors' own metrics ----------------------------------------------------
        raw = {f"agent-{n}": _http(a.self_url) for n, a in agents.items()}  # type: ignore[attr-defined]
        raw.update({g.name: _http(g.self_url) for g in gateways})  # type: ignore[attr-defined]
        raw["jaeger"] = jaeger_text
        for name, text in raw.items():  # kept beside the logs, for a look at the real names
            (tmp_path / f"{name}.metrics.txt").write_text(text, encoding="utf-8")
        (tmp_path / f"{victim.name}-before-kill.metrics.txt").write_text(pre_kill_text, encoding="utf-8")
        agent_m = {n: _samples(raw[f"agent-{n}"]) for n in agents}
        gw_m = {g.name: _samples(raw[g.name]) for g in gateways}
        jaeger_m = _samples(raw["jaeger"])
        # Collector 0.161 names these without unit or _total (otelcol_process_memory_rss);
        # Jaeger 2.13, on an older Collector, with them (otelcol_process_memory_rss_bytes)
        cpu = {name: (_sum(_samples(text), "otelcol_process_cpu_seconds"),
                      (_sum(_samples(text), "otelcol_process_memory_rss")
                       + _sum(_samples(text), "otelcol_process_memory_rss_bytes")) / 2**20)
               for name, text in raw.items()}
        a_accepted = sum(_sum(m, "otelcol_receiver_accepted_spans") for m in agent_m.values())
        a_sent = sum(_sum(m, "otelcol_exporter_sent_spans", exporter="load_balancing/traces") for m in agent_m.values())
        a_failed = sum(_sum(m, "otelcol_exporter_send_failed_spans") for m in agent_m.values())
        a_points_failed = sum(_sum(m, "otelcol_exporter_send_failed_metric_points") for m in agent_m.values())
        a_outcome_fail = sum(_sum(m, "otelcol_loadbalancer_backend_outcome", success="false") for m in agent_m.values())
        retry_lines = sum(a.log().count("Exporting failed. Will retry the request after interval.")
                          for a in agents.values())
        retry_lines_victim = sum(len(re.findall(r"Exporting failed\. Will retry.*" + re.escape(victim.endpoint), a.log()))  # type: ignore[attr-defined]
                                 for a in agents.values())
        g_accepted_pre = _sum(pre_kill, "otelcol_receiver_accepted_spans")
        g_accepted = sum(_sum(m, "otelcol_receiver_accepted_spans") for m in gw_m.values()) + g_accepted_pre
        on_memory = _sum(pre_kill, "otelcol_processor_tail_sampling_sampling_traces_on_memory")
        new_traces_pre = _sum(pre_kill, "otelcol_processor_tail_sampling_new_trace_id_received")
        decided_pre = _sum(pre_kill, "otelcol_processor_tail_sampling_global_count_traces_sampled", sampled="true")
        decided = sum(_sum(m, "otelcol_processor_tail_sampling_global_count_traces_sampled", sampled="true")
                      for m in gw_m.values()) + decided_pre
        g_sent_pre = _sum(pre_kill, "otelcol_exporter_sent_spans", exporter="otlp_grpc/jaeger")
        g_sent = sum(_sum(m, "otelcol_exporter_sent_spans", exporter="otlp_grpc/jaeger") for m in gw_m.values()) + g_sent_pre
        g_send_failed = sum(_sum(m, "otelcol_exporter_send_failed_spans") for m in gw_m.values())
        j_accepted = _sum(jaeger_m, "otelcol_receiver_accepted_spans")
        per_policy = {}
        for m in [pre_kill, *gw_m.values()]:
            for n, labels, v in m:
                if n.startswith("otelcol_processor_tail_sampling_count_traces_sampled") and labels.get("sampled") == "true":
                    per_policy[labels.get("policy", "?")] = per_policy.get(labels.get("policy", "?"), 0) + v

        # -- figures ---------------------------------------------------------------------
        total_ops = sum(r["ops"] for r in runs.values())
        meas = {k: sum(r["measured"][k] for r in runs.values()) for k in runs["node-a"]["measured"]}
        print("fleet: per node: " + "; ".join(
            f"{r['node']}: {r['ops']} ops in {r['elapsed_s']:.1f} s, "
            f"{r['delivery']['spans']['exported'] / r['elapsed_s']:.0f} spans/s, "
            f"{r['failed']} error ops, {r['kinds'].count('s')} slow ops" for r in runs.values()))
        print(f"fleet: spans per op {meas['spans'] / total_ops:.2f}; OTLP bytes per span "
              f"{meas['otlp_bytes'] / meas['spans']:.0f} (protobuf, uncompressed), "
              f"{meas['otlp_gzip_bytes'] / meas['spans']:.0f} gzip, in batches of "
              f"{meas['spans'] / max(1, meas['batches']):.0f} spans; the hicache.* spans alone "
              f"{meas['transfer_otlp_bytes'] / max(1, meas['transfer_spans']):.0f} and "
              f"{meas['transfer_otlp_gzip_bytes'] / max(1, meas['transfer_spans']):.0f}")
        print(f"fleet: (1) Prometheus counters {'== ground truth' if got == want else '!= ground truth'} "
              f"{counters_s:.1f} s after the workloads ended: {json.dumps(got)}; bytes per node {per_node}")
        print(f"fleet: (2) Jaeger holds {len(stored)} traces ({spans_in_jaeger} spans). Outside the kill "
              f"window: errors {must['e'][1]}/{must['e'][0]}, slow {must['s'][1]}/{must['s'][0]} kept "
              f"({incomplete_must} incomplete), base rate {normal_out[1]}/{normal_out[0]} = "
              f"{100 * normal_out[1] / max(1, normal_out[0]):.2f}% (policy {BASE_PERCENT}%). In the window "
              f"[{(window[0] - t_kill) / 1e9:.0f} s, +{(window[1] - t_kill) / 1e9:.1f} s] around the kill: errors "
              f"{must['e'][3]}/{must['e'][2]}, slow {must['s'][3]}/{must['s'][2]}, ordinary "
              f"{normal_in[1]}/{normal_in[0]} kept: {lost_must} must-keep traces lost to the kill")
        print(f"fleet: (3) spans: workloads exported {sent_spans}, agents accepted {a_accepted:.0f} and handed "
              f"{a_sent:.0f} to the per-gateway queues (send_failed {a_failed:.0f} spans, {a_points_failed:.0f} "
              f"points; backend failures {a_outcome_fail:.0f}; retry log lines {retry_lines}, {retry_lines_victim} "
              f"naming {victim.name}); gateways accepted {g_accepted:.0f} ({g_accepted_pre:.0f} by "
              f"{victim.name} before the kill); {victim.name} held {on_memory:.0f} undecided traces at the kill "
              f"(of {new_traces_pre:.0f} it had received); traces sampled {decided:.0f} "
              f"(per policy {json.dumps({k: int(v) for k, v in sorted(per_policy.items())})}), spans sent to "
              f"Jaeger {g_sent:.0f} (failed {g_send_failed:.0f}), Jaeger accepted {j_accepted:.0f}")
        print("fleet: Collector CPU and RSS at the end (the victim since its restart): " + ", ".join(
            f"{name} {c:.1f} s / {r:.0f} MiB" for name, (c, r) in cpu.items()))
        print(f"fleet: refused clients' data: Jaeger services {services}, Prometheus series of {INTRUDER}: "
              f"{len(intruder_series)}")
        print(f"fleet: test took {time.monotonic() - t_begin:.0f} s")

        # -- assertions ------------------------------------------------------------------
        problems = []
        if INTRUDER in services or intruder_series or SERVICE not in services:
            problems.append(f"refused data arrived: Jaeger services {services}, Prometheus {intruder_series}")
        if got != want:
            problems.append(f"counters {got} != ground truth {want}")
        if missing_outside:
            problems.append(f"{len(missing_outside)} must-keep traces outside the kill window missing: "
                            f"{missing_outside[:10]}")
        if incomplete_must:
            problems.append(f"{incomplete_must} must-keep traces outside the kill window are incomplete")
        if min(must["e"][0], must["s"][0]) < 20:
            problems.append(f"too few error/slow ops to test the policy: {must}")
        n, k, p = normal_out[0], normal_out[1], BASE_PERCENT / 100
        sigma = math.sqrt(n * p * (1 - p))
        if abs(k - n * p) > 5 * sigma + 5:
            problems.append(f"base rate {k}/{n} is not plausibly {BASE_PERCENT}%")
        if sent_spans != 2 * total_ops or a_accepted != sent_spans:
            problems.append(f"spans: {2 * total_ops} made, workloads exported {sent_spans}, agents accepted {a_accepted}")
        if a_sent != a_accepted or a_failed or a_points_failed or a_outcome_fail:
            problems.append("the agents refused or failed data (they should have queued it)")
        if retry_lines_victim == 0:
            problems.append(f"no agent logged a retry to {victim.name}")
        # every span the agents handed on was accepted by a gateway, but for those the killed
        # gateway took in its last moments (after the pre-kill scrape) or twice (a retried
        # request it had already accepted): a small difference either way
        if abs(g_accepted - a_sent) > max(200, 0.02 * a_sent):
            problems.append(f"gateways accepted {g_accepted} spans, agents sent {a_sent}")
        if on_memory <= 0 or lost_must > on_memory:
            problems.append(f"{lost_must} must-keep traces lost, {on_memory} traces in the killed gateway's memory")
        if j_accepted != spans_in_jaeger or abs(g_sent - j_accepted) > 100:
            problems.append(f"Jaeger accepted {j_accepted} spans, stores {spans_in_jaeger}, gateways sent {g_sent}")
        if g_send_failed:
            problems.append(f"gateways failed {g_send_failed} spans to Jaeger")
        elapsed = time.monotonic() - t_begin
        if elapsed > 170:
            problems.append(f"the test took {elapsed:.0f} s (bound: 3 minutes)")
        assert not problems, "\n".join(problems)
    finally:
        for process in workloads.values():
            if process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)
                process.wait(5)
        for proc in (prometheus, *agents.values(), *gateways, jaeger):
            proc.stop()  # by PID; nothing when it never started or already exited
