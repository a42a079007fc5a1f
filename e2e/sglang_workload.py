"""The real SGLang HiCache code on CPU sending into a running stack, as a scheduler process does:
SGLang's own load_plugins() loads otel-hicache through its entry point, configured only by
OTEL_*; write-through round trips (a merged offload and onboard each), traced ones with SGLang's
request tracing on (its process_tracing_init, as --enable-trace runs it), and a decode
retraction (two direct copies), through the adapter tests' CPU harness. Writes what it did,
the traced requests and SGLang's own counter deltas to --truth-json (e2e/conftest.py)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "instrumentation/otel-hicache-sglang/tests"))
import sglang_cpu  # noqa: E402  (the adapter tests' CPU harness)

REQUEST_SERVICE = "sglang-e2e-requests"  # SGLang's own request spans (its --otlp-service-name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--round-trips", type=int, default=20)
    parser.add_argument("--traced-round-trips", type=int, default=2)
    parser.add_argument("--truth-json", required=True)
    args = parser.parse_args()
    sglang_cpu.install_cpu_support()
    from sglang.srt.plugins import load_plugins

    before = sglang_cpu.sglang_counter_values()
    load_plugins()
    from otel_hicache_sglang import SGLangHiCacheInstrumentor
    from sglang.srt.observability.trace import process_tracing_init

    from otel_hicache.sinks.spans import trace_id_hex
    assert SGLangHiCacheInstrumentor().is_instrumented_by_opentelemetry, "load_plugins() did not load otel-hicache"
    # what the scheduler does with --enable-trace before it builds its cache: SGLang's provider, global
    process_tracing_init(os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"], REQUEST_SERVICE)
    merged = {d: {"ops": 0, "bytes": 0, "tokens": 0} for d in ("offload", "onboard")}
    requests = []
    for i in range(args.round_trips + args.traced_round_trips):
        # a fresh cache each time: on one cache the next eviction takes an older, loaded-back node
        cache = sglang_cpu.build_stack("write_through")
        traced = i >= args.round_trips
        run = (sglang_cpu.traced_round_trip if traced else sglang_cpu.write_through_round_trip)(cache, start=100 + 50 * i)
        for d, row in merged.items():
            row["ops"] += run[f"merged_{d}s"]
            row["bytes"] += run[f"{d}_bytes"]
            row["tokens"] += run[f"{d}_tokens"]
        requests += [{"trace_id": trace_id_hex(run[role]), "span_id": f"{run[role].span_id:016x}", "cause": cause}
                     for role, cause in (("writer", "write_through"), ("reader", "prefix_hit")) if traced]
    retraction = sglang_cpu.decode_retraction(sglang_cpu.build_stack("write_through"))
    direct = {d: {"ops": 1, "tokens": retraction[f"direct_{d}_tokens"]} for d in merged}  # a backup, a restore
    after = sglang_cpu.sglang_counter_values()
    counters = [[name, dict(labels), value - before.get((name, labels), 0.0)]
                for (name, labels), value in after.items() if value != before.get((name, labels), 0.0)]
    Path(args.truth_json).write_text(json.dumps({"merged": merged, "direct": direct, "requests": requests,
                                                 "request_service": REQUEST_SERVICE, "sglang": counters}))
    return 0  # otel-hicache's exit hooks flush and export


if __name__ == "__main__":
    sys.exit(main())
