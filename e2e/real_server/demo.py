"""otel-hicache on a real SGLang server, on CPU (run by scripts/demo-server.sh).

Starts the telemetry stack (the real Collector, Jaeger and Prometheus, from the shipped
configs) and ``python -m sglang.launch_server`` with HiCache and SGLang's request tracing,
otel-hicache loaded by SGLang's plugin entry point and configured only by ``OTEL_*``; sends
requests that force offload and load-back; prints the spans and bytes per direction and cause
beside SGLang's own counters, and where to look; stops everything it started (after Enter,
when run in a terminal).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import urllib.parse
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))
import check_pipeline as cp  # noqa: E402
from real_server import server as rs  # noqa: E402

JAEGER, PROMETHEUS = "http://127.0.0.1:16686", "http://127.0.0.1:9090"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", default="write_through", choices=("write_through", "write_back"))
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2, help="prefix, fillers, prefix again (default 2)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hicache-demo-server."))
    env = {**os.environ, "HICACHE_STACK_STATE": str(work / "stack")}
    stack = [str(ROOT / "deploy" / "local" / "stack.sh")]
    service = "sglang-demo"
    print(f"demo-server: starting the stack (logs in {work})", flush=True)
    subprocess.run(["bash", *stack, "up"], env=env, check=True, stdout=subprocess.DEVNULL)
    started_us = int(time.time() * 1e6)
    try:
        model = rs.make_model(work / "model")
        print(f"demo-server: starting SGLang {metadata.version('sglang')} on CPU "
              f"({args.policy}, page size {args.page_size}); about a minute", flush=True)
        server = rs.Server(model, work / "server.log", policy=args.policy, page_size=args.page_size,
                           trace=True, service=service)
        with server:
            timings = rs.workload(server, rounds=args.rounds)
            time.sleep(2.0)  # the last acks
            sglang = server.hicache_counters()
            children = server.telemetry_processes()
        left = server.alive()
        print(f"demo-server: {len(timings)} requests; the server stopped, and with it its telemetry process "
              f"(pid {', '.join(map(str, children)) or 'none'}): "
              f"{'nothing left running' if not left else f'still running: {left}'}", flush=True)
        jaeger = cp.Jaeger(JAEGER, started_us)
        spans = rs.transfer_spans(jaeger, service, sglang)
        report(spans, sglang, service, jaeger)
        if sys.stdin.isatty():
            input("demo-server: press Enter to stop the stack ")
        return 0 if rs.span_sums(spans, by=None) == _total(sglang) else 1
    finally:
        subprocess.run(["bash", *stack, "down", "-v"], env=env, check=False, stdout=subprocess.DEVNULL)


def _total(sglang: dict) -> dict:
    out: dict = {}
    for (d, what, _), v in sglang.items():
        out[(d, what, "0")] = out.get((d, what, "0"), 0.0) + v
    return out


def report(spans: dict, sglang: dict, service: str, jaeger: cp.Jaeger) -> None:
    by_cause = rs.span_sums(spans, by="hicache.cause")
    total = _total(sglang)
    print(f"\n{'direction':9}  {'cause':14} {'spans':>5} {'tokens':>7} {'bytes':>10}   "
          f"{'SGLang tokens':>13} {'SGLang bytes':>12}  equal")
    for d in rs.SPAN_NAMES:
        causes = sorted({k[2] for k in by_cause if k[0] == d})
        for cause in causes:
            n = sum(1 for t in spans[d] if t["hicache.cause"] == cause)
            print(f"{d:9}  {cause:14} {n:5d} {by_cause[(d, 'tokens', cause)]:7.0f} "
                  f"{by_cause[(d, 'bytes', cause)]:10,.0f}")
        ours = rs.span_sums({d: spans[d]}, by=None)
        equal = all(ours.get((d, w, "0"), 0) == total.get((d, w, "0"), 0) for w in ("tokens", "bytes"))
        print(f"{d:9}  {'(all)':14} {len(spans[d]):5d} {ours.get((d, 'tokens', '0'), 0):7.0f} "
              f"{ours.get((d, 'bytes', '0'), 0):10,.0f}   {total.get((d, 'tokens', '0'), 0):13.0f} "
              f"{total.get((d, 'bytes', '0'), 0):12,.0f}  {'yes' if equal else 'NO'}")
    onboard = [t for t in spans["onboard"] if t["_references"]] or spans["onboard"]
    query = f'sum by (hicache_direction, hicache_cause) (hicache_transfer_bytes_total{{job="{service}"}})'
    print("\nwhere to look:")
    if onboard:
        print(f"  a load-back span in Jaeger:  {JAEGER}/trace/{onboard[0]['_trace']}")
        for ref in onboard[0]["_references"]:  # what its links open
            tr, _ = jaeger.trace(ref["traceID"])
            name = next((s["operationName"] for s in (tr or {}).get("spans") or []
                         if s["spanID"] == ref["spanID"]), "(not found)")
            print(f"    links to {name!r}: {JAEGER}/trace/{ref['traceID']}")
    print(f"  bytes by direction and cause: {PROMETHEUS}/query?g0.expr={urllib.parse.quote(query)}")
    print(f"    PromQL: {query}")


if __name__ == "__main__":
    sys.exit(main())
