"""What a spawned SGLang scheduler process does, for the process-model tests.

``run_scheduler_process`` calls ``sglang.srt.plugins.load_plugins()`` first;
this child does the same, then drives real HiCache transfers on CPU and reports
(through a queue) what it did and what SGLang's own counters say. Its spans and
metrics leave over OTLP, configured only by the ``OTEL_*`` variables it
inherited.
"""

from __future__ import annotations

from typing import Any


def scheduler_like(results: Any) -> None:
    import sglang_cpu

    sglang_cpu.install_cpu_support()
    from opentelemetry import trace

    from sglang.srt.plugins import load_plugins

    before = sglang_cpu.sglang_counter_values()
    load_plugins()  # the entry point group sglang.srt.plugins, as every scheduler does
    load_plugins()  # idempotent (SGLang's guard), and so is the plugin itself
    from otel_hicache_sglang import SGLangHiCacheInstrumentor, plugin

    instrumentor = SGLangHiCacheInstrumentor()
    report: dict[str, Any] = {"instrumented": instrumentor.is_instrumented_by_opentelemetry,
                              "groups": instrumentor.instrumented_groups()}
    if report["instrumented"]:
        plugin()  # a second way in, in the same process: still instrumented once
    stack = sglang_cpu.build_stack("write_through")
    report["write_through"] = {k: v for k, v in sglang_cpu.write_through_round_trip(stack).items()
                               if isinstance(v, (int, bool))}
    report["retraction"] = {k: v for k, v in sglang_cpu.decode_retraction(stack).items()
                            if isinstance(v, (int, bool))}
    after = sglang_cpu.sglang_counter_values()
    report["sglang"] = {f"{name}{dict(sorted(labels))}": after[(name, labels)] - before.get((name, labels), 0.0)
                        for name, labels in after}
    report["global_tracer_provider"] = type(trace.get_tracer_provider()).__name__
    results.put(report)
    # no explicit flush: the multiprocessing finalizers otel-hicache registered export at exit


def scheduler_rank(results: Any, tp_rank: int, dp_attention: bool, tokens: int) -> None:
    """A scheduler of a TP=2 server (with attention DP: ``--dp-size 2 --enable-dp-attention``)
    at ``tp_rank``: its ranks published through SGLang's runtime context the way
    ``run_scheduler_process`` publishes them (``publish(..., ranks=SpawnRanks(...))``, then the
    DP-attention flags distributed initialization sets), then a write-through round trip of
    ``tokens`` tokens, different per rank, so that a sum over ranks would show."""
    import sglang_cpu

    sglang_cpu.install_cpu_support()
    from sglang.srt.layers.dp_attention import initialize_dp_attention_flags
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, spawn_world_rank
    from sglang.srt.server_args import ServerArgs

    load_plugins()
    sglang_cpu.PARALLEL_ARGS.update(tp_size=2, **({"dp_size": 2, "enable_dp_attention": True} if dp_attention else {}))
    server_args = ServerArgs(model_path="dummy", device="cpu", page_size=4, **sglang_cpu.PARALLEL_ARGS)
    publish(server_args, role="scheduler",
            ranks=SpawnRanks(world_rank=spawn_world_rank(server_args, tp_rank=tp_rank, pp_rank=0), gpu_id=None))
    initialize_dp_attention_flags(server_args)
    parallel = get_parallel()
    stack = sglang_cpu.build_stack("write_through")
    did = sglang_cpu.write_through_round_trip(stack, n=tokens, start=100 + tokens)
    results.put({"tp_rank": tp_rank, "published": {"tp_rank": parallel.tp_rank, "attn_tp_rank": parallel.attn_tp_rank,
                                                   "attn_dp_rank": parallel.attn_dp_rank},
                 "offload_tokens": did["offload_tokens"], "onboard_tokens": did["onboard_tokens"],
                 "offload_bytes": did["offload_bytes"]})


def collect(results: Any, children: list[Any], timeout_s: float = 180.0) -> list[Any]:
    """One report per child, read in the parent: a child that dies before it reports fails the
    test at once rather than after ``timeout_s``."""
    import queue
    import time

    reports, deadline = [], time.monotonic() + timeout_s
    while len(reports) < len(children):
        try:
            reports.append(results.get(timeout=0.2))
        except queue.Empty:
            dead = [child.exitcode for child in children if child.exitcode not in (None, 0)]
            assert not dead, f"a child died before it reported (exit codes {dead})"
            assert time.monotonic() < deadline, f"no report within {timeout_s} s"
    return reports
