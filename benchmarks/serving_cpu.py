"""Serving-process CPU per op: what otel-hicache costs the process it runs in, on the user's path.

Each turn is a fresh host process configured only by ``OTEL_*`` variables, as a user's is:
``otel_hicache.configure()`` and a ``TransferTelemetry``, spans at 100% (the default sampler),
OTLP/HTTP (``http/protobuf``) to a receiver in another process (``gil_impact.py``'s receiver
child, on ``tests/otlp_receiver.HttpReceiver``; one per turn, it counts the spans it got). The
host submits ``--rate`` ops per second on a fixed schedule, sleeping between them (the op of
``overhead.py``: 2 pools x 1408 tokens, a completed device-timed event pair), and acks each op
at once. After ``--warmup-s`` of the same load and a ``force_flush()``, the timed window runs
``--seconds`` of ops and ends when ``force_flush()`` has returned: every span of the window's
ops encoded and exported, and one metric collection.

Variants, in rotating order within each of ``--rounds`` rounds, so the machine's other load
falls on them alike:

* ``control``: ``OTEL_HICACHE_ENABLED=false``, the same loop and calls (the floor);
* ``embedded``: ``OTEL_HICACHE_TELEMETRY_PROCESS=false``, the sinks on the poller thread and
  the SDK's export threads, all in the serving process;
* ``telemetry process``: the default, the serving process only captures; a telemetry process
  of its own builds, aggregates and exports (its CPU from ``/proc``, apart).

Figures, per variant, median and range over the rounds:

* serving-process CPU per op: CPU time of the whole host process (all its threads,
  ``time.process_time``) over the window, minus the control's of the same round, divided by
  the window's ops;
* total CPU per op: the same plus the telemetry process's CPU (not the receiver's);
* the longest single stretch otel-hicache's threads ran in the serving process: the thread
  CPU time (``time.thread_time_ns``) of each poller cycle (``Poller._cycle``, wrapped here,
  in the host process only) and of each call of a span exporter there (``export()``: OTLP
  encoding and the request; embedded only), p50, p99, p99.9 and max over every call in the
  windows of all rounds.

The goals of the telemetry-process design are printed with this run's figures and met or not.

Usage::

    python benchmarks/serving_cpu.py                 # 3 rounds x 20 s per variant, ~4 minutes
    python benchmarks/serving_cpu.py --quick         # 3 rounds x 5 s
    python benchmarks/serving_cpu.py --json out.json

Nothing asserts a time. Exit status 0 unless a turn fails or the receiver got fewer spans than
an instrumented turn submitted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any, Callable, Sequence

# sibling modules: this script's folder is first on sys.path
from bench_common import machine, percentile, table, thread_cpu, wait_until

ROOT = Path(__file__).resolve().parents[1]

VARIANTS: dict[str, dict[str, str]] = {
    "control": {"OTEL_HICACHE_ENABLED": "false"},
    "embedded": {"OTEL_HICACHE_TELEMETRY_PROCESS": "false"},
    "telemetry process": {},
}
INSTRUMENTED = ("embedded", "telemetry process")
WORKER_THREAD = "otel-hicache-poller"

# The goals of the telemetry-process design.
GOAL_SHARE_OF_EMBEDDED = 1 / 8
GOAL_SERVING_US = 20.0
GOAL_STRETCH_US = 200.0
GOAL_TOTAL_OF_EMBEDDED = 1.25


# --------------------------------------------------------------------------------------
# The host process (one turn)
# --------------------------------------------------------------------------------------

class Stretches:
    """The thread CPU time of each call of the functions :meth:`wrap` returns, while
    ``recording``, into a preallocated array (no allocation per call); calls beyond its
    capacity are counted in ``missed``."""

    def __init__(self, capacity: int) -> None:
        self.ns = array("q", bytes(8 * capacity))
        self.count = 0
        self.missed = 0
        self.recording = False

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.thread_time_ns

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.recording:
                return fn(*args, **kwargs)
            started = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = clock() - started
                i = self.count
                if i < len(self.ns):
                    self.ns[i] = spent
                    self.count = i + 1
                else:
                    self.missed += 1

        return timed

    def values(self) -> list[int]:
        return list(self.ns[:self.count])


def span_exporters(conf: Any) -> list[Any]:
    """The exporters behind ``configure()``'s span processors (the SDK's batch processor keeps
    its exporter in private attributes: SDK 1.45's ``_batch_processor._exporter``, older
    ones' ``span_exporter``)."""
    found = []
    for processor in conf.span_processors:
        batch = getattr(processor, "_batch_processor", None)
        exporter = getattr(batch, "_exporter", None) or getattr(processor, "span_exporter", None)
        if exporter is not None:
            found.append(exporter)
    return found


def host(rate: float, seconds: float, warmup_s: float, out: Path) -> None:
    """Child mode: one turn, configured by the ``OTEL_*`` variables it was started with;
    writes what it measured to ``out`` (JSON)."""
    import otel_hicache
    from otel_hicache.capture.poller import Poller

    from bench_common import process_cpu_s
    from overhead import IO_BACKEND, NUM_BYTES, PAGE_SIZE, STATIC, make_prep

    capacity = int(seconds * 5_000) + 10_000  # a cycle per poll interval and more: ample
    cycles, exports = Stretches(capacity), Stretches(capacity)
    Poller._cycle = cycles.wrap(Poller._cycle)  # pylint: disable=protected-access
    conf = otel_hicache.configure()
    tel = otel_hicache.TransferTelemetry(attributes=STATIC)
    for exporter in span_exporters(conf):
        exporter.export = exports.wrap(exporter.export)
    prep = make_prep()
    period_ns = int(1e9 / rate)
    submit, ack = tel.submit, tel.ack

    def paced(ops: int) -> float:
        start_ns = time.perf_counter_ns()
        for i in range(ops):
            wait_until(start_ns + i * period_ns)  # a fixed schedule: every variant submits the same ops
            direction, pools, start, finish = prep(i)
            ack(submit(direction, tokens_by_pool=pools, num_bytes=NUM_BYTES, page_size=PAGE_SIZE,
                       start_event=start, finish_event=finish, timing_enabled=True, io_backend=IO_BACKEND))
        return (time.perf_counter_ns() - start_ns) / 1e9

    warmup_ops, ops = int(rate * warmup_s), int(rate * seconds)
    paced(warmup_ops)  # exporters connected and the telemetry process started before the window
    warm_flushed = tel.force_flush(60.0)
    process = getattr(tel.channel, "process", None)
    helper = process.pid if process is not None else None

    helper0 = process_cpu_s(helper) if helper is not None else None
    threads0 = thread_cpu()
    cycles.recording = exports.recording = True
    cpu0, wall0 = time.process_time_ns(), time.perf_counter_ns()
    loop_s = paced(ops)
    flushed = tel.force_flush(60.0)
    cpu1, wall1 = time.process_time_ns(), time.perf_counter_ns()
    cycles.recording = exports.recording = False
    threads1 = thread_cpu()
    helper1 = process_cpu_s(helper) if helper is not None else None

    result = {
        "enabled": tel.enabled, "ops": ops, "ops_submitted": warmup_ops + ops, "loop_s": loop_s,
        "window_s": (wall1 - wall0) / 1e9, "flushed": warm_flushed and flushed,
        "host_cpu_s": (cpu1 - cpu0) / 1e9,
        "helper_cpu_s": None if helper0 is None or helper1 is None else helper1 - helper0,
        "helper_pid": helper,
        "threads_cpu_s": {name: threads1[name] - threads0.get(name, 0.0) for name in threads1},
        "cycle_ns": cycles.values(), "export_ns": exports.values(),
        "missed": {"cycle": cycles.missed, "export": exports.missed},
    }
    tel.shutdown()
    otel_hicache.configuration.shutdown()
    out.write_text(json.dumps(result), encoding="utf-8")


# --------------------------------------------------------------------------------------
# Turns and rounds
# --------------------------------------------------------------------------------------

def run_turn(variant: str, rate: float, seconds: float, warmup_s: float, tmp: Path) -> dict[str, Any]:
    """One host process of ``variant`` against a receiver process of its own; its
    measurements, with ``received_spans`` (what the receiver counted)."""
    from gil_impact import Receiver  # pylint: disable=import-outside-toplevel

    receiver = Receiver()
    out = tmp / f"turn-{time.monotonic_ns()}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update({"OTEL_SERVICE_NAME": "serving-cpu", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}"})
    env.update(VARIANTS[variant])
    command = [sys.executable, __file__, "--host", "--rate", str(rate), "--seconds", str(seconds),
               "--warmup-s", str(warmup_s), "--out", str(out)]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT,
                              timeout=seconds + warmup_s + 180, check=False)
    finally:
        received = receiver.close()
    if done.returncode != 0:
        raise RuntimeError(f"{variant} turn failed (rc {done.returncode}):\n{done.stderr[-4000:]}")
    result = json.loads(out.read_text(encoding="utf-8"))
    out.unlink()
    result["received_spans"] = received
    return result


def spread(values: Sequence[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": list(values)}


def stretch(values_ns: Sequence[int]) -> dict[str, Any]:
    """Percentiles in us of the per-call thread CPU times of all rounds."""
    ordered = sorted(values_ns)
    if not ordered:
        return {"calls": 0}
    return {"calls": len(ordered), **{name: percentile(ordered, q) / 1e3 for name, q in
                                      (("p50", 0.5), ("p99", 0.99), ("p999", 0.999))}, "max": ordered[-1] / 1e3}


def summarize(turns: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per variant: its rounds' figures, the control of the same round subtracted."""
    control = [t["host_cpu_s"] / t["ops"] * 1e6 for t in turns["control"]]
    out: dict[str, Any] = {}
    for name, rounds in turns.items():
        raw = [t["host_cpu_s"] / t["ops"] * 1e6 for t in rounds]
        helper = [t["helper_cpu_s"] / t["ops"] * 1e6 for t in rounds if t["helper_cpu_s"] is not None]
        threads: dict[str, list[float]] = {}
        for t in rounds:
            for thread, seconds in t["threads_cpu_s"].items():
                threads.setdefault(thread, []).append(seconds / t["ops"] * 1e6)
        figures: dict[str, Any] = {
            "enabled": all(t["enabled"] for t in rounds), "flushed": all(t["flushed"] for t in rounds),
            "ops_per_round": [t["ops"] for t in rounds],
            "ops_per_s": [t["ops"] / t["loop_s"] for t in rounds],
            "ops_submitted": [t["ops_submitted"] for t in rounds],
            "received_spans": [t["received_spans"] for t in rounds],
            "host_cpu_us_per_op": spread(raw),
            "threads_us_per_op": {thread: statistics.median(v) for thread, v in threads.items()},
            "stretch_us": {"worker_cycle": stretch([x for t in rounds for x in t["cycle_ns"]]),
                           "span_export": stretch([x for t in rounds for x in t["export_ns"]])},
            "stretch_missed": {k: sum(t["missed"][k] for t in rounds) for k in ("cycle", "export")},
        }
        if name != "control":
            figures["serving_cpu_us_per_op"] = spread([r - c for r, c in zip(raw, control)])
            figures["helper_cpu_us_per_op"] = spread(helper) if helper else None
            total = [r + h - c for r, h, c in zip(raw, helper or [0.0] * len(raw), control)]
            figures["total_cpu_us_per_op"] = spread(total)
        out[name] = figures
    return out


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------

def span_of(s: dict[str, Any] | None, digits: int = 1) -> str:
    if not s:
        return ""
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def goal_lines(res: dict[str, Any]) -> list[tuple[str, str]]:
    """(goal, today's figures of this run) for each goal of the telemetry-process design."""
    embedded = res["embedded"]["serving_cpu_us_per_op"]["median"]
    served = res["telemetry process"]["serving_cpu_us_per_op"]["median"]
    total = res["telemetry process"]["total_cpu_us_per_op"]["median"]
    longest = res["telemetry process"]["stretch_us"]["worker_cycle"]

    def met(ok: bool) -> str:
        return "met" if ok else "NOT met"

    return [
        (f"serving-process CPU per op <= 1/8 of embedded (<= {GOAL_SHARE_OF_EMBEDDED * embedded:.1f} us here)",
         f"{served:.1f} us = {served / embedded:.3f}x embedded ({embedded:.1f} us)",
         met(served <= GOAL_SHARE_OF_EMBEDDED * embedded)),
        (f"serving-process CPU per op <= {GOAL_SERVING_US:.0f} us", f"{served:.1f} us",
         met(served <= GOAL_SERVING_US)),
        (f"longest stretch in the serving process <= {GOAL_STRETCH_US:.0f} us",
         f"poller cycle p99.9 {longest.get('p999', 0):.0f} us, max {longest.get('max', 0):.0f} us",
         met(longest.get("p999", 0) <= GOAL_STRETCH_US)),
        (f"total CPU per op <= {GOAL_TOTAL_OF_EMBEDDED:g}x embedded "
         f"(<= {GOAL_TOTAL_OF_EMBEDDED * embedded:.1f} us here)",
         f"{total:.1f} us = {total / embedded:.2f}x embedded", met(total <= GOAL_TOTAL_OF_EMBEDDED * embedded)),
    ]


def report(res: dict[str, Any], rounds: int, seconds: float, rate: float) -> None:
    print(f"\n## CPU per op (us), median [min-max] over {rounds} round(s) of {seconds:g} s at {rate:g} ops/s\n")
    rows = []
    for name, f in res.items():
        threads = f["threads_us_per_op"]
        rows.append([name, f"{statistics.median(f['ops_per_s']):.0f}", span_of(f["host_cpu_us_per_op"]),
                     span_of(f.get("serving_cpu_us_per_op")), span_of(f.get("helper_cpu_us_per_op")),
                     span_of(f.get("total_cpu_us_per_op")),
                     f"{threads.get(WORKER_THREAD, 0.0):.1f}" if f["enabled"] else "",
                     f"{threads.get('OtelBatchSpanRecordProcessor', 0.0):.1f}" if f["enabled"] else "",
                     f"{threads.get('caller', 0.0):.1f}",
                     "" if name == "control" else f"{sum(f['received_spans'])} of {sum(f['ops_submitted'])}"])
    print(table(rows, ["variant", "ops/s", "host process", "serving (net)", "telemetry process", "total (net)",
                       "worker thread", "span processor", "caller thread", "spans at receiver"]))
    print("host process = CPU of the whole serving process (all threads) over the window, per op; net = minus\n"
          "the control's of the same round; total = serving (net) + the telemetry process otel-hicache started\n"
          "(not the receiver). The thread columns are the host's threads' CPU clocks (medians), for scale.")
    print("\n## Longest single stretch in the serving process: thread CPU time per call (us), all rounds\n")
    rows = []
    for name in INSTRUMENTED:
        for key, label in (("worker_cycle", "poller, per cycle"),
                           ("span_export", "span processor, per export() call")):
            s = res[name]["stretch_us"][key]
            if s["calls"]:
                rows.append([name, label, str(s["calls"]), f"{s['p50']:.1f}", f"{s['p99']:.1f}",
                             f"{s['p999']:.1f}", f"{s['max']:.1f}"])
    print(table(rows, ["variant", "where", "calls", "p50", "p99", "p99.9", "max"], left=2))
    print("\n## The goals of the telemetry-process design, this run\n")
    print(table([list(line) for line in goal_lines(res)], ["goal", "this run", ""], left=2))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--rate", type=float, default=1000.0, help="ops per second")
    parser.add_argument("--seconds", type=float, help="timed window per turn (default 20; --quick 5)")
    parser.add_argument("--warmup-s", type=float, default=1.0, help="ops before the window, flushed")
    parser.add_argument("--rounds", type=int, default=3, help="turns per variant, in rotating order")
    parser.add_argument("--quick", action="store_true", help="5 s turns")
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = parser.parse_args(argv)
    seconds = args.seconds or (5.0 if args.quick else 20.0)
    if args.host:
        host(args.rate, seconds, args.warmup_s, Path(args.out))
        return 0

    from otel_hicache import __version__
    info = machine("otel_hicache", __version__)
    print(f"# otel-hicache {info['otel_hicache']}: serving-process CPU per op, OTLP/HTTP to a receiver process")
    print(f"{info['python']}, opentelemetry-sdk {info['opentelemetry_sdk']}, {info['cpus']} CPUs "
          f"({info['processor']}), {info['platform']}")
    print(f"{args.rounds} round(s) x {seconds:g} s per variant after {args.warmup_s:g} s of warm-up, "
          f"{args.rate:g} ops/s, spans at 100%, every op acked; variants: {', '.join(VARIANTS)}", flush=True)
    names = list(VARIANTS)
    turns: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="serving-cpu.") as tmp:
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                turn = run_turn(name, args.rate, seconds, args.warmup_s, Path(tmp))
                turns[name].append(turn)
                print(f"  round {r + 1} {name}: host {turn['host_cpu_s'] / turn['ops'] * 1e6:.1f} us per op"
                      + ("" if turn["helper_cpu_s"] is None
                         else f", telemetry process {turn['helper_cpu_s'] / turn['ops'] * 1e6:.1f} us per op"),
                      flush=True)
    res = summarize(turns)
    report(res, args.rounds, seconds, args.rate)
    complete = all(sum(res[n]["received_spans"]) >= sum(res[n]["ops_submitted"]) and res[n]["flushed"]
                   for n in INSTRUMENTED)
    elapsed = time.perf_counter() - started
    print(f"\nspans at the receiver: {'all' if complete else 'MISSING'}; run took {elapsed:.0f} s")
    if args.json:
        figures = {"machine": info, "params": {"rate": args.rate, "seconds": seconds, "warmup_s": args.warmup_s,
                                               "rounds": args.rounds},
                   "variants": res, "goals": [{"goal": goal, "measured": measured, "result": result}
                                              for goal, measured, result in goal_lines(res)],
                   "complete": complete, "elapsed_s": elapsed}
        Path(args.json).write_text(json.dumps(figures, indent=1), encoding="utf-8")
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
