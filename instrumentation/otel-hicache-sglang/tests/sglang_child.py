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
