"""A bounded soak with the real Collector in the path.

    tests/paced_workload.py --OTLP gRPC--> Collector (deploy/local/stack.sh) --OTLP/HTTP--> counting sink

Default: 5 minutes at 1,500 merged ops/s, spans at 100%, metrics every 5 s, configured only by
``OTEL_*``. The sink (in this process) counts every span and keeps each series' newest point.
Checks, as a table: the transfer counters at the sink equal the workload's ground truth; every
span arrived and the SDK's self-metrics (``otel.sdk.*``) count every one exported; export errors
0; RSS, the pipeline's and span processor's queue depths and the CPU time per op stay flat (the
last minute against the minute after warm-up).

Needs ``bash deploy/local/stack.sh install``; ``--seconds``/``--rate`` shorten it; a failed check
exits 1.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "e2e"))
sys.path.insert(0, str(ROOT / "tests"))

from bench_common import CountingSink  # noqa: E402  (this script's folder)
from collector_process import Collector  # noqa: E402
from paced_runs import NewestPoints, run_workload  # noqa: E402


def _window(samples: list[dict[str, Any]], start_s: float, end_s: float, key: str) -> list[float]:
    return [s[key] for s in samples if start_s <= s["t"] < end_s]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=300.0)
    # A soak checks stability (flat memory, queues and cost; exact delivery), not capacity: its
    # rate leaves a 2-core machine headroom below the one at which the completion queue fills.
    parser.add_argument("--rate", type=float, default=1500.0, help="merged ops per second")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="hicache-soak."))
    points = NewestPoints()  # the newest point of every transfer counter series at the sink
    sink = CountingSink(on_metrics=points.add)

    def sink_counters() -> dict[str, dict[str, int]]:
        with sink.lock:
            return points.counters()

    collector = Collector(tmp, sink.endpoint)
    try:  # the Collector and the sink stop whatever happens (a crash once left it running)
        collector.start()
        env = {
            "OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED": "true",  # the delivery counts (run_workload's default too)
            "OTEL_SERVICE_NAME": "hicache-soak",
            "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint("grpc"),
            "OTEL_METRIC_EXPORT_INTERVAL": "5000",
        }
        print(f"soak: {args.rate:,.0f} ops/s for {args.seconds:.0f} s ({int(args.rate * args.seconds):,} ops), "
              f"spans at 100%, through the Collector ({collector.binary})", flush=True)
        started = time.monotonic()
        run = run_workload(tmp, env, "--rate", str(args.rate), "--seconds", str(args.seconds), "--summary",
                           "--no-op-attribute", timeout_s=args.seconds + 300)
        result = run.result
        truth = result["truth"]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (sink_counters() != truth or sink.spans < result["ops"]):
            time.sleep(0.2)
    finally:
        collector.stop()
        sink.stop()
    wall = time.monotonic() - started

    samples = result["samples"]
    end = samples[-1]["t"] if samples else 0.0
    warm = (min(60.0, end / 5), min(120.0, 2 * end / 5))  # the minute after warm-up (shorter runs: scaled)
    last = (end - (warm[1] - warm[0]), end + 1)
    rss_warm = statistics.median(_window(samples, *warm, "rss"))
    rss_last = statistics.median(_window(samples, *last, "rss"))
    # The completion queue by its median per window: on a shared 2-core machine the poller falls
    # behind for seconds at times and drains again, in either window, so a window's maximum is one
    # episode, not a trend. Growth moves the median; a dropped record breaks the exact counters.
    pipe_warm = statistics.median(_window(samples, *warm, "pipeline"))
    pipe_last = statistics.median(_window(samples, *last, "pipeline"))
    pipe_max = (max(_window(samples, *warm, "pipeline")), max(_window(samples, *last, "pipeline")))
    spanq_warm, spanq_last = max(_window(samples, *warm, "span_queue")), max(_window(samples, *last, "span_queue"))

    def worker_us_per_op(window: tuple[float, float]) -> float:
        inside = [x for x in samples if window[0] <= x["t"] < window[1]]
        ops = inside[-1]["ops"] - inside[0]["ops"]
        return (inside[-1]["poller_cpu_s"] - inside[0]["poller_cpu_s"]) / max(1, ops) * 1e6

    cpu_warm, cpu_last = worker_us_per_op(warm), worker_us_per_op(last)
    delivery = result["final"]["delivery"]  # tests/sdk_delivery.py: the SDK's self-metrics
    exported, export_failed = run.spans("exported"), run.spans("export_failed")
    queue_full, metric_failures = run.spans("queue_full"), run.metric_points("failed")
    submit = result["submit"]
    growth = rss_last - rss_warm
    checks = [
        ("transfer counters at the sink = ground truth", sink_counters() == truth,
         f"{sum(t['ops'] for t in truth.values()):,} ops, {sum(t['bytes'] for t in truth.values()) / 1e9:,.1f} GB"),
        ("spans at the sink = ops (spans at 100%)", sink.spans == result["ops"],
         f"{sink.spans:,} of {result['ops']:,}"),
        ("spans exported = ops (SDK self-metrics)", exported == result["ops"],
         f"{exported:,} of {result['ops']:,}" + ("" if delivery["components"] else
                                                 " (no otel.sdk.* self-metrics: are they enabled?)")),
        ("export errors", export_failed == queue_full == metric_failures == 0 and bool(delivery["components"]),
         f"export_failed {export_failed}, queue_full {queue_full}, failed metric data points {metric_failures}"),
        ("RSS flat (last window vs after warm-up)", growth < 16 * 2**20,
         f"{rss_warm / 2**20:.1f} -> {rss_last / 2**20:.1f} MiB ({growth / 2**20:+.1f} MiB)"),
        ("completion queue flat (median per window)", pipe_last <= 2 * pipe_warm + 256,
         f"{pipe_warm:.0f} -> {pipe_last:.0f} records (max {pipe_max[0]} -> {pipe_max[1]})"),
        ("span export queue flat (max per window)", spanq_last <= 2 * spanq_warm + 512,
         f"{spanq_warm} -> {spanq_last} spans"),
        ("completion worker CPU per op flat", cpu_last <= 1.5 * cpu_warm + 5,
         f"{cpu_warm:.1f} -> {cpu_last:.1f} us per op"),
    ]
    figures = {
        "ops": result["ops"], "seconds": result["elapsed_s"], "rate": result["ops"] / result["elapsed_s"],
        "wall_s": wall, "spans_at_sink": sink.spans, "span_requests_at_sink": sink.requests,
        "rss_mib": [round(s["rss"] / 2**20, 1) for s in samples],
        "pipeline": [s["pipeline"] for s in samples], "span_queue": [s["span_queue"] for s in samples],
        "poller_cpu_s": [s["poller_cpu_s"] for s in samples],
        "submit": submit, "delivery": delivery, "truth": truth, "sink_counters": sink_counters(),
        "checks": {name: ok for name, ok, _ in checks},
    }
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1), encoding="utf-8")
    print(f"\nsoak: {result['ops']:,} ops in {result['elapsed_s']:.0f} s ({figures['rate']:,.0f} ops/s), "
          f"{wall:.0f} s wall; submit() p50 {submit['p50_ns'] / 1e3:.1f} us, p99 {submit['p99_ns'] / 1e3:.1f} us, "
          f"p99.9 {submit['p999_ns'] / 1e3:.1f} us, max {submit['max_ns'] / 1e3:.0f} us")
    print(f"RSS MiB every {max(1, len(samples) // 10)} s: "
          + " ".join(f"{s['rss'] / 2**20:.0f}" for s in samples[:: max(1, len(samples) // 10)]))
    width = max(len(name) for name, _, _ in checks)
    for name, ok, detail in checks:
        print(f"  {name:<{width}}  {'PASS' if ok else 'FAIL'}  {detail}")
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
