"""The sinks' CPU per op against a naive instrumentation, and the telemetry process's most
ops/s, side by side in one run.

1. Process CPU per op, turns alternating for ``--rounds`` rounds (goal on the median ratio).
   ``sinks``: embedded (caller providers, every span sampled and dropped by its exporter, metrics
   collected once a round), ``submit()`` + ``ack()`` of host-clock merged ops (2 pools, ranks as
   static attributes), drained by ``force_flush()``. ``naive``: the same op as a plain
   instrumentation reports it on the caller's thread (a span with a few attributes, a histogram
   record, three counter adds). ``sdk``, no goal: only the SDK calls the sinks make for it (the
   same span attributes, histogram records and instruments), on the caller's thread.
2. ``telemetry process``: ``configure()`` from ``OTEL_*`` (OTLP/HTTP to a span counter process),
   ``--burst`` ops at once until ``force_flush()`` returns: its ops/s and CPU per op; every span
   must arrive.

    python benchmarks/sinks_cpu.py [--rounds 3] [--ops 20000] [--burst 30000]
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

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


def report(tel: Any, i: int) -> None:
    now = time.time_ns()
    tel.ack(tel.submit("offload" if i % 2 else "onboard", POOLS, NUM_BYTES, page_size=PAGE_SIZE,
                       host_start_ns=now - 6_000_000, host_end_ns=now, cause="other"))


def sinks_turn(ops: int) -> float:
    from otel_hicache import TransferTelemetry

    tracer_provider, meter_provider, reader = providers()
    with env(OTEL_HICACHE_MAX_QUEUE_SIZE=str(2 * ops)):  # submitted flat out: none may be dropped uncosted
        tel = TransferTelemetry(tracer_provider=tracer_provider, meter_provider=meter_provider, attributes=STATIC)
    tel.force_flush(5.0)
    started = time.process_time()
    for i in range(ops):
        report(tel, i)
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


def sdk_turn(ops: int) -> float:
    """The SDK calls the sinks made for one op, replayed per op."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import set_span_in_context
    from otel_hicache import TransferTelemetry, semconv as sc
    from otel_hicache.sinks.metrics import TransferMetrics

    tracer_provider, meter_provider, reader = providers()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans := InMemorySpanExporter()))
    tel = TransferTelemetry(tracer_provider=tracer_provider, meter_provider=meter_provider, attributes=STATIC)
    report(tel, 0), report(tel, 1), tel.shutdown()
    points = [(m.name, p.sum / p.count, p.attributes) for rm in reader.get_metrics_data().resource_metrics
              for sm in rm.scope_metrics for m in sm.metrics for p in m.data.data_points if hasattr(p, "bucket_counts")]
    tracer_provider, meter_provider, reader = providers()
    tracer, m = tracer_provider.get_tracer("sdk"), TransferMetrics(meter_provider, STATIC, time.time_ns, "", "")
    made = {h.name: (h, h in (m.duration, m.ack_delay)) for h in (m.duration, m.bandwidth, m.queue_wait, m.ack_delay)}
    calls = [(s.name, dict(s.attributes), [(*made[n], v, dict(a)) for n, v, a in points
                                           if a.get(sc.DIRECTION) == s.attributes[sc.DIRECTION]])
             for s in sorted(spans.get_finished_spans(), key=lambda s: s.name, reverse=True)]
    started = time.process_time()
    for i in range(ops):
        now = time.time_ns()
        name, attrs, records = calls[i % 2]
        span = tracer.start_span(name, attributes=attrs, start_time=now - 6_000_000)
        context = set_span_in_context(span)
        for histogram, exemplar, value, point in records:  # as the sinks
            histogram.record(value, point, context if exemplar else None)
        span.end(end_time=now)
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
        for _ in range(burst):
            report(tel, 1)
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
    sinks_turn(args.ops // 10), naive_turn(args.ops // 10), sdk_turn(args.ops // 10)  # warm-up
    rows, ratios = [], []
    for r in range(args.rounds):
        turns = [("sinks", sinks_turn), ("naive", naive_turn), ("sdk", sdk_turn)][:: 1 if r % 2 else -1]
        got = {name: turn(args.ops) * 1e6 for name, turn in turns}
        ratios.append(got["sinks"] / got["naive"])
        rows.append([str(r + 1), *(f"{got[k]:.1f}" for k in ("sinks", "naive", "sdk")), f"{ratios[-1]:.2f}",
                     f"{got['sdk'] / got['naive']:.2f}"])
    print(table(rows, ["round", "sinks us/op", "naive us/op", "sdk us/op", "sinks / naive", "sdk / naive"]))
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
