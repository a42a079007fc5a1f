"""Serving-process CPU: what otel-hicache costs the process it runs in, side by side in one run.

Configured by ``OTEL_*`` only, as a user's scheduler is (spans at 100%, OTLP/HTTP to a span
counter process, the sinks in the telemetry process). Variants take turns in each of ``--rounds``
rounds, in rotating order: ``core`` (``submit()`` + ``ack()`` of a merged op), ``sglang`` (SGLang's
real ``HiCacheController`` on CPU, instrumented by the adapter), and both uninstrumented
(``control``). A turn times on CPU clocks (this process's, its poller thread's, the telemetry
process's; net = minus the control of the same round) ``--rate`` ops/s for ``--seconds`` up to
the ``force_flush()`` after them, CPU per op; for the core, 30 ops/s and then idle for
``--slow-seconds``, % of a core. The reference op (:func:`reference_op`), timed at each round's
start in bursts after a poll interval asleep, as the poller runs (back to back too), makes per-op
figures compare across machines.

Goals (:data:`GOALS`, with margin on a shared 2-core machine) and figures without one
(:data:`REPORTED`) are printed with this run's medians; a missed goal, or a span missing at the
counter, exits 1.

    python benchmarks/serving_cpu.py            # 3 rounds of 10 s windows, ~5 minutes
    python benchmarks/serving_cpu.py --quick    # 3 rounds of 2-3 s windows, ~90 s (CI)
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from bench_common import (SpanCounter, env, machine, process_cpu_s, spread, spread_text, table, thread_cpu_s,
                          wait_until)

ROOT = Path(__file__).resolve().parents[1]
ADAPTER = ROOT / "instrumentation" / "otel-hicache-sglang"
sys.path[:0] = [str(ROOT), str(ADAPTER / "src"), str(ADAPTER / "tests")]  # this checkout's code

VARIANTS = ("core control", "core", "sglang control", "sglang")
SLOW_RATE = 30.0  # ops/s of a lightly loaded server
POLLER, POLL_S = "otel-hicache-poller", 0.01  # its thread, its interval
# The core's op: SGLang's merged op of a hybrid model, as its adapter reports it.
POOL_TOKENS, NUM_BYTES, PAGE_SIZE, COPY_MS = 1408, 161_480_704, 64, 6.0
STATIC = {"tp_rank": 0, "pp_rank": 0, "dp_rank": 0, "attn_cp_rank": 0}
REFERENCE_ITEMS = 100  # the reference op builds and sums a dict of this many ints
# (key, goal, limit): the medians this machine holds with margin (see the module's docstring)
GOALS = (
    ("core_reference_ops", "serving CPU per op at 1,000 ops/s, in reference ops", 8.0),
    ("slow_serving_pct", "30 ops/s: serving process, % of a core", 4.0),
    ("slow_both_pct", "30 ops/s: serving + telemetry process, % of a core", 10.0),
    ("idle_serving_pct", "idle: serving process, % of a core", 1.0),
    ("idle_both_pct", "idle: serving + telemetry process, % of a core", 2.0),
)
REPORTED = (("sglang_over_core", "real SGLang path / direct submit(), serving CPU per merged op"),
            ("sglang_over_core_poller", "the same, the poller thread's CPU alone"),
            ("core_loop_reference_ops", "serving CPU per op at 1,000 ops/s, in reference ops back to back"))


def reference_op() -> int:
    """The unit of CPU work: plain Python, the same on every machine."""
    table_ = {i: i * 3 for i in range(REFERENCE_ITEMS)}
    return sum(table_.values())


def reference_us(batches: int = 5, calls: int = 400, pause_s: float = 0.0) -> float:
    """This thread's CPU per reference op: the median of ``batches``, each after ``pause_s`` asleep."""
    per_call = []
    for _ in range(batches):
        time.sleep(pause_s)
        t0 = time.thread_time_ns()
        for _ in range(calls):
            reference_op()
        per_call.append((time.thread_time_ns() - t0) / calls / 1e3)
    return statistics.median(per_call)


# -- the ops

class CoreOps:
    """Direct ``submit()`` + ``ack()`` of the core's op (``instrumented=False``: the same
    arguments prepared, no call)."""

    def __init__(self, instrumented: bool, tokens: int) -> None:
        import otel_hicache
        from otel_hicache.testing import WallClockDevice

        self.telemetry = otel_hicache.TransferTelemetry(attributes=STATIC) if instrumented else None
        self.copy = WallClockDevice().copy

    def __call__(self, i: int) -> None:
        start, finish = self.copy(time.time_ns() - int(COPY_MS * 1e6) - 100_000, COPY_MS)
        pools = {"kv": POOL_TOKENS, "swa": POOL_TOKENS}
        if self.telemetry is not None:
            tel = self.telemetry
            tel.ack(tel.submit("onboard" if i & 1 else "offload", tokens_by_pool=pools, num_bytes=NUM_BYTES,
                               page_size=PAGE_SIZE, start_event=start, finish_event=finish, io_backend="kernel"))

    def close(self) -> None:
        if self.telemetry is not None:
            self.telemetry.shutdown()


class SGLangOps:
    """SGLang's merged ops on its real controller, instrumented by the adapter or not; an even
    op offloads ``tokens`` device slots, the odd one after loads them back, then both are freed."""

    def __init__(self, instrumented: bool, tokens: int) -> None:
        import sglang_cpu
        from otel_hicache_sglang import SGLangHiCacheInstrumentor

        self.instrumentor = SGLangHiCacheInstrumentor() if instrumented else None
        if self.instrumentor is not None:
            self.instrumentor.instrument()  # no providers: configure()'s, as in a server
        self.controller, _kv, self.allocator = sglang_cpu.build_controller(4, 3, kv_size=max(64, 4 * tokens))
        self.telemetry = self.instrumentor.telemetry if self.instrumentor is not None else None
        if (self.telemetry is not None) != instrumented:
            raise RuntimeError(f"instrumented={instrumented}, but the adapter's telemetry is {self.telemetry!r}")
        self.device = self.allocator.alloc(tokens)
        self.host: Any = None

    def __call__(self, i: int) -> None:
        controller = self.controller
        if not i & 1:
            self.host = controller.write(self.device, node_id=i)
            controller.ack_write_queue.pop(0)  # a pool that ran out queued nothing: this raises
        else:
            loaded = controller.load(self.host, node_id=i)
            controller.start_loading()
            controller.ack_load_queue.pop(0)
            self.allocator.free(loaded)
            controller.mem_pool_host.free(self.host)

    def close(self) -> None:
        self.allocator.free(self.device)
        if self.instrumentor is not None:
            self.instrumentor.uninstrument()  # shuts its telemetry down: the telemetry process ends


# -- one turn

def paced(op: Callable[[int], None], rate: float, seconds: float) -> int:
    """``rate`` ops a second on a fixed schedule for ``seconds`` (an even count: whole round
    trips), sleeping between them; returns the ops."""
    n = 2 * max(1, int(rate * seconds / 2))
    period, t0 = int(1e9 / rate), time.perf_counter_ns()
    for i in range(n):
        wait_until(t0 + i * period)
        op(i)
    return n


def window(work: Callable[[], int], pid: int | None) -> dict[str, float]:
    """Runs ``work`` (returns its ops); the wall, this process's, the poller's and the telemetry
    process's CPU seconds it took."""
    gc.collect()
    before = (time.perf_counter(), time.process_time(), thread_cpu_s(POLLER), process_cpu_s(pid))
    ops = work()
    after = (time.perf_counter(), time.process_time(), thread_cpu_s(POLLER), process_cpu_s(pid))
    wall, serving, poller = (b - a for a, b in zip(before[:3], after[:3]))
    telemetry = after[3] - before[3] if before[3] is not None and after[3] is not None else None
    return {"ops": ops, "wall_s": wall, "serving_s": serving, "poller_s": poller, "telemetry_s": telemetry}


def run_turn(variant: str, args: argparse.Namespace, endpoint: str) -> dict[str, Any]:
    from otel_hicache import configuration

    instrumented = not variant.endswith("control")
    kind = CoreOps if variant.startswith("core") else SGLangOps
    flushes: list[bool] = []

    def flush() -> None:
        if ops.telemetry is not None:
            flushes.append(ops.telemetry.force_flush(60.0))

    def fast() -> int:
        n = paced(ops, args.rate, args.seconds)
        flush()  # the window ends once every span of its ops was exported
        return n

    with env(**otel_variables(endpoint)):
        if instrumented and not configuration.configure(force=True).telemetry_process:
            raise RuntimeError("configure() chose the embedded sinks; this measures the telemetry process")
        ops = kind(instrumented, args.tokens)
        try:
            warm = paced(ops, args.rate, args.warmup_s)
            flush()  # the telemetry process and its exporters up before the windows
            process = getattr(getattr(ops.telemetry, "channel", None), "process", None)
            if instrumented and process is None:
                raise RuntimeError(f"{variant}: no telemetry process after the warm-up")
            pid = process.pid if process is not None else None
            turn = {"fast": window(fast, pid)}
            if kind is CoreOps:
                turn["slow"] = window(lambda: paced(ops, SLOW_RATE, args.slow_seconds), pid)
                flush()
                turn["idle"] = window(lambda: time.sleep(args.slow_seconds) or 0, pid)
        finally:
            ops.close()
            configuration.shutdown(10.0)
    submitted = warm + turn["fast"]["ops"] + turn.get("slow", {}).get("ops", 0) if instrumented else 0
    return {**turn, "submitted": submitted, "flushed": all(flushes)}


def otel_variables(endpoint: str) -> dict[str, str]:
    return {"OTEL_SERVICE_NAME": "serving-cpu", "OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}


# -- figures and goals

def summarize(turns: dict[str, list[dict[str, Any]]], reference: list[tuple[float, float]]) -> dict[str, Any]:
    """Per variant and round, CPU per op at ``--rate`` and % of a core at 30 ops/s and idle, the
    control of the same round subtracted; the goals' figures are medians of per-round values."""
    def per_op(turn: dict[str, Any], key: str) -> float:
        value = turn["fast"][key]
        return value / turn["fast"]["ops"] * 1e6 if value is not None else float("nan")

    burst, loop = zip(*reference)
    out: dict[str, Any] = {"reference_op_us": spread(burst), "loop_reference_op_us": spread(loop)}
    for name in ("core", "sglang"):
        own, floor = turns[name], turns[f"{name} control"]
        net = [per_op(t, "serving_s") - per_op(c, "serving_s") for t, c in zip(own, floor)]
        out[name] = {"serving_us_per_op": spread([per_op(t, "serving_s") for t in own]),
                     "control_us_per_op": spread([per_op(c, "serving_s") for c in floor]),
                     "net_us_per_op": spread(net), "poller_us_per_op": spread([per_op(t, "poller_s") for t in own]),
                     "telemetry_us_per_op": spread([per_op(t, "telemetry_s") for t in own]),
                     "reference_ops": spread([n / r for n, r in zip(net, burst)]),
                     "loop_reference_ops": spread([n / r for n, r in zip(net, loop)]),
                     "ops_per_s": spread([t["fast"]["ops"] / t["fast"]["wall_s"] for t in own])}
    core, sglang = out["core"]["net_us_per_op"]["rounds"], out["sglang"]["net_us_per_op"]["rounds"]
    out["sglang_over_core"] = spread([s / c for s, c in zip(sglang, core)])
    poller = [out[n]["poller_us_per_op"]["rounds"] for n in ("core", "sglang")]
    out["sglang_over_core_poller"] = spread([s / c for c, s in zip(*poller)])
    for key in ("reference_ops", "loop_reference_ops"):
        out[f"core_{key}"] = out["core"][key]
    for phase in ("slow", "idle"):
        def pct(t: dict[str, Any], key: str) -> float:
            value = t[phase][key]
            return 100 * value / t[phase]["wall_s"] if value is not None else float("nan")

        serving = [pct(t, "serving_s") - pct(c, "serving_s") for t, c in zip(turns["core"], turns["core control"])]
        telemetry = [pct(t, "telemetry_s") for t in turns["core"]]
        out[f"{phase}_serving_pct"] = spread(serving)
        out[f"{phase}_telemetry_pct"] = spread(telemetry)
        out[f"{phase}_both_pct"] = spread([s + t for s, t in zip(serving, telemetry)])
    return out


def judge(figures: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"key": key, "goal": f"{text} <= {limit:g}", "median": figures[key]["median"],
             "met": figures[key]["median"] <= limit} for key, text, limit in GOALS]


def report(figures: dict[str, Any], goals: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\n## {args.rate:g} ops/s, CPU per op (us), median [min-max] over {args.rounds} rounds; "
          f"reference op {spread_text(figures['reference_op_us'], 2)} us in bursts, "
          f"{spread_text(figures['loop_reference_op_us'], 2)} back to back\n")
    rows = []
    for name, label in (("core", "core: direct submit()"), ("sglang", f"sglang: real path, {args.tokens} tokens")):
        f = figures[name]
        rows.append([label, f"{f['ops_per_s']['median']:.0f}", spread_text(f["serving_us_per_op"]),
                     spread_text(f["control_us_per_op"]), spread_text(f["net_us_per_op"]),
                     spread_text(f["reference_ops"]), spread_text(f["poller_us_per_op"]),
                     spread_text(f["telemetry_us_per_op"])])
    print(table(rows, ["variant", "ops/s", "serving process", "its control", "serving (net)", "in reference ops",
                       "poller thread", "telemetry process"]))
    print(f"\n## {SLOW_RATE:g} ops/s and idle, {args.slow_seconds:g} s each (core), % of a core\n")
    print(table([[phase, spread_text(figures[f"{key}_serving_pct"], 2), spread_text(figures[f"{key}_telemetry_pct"], 2),
                  spread_text(figures[f"{key}_both_pct"], 2)] for phase, key in
                 ((f"{SLOW_RATE:g} ops/s", "slow"), ("idle", "idle"))],
                ["window", "serving (net)", "telemetry process", "both"]))
    print("\n## Goals (medians of this run; a miss exits 1)\n")
    print(table([[g["goal"], f"{g['median']:.2f}", "met" if g["met"] else "MISSED"] for g in goals]
                + [[text, spread_text(figures[key], 2), "no goal"] for key, text in REPORTED],
                ["goal", "this run", "result"]))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short windows, for CI")
    parser.add_argument("--rounds", type=int, default=3, help="turns per variant, in rotating order (>= 3)")
    parser.add_argument("--rate", type=float, default=1000.0, help="ops per second of the per-op window")
    parser.add_argument("--seconds", type=float, help="per-op window (default 10; --quick 2)")
    parser.add_argument("--slow-seconds", type=float, help="30 ops/s window, and the idle one (default 10; --quick 3)")
    parser.add_argument("--warmup-s", type=float, default=0.5, help="ops before the windows, flushed")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per merged op on SGLang's path (x 4)")
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = parser.parse_args(argv)
    args.seconds = args.seconds or (2.0 if args.quick else 10.0)
    args.slow_seconds = args.slow_seconds or (3.0 if args.quick else 10.0)
    if args.rounds < 3:
        parser.error("--rounds: at least 3 (the goals are medians)")
    if args.tokens <= 0 or args.tokens % 4:
        parser.error("--tokens: a positive multiple of the page size, 4")
    return args


def run_rounds(args: argparse.Namespace) -> tuple[dict[str, list[dict[str, Any]]], list[tuple[float, float]], int]:
    """Every variant's turns, the reference op of each round (bursts, back to back), and the spans the counter got."""
    counter = SpanCounter()
    turns: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    reference = []
    try:
        for r in range(args.rounds):
            reference.append((reference_us(100, 20, POLL_S), reference_us()))  # bursts, back to back
            for variant in VARIANTS[r % 4:] + VARIANTS[:r % 4]:
                turn = run_turn(variant, args, counter.endpoint)
                turns[variant].append(turn)
                fast = turn["fast"]
                print(f"  round {r + 1} {variant}: {fast['serving_s'] / fast['ops'] * 1e6:.1f} us per op", flush=True)
    finally:
        received = counter.close()
    return turns, reference, received


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    for name in [k for k in os.environ if k.startswith("OTEL_")]:  # only this script's variables
        del os.environ[name]
    started = time.perf_counter()
    import sglang_cpu

    sglang_cpu.install_cpu_support()  # before anything imports SGLang or the adapter
    gc.collect()
    gc.freeze()  # SGLang and torch: or a full collection scans them, in the windows too
    from otel_hicache import __version__

    info = machine("otel_hicache", __version__)
    print(f"# otel-hicache {info['otel_hicache']}: serving-process CPU, sinks in the telemetry process, "
          f"OTLP/HTTP to a span counter process\n{info['python']}, opentelemetry-sdk {info['opentelemetry_sdk']}, "
          f"{info['cpus']} CPUs ({info['processor']}), {info['platform']}", flush=True)
    turns, reference, received = run_rounds(args)
    submitted = sum(t["submitted"] for ts in turns.values() for t in ts)
    complete = received == submitted and all(t["flushed"] for ts in turns.values() for t in ts)
    figures = summarize(turns, reference)
    goals = judge(figures)
    report(figures, goals, args)
    elapsed = time.perf_counter() - started
    print(f"\nspans at the counter: {received} of {submitted} ops ({'all' if complete else 'MISSING'}); "
          f"run took {elapsed:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "params": vars(args), "figures": figures,
                                               "goals": goals, "received_spans": received, "submitted": submitted,
                                               "complete": complete, "turns": turns, "elapsed_s": elapsed},
                                              indent=1), encoding="utf-8")
    return 0 if complete and all(g["met"] for g in goals) else 1


if __name__ == "__main__":
    sys.exit(main())
