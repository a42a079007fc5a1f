"""What otel-hicache costs a real SGLang server: the plugin off and on, side by side in one run.

Two ``python -m sglang.launch_server`` on CPU with HiCache (e2e/real_server/), alike but for
SGLang's plugin list (off: ``SGLANG_PLUGINS=none``), exporting to an in-process OTLP receiver
that counts the spans (one per merged op). The same request workload (a prefix, fillers that
evict it from the device pool, the prefix again: offload and load-back) runs against each in
turn, alternating which goes first, ``--pairs`` times. Per batch: requests per second, median
time to first token and per output token (streamed), the scheduler process's CPU from /proc
(its poller thread included; that thread's own clock too, from otel-hicache's self-metric), and
the telemetry process's. Prints on/off ratios with their spread and CPU per merged op; asserts
nothing (a CPU model's forward pass dwarfs the cost, and shared cores add noise).
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_common import process_cpu_s, spread_text  # this script's folder

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "e2e"), str(ROOT / "tests")]
from otlp_receiver import GrpcReceiver  # noqa: E402
from real_server import server as rs  # noqa: E402


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (0 once it is gone)."""
    return process_cpu_s(pid) or 0.0


def poller_cpu_s(receiver: GrpcReceiver | None) -> float:
    """The poller thread's CPU (its own thread clock), as the telemetry process last exported it."""
    points = receiver.received.last_points("otel_hicache.poller.cpu_time") if receiver else []
    return sum(p.as_double for p in points)


def batch(server: rs.Server, receiver: GrpcReceiver | None, rounds: int, seed: int) -> dict[str, float]:
    scheduler = next(iter(server.schedulers()))
    children = list(server.telemetry_processes())
    spans_before = len(receiver.received.spans()) if receiver else 0
    poller0 = poller_cpu_s(receiver)
    cpu0, child0, t0 = cpu_s(scheduler), sum(map(cpu_s, children)), time.perf_counter()
    timings = rs.workload(server, rounds=rounds, seed=seed)
    wall = time.perf_counter() - t0
    time.sleep(2.5)  # the last acks and a metric export of the batch (every 1 s), counted in it
    out = {"rps": len(timings) / wall, "ttft": statistics.median(t["ttft"] for t in timings),
           "tpot": statistics.median(t["tpot"] for t in timings), "cpu": cpu_s(scheduler) - cpu0,
           "child": sum(map(cpu_s, children)) - child0, "poller": poller_cpu_s(receiver) - poller0, "ops": 0.0}
    if receiver:
        out["ops"] = float(len(receiver.received.spans()) - spans_before)
    return out


def spread(values: list[float]) -> str:
    return spread_text({"median": statistics.median(values), "min": min(values), "max": max(values)}, 3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3, help="batches per variant (default 3)")
    parser.add_argument("--rounds", type=int, default=3, help="workload rounds per batch (default 3)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hicache-real-server-bench."))
    model = rs.make_model(work / "model")
    receiver = GrpcReceiver()
    servers = {"off": rs.Server(model, work / "off.log", plugin=False, otlp_endpoint=receiver.endpoint),
               "on": rs.Server(model, work / "on.log", otlp_endpoint=receiver.endpoint)}
    rows: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    try:
        for server in servers.values():
            server.start()
        print(f"real SGLang server on CPU (write_through, page size 1), plugin off vs on, {args.pairs} "
              f"batches each of {args.rounds} workload rounds, alternating")
        print(f"{'batch':>5} {'plugin':6} {'req/s':>7} {'TTFT ms':>8} {'TPOT ms':>8} {'sched CPU s':>11} "
              f"{'merged ops':>10} {'telemetry CPU s':>15}")
        for i in range(args.pairs):
            for variant in (("off", "on") if i % 2 == 0 else ("on", "off")):
                r = batch(servers[variant], receiver if variant == "on" else None, args.rounds, seed=100 + i)
                rows[variant].append(r)
                print(f"{i:5d} {variant:6} {r['rps']:7.2f} {r['ttft'] * 1e3:8.1f} {r['tpot'] * 1e3:8.2f} "
                      f"{r['cpu']:11.2f} {r['ops']:10.0f} {r['child']:15.2f}", flush=True)
    finally:
        for server in servers.values():
            server.stop()
        receiver.stop()
    on, off = rows["on"], rows["off"]
    print("\non/off ratios, median [min-max] over the pairs (1.0 = no difference):")
    for key, name in (("rps", "request throughput"), ("ttft", "TTFT median"), ("tpot", "TPOT median")):
        print(f"  {name:19} {spread([a[key] / b[key] for a, b in zip(on, off)])}")
    per_op = [(a["cpu"] - b["cpu"]) / a["ops"] * 1e3 for a, b in zip(on, off) if a["ops"]]
    child = [a["child"] / a["ops"] * 1e3 for a in on if a["ops"]]
    poller = [a["poller"] / a["ops"] * 1e3 for a in on if a["ops"]]
    print(f"  scheduler CPU per batch        {spread([a['cpu'] / b['cpu'] for a, b in zip(on, off)])}")
    print(f"scheduler CPU per merged op, on minus off (ms): {spread(per_op)}")
    print(f"  poller thread (its own clock):                 {spread(poller)}")
    print(f"telemetry process CPU per merged op (ms):       {spread(child)}")
    print(f"merged ops per batch: {spread([a['ops'] for a in on])}; logs in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
