"""The shared harness of the benchmarks in this folder: CPU clocks, pacing, an OTLP sink that
counts, the machine's description and plain-text tables.

Scripts in this folder import it as ``bench_common`` (Python puts their folder first on
``sys.path``). Standard library and OTLP protocol packages only; run as a script, it is an
OTLP/HTTP span counter (:class:`SpanCounter`).
"""

import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

HERE = Path(__file__).resolve().parent


# -- clocks and pacing

def thread_cpu_s(name: str) -> float:
    """CPU seconds of the live threads whose name starts with ``name`` (their own clocks)."""
    total = 0.0
    for thread in threading.enumerate():
        if thread.name.startswith(name) and thread.ident is not None:
            try:
                total += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
            except (AttributeError, OSError):
                pass
    return total


def process_cpu_s(pid: int | None) -> float | None:
    """CPU seconds (user + system, every thread, ended ones too) of another process, from
    ``/proc``; None when it is gone or not Linux."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def wait_until(deadline: int, spin_ns: int = 0) -> int:
    """Wait until ``deadline`` (``perf_counter_ns``); returns it, or now if it already passed
    (no catch-up bursts). The wait sleeps, releasing the GIL as a scheduler waiting on its device
    does; with ``spin_ns`` the last ``spin_ns`` are spun, for a punctual deadline."""
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


@contextmanager
def env(**values: str) -> Iterator[None]:
    """Environment variables set while something that reads them is built or run."""
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


# -- statistics

def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``sorted_values``: the nearest rank, no interpolation."""
    index = min(len(sorted_values) - 1, max(0, int(round(q * (len(sorted_values) - 1)))))
    return sorted_values[index]


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Median, min, max and every value: how a figure varied over repetitions."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": list(values)}


def spread_text(s: dict[str, Any] | None, digits: int = 1) -> str:
    return "" if not s else f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


# -- an OTLP/HTTP sink that counts

class CountingSink:
    """OTLP/HTTP receiver that counts spans and hands each metrics request to ``on_metrics``
    (under its lock); it keeps no request, so a long run does not grow it."""

    def __init__(self, on_metrics: Callable[[Any], None] | None = None) -> None:
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as mpb
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tpb

        self.lock = threading.Lock()
        self.spans = self.requests = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path == "/v1/traces":
                    request = tpb.ExportTraceServiceRequest.FromString(body)
                    with sink.lock:
                        sink.spans += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
                        sink.requests += 1
                    payload = tpb.ExportTraceServiceResponse().SerializeToString()
                elif self.path == "/v1/metrics":
                    if on_metrics is not None:
                        request = mpb.ExportMetricsServiceRequest.FromString(body)
                        with sink.lock:
                            on_metrics(request)
                    payload = mpb.ExportMetricsServiceResponse().SerializeToString()
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class SpanCounter:
    """A :class:`CountingSink` in a process of its own (this file run as a script), so that its
    CPU is not the measured process's; :meth:`close` returns the spans it counted."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__))], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.endpoint = self.proc.stdout.readline().strip()  # type: ignore[union-attr]

    def close(self) -> int:
        out, _ = self.proc.communicate(timeout=120)
        return int(out.strip().splitlines()[-1])


def _serve_counting_sink() -> None:
    """:class:`SpanCounter`'s process: prints the endpoint, and the span count once stdin closes."""
    sink = CountingSink()
    print(sink.endpoint, flush=True)
    sys.stdin.read()
    time.sleep(0.2)  # a request still being answered
    sink.stop()
    print(sink.spans, flush=True)


# -- report

def machine(package: str, version: str, **versions: str) -> dict[str, Any]:
    """What ran: ``package`` at ``version`` and this checkout's git revision, other packages'
    ``versions``, CPUs, Python, the OTel SDK, the platform and the CPU model."""
    from opentelemetry.sdk.version import __version__ as sdk_version

    try:
        revision = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=HERE, capture_output=True,
                                  text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        revision = "unknown revision"
    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), model)
    except OSError:
        pass
    return {package: f"{version} ({revision})", **versions, "cpus": os.cpu_count(),
            "python": f"{platform.python_implementation()} {platform.python_version()}",
            "opentelemetry_sdk": sdk_version, "platform": platform.platform(), "processor": model}


def table(rows: Sequence[Sequence[str]], header: Sequence[str], left: int = 1) -> str:
    """Plain-text table; the first ``left`` columns left-aligned, the others right-aligned."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(str(c).ljust(w) if i < left else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


if __name__ == "__main__":
    _serve_counting_sink()
