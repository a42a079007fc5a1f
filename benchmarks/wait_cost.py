"""What one wait costs the completion worker on this machine, in CPU.

At realistic pacing the worker takes in one or two records per cycle, and between
cycles it waits one poll interval (``OTEL_HICACHE_POLL_INTERVAL_MS``, 1 ms): the
SGLang adapter's acks are stamped when a cycle sees them leave SGLang's ack queue,
so the poll interval is the ack delay's resolution. This prints the thread CPU
(user + system, ``time.thread_time``) and the wall time of one wait with each
primitive the worker could use, side by side, so the per-cycle floor of a machine
is a measured number: a hot idle worker cycle is ~2 us of CPU, and the wait
after it is what this prints.

    python benchmarks/wait_cost.py [--poll-ms 1] [--waits 2000]
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--poll-ms", type=float, default=1.0, help="the wait's timeout (the poll interval)")
    parser.add_argument("--waits", type=int, default=2000, help="waits per primitive")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
