"""Helpers shared by the benchmarks in this folder (``overhead.py``, ``sglang_overhead.py``)
and the tests that run them.

The OTel SDK sinks both measure against (a counting span exporter, SDK providers with an
in-memory metric reader), per-thread CPU clocks, the paced wait between ops, percentiles,
the machine description and the plain-text tables of their reports.

The benchmarks are run as scripts (``python benchmarks/overhead.py``), so Python puts this
folder first on ``sys.path`` and they import this module as ``bench_common``, from any
working directory. It imports only the standard library and the OpenTelemetry SDK: not
otel-hicache, nor SGLang (``sglang_overhead.py`` must install its CPU support first).
"""

from __future__ import annotations

import os
import platform
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.version import __version__ as SDK_VERSION

HERE = Path(__file__).resolve().parent

# --------------------------------------------------------------------------------------
# OTel SDK sinks
# --------------------------------------------------------------------------------------


class CountingSpanExporter(SpanExporter):
    """Counts spans and keeps the first one (to compare attribute sets); exports nothing."""

    def __init__(self) -> None:
        self.count = 0
        self.first: Any = None

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        if self.first is None and spans:
            self.first = spans[0]
        self.count += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class SdkProviders:
    """TracerProvider (default sampler: 100%) with a BatchSpanProcessor into a
    counting exporter, and a MeterProvider with an InMemoryMetricReader.

    ``max_spans_queued``: the BatchSpanProcessor's queue size. ``shutdown_on_exit``:
    passed to both providers (whether they register an ``atexit`` shutdown)."""

    def __init__(self, max_spans_queued: int = 1 << 20, shutdown_on_exit: bool = True) -> None:
        self.exporter = CountingSpanExporter()
        self.tracer_provider = TracerProvider(shutdown_on_exit=shutdown_on_exit)
        self.tracer_provider.add_span_processor(
            BatchSpanProcessor(self.exporter, max_queue_size=max_spans_queued, max_export_batch_size=512)
        )
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader], shutdown_on_exit=shutdown_on_exit)

    def flush(self) -> None:
        self.tracer_provider.force_flush()
        self.meter_provider.force_flush()

    def shutdown(self) -> None:
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()

    def totals(self, split_by: str | None = None) -> dict[str, float]:
        """Counter sums (key: the metric name) and histogram counts (key: ``<name>.count``),
        over all points. With ``split_by``, counter points that have that attribute are
        summed apart, under ``<name>[<value>]`` (e.g. tokens by pool)."""
        totals: dict[str, float] = {}
        data = self.reader.get_metrics_data()
        for resource_metrics in data.resource_metrics if data else ():
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    for point in metric.data.data_points:
                        if hasattr(point, "bucket_counts"):
                            key, value = f"{metric.name}.count", point.count
                        else:
                            part = point.attributes.get(split_by) if split_by else None
                            key, value = metric.name + (f"[{part}]" if part else ""), point.value
                        totals[key] = totals.get(key, 0) + value
        return totals

    def metric_sum(self, name: str) -> float:
        """Sum of every point of counter ``name`` (all attribute sets)."""
        return float(self.totals().get(name, 0.0))


@contextmanager
def env(**values: str) -> Iterator[None]:
    """Environment variables set while constructing something that reads them."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


# --------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------


def thread_cpu() -> dict[str, float]:
    """CPU seconds of every live thread, by thread name (its first word; this thread is
    ``"caller"``). Linux: per-thread CPU clocks; threads without one are left out."""
    cpu: dict[str, float] = {}
    for thread in threading.enumerate():
        try:
            seconds = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))  # type: ignore[arg-type]
        except (AttributeError, OSError, TypeError):
            continue
        name = "caller" if thread is threading.current_thread() else thread.name.split(" ")[0]
        cpu[name] = cpu.get(name, 0.0) + seconds
    return cpu


def worker_us_per_op(tel: Any, providers: "SdkProviders", ops: int, drive: Any) -> float:
    """``drive()`` submits ``ops`` ops to ``tel``: run it, flush, and return the completion
    worker's CPU per op in microseconds (its thread's clock, from the first submit until
    ``force_flush`` returned). Shuts ``tel`` and ``providers`` down either way."""
    try:
        before = thread_cpu().get("otel-hicache-poller", 0.0)
        drive()
        if not tel.force_flush(600):
            raise RuntimeError("force_flush timed out")
        worker = thread_cpu().get("otel-hicache-poller", 0.0) - before
    finally:
        tel.shutdown()
        providers.shutdown()
    return worker / ops * 1e6


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) of another process so far, from ``/proc`` (None: gone, or not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def wait_until(deadline: int, spin_ns: int = 0) -> int:
    """Wait until ``deadline`` (``perf_counter_ns``). Returns the deadline, or now if it
    already passed (no catch-up bursts).

    The wait sleeps, releasing the GIL (as a scheduler waiting on its device does), so
    worker threads (otel-hicache's, the span processor's) run between ops. With
    ``spin_ns`` it sleeps until ``spin_ns`` before the deadline (not at all when less
    than ``spin_ns`` + 20 us are left) and spins the rest, for a punctual deadline. A
    long spin holds the GIL: a worker then gets it only every switch interval (5 ms)
    and processes a large batch while the caller waits."""
    now = time.perf_counter_ns()
    if now >= deadline:
        return now
    if not spin_ns:
        time.sleep((deadline - now) / 1e9)
        return deadline
    if deadline - now > spin_ns + 20_000:
        time.sleep((deadline - now - spin_ns) / 1e9)
    while time.perf_counter_ns() < deadline:
        pass
    return deadline


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``sorted_values``: the nearest rank, no interpolation."""
    index = min(len(sorted_values) - 1, max(0, int(round(q * (len(sorted_values) - 1)))))
    return sorted_values[index]


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------


def machine(package: str, version: str, **versions: str) -> dict[str, Any]:
    """What ran: ``package`` at ``version`` and this checkout's git revision, then
    ``versions`` (other packages, in order), CPUs, Python, the OTel SDK, platform and CPU model."""
    return {
        package: f"{version} ({_git_revision()})",
        **versions,
        "cpus": os.cpu_count(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "opentelemetry_sdk": SDK_VERSION,
        "platform": platform.platform(),
        "processor": _cpu_model(),
    }


def _git_revision() -> str:
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=HERE, capture_output=True, text=True,
                             check=True, timeout=10)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown revision"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def table(rows: Sequence[Sequence[str]], header: Sequence[str], left: int = 1) -> str:
    """Plain-text table; the first ``left`` columns left-aligned, the others right-aligned."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(str(c).ljust(w) if i < left else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])
