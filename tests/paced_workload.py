"""A paced stream of merged ops, configured only by ``OTEL_*`` variables: the load of the
fault tests and of the soak (``benchmarks/soak.py``), run as a script (``paced_runs.py``).

Runs ``--rate`` ops per second for ``--seconds`` through ``otel_hicache.configure()`` and a
``TransferTelemetry`` (its exporters), alternating offload and onboard ops of a few pages
with host-clock times and an ack one op later. Every op's span carries ``workload.op`` (its
index), so a receiver can tell which ops arrived. What the exporters delivered and lost is
read from the SDK's own self-metrics (``otel.sdk.*``) through an in-memory metric reader
added to the providers (which keeps the sinks embedded in this process): run it with
``OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED=true`` (``tests/paced_runs.py`` does), or every
delivery count reads 0. With ``--telemetry-process`` no reader is added: ``configure()``
chooses as it does for a user (the telemetry process when an exporter sends over OTLP), the
SDK's self-metrics stay in the telemetry process and every delivery count here reads 0;
``telemetry_process_pid`` in the results is its pid (None when the sinks ran embedded).

Measured in the process and written to ``--out`` (JSON):

* ``truth``: ops, bytes, blocks and tokens per direction (what the counters must say);
* ``submit``: the time of each op's submit (ms since ``start_unix_ns``) and the cost of the
  ``submit()`` call itself (ns), both as lists indexed by op;
* ``samples``: once a second, RSS, the completion pipeline's size, the batch span
  processor's queue, the completion worker's CPU time and the delivery counts
  (``sdk_delivery.py``);
* ``final``: the same after the final flush (before shutdown), the delivery counts read
  until two collections agree; and the seconds ``shutdown()`` took.

Prints ``ops done`` (flushed) once the ops are submitted, before the final flush, so a
caller can time the exit from there.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import threading
import time
from array import array
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402

import otel_hicache  # noqa: E402
from otel_hicache import configuration  # noqa: E402
from sdk_delivery import SDK_SELF_METRICS, read_sdk_delivery, sdk_delivery  # noqa: E402  (this script's folder)

PAGE = 64
BYTES_PER_TOKEN = 4096
DIRECTIONS = ("offload", "onboard")


def rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def wait_until(deadline_ns: int) -> None:
    """Sleep until ``deadline_ns`` (``perf_counter_ns``), releasing the GIL as a scheduler waiting
    on its device does; a deadline already passed returns at once (no catch-up burst)."""
    now = time.perf_counter_ns()
    if now < deadline_ns:
        time.sleep((deadline_ns - now) / 1e9)


def _percentiles(costs: array) -> dict[str, int]:
    ordered = sorted(costs)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1)))]  # noqa: E731
    return {"p50_ns": pick(0.5), "p99_ns": pick(0.99), "p999_ns": pick(0.999), "max_ns": ordered[-1]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=200.0, help="ops per second")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--out", required=True, help="JSON results")
    parser.add_argument("--tp-rank", type=int, default=0)
    parser.add_argument("--no-op-attribute", action="store_true",
                        help="leave workload.op off the spans (the soak: no per-op attribute dict)")
    parser.add_argument("--no-provider-flush", action="store_true",
                        help="after the ops, wait for the spans to reach the SDK but do not flush the exporters")
    parser.add_argument("--summary", action="store_true",
                        help="submit() cost percentiles instead of the per-op lists (long runs)")
    parser.add_argument("--exit-without-shutdown", action="store_true",
                        help="write the results and return: the exit hooks shut telemetry down (as in a server)")
    parser.add_argument("--telemetry-process", action="store_true",
                        help="no in-process metric reader: configure() chooses where the sinks run, as for a "
                             "user (delivery counts read 0)")
    args = parser.parse_args(argv)

    if args.telemetry_process:
        reader = None
        configuration.configure()
    else:
        if any(os.environ.get(k) != v for k, v in SDK_SELF_METRICS.items()):
            print("paced_workload: OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED is not true: the SDK keeps no "
                  "self-metrics, every delivery count reads 0", file=sys.stderr)
        reader = InMemoryMetricReader()  # the SDK's self-metrics (and the transfer metrics), read in-process
        configuration.configure(metric_readers=[reader])
    tel = otel_hicache.TransferTelemetry(attributes={"tp_rank": args.tp_rank})
    total = int(args.rate * args.seconds)
    submit_ms = array("d", bytes(8 * total))  # preallocated: the lists do not grow the RSS
    submit_cost = array("q", bytes(8 * total))
    truth = {d: {"ops": 0, "bytes": 0, "blocks": 0, "tokens": 0} for d in DIRECTIONS}
    samples: list[dict[str, Any]] = []
    done = threading.Event()
    progress = [0]

    def poller_cpu_s() -> float:
        for thread in threading.enumerate():
            if thread.name == "otel-hicache-poller" and thread.ident is not None:
                try:
                    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
                except (AttributeError, OSError):
                    return 0.0
        return 0.0

    def sample(attempts: int = 0) -> dict[str, Any]:
        pipeline = tel._pipeline  # pylint: disable=protected-access
        delivery = read_sdk_delivery(reader, attempts) if reader is not None else sdk_delivery(None)
        return {"t": round(time.monotonic() - t0, 3), "ops": progress[0], "rss": rss_bytes(),
                "pipeline": pipeline._snapshot()[1] if pipeline is not None else 0,
                "span_queue": delivery["spans"]["queued"], "poller_cpu_s": round(poller_cpu_s(), 4),
                "delivery": delivery}

    def sampler() -> None:
        while not done.wait(1.0):
            samples.append(sample())

    t0 = time.monotonic()
    start_unix_ns = time.time_ns()
    start_ns = time.perf_counter_ns()
    period_ns = int(1e9 / args.rate)
    thread = threading.Thread(target=sampler, name="sampler", daemon=True)
    thread.start()
    previous = None
    for i in range(total):
        wait_until(start_ns + i * period_ns)  # a fixed schedule: a late op does not delay the next ones
        direction = DIRECTIONS[i & 1]
        pages = 1 + (i * 7919) % 8
        tokens = pages * PAGE
        num_bytes = tokens * BYTES_PER_TOKEN
        end = time.time_ns()
        attributes = None if args.no_op_attribute else {"workload.op": i}
        t_call = time.perf_counter_ns()
        handle = tel.submit(direction, {"kv": tokens}, num_bytes, page_size=PAGE, attributes=attributes,
                            host_start_ns=end - 20_000 * pages, host_end_ns=end)
        t_back = time.perf_counter_ns()
        tel.ack(previous)  # the consumer takes the previous op's ack
        previous = handle
        submit_cost[i] = t_back - t_call
        submit_ms[i] = (t_call - start_ns) / 1e6
        truth_d = truth[direction]
        truth_d["ops"] += 1
        truth_d["bytes"] += num_bytes
        truth_d["blocks"] += pages
        truth_d["tokens"] += tokens
        progress[0] = i + 1
    tel.ack(previous)
    elapsed = (time.perf_counter_ns() - start_ns) / 1e9
    print(f"ops done: {total} ops in {elapsed:.1f} s", flush=True)
    done.set()
    thread.join()
    pipeline = tel._pipeline  # pylint: disable=protected-access
    flushed = pipeline.flush(10.0)  # every op's span handed to the SDK
    if not args.no_provider_flush:
        flushed = tel.force_flush(10.0) and flushed
    final = sample(attempts=10)
    process = getattr(tel.channel, "process", None)  # the telemetry process, while it runs
    result = {
        "rate": args.rate, "seconds": args.seconds, "ops": total, "start_unix_ns": start_unix_ns,
        "elapsed_s": elapsed, "flushed": flushed,
        "channel": type(tel.channel).__name__, "telemetry_process_pid": process.pid if process is not None else None,
        "truth": truth, "samples": samples, "final": final,
        "submit": _percentiles(submit_cost) if args.summary else {"ms": list(submit_ms),
                                                                   "cost_ns": list(submit_cost)},
    }
    if not args.exit_without_shutdown:
        t_shutdown = time.monotonic()
        tel.shutdown()
        configuration.shutdown()
        result["shutdown_s"] = round(time.monotonic() - t_shutdown, 3)
    gc.collect()
    Path(args.out).write_text(json.dumps(result), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
