"""What links to requests cost: the completion worker per op, and the SGLang adapter's
request site per call on the scheduler thread.

Worker: three TransferTelemetry instances, each with its own SDK providers (spans at 100%
into a counting exporter, an in-memory metric reader), take the same stream of ops in
turns (rotating order, ``--rounds``): without ``requests``, with one traced request per
op (a prefix hit's load-back, the common case), and with four (a merged load-back that
admitted four requests). An op is the 1,408-token merged op of ``benchmarks/overhead.py``,
device-timed events already complete, directions alternating, submitted flat out; the
worker's CPU (its thread's clock) from the first submit until ``force_flush`` returned,
per op, is printed with the difference.

Request site: the adapter's wrapper (``causes.QueuedCauses.request_site``) around a
Python function that does nothing, called with a real SGLang ``Req`` whose trace context
crossed a pickle as in a scheduler (``sglang_cpu.traced_request``), paired with the bare
function call by call, paced one every ``--interval-us``: the site's own cost (reading
``req.time_stats.trace_ctx.root_span_context``, setting and restoring the thread's
request). Also with an untraced ``Req`` (SGLang's ``TraceNullContext``). A request site
is wrapped only in a process whose SGLang tracing is on.

Usage::

    python benchmarks/request_links.py            # ~30 s on 2 cores (about 6 s importing SGLang)
    python benchmarks/request_links.py --quick

Only differences within one run mean anything; nothing asserts a time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "instrumentation" / "otel-hicache-sglang" / "tests"))

from bench_common import SdkProviders, env, table, wait_until, worker_us_per_op  # noqa: E402
from opentelemetry.trace import SpanContext, TraceFlags  # noqa: E402

from otel_hicache import TransferTelemetry  # noqa: E402
from otel_hicache.testing import WallClockDevice  # noqa: E402

STATIC = {"tp_rank": 0, "pp_rank": 0, "dp_rank": 0, "attn_cp_rank": 0}
VARIANTS = {"no requests": 0, "1 request per op": 1, "4 requests per op": 4}


def run_worker(requests_per_op: int, ops: int) -> dict[str, float]:
    providers = SdkProviders(max_spans_queued=1 << 20)
    with env(OTEL_HICACHE_ENABLED="true", OTEL_HICACHE_MAX_QUEUE_SIZE=str(ops + 1000)):
        tel = TransferTelemetry(providers.tracer_provider, providers.meter_provider, attributes=STATIC)
    sampled = TraceFlags(TraceFlags.SAMPLED)
    device = WallClockDevice()
    submit = tel.submit

    def drive() -> None:
        for i in range(ops):
            offload = not i & 1
            start_event, finish_event = device.copy(time.time_ns() - 7_000_000, 6.0)  # done 1 ms ago
            # new requests every op (64-bit trace ids, as SGLang's own request tracing makes),
            # made here, alive only until the op is reported: as a scheduler's
            requests = [SpanContext((i << 8) + k + 1, (i << 8) + k + 1, is_remote=True, trace_flags=sampled)
                        for k in range(requests_per_op)] if requests_per_op else None
            submit("offload" if offload else "onboard", {"kv": 1408, "swa": 1408}, 161_480_704, 64, start_event,
                   finish_event, True, "kernel", expect_ack=False,
                   cause="write_through" if offload else "prefix_hit", requests=requests)

    worker_us = worker_us_per_op(tel, providers, ops, drive)
    if providers.exporter.count != ops:
        raise RuntimeError(f"{providers.exporter.count} spans for {ops} ops")
    return {"worker_us": worker_us}


def run_request_site(calls: int, interval_us: float) -> dict[str, float]:
    """The request site's own cost per call, paired with the bare call (see the docstring)."""
    import sglang_cpu

    sglang_cpu.install_cpu_support()
    from opentelemetry.sdk.trace import TracerProvider
    from otel_hicache_sglang.causes import QueuedCauses, RequestSite
    from otel_hicache_sglang.transfers import _Capture  # pylint: disable=protected-access
    from sglang.srt.observability.trace import TraceNullContext

    def noop(_self: object, _req: object) -> None:
        return None

    site = QueuedCauses(_Capture()).request_site(RequestSite("bench", "noop", 0, "req"))
    wrapped = site.make(noop)
    with sglang_cpu.request_tracing(TracerProvider(shutdown_on_exit=False)):
        traced, tokenizer_side = sglang_cpu.traced_request("rid-bench", list(range(16)))
        untraced, untraced_side = sglang_cpu.traced_request("rid-bench-2", list(range(16)))
    untraced.time_stats.trace_ctx = TraceNullContext()
    results = {}
    clock, interval_ns = time.perf_counter_ns, int(interval_us * 1000)
    for name, req in (("traced request", traced), ("untraced request", untraced)):
        samples: dict[bool, list[int]] = {False: [], True: []}
        deadline = clock() + interval_ns
        for i in range(2 * calls + 200):
            site_on = bool((i >> 1) & 1)  # pairs of calls alternate
            call = wrapped if site_on else noop
            deadline = wait_until(deadline) + interval_ns
            t0 = clock()
            call(None, req)
            t1 = clock()
            if i >= 200:
                samples[site_on].append(t1 - t0)
        results[name] = (statistics.median(samples[True]) - statistics.median(samples[False])) / 1e3
    results["bare call"] = statistics.median(samples[False]) / 1e3
    for side in (tokenizer_side, untraced_side):
        side.trace_req_finish()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--ops", type=int)
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--calls", type=int, help="paired request-site calls per half")
    parser.add_argument("--interval-us", type=float, default=200.0, help="request site: one call every this many us")
    args = parser.parse_args(argv)
    ops = args.ops or (4000 if args.quick else 20000)
    rounds = args.rounds or (2 if args.quick else 4)
    names = list(VARIANTS)
    results: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            results[name].append(run_worker(VARIANTS[name], ops)["worker_us"])
    med = {name: statistics.median(v) for name, v in results.items()}
    base = med["no requests"]
    print(f"# links to requests: {ops} ops x {rounds} rounds per variant, spans at 100%\n")
    print(table([[name, f"{med[name]:.1f}", "" if name == "no requests" else f"{med[name] - base:+.1f}",
                  f"{med[name] / base:.2f}"] for name in names],
                ["variant", "worker CPU us/op", "added us/op", "ratio"]))
    site = run_request_site(args.calls or (1000 if args.quick else 5000), args.interval_us)
    print(f"\n# the SGLang adapter's request site, paired call by call with the bare call "
          f"({site['bare call']:.2f} us), paced every {args.interval_us:.0f} us\n")
    print(table([[name, f"{site[name]:+.2f}"] for name in ("traced request", "untraced request")],
                ["request", "added us per call"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
