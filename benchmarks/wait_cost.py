"""What one wait costs the completion worker on this machine, in CPU.

At realistic pacing the worker takes in one or two records per cycle, and between
cycles it waits one poll interval (``OTEL_HICACHE_POLL_INTERVAL_MS``, 1 ms): the
SGLang adapter's acks are stamped when a cycle sees them leave SGLang's ack queue,
so the poll interval is the ack delay's resolution. This prints the thread CPU
(user + system, ``time.thread_time``) and the wall time of one wait with each
primitive the worker could use, side by side, so the per-cycle floor of a machine
is a measured number: a hot idle worker cycle is ~2 us of CPU, and the wait
after it is what this prints.

A wait also costs the work after it: code that runs after a sleep finds the CPU's
caches cold (here, on a VM, also the vCPU halted and woken), so the same work costs
more CPU the longer the sleep before it. The second table times one fixed piece of
pure Python (:func:`control_work`, no otel-hicache) back to back and after sleeps of
0.2-16 ms, alone and in bursts: what any worker's per-op cost gains on this machine
when its ops arrive slowly, whatever its own code does.

    python benchmarks/wait_cost.py [--poll-ms 1] [--waits 2000] [--cold-calls 1000]
"""

from __future__ import annotations

import argparse
import os
import select
import sys
import threading
import time
from typing import Callable


def measure(wait: Callable[[], object], n: int) -> tuple[float, float]:
    """CPU and wall microseconds per call of ``wait``, over ``n`` calls."""
    cpu0, wall0 = time.thread_time_ns(), time.perf_counter_ns()
    for _ in range(n):
        wait()
    return (time.thread_time_ns() - cpu0) / n / 1e3, (time.perf_counter_ns() - wall0) / n / 1e3


def control_work() -> int:
    """~30 us of ordinary Python on a warm CPU (dicts, strings, small calls): the control."""
    out = []
    for i in range(60):
        d = {"a": i, "b": str(i), "c": (i, i + 1)}
        out.append(len(d) + hash(d["b"]) % 7)
    return sum(out)


def after_sleep(gap_s: float, burst: int = 1, calls: int = 1000) -> float:
    """Median thread CPU (us) of one :func:`control_work` in bursts of ``burst`` calls, each
    burst after a sleep of ``gap_s`` (0: back to back), over about ``calls`` calls."""
    bursts = max(5, calls // burst)
    clock, costs = time.thread_time_ns, []
    control_work()
    for _ in range(bursts):
        if gap_s:
            time.sleep(gap_s)
        t0 = clock()
        for _ in range(burst):
            control_work()
        costs.append((clock() - t0) / burst)
    costs.sort()
    return costs[len(costs) // 2] / 1e3


COLD_GAPS_MS = (0.0, 0.2, 1.0, 4.0, 16.0)
COLD_BURSTS = (1, 4, 16)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--poll-ms", type=float, default=1.0, help="the wait's timeout (the poll interval)")
    parser.add_argument("--waits", type=int, default=2000, help="waits per primitive")
    parser.add_argument("--cold-calls", type=int, default=1000,
                        help="control calls per cell of the after-a-sleep table (fewer after the long sleeps)")
    args = parser.parse_args(argv)
    timeout = args.poll_ms / 1e3
    held = threading.Lock()
    held.acquire()  # never released: every acquire times out, as the worker's idle wait does
    read_end, _write_end = os.pipe()
    rows = [
        (f"lock.acquire(timeout={args.poll_ms:g} ms) (the worker's wait)", lambda: held.acquire(timeout=timeout)),
        (f"time.sleep({args.poll_ms:g} ms)", lambda: time.sleep(timeout)),
        (f"select.select(pipe, {args.poll_ms:g} ms)", lambda: select.select([read_end], [], [], timeout)),
        ("time.sleep(0) (a GIL yield)", lambda: time.sleep(0)),
    ]
    print(f"CPython {sys.version.split()[0]}, {os.cpu_count()} CPUs; {args.waits} waits each")
    width = max(len(name) for name, _ in rows)
    print(f"{'wait':<{width}}  CPU us/wait  wall us/wait")
    for name, wait in rows:
        cpu, wall = measure(wait, args.waits)
        print(f"{name:<{width}}  {cpu:>11.1f}  {wall:>12.0f}")
    print("\nThe same Python work (control_work, no otel-hicache) after a sleep: thread CPU us per call (median)")
    print(f"{'sleep before a burst':<20}" + "".join(f"  {f'burst of {b}':>11}" for b in COLD_BURSTS)
          + "  (burst of 1 / back to back)")
    warm = None
    after_sleep(0.0, 1, args.cold_calls)  # warm-up
    for gap_ms in COLD_GAPS_MS:
        # about 0.3 s of sleeping per cell at most: fewer calls after the long sleeps
        calls = min(args.cold_calls, max(20, int(0.3e3 / gap_ms))) if gap_ms else args.cold_calls
        cells = [after_sleep(gap_ms / 1e3, burst, calls * burst if gap_ms else calls) for burst in COLD_BURSTS]
        warm = cells[0] if warm is None else warm
        label = "none (back to back)" if not gap_ms else f"{gap_ms:g} ms"
        print(f"{label:<20}" + "".join(f"  {c:>11.1f}" for c in cells) + f"  {cells[0] / warm:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
