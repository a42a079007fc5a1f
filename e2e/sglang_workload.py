"""The real SGLang HiCache code on CPU sending into the stack, as a scheduler process does: SGLang's
load_plugins() loads otel-hicache, configured only by OTEL_*; write-through round trips (a merged
offload and onboard each), traced ones with SGLang's request tracing on (process_tracing_init, as
--enable-trace runs it), a decode retraction (two direct copies), through the adapter tests' CPU
harness. Writes its ground truth, the traced requests and SGLang's counter deltas to --truth-json."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "instrumentation/otel-hicache-sglang/tests"))
import sglang_cpu  # noqa: E402  (the adapter tests' CPU harness)

REQUEST_SERVICE = "sglang-e2e-requests"  # SGLang's own request spans (its --otlp-service-name)
ROUND_TRIPS, TRACED = 20, 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split(":")[0])
    parser.add_argument("--truth-json", required=True)
    out = parser.parse_args().truth_json
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
    for i in range(ROUND_TRIPS + TRACED):
        # a fresh cache each time: on one cache the next eviction takes an older, loaded-back node
        cache = sglang_cpu.build_stack("write_through")
        traced = i >= ROUND_TRIPS
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
    Path(out).write_text(json.dumps({"merged": merged, "direct": direct, "requests": requests,
                                                 "request_service": REQUEST_SERVICE, "sglang": counters}))
    return 0  # otel-hicache's exit hooks flush and export


if __name__ == "__main__":
    sys.exit(main())
