"""What otel-hicache costs the process, as counters: CPU seconds of its own threads.

* ``otel_hicache.worker.cpu_time``: the completion worker (everything but
  ``submit()``/``ack()``: intake, timing, spans, metrics);
* ``otel_hicache.export.cpu_time{thread}``: the SDK threads that export
  otel-hicache's telemetry, ``span_processor`` (each ``BatchSpanProcessor``'s
  worker: span encoding and export) and ``metric_reader`` (each
  ``PeriodicExportingMetricReader``'s: collection and export), and ``export_process``
  (the helper process of ``OTEL_HICACHE_SPAN_EXPORT_PROCESS=true``, from ``/proc``).

Observable counters, read at collection on the reader's thread from each
thread's CPU clock (``time.pthread_getcpuclockid``): nothing on the hot path,
nothing per op on the worker. ``rate(...)`` of either is the share of one core
that thread kind uses. Every point carries the static attributes (ranks).
Threads are looked up at each collection (a processor added later, the threads
a forked child restarts), through :func:`otel_hicache.sdk_internals.export_threads`;
the CPU time of a thread that ended stays counted, so the counters never go
down. Where a thread's CPU clock cannot be read (not Linux, or an SDK whose
threads cannot be found) there is no point for it.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Mapping

from . import sdk_internals
from . import semconv as sc
from .version import __version__


def thread_cpu_s(thread: threading.Thread | None) -> float | None:
    """CPU seconds of a live thread, or None (ended, not started, or no per-thread clock here)."""
    if not isinstance(thread, threading.Thread) or thread.ident is None or not thread.is_alive():
        return None
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (AttributeError, OSError, ValueError, OverflowError):
        return None


class _ThreadKind:
    """Summed CPU seconds of the threads of one kind, with the last reading of
    threads that ended kept, so the total never goes down."""

    __slots__ = ("_last", "_retired")

    def __init__(self) -> None:
        self._last: dict[int, tuple[threading.Thread, float]] = {}
        self._retired = 0.0

    def total(self, threads: list[threading.Thread]) -> float | None:
        seen: dict[int, tuple[threading.Thread, float]] = {}
        for thread in threads:
            seconds = thread_cpu_s(thread)
            if seconds is not None:
                seen[id(thread)] = (thread, seconds)
        for key, (thread, seconds) in self._last.items():
            if key not in seen:
                self._retired += seconds  # ended (or dropped by its provider) since the last reading
        self._last = seen
        if not seen and not self._retired:
            return None
        return self._retired + sum(seconds for _thread, seconds in seen.values())


class TelemetryCpu:
    """Registers ``otel_hicache.worker.cpu_time`` and ``otel_hicache.export.cpu_time``
    on ``meter_provider``.

    :param worker: returns the completion worker's thread (read at each collection).
    :param tracer_provider: whose span processors' threads are ``span_processor``.
    """

    def __init__(self, meter_provider: Any, tracer_provider: Any, static: Mapping[str, Any],
                 worker: Callable[[], threading.Thread | None]) -> None:
        from opentelemetry.metrics import Observation

        self._static = dict(static)
        self._worker = worker
        self._tracer_provider = tracer_provider
        self._meter_provider = meter_provider
        self._kinds = {sc.THREAD_SPAN_PROCESSOR: _ThreadKind(), sc.THREAD_METRIC_READER: _ThreadKind()}
        self._attrs = {kind: {**self._static, sc.THREAD: kind} for kind in self._kinds}
        self._lock = threading.Lock()  # two readers may collect at once
        meter = meter_provider.get_meter(sc.SCOPE_NAME, __version__)

        def worker_cpu(_options: Any) -> list[Any]:
            seconds = thread_cpu_s(self._worker())
            return [] if seconds is None else [Observation(seconds, self._static)]

        process_attrs = {**self._static, sc.THREAD: sc.THREAD_EXPORT_PROCESS}

        def export_cpu(_options: Any) -> list[Any]:
            threads = sdk_internals.export_threads(self._tracer_provider, self._meter_provider)
            observations = []
            with self._lock:
                for kind, counter in self._kinds.items():
                    seconds = counter.total(threads[kind])
                    if seconds is not None:
                        observations.append(Observation(seconds, self._attrs[kind]))
                helpers = [s for s in (h.helper_cpu_s() for h in threads["export_process"]) if s is not None]
                if helpers:
                    observations.append(Observation(sum(helpers), process_attrs))
            return observations

        for spec, callback in ((sc.WORKER_CPU_TIME, worker_cpu), (sc.EXPORT_CPU_TIME, export_cpu)):
            name, unit, description = spec
            meter.create_observable_counter(name, callbacks=[callback], unit=unit, description=description)
