"""The sinks' CPU per op against a naive instrumentation, and the telemetry process's most
ops/s, side by side in one run.

1. ``sinks``: embedded (caller providers: every span sampled, an exporter that drops them, a
   metric reader collected once a round), ``TransferTelemetry.submit()`` + ``ack()`` of host-clock
   merged ops (2 pools, ranks as static attributes, a cause), drained by ``force_flush()``; this
   process's CPU per op (every thread: the poller runs the sinks). ``naive``: the same op reported
   on the caller's thread by the public API as a plain instrumentation would (a span with a few
   attributes, a histogram record, three counter adds). Turns alternate for ``--rounds`` rounds;
   the goal is on the median of the rounds' ratios.
2. ``telemetry process``: ``configure()`` from ``OTEL_*`` (OTLP/HTTP to a span counter in another
   process), ``--burst`` ops submitted at once, timed until ``force_flush()`` returns: the ops/s
   the telemetry process took them at, and its CPU per op. Every span must arrive.

    python benchmarks/sinks_cpu.py [--rounds 3] [--ops 20000] [--burst 30000]
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from bench_common import SpanCounter, env, process_cpu_s, table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's code

POOLS, NUM_BYTES, PAGE_SIZE = {"kv": 1408, "swa": 1408}, 161_480_704, 64
STATIC = {"tp_rank": 0, "pp_rank": 0, "dp_rank": 0, "attn_cp_rank": 0}
GOALS = (("sinks_over_naive", "sinks / naive, process CPU per op (median of rounds)", "<=", 1.0),
         ("telemetry_ops_per_s", "telemetry process: ops/s taken, spans at 100%", ">=", 10_000.0))


def providers():
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    class Dropping(SpanExporter):
        def export(self, spans):
            return SpanExportResult.SUCCESS

    tracer_provider = TracerProvider(shutdown_on_exit=False)
    tracer_provider.add_span_processor(SimpleSpanProcessor(Dropping()))
    reader = InMemoryMetricReader()
    return tracer_provider, MeterProvider([reader], shutdown_on_exit=False), reader


def sinks_turn(ops: int) -> float:
    from otel_hicache import TransferTelemetry

    tracer_provider, meter_provider, reader = providers()
    with env(OTEL_HICACHE_MAX_QUEUE_SIZE=str(2 * ops)):  # submitted flat out: none may be dropped uncosted
        tel = TransferTelemetry(tracer_provider=tracer_provider, meter_provider=meter_provider, attributes=STATIC)
    tel.force_flush(5.0)
    started = time.process_time()
    for i in range(ops):
        now = time.time_ns()
        tel.ack(tel.submit("offload" if i % 2 else "onboard", POOLS, NUM_BYTES, page_size=PAGE_SIZE,
                           host_start_ns=now - 6_000_000, host_end_ns=now, cause="other"))
    assert tel.force_flush(60.0), "sinks: not drained"
    reader.get_metrics_data()
    spent = time.process_time() - started
    tel.shutdown()
    return spent / ops


def naive_turn(ops: int) -> float:
    tracer_provider, meter_provider, reader = providers()
    tracer, meter = tracer_provider.get_tracer("naive"), meter_provider.get_meter("naive")
    duration = meter.create_histogram("naive.duration", unit="s")
    counters = [meter.create_counter(name) for name in ("naive.bytes", "naive.tokens", "naive.ops")]
    started = time.process_time()
    for i in range(ops):
        now = time.time_ns()
        direction = "offload" if i % 2 else "onboard"
        attrs = {"direction": direction, **STATIC}
        span = tracer.start_span(f"hicache.{direction}", start_time=now - 6_000_000,
                                 attributes={**attrs, "bytes": NUM_BYTES, "tokens": POOLS["kv"]})
        span.end(end_time=now)
        duration.record(0.006, {"direction": direction})
        for counter, value in zip(counters, (NUM_BYTES, POOLS["kv"], 1)):
            counter.add(value, {"direction": direction})
    reader.get_metrics_data()
    return (time.process_time() - started) / ops


def telemetry_process(burst: int) -> dict[str, float]:
    import otel_hicache

    counter = SpanCounter()
    variables = dict(OTEL_EXPORTER_OTLP_ENDPOINT=counter.endpoint, OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
                     OTEL_TRACES_SAMPLER="always_on", OTEL_METRIC_EXPORT_INTERVAL="60000",
                     OTEL_HICACHE_MAX_QUEUE_SIZE=str(2 * burst))
    with env(**variables):
        otel_hicache.configure()
        tel = otel_hicache.TransferTelemetry(attributes=STATIC)
        assert tel.force_flush(30.0), "the telemetry process did not start"
        pid = tel.channel.process.pid
        cpu0, started = process_cpu_s(pid), time.perf_counter()
        for i in range(burst):
            now = time.time_ns()
            tel.ack(tel.submit("offload", POOLS, NUM_BYTES, page_size=PAGE_SIZE, host_start_ns=now - 6_000_000,
                               host_end_ns=now))
        assert tel.force_flush(300.0), "telemetry process: not drained"
        wall, cpu = time.perf_counter() - started, process_cpu_s(pid) - cpu0
        tel.shutdown()
        otel_hicache.shutdown()
    spans = counter.close()
    assert spans == burst, f"{spans} spans arrived of {burst}"
    return {"ops_per_s": burst / wall, "cpu_us_per_op": cpu / burst * 1e6}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ops", type=int, default=20_000, help="ops per turn (default %(default)s)")
    parser.add_argument("--burst", type=int, default=30_000, help="ops for the telemetry process (default %(default)s)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OTEL_HICACHE_HOST_RESIDENCE", "false")
    sinks_turn(args.ops // 10), naive_turn(args.ops // 10)  # warm up: imports, first calls
    rows, ratios = [], []
    for r in range(args.rounds):
        turns = [("sinks", sinks_turn), ("naive", naive_turn)][:: 1 if r % 2 else -1]
        got = {name: turn(args.ops) * 1e6 for name, turn in turns}
        ratios.append(got["sinks"] / got["naive"])
        rows.append([str(r + 1), f"{got['sinks']:.1f}", f"{got['naive']:.1f}", f"{ratios[-1]:.2f}"])
    print(table(rows, ["round", "sinks us/op", "naive us/op", "sinks / naive"]))
    tp = telemetry_process(args.burst)
    print(f"telemetry process: {args.burst:,} ops at {tp['ops_per_s']:,.0f} ops/s, "
          f"{tp['cpu_us_per_op']:.1f} us of its CPU per op, every span arrived")
    figures = {"sinks_over_naive": statistics.median(ratios), "telemetry_ops_per_s": tp["ops_per_s"]}
    failed = 0
    for key, goal, op, limit in GOALS:
        ok = figures[key] <= limit if op == "<=" else figures[key] >= limit
        failed += not ok
        print(f"goal: {goal}: {figures[key]:,.2f} {op} {limit:,g}: {'met' if ok else 'NOT met'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
