"""The real SGLang 0.5.23 HiCache code on CPU, sending into a running stack (e2e/run.sh).

Does what a scheduler process does: SGLang's own ``load_plugins()`` loads otel-hicache
through the ``sglang.srt.plugins`` entry point, configured only by the ``OTEL_*``
variables of the environment; then real HiCache transfers run through the real
controller, transfer engine, KV pools and radix cache (the CPU harness of the adapter's
tests): write-through round trips (one merged offload and one merged onboard each) and a
decode retraction (two direct copies). With SGLang's own request tracing on (its
``process_tracing_init``, as ``--enable-trace`` runs it in a scheduler, exporting to the
same Collector), traced round trips: a request's insert backs up its KV, a later
request's admission loads it back, each op linked to its request. Writes what it did,
the requests' trace ids and SGLang's own counter deltas, to ``--truth-json`` for
e2e/check_pipeline.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "instrumentation" / "otel-hicache-sglang" / "tests"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--round-trips", type=int, default=20, help="write-through round trips (default 20)")
    parser.add_argument("--traced-round-trips", type=int, default=2,
                        help="round trips of two traced requests, with SGLang's request tracing on (default 2; 0: off)")
    parser.add_argument("--request-service", default="sglang-e2e-requests",
                        help="service name of SGLang's own request spans (its --otlp-service-name)")
    parser.add_argument("--truth-json", required=True)
    args = parser.parse_args(argv)

    import sglang_cpu  # the adapter tests' CPU harness (three documented CPU substitutions)

    sglang_cpu.install_cpu_support()
    from sglang.srt.plugins import load_plugins

    before = sglang_cpu.sglang_counter_values()
    load_plugins()  # as every SGLang scheduler does: otel-hicache comes in through its entry point
    from otel_hicache_sglang import SGLangHiCacheInstrumentor

    from otel_hicache.sinks.spans import trace_id_hex

    if not SGLangHiCacheInstrumentor().is_instrumented_by_opentelemetry:
        print("sglang_workload: otel-hicache was not loaded by SGLang's load_plugins()", file=sys.stderr)
        return 1
    if args.traced_round_trips:
        # what run_scheduler_process does with --enable-trace, after load_plugins() and before
        # the scheduler builds its cache: SGLang's own provider (64-bit ids), set globally
        from sglang.srt.observability.trace import process_tracing_init

        process_tracing_init(os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"], args.request_service)
    truth = {"offload": {"ops": 0, "bytes": 0, "tokens": 0}, "onboard": {"ops": 0, "bytes": 0, "tokens": 0},
             "direct": {"ops": 0, "tokens": 0, "offload": {"ops": 0, "tokens": 0},
                        "onboard": {"ops": 0, "tokens": 0}}}
    for i in range(args.round_trips):
        # A fresh cache per round trip: on one cache the device eviction of the next round
        # trip would take the least recently used node (an earlier sequence, loaded back),
        # not the one just inserted, and its load-back would find nothing on the host.
        stack = sglang_cpu.build_stack("write_through")
        r = sglang_cpu.write_through_round_trip(stack, start=100 + 50 * i)
        for d, prefix in (("offload", "offload"), ("onboard", "onboard")):
            truth[d]["ops"] += r[f"merged_{d}s"]
            truth[d]["bytes"] += r[f"{prefix}_bytes"]
            truth[d]["tokens"] += r[f"{prefix}_tokens"]
    truth["requests"] = []
    for i in range(args.traced_round_trips):
        stack = sglang_cpu.build_stack("write_through")
        r = sglang_cpu.traced_round_trip(stack, start=5000 + 50 * i)
        for d in ("offload", "onboard"):
            truth[d]["ops"] += r[f"merged_{d}s"]
            truth[d]["bytes"] += r[f"{d}_bytes"]
            truth[d]["tokens"] += r[f"{d}_tokens"]
        for role, cause in (("writer", "write_through"), ("reader", "prefix_hit")):
            root = r[role]
            truth["requests"].append({"trace_id": trace_id_hex(root), "span_id": f"{root.span_id:016x}",
                                      "cause": cause, "service": args.request_service})
    retraction = sglang_cpu.decode_retraction(sglang_cpu.build_stack("write_through"))
    truth["direct"]["ops"] += 2  # the backup and the restore copy
    truth["direct"]["tokens"] += retraction["direct_offload_tokens"] + retraction["direct_onboard_tokens"]
    for d in ("offload", "onboard"):  # per direction: one backup (offload), one restore (onboard)
        truth["direct"][d]["ops"] += 1
        truth["direct"][d]["tokens"] += retraction[f"direct_{d}_tokens"]
    after = sglang_cpu.sglang_counter_values()
    truth["sglang"] = {name + json.dumps(dict(sorted(labels))): after[(name, labels)] - before.get((name, labels), 0.0)
                       for name, labels in after if after[(name, labels)] != before.get((name, labels), 0.0)}
    Path(args.truth_json).write_text(json.dumps(truth, indent=1, sort_keys=True), encoding="utf-8")
    print(f"sglang_workload: {truth['offload']['ops']} merged offloads ({truth['offload']['bytes']} B), "
          f"{truth['onboard']['ops']} merged onboards ({truth['onboard']['bytes']} B), "
          f"{truth['direct']['ops']} decode-retraction copies, {len(truth['requests'])} traced requests, "
          "through SGLang's plugin entry point")
    return 0  # exit hooks registered by otel-hicache flush and export


if __name__ == "__main__":
    sys.exit(main())
