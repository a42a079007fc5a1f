"""Memory of the serving process while its collector stalls, against the bound it comes from.

    paced workload --OTLP gRPC (or HTTP)--> a collector that accepts and never answers

The workload is ``paced_workload.py`` (the fault tests' and the soak's load), configured
only by ``OTEL_*`` variables, as the SGLang plugin configures a scheduler process: spans at
100%, the SDK's default queue, batch, timeout and export interval settings, a
``StallingServer`` (``tests/otlp_receiver.py``) on loopback as the collector. Its in-process
metric reader (the SDK's self-metrics) keeps the sinks embedded: the span queue and the
exports in flight are in the serving process, the case that needs a bound there. Once a second
this process reads the workload's ``VmRSS`` from ``/proc/<pid>/status``. Printed: the RSS
before the first op, the first sample, the median of each minute, the peak and when it
happened, the final sample, and the computed bound beside the peak.

The bound is measured part by part, before the run, in a fresh process built like the
workload's (the same imports, ``configure()`` from the same variables, towards the same
stalled collector):

* ``baseline``: RSS once ``configure()`` and a ``TransferTelemetry`` exist, before any op;
* ``workload arrays``: the workload's own per-op lists (``paced_workload.py`` preallocates
  16 bytes per op, before the first one);
* ``span queue``: the batch span processor's queue cap plus the batch it has taken out for
  the export (``OTEL_BSP_MAX_QUEUE_SIZE`` + ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE``) times the
  memory of one finished transfer span, measured on spans built by otel-hicache and kept;
* ``span export in flight``: the memory the real span exporter holds while one batch's
  export hangs on the stalled collector (its encoded protobuf, the transport's buffers and
  connection), measured around that export; the SDK exports one batch at a time and an
  exporter's retries wait in turn, so there is one;
* ``metric snapshot and export in flight``: the same for the real metric exporter with one
  collection of every series (the series are bounded, so the snapshot does not grow with
  ops), plus that snapshot;
* ``completion queue``: ``OTEL_HICACHE_MAX_QUEUE_SIZE`` records, the larger of a queued op
  (the poller paused: its ``Poller._cycle`` a no-op, so ``submit()``'s lists stay in its
  queue) and a held one (its finish event never completes), measured full;
* ``busy-time union``: the intervals ``busy_time.BusyTimeTracker`` keeps, at most its 120 s
  horizon of ops (the sinks' consumer has it forget those ending 5 s before the oldest op
  in flight, so it usually keeps far fewer), as paced ops leave them: disjoint;
* ``host residence``: 0 unless ``OTEL_HICACHE_HOST_RESIDENCE`` is on (this workload names no
  host pages either way).

Each measured part is an RSS difference (what the allocator really took, its overhead
included). With ``--breakdown`` (on by default) a second such process repeats the
measurements under ``tracemalloc`` and prints the Python allocations of each part grouped
by source file (C allocations, in gRPC's core and the protobuf runtime, are not traced).

Growth with time is what the quick test (``tests/test_stalled_collector.py``) checks: the
RSS of the last third of a run against the peak of its first two thirds.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from otlp_receiver import StallingServer  # noqa: E402
from paced_runs import run_workload  # noqa: E402

MIB = 2**20
ARRAY_BYTES_PER_OP = 16  # paced_workload.py's two preallocated per-op arrays, 8 bytes each
SETTLE_S = 3.0  # how long an export is left hanging on the stalled collector before it is measured
PROTOCOLS = ("grpc", "http/protobuf")
BUSY_INTERVALS = 100_000  # intervals of the busy-time union measured together
BUSY_HORIZON_S = 120  # busy_time.BusyTimeTracker's default horizon: the most history it keeps


def vmrss(pid: int | str = "self") -> int | None:
    """``VmRSS`` of process ``pid`` in bytes (None once it has exited)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def workload_env(protocol: str, endpoint: str) -> dict[str, str]:
    """The user's settings: where to export and how, nothing else (the SDK's defaults)."""
    return {"OTEL_SERVICE_NAME": "hicache-stalled", "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED": "true"}


# --------------------------------------------------------------------------------------
# The bound, measured part by part (in a process of its own: --measure-parts)
# --------------------------------------------------------------------------------------


class _Measure:
    """RSS differences around each part, and with ``tracemalloc`` on, the traced Python
    allocations of each part by source file."""

    def __init__(self, traced: bool) -> None:
        self.traced = traced
        self.parts: dict[str, dict[str, Any]] = {}
        self.kept: list[Any] = []  # every part stays alive: a later one never reuses its memory
        if traced:
            import tracemalloc

            tracemalloc.start()

    def part(self, name: str, fill: Callable[[], Any], items: int = 1) -> Any:
        import gc

        gc.collect()
        before_rss, before = vmrss(), self._snapshot()
        kept = fill()
        gc.collect()
        entry: dict[str, Any] = {"rss": vmrss() - before_rss, "items": items}
        if self.traced:
            diff = self._snapshot().compare_to(before, "filename")
            entry["traced"] = sum(d.size_diff for d in diff)
            entry["by_file"] = [[_short(d.traceback[0].filename), d.size_diff] for d in diff[:6] if d.size_diff > 0]
        self.parts[name] = entry
        self.kept.append(kept)
        return kept

    def _snapshot(self) -> Any:
        if not self.traced:
            return None
        import tracemalloc

        return tracemalloc.take_snapshot()


def _short(filename: str) -> str:
    for marker in ("site-packages/", "otel_hicache/", "benchmarks/"):
        if marker in filename:
            return filename.split(marker, 1)[1] if marker == "site-packages/" else marker + filename.split(marker, 1)[1]
    return Path(filename).name


class _NeverDone:
    """A timing event that never completes: the worker holds the op it finishes."""

    def query(self) -> bool:
        return False

    def elapsed_time(self, other: Any) -> float:
        return 0.0


def measure_parts(traced: bool) -> dict[str, Any]:
    """Every part of the bound (see the module docstring), in this fresh process."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.metrics import NoOpMeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    import otel_hicache
    import paced_workload  # noqa: F401  (the workload's imports, as in the run)
    from otel_hicache import configuration
    from otel_hicache.sinks import providers
    from otel_hicache import environment_variables as ev
    from otel_hicache.sinks.busy_time import BusyTimeTracker
    from otel_hicache.settings import env_bool, env_int

    logging.getLogger("opentelemetry.exporter").setLevel(logging.CRITICAL)  # the hanging exports' failures
    measure = _Measure(traced)
    reader = InMemoryMetricReader()
    before_configure = vmrss()
    conf = configuration.configure(metric_readers=[reader])
    tel = otel_hicache.TransferTelemetry(attributes={"tp_rank": 0})
    baseline = vmrss()
    batch = conf.span_processors[0]._batch_processor  # pylint: disable=protected-access
    queue_cap, batch_size = batch._max_queue_size, batch._max_export_batch_size  # pylint: disable=protected-access
    completion_cap = env_int(ev.OTEL_HICACHE_MAX_QUEUE_SIZE)

    class Keeping(SpanExporter):
        def __init__(self) -> None:
            self.spans: list[Any] = []

        def export(self, spans: Any) -> SpanExportResult:
            self.spans.extend(spans)
            return SpanExportResult.SUCCESS

    def submit_ops(into: Any, n: int, **events: Any) -> None:
        """``n`` ops shaped as the workload's, each acked at once (a span leaves at its ack)."""
        end = time.time_ns()
        for i in range(n):
            pages = 1 + (i * 7919) % 8
            tokens = pages * paced_workload.PAGE
            into.ack(into.submit(paced_workload.DIRECTIONS[i & 1], {"kv": tokens},
                                 tokens * paced_workload.BYTES_PER_TOKEN, paced_workload.PAGE,
                                 host_start_ns=end - 20_000 * pages, host_end_ns=end, **events))

    # Finished spans as the batch span processor keeps them: built by otel-hicache (same
    # resource, static attributes and meter provider), kept by an exporter that holds them.
    keeping = Keeping()
    provider = TracerProvider(resource=conf.tracer_provider.resource, shutdown_on_exit=False,
                              meter_provider=NoOpMeterProvider())  # as configure() builds it
    provider.add_span_processor(SimpleSpanProcessor(keeping))
    span_tel = otel_hicache.TransferTelemetry(provider, conf.meter_provider, attributes={"tp_rank": 0})
    submit_ops(span_tel, 200)  # first ops: one-time state (series, anchors) outside the measurement
    span_tel._pipeline.flush(30)  # pylint: disable=protected-access
    keeping.spans.clear()
    span_items = queue_cap + batch_size

    def fill_spans() -> None:
        submit_ops(span_tel, span_items)
        span_tel._pipeline.flush(60)  # pylint: disable=protected-access

    measure.part("span queue", fill_spans, span_items)
    spans = list(keeping.spans[:batch_size])

    # The real exporters, built as configure() builds them, each with one export hanging on
    # the stalled collector; their threads are left hanging (the process exits with os._exit).
    span_exporter = providers.exporters("traces")[0]
    metric_exporter = providers.exporters("metrics")[0]

    def hang(export: Callable[[], Any]) -> None:
        threading.Thread(target=export, daemon=True).start()
        time.sleep(SETTLE_S)

    measure.part("span export in flight", lambda: hang(lambda: span_exporter.export(spans)))
    snapshot = measure.part("metric snapshot", reader.get_metrics_data)
    measure.part("metric export in flight", lambda: hang(lambda: metric_exporter.export(snapshot)))
    encoded = measure.part("encoded span batch (one copy)", lambda: encode_spans(spans))
    encoded_bytes = encoded.ByteSize()

    # The completion queue full: ops queued with the poller paused (its thread wakes and runs a
    # no-op cycle: nothing is taken from the queue), and ops the poller holds.
    paused = otel_hicache.TransferTelemetry(provider, conf.meter_provider, attributes={"tp_rank": 0})
    paused._pipeline._cycle = lambda: None  # pylint: disable=protected-access
    measure.part("completion queue (queued ops)", lambda: submit_ops(paused, completion_cap), completion_cap)
    held = otel_hicache.TransferTelemetry(provider, conf.meter_provider, attributes={"tp_rank": 0})

    def fill_held() -> None:
        submit_ops(held, completion_cap, start_event=_NeverDone(), finish_event=_NeverDone(), timing_enabled=True)
        deadline = time.monotonic() + 60
        while held._pipeline.held < completion_cap and time.monotonic() < deadline:  # pylint: disable=protected-access
            time.sleep(0.05)

    measure.part("completion queue (held ops)", fill_held, completion_cap)

    def fill_busy() -> Any:
        tracker, start = BusyTimeTracker(), time.time_ns()
        for i in range(BUSY_INTERVALS):  # disjoint, as paced ops are: none merges
            tracker.add(start + 1000 * i, start + 1000 * i + 500)
        return tracker

    measure.part("busy-time intervals", fill_busy, BUSY_INTERVALS)
    del tel
    return {"traced": traced, "before_configure": before_configure, "baseline": baseline,
            "queue_cap": queue_cap, "batch_size": batch_size, "completion_cap": completion_cap,
            "host_residence": env_bool(ev.OTEL_HICACHE_HOST_RESIDENCE), "encoded_bytes": encoded_bytes,
            "parts": measure.parts}


def compute_bound(measured: dict[str, Any], ops: int, rate: float) -> dict[str, Any]:
    """The bound's rows (bytes) from ``measure_parts``' RSS differences, and their sum, for
    ``ops`` ops at ``rate`` ops/s."""
    parts = measured["parts"]
    per_interval = parts["busy-time intervals"]["rss"] / parts["busy-time intervals"]["items"]
    intervals = int(BUSY_HORIZON_S * rate)
    per_span = parts["span queue"]["rss"] / parts["span queue"]["items"]
    completion = max(parts["completion queue (queued ops)"]["rss"], parts["completion queue (held ops)"]["rss"])
    rows = [
        ("baseline (configure, TransferTelemetry)", measured["baseline"], "measured before the first op"),
        ("workload arrays", ARRAY_BYTES_PER_OP * ops, f"{ARRAY_BYTES_PER_OP} B x {ops:,} ops"),
        ("span queue + batch taken out", per_span * (measured["queue_cap"] + measured["batch_size"]),
         f"{per_span:,.0f} B x ({measured['queue_cap']:,} + {measured['batch_size']:,}) spans"),
        ("span export in flight", max(0, parts["span export in flight"]["rss"]),
         f"one batch, {measured['encoded_bytes']:,} B encoded"),
        ("metric snapshot + export in flight",
         max(0, parts["metric snapshot"]["rss"]) + max(0, parts["metric export in flight"]["rss"]), "one collection"),
        ("completion queue", completion,
         f"{completion / measured['completion_cap']:,.0f} B x {measured['completion_cap']:,} records"),
        ("busy-time union", per_interval * intervals,
         f"{per_interval:,.0f} B x {intervals:,} intervals ({BUSY_HORIZON_S} s horizon)"),
        ("host residence", 0, "on, not measured" if measured["host_residence"] else "off"),
    ]
    return {"rows": [{"part": p, "bytes": int(b), "how": h} for p, b, h in rows],
            "total": int(sum(b for _, b, _ in rows))}


def _measure_in_process(env: dict[str, str], traced: bool) -> dict[str, Any]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    full_env.update(env)
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as out:
        path = Path(out.name)
    try:
        subprocess.run([sys.executable, __file__, "--measure-parts", str(path)] + (["--traced"] if traced else []),
                       env=full_env, check=True, cwd=ROOT, timeout=300)
        return json.loads(path.read_text(encoding="utf-8"))
    finally:
        path.unlink(missing_ok=True)


# --------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------


def sample_rss(samples: list[tuple[int, int]]) -> Callable[[Any, float], None]:
    """A ``run_workload`` hook: a thread appending (unix ns, VmRSS) of the workload every second."""

    def during(process: Any, _t0: float) -> None:
        def loop() -> None:
            while process.poll() is None:
                rss = vmrss(process.pid)
                if rss is not None:
                    samples.append((time.time_ns(), rss))
                time.sleep(1.0)

        threading.Thread(target=loop, name="rss-sampler", daemon=True).start()

    return during


def summarize(rss: list[tuple[int, int]], start_unix_ns: int, elapsed_s: float) -> dict[str, Any]:
    """First sample, the median of each minute, peak (and when), final;
    times in seconds since the first op, over the samples taken while the ops ran."""
    during = [((t - start_unix_ns) / 1e9, r) for t, r in rss if start_unix_ns <= t <= start_unix_ns + elapsed_s * 1e9]
    if not during:
        raise RuntimeError("no RSS sample while the ops ran")
    minutes: dict[int, list[int]] = {}
    for t, r in during:
        minutes.setdefault(int(t // 60), []).append(r)
    peak_t, peak = max(during, key=lambda s: s[1])
    third = during[-1][0] * 2 / 3
    early, late = [r for t, r in during if t < third], [r for t, r in during if t >= third]
    return {
        "first": during[0][1],
        "minute_medians": [int(statistics.median(minutes[m])) for m in sorted(minutes)],
        "peak": peak, "peak_t": round(peak_t, 1), "final": during[-1][1],
        "peak_first_two_thirds": max(early) if early else None, "peak_last_third": max(late) if late else None,
        "series": [[round(t, 1), r] for t, r in during],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--protocol", choices=PROTOCOLS, default="grpc")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, help="the run's length in seconds (instead of --minutes)")
    parser.add_argument("--rate", type=float, default=2000.0, help="merged ops per second")
    parser.add_argument("--no-breakdown", action="store_true", help="skip the tracemalloc breakdown by file")
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument("--measure-parts", metavar="OUT", help=argparse.SUPPRESS)  # the bound's own process
    parser.add_argument("--traced", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.measure_parts:
        Path(args.measure_parts).write_text(json.dumps(measure_parts(args.traced)), encoding="utf-8")
        sys.stdout.flush()
        os._exit(0)  # the hanging exports' threads never return

    seconds = args.seconds if args.seconds is not None else args.minutes * 60
    ops = int(args.rate * seconds)
    stall = StallingServer()
    tmp = Path(tempfile.mkdtemp(prefix="hicache-stalled."))
    try:
        env = workload_env(args.protocol, stall.endpoint)
        measured = _measure_in_process(env, traced=False)
        breakdown = None if args.no_breakdown else _measure_in_process(env, traced=True)
        bound = compute_bound(measured, ops, args.rate)
        print(f"stalled collector ({args.protocol}): {args.rate:,.0f} ops/s for {seconds:.0f} s ({ops:,} ops), "
              f"spans at 100%, SDK defaults otherwise", flush=True)
        rss: list[tuple[int, int]] = []
        run = run_workload(tmp, env, "--rate", str(args.rate), "--seconds", str(seconds), "--summary",
                           "--no-op-attribute", "--no-provider-flush", "--exit-without-shutdown",
                           timeout_s=seconds + 300, during=sample_rss(rss))
    finally:
        stall.stop()
    result = run.result
    summary = summarize(rss, result["start_unix_ns"], result["elapsed_s"])
    samples = result["samples"]
    figures = {
        "protocol": args.protocol, "rate": args.rate, "seconds": seconds, "ops": result["ops"],
        "achieved_rate": result["ops"] / result["elapsed_s"], "elapsed_s": result["elapsed_s"],
        "rss": summary, "bound": bound, "measured": measured, "breakdown": breakdown,
        "span_queue_max": max((s["span_queue"] for s in samples), default=0),
        "completion_queue_max": max((s["pipeline"] for s in samples), default=0),
        "delivery": result["final"]["delivery"], "submit": result["submit"],
    }
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1), encoding="utf-8")
    print(report(figures))
    return 0


def report(figures: dict[str, Any]) -> str:
    s, bound = figures["rss"], figures["bound"]
    spans = figures["delivery"]["spans"]
    mib = lambda b: f"{b / MIB:.1f}"  # noqa: E731
    lines = [
        f"ran {figures['ops']:,} ops in {figures['elapsed_s']:.0f} s ({figures['achieved_rate']:,.0f} ops/s); "
        f"spans exported {spans['exported']}, export_failed {spans['export_failed']}, queue_full {spans['queue_full']}",
        f"largest span queue {figures['span_queue_max']:,}, largest completion queue {figures['completion_queue_max']:,}",
        f"RSS MiB: first sample {mib(s['first'])}, final {mib(s['final'])}",
        "  median of each minute: " + " ".join(mib(m) for m in s["minute_medians"]),
        f"  peak {mib(s['peak'])} at {s['peak_t']:.0f} s; first two thirds' peak "
        f"{mib(s['peak_first_two_thirds'] or 0)}, last third's {mib(s['peak_last_third'] or 0)}",
        f"bound {mib(bound['total'])} MiB (peak {mib(s['peak'])}):",
    ]
    width = max(len(r["part"]) for r in bound["rows"])
    lines += [f"  {r['part']:<{width}}  {mib(r['bytes']):>6} MiB  {r['how']}" for r in bound["rows"]]
    if figures["breakdown"]:
        lines.append("traced Python allocations of each part (tracemalloc, by file; KiB):")
        for name, part in figures["breakdown"]["parts"].items():
            files = ", ".join(f"{f} {b / 1024:,.0f}" for f, b in part.get("by_file", [])[:4])
            lines.append(f"  {name}: {part['traced'] / 1024:,.0f} ({files})")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
