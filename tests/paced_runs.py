"""Runs ``paced_workload.py`` (this folder) as a real process and reads what it measured.

Shared by the export fault tests here and the Collector fault tests under ``e2e/``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = Path(__file__).resolve().parent / "paced_workload.py"

# What the SDK (1.45) logs, since otel-hicache leaves the reporting of the way out to it: a
# failed export (gRPC: "... traces to <endpoint>, error code: ..."; HTTP: "... spans batch
# code: ..." or "... due to timeout, ..."), and a span dropped on a full queue. The gRPC
# exporter and the batch processor log each message at most once per 20 s (the SDK's
# DuplicateFilter); the HTTP exporter logs every failure.
EXPORT_FAILED_LOG = "Failed to export"
QUEUE_FULL_LOG = "Queue full, dropping Span"


@dataclass
class Run:
    result: dict[str, Any]
    stderr: str
    returncode: int
    exit_s: float  # from "ops done" to the process's exit

    # -- what the process measured ----------------------------------------------------
    def costs_ns(self, start_ms: float = 0.0, end_ms: float = float("inf")) -> list[int]:
        """submit() costs of the ops submitted in [start_ms, end_ms) since the start, sorted."""
        submit = self.result["submit"]
        return sorted(c for t, c in zip(submit["ms"], submit["cost_ns"]) if start_ms <= t < end_ms)

    def spans(self, key: str = "exported") -> int:
        """A span delivery count of the SDK's self-metrics after the final flush, summed over
        the span exporters: exported, export_failed, queue_full, queued, in_export
        (``sdk_delivery.py``)."""
        return self.result["final"]["delivery"]["spans"][key]

    def metric_points(self, key: str = "exported") -> int:
        """Metric data points the metric exporters delivered (``exported``) or lost (``failed``)."""
        return self.result["final"]["delivery"]["metric_points"][key]

    def warnings(self, text: str) -> int:
        return self.stderr.count(text)


def quantile(sorted_values: Sequence[int], q: float) -> int:
    return sorted_values[min(len(sorted_values) - 1, int(q * (len(sorted_values) - 1)))]


def run_workload(tmp: Path, env: Mapping[str, str], *args: str, timeout_s: float = 120.0,
                 during: Any = None) -> Run:
    """Run the paced workload with the standard ``OTEL_*`` variables in ``env``, and the SDK's
    self-metrics on (``OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED=true``, unless ``env`` says
    otherwise): they are what the workload reads its delivery counts from.

    ``during(process, t0)`` (optional) runs while the workload does: fault injection."""
    out = tmp / f"run-{time.monotonic_ns()}.json"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    full_env["OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED"] = "true"
    full_env.update(env)
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    err_path = out.with_suffix(".stderr")
    with open(err_path, "w", encoding="utf-8") as err:
        process = subprocess.Popen([sys.executable, str(WORKLOAD), "--out", str(out), *args],
                                   env=full_env, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT)
        t0 = time.monotonic()
        if during is not None:
            during(process, t0)
        done_at = None
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith("ops done"):
                done_at = time.monotonic()
        process.wait(timeout_s)
        exited = time.monotonic()
    stderr = err_path.read_text(encoding="utf-8")
    if process.returncode != 0 or done_at is None:
        raise AssertionError(f"workload failed (rc {process.returncode}):\n{stderr[-4000:]}")
    return Run(json.loads(out.read_text(encoding="utf-8")), stderr, process.returncode, exited - done_at)


COUNTERS = {"hicache.transfer.bytes": "bytes", "hicache.transfer.blocks": "blocks",
            "hicache.transfer.tokens": "tokens", "hicache.transfer.duration": "ops"}


class NewestPoints:
    """The newest cumulative point of every transfer counter series, fed one OTLP
    metrics request at a time (a receiver may see series split over requests)."""

    def __init__(self) -> None:
        self.newest: dict[tuple[str, tuple], Any] = {}

    def add(self, request: Any) -> None:
        for rm in request.resource_metrics:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    if metric.name not in COUNTERS:
                        continue
                    points = metric.sum.data_points if metric.HasField("sum") else metric.histogram.data_points
                    for p in points:
                        attrs = tuple(sorted((kv.key, getattr(kv.value, kv.value.WhichOneof("value")))
                                             for kv in p.attributes))
                        key = (metric.name, attrs)
                        old = self.newest.get(key)
                        if old is None or p.time_unix_nano >= old.time_unix_nano:
                            self.newest[key] = p

    def counters(self) -> dict[str, dict[str, int]]:
        """Per direction: ops (the duration histogram's count), bytes, blocks, tokens."""
        out: dict[str, dict[str, int]] = {}
        for (name, attrs), p in self.newest.items():
            direction = dict(attrs).get("hicache.direction")
            if direction is None:
                continue
            row = out.setdefault(direction, {"ops": 0, "bytes": 0, "blocks": 0, "tokens": 0})
            row[COUNTERS[name]] += int(p.count) if name == "hicache.transfer.duration" else int(p.as_int)
        return out


def final_counters(metric_requests: Sequence[Any]) -> dict[str, dict[str, int]]:
    """Per direction, the transfer counters as a receiver last saw them: the newest
    cumulative point of every series, summed."""
    points = NewestPoints()
    for request in metric_requests:
        points.add(request)
    return points.counters()


def otlp_env(service: str, protocol: str, endpoint: str, **extra: str) -> dict[str, str]:
    """The standard OTEL_* variables of a fault-test workload: metrics every 500 ms,
    span batches every 100 ms."""
    env = {
        "OTEL_SERVICE_NAME": service,
        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_METRIC_EXPORT_INTERVAL": "500",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    env.update(extra)
    return env
