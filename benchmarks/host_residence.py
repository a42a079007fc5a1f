"""What host residence bookkeeping costs the completion worker per op, and its memory per page.

Three TransferTelemetry instances, each with its own SDK providers (spans at 100% into a
counting exporter, an in-memory metric reader), take the same stream of ops in turns
(rotating order, ``--rounds``): two submit each op with ``host_slots`` (its host token
slots in a pool made by ``TransferTelemetry.host_pool``; a host free every tenth op), one
keeping its pages in plain Python (``HostPool``'s path for small ops), one in NumPy (its
path for large ones), both forced whatever the op's size; the third submits the same op
without. An op is a merged op of ``--pages`` pages of 64 tokens, for each size given
(default 1, 4, 8, 16 and 22 pages: 22 is the 1,408-token op of ``benchmarks/overhead.py``),
device-timed events already complete, directions alternating: every load-back reads the
pages an earlier offload wrote (two writing offloads per load-back), so each records
residences, reloaded bytes and links. The sizes where each path is cheaper say where
``host_residence.SMALL_OP_SLOTS`` belongs.
Ops are submitted flat out; the worker's CPU (its thread's clock) from the first submit until
``force_flush`` returned, per op, and the difference, are printed. The caller's ``submit()``
is timed too: ``host_slots`` is one more keyword, nothing else runs on the caller's thread.

Usage::

    python benchmarks/host_residence.py            # ~20 s on 2 cores
    python benchmarks/host_residence.py --quick    # ~6 s

Only differences within one run mean anything; nothing asserts a time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import SdkProviders, env, table, worker_us_per_op  # noqa: E402

from otel_hicache import TransferTelemetry  # noqa: E402
from otel_hicache.sinks.host_residence import SMALL_OP_PAGES, SMALL_OP_SLOTS  # noqa: E402
from otel_hicache.testing import WallClockDevice  # noqa: E402

PAGE = 64
STATIC = {"tp_rank": 0, "pp_rank": 0, "dp_rank": 0, "attn_cp_rank": 0}


VARIANTS = {"without host_slots": None, "with, plain Python": 1 << 30, "with, NumPy": 0}  # -> small_op_slots


def run(variant: str, ops: int, pages: int) -> dict[str, float]:
    small_op_slots = VARIANTS[variant]
    tracked = small_op_slots is not None
    providers = SdkProviders(max_spans_queued=1 << 20)
    host_pages = 64 * pages
    # host residence is off by default (OTEL_HICACHE_HOST_RESIDENCE): on here, for the tracked variant
    with env(OTEL_HICACHE_ENABLED="true", OTEL_HICACHE_MAX_QUEUE_SIZE=str(ops + 1000),
             OTEL_HICACHE_HOST_RESIDENCE="true"):
        tel = TransferTelemetry(providers.tracer_provider, providers.meter_provider, attributes=STATIC)
        pool = tel.host_pool(host_pages * PAGE, PAGE) if tracked else None
    if tracked and pool is None:
        raise RuntimeError("host residence did not start (NumPy missing?)")
    if tracked:
        pool.small_op_slots = pool.small_op_pages = small_op_slots
    slots = [np.arange(start * PAGE, (start + pages) * PAGE, dtype=np.int64)
             for start in range(0, host_pages - pages, pages)]
    half = pages // 2 * PAGE  # a load-back reads the second half of one offload and the first of the next
    reads = [np.concatenate([a[half:], b[:half]]) for a, b in zip(slots, slots[1:])]
    device = WallClockDevice()
    submit = tel.submit
    costs = []

    def drive() -> None:
        for i in range(ops):
            k = (i // 2) % len(reads)
            offload = not i & 1
            start_event, finish_event = device.copy(time.time_ns() - 7_000_000, 6.0)  # done 1 ms ago
            t0 = time.perf_counter_ns()
            submit("offload" if offload else "onboard", {"kv": pages * PAGE}, 161_480_704, PAGE, start_event,
                   finish_event, True, "kernel", expect_ack=False,
                   cause="write_through" if offload else "prefix_hit",
                   host_slots=(pool, slots[k] if offload else reads[k - 1 if k else 0]) if tracked else None)
            costs.append(time.perf_counter_ns() - t0)
            if tracked and i % 10 == 9:
                tel.host_freed(pool, slots[(k + 7) % len(slots)])  # evicted, some never read

    worker_us = worker_us_per_op(tel, providers, ops, drive)
    return {"worker_us": worker_us, "submit_median_us": statistics.median(costs) / 1e3,
            "bytes_per_page": float(pool.bytes_per_page) if pool is not None else 0.0,
            "spans": float(providers.exporter.count)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--ops", type=int)
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--pages", default="1,4,8,16,22", help="op sizes in pages of 64 tokens (comma-separated)")
    args = parser.parse_args(argv)
    ops = args.ops or (2000 if args.quick else 10000)
    rounds = args.rounds or (2 if args.quick else 3)
    sizes = [int(p) for p in args.pages.split(",")]
    names = list(VARIANTS)
    python_up_to = min(SMALL_OP_SLOTS, SMALL_OP_PAGES * PAGE)  # ops of at most this many slots: the Python path
    rows = []
    bytes_per_page = 0.0
    for pages in sizes:
        results: dict[str, list[dict[str, float]]] = {name: [] for name in names}
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:  # rotating order
                results[name].append(run(name, ops, pages))
        med = {k: {f: statistics.median(x[f] for x in v) for f in v[0]} for k, v in results.items()}
        base = med[names[0]]["worker_us"]
        python, numpy_ = med[names[1]]["worker_us"], med[names[2]]["worker_us"]
        bytes_per_page = med[names[1]]["bytes_per_page"]
        rows.append([str(pages), str(pages * PAGE), f"{base:.1f}", f"{python - base:+.1f}", f"{numpy_ - base:+.1f}",
                     f"{numpy_ / python:.2f}", f"{med[names[1]]['submit_median_us'] - med[names[0]]['submit_median_us']:+.2f}",
                     "plain Python" if pages * PAGE <= python_up_to else "NumPy"])
    print(f"# host residence: {ops} ops x {rounds} rounds per variant and size, pages of {PAGE} tokens, "
          f"bookkeeping {bytes_per_page:.0f} B per host page\n")
    print(table(rows, ["pages", "slots", "worker us/op without", "added: Python", "added: NumPy", "NumPy/Python",
                       "submit() added us", f"default path (<= {python_up_to} slots: Python)"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
