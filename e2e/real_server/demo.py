"""otel-hicache on a real SGLang server on CPU (scripts/demo-server.sh): the stack, the server,
requests forcing offload and load-back; the spans beside SGLang's counters, where to look."""

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import STACK, Jaeger  # noqa: E402
from real_server import server as rs  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split(" (")[0])
    parser.add_argument("--policy", default="write_through", choices=("write_through", "write_back"))
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2, help="prefix, fillers, prefix again")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hicache-demo-server."))
    env = os.environ | {"HICACHE_STACK_STATE": str(work / "stack")}
    print(f"demo-server: the stack and SGLang on CPU ({args.policy}, page size {args.page_size}); logs in {work}")
    subprocess.run(["bash", STACK, "up"], env=env, check=True, stdout=subprocess.DEVNULL)
    try:
        with rs.Server(rs.make_model(work / "model"), work / "server.log", policy=args.policy,
                       page_size=args.page_size, trace=True, service="sglang-demo") as server:
            print(f"demo-server: {len(rs.workload(server, rounds=args.rounds))} requests", flush=True)
            sglang = server.settled_counters()
        spans = rs.transfer_spans(Jaeger(), "sglang-demo", sglang)
        equal = report(spans, sglang)
        if sys.stdin.isatty():
            input("demo-server: press Enter to stop the stack ")
        return 0 if equal else 1
    finally:
        subprocess.run(["bash", STACK, "down", "-v"], env=env, check=False, stdout=subprocess.DEVNULL)


def report(spans: dict, sglang: dict) -> bool:
    """Print the spans per direction and cause, whether they equal SGLang's counters."""
    by_cause = rs.span_sums(spans, by="hicache.cause")
    print(f"{'direction':9} {'cause':14} {'spans':>5} {'tokens':>8} {'bytes':>11}")
    for d, _, cause in sorted(k for k in by_cause if k[1] == "tokens"):
        n = sum(s["attrs"]["hicache.cause"] == cause for s in spans[d])
        print(f"{d:9} {cause:14} {n:5} {by_cause[d, 'tokens', cause]:8.0f} {by_cause[d, 'bytes', cause]:11,.0f}")
    equal = rs.span_sums(spans) == sglang
    print(f"tokens and bytes per direction and rank equal SGLang's own counters: {'yes' if equal else f'NO {sglang}'}")
    print("where to look: Jaeger http://127.0.0.1:16686 (service sglang-demo), Prometheus http://127.0.0.1:9090:"
          ' sum by (hicache_direction, hicache_cause) (hicache_transfer_bytes_total{job="sglang-demo"})')
    return equal


if __name__ == "__main__":
    sys.exit(main())
