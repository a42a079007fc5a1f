"""Validate otel-hicache's device timing on a real GPU, against independent measurements.

Pinned host <-> device copies (1 MiB to 1 GiB, both ways), each reported through a real
``TransferTelemetry``, checked against independent events and ``triton.testing.do_bench``; also the
wall-clock anchor, ``submit()``'s cost, a late ack and the wiring. Without CUDA, or with ``--dry``,
the same code runs on a CPU stand-in; only the wiring decides the exit status then.
docs/gpu-validation.md has the protocol, the checks and the results.

    python benchmarks/gpu_validate.py --out docs/gpu-results/<date>-<gpu>.json  # CUDA
    python benchmarks/gpu_validate.py --dry --out /tmp/r.json  # CPU, seconds

The table of checks is printed last; ``--out`` gets every op and the environment after each
phase. Exit status: 1 if a check fails (CUDA: wiring and targets; dry: wiring and
checks that raised), 2 for usage errors.
"""

from __future__ import annotations

import time

_STARTED = time.perf_counter()  # the runtime counts the imports (torch, triton)

import argparse  # noqa: E402
import datetime
import faulthandler
import importlib.metadata
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

HERE = Path(__file__).resolve().parent
sys.path[:0] = [p for p in (str(HERE), str(HERE.parent)) if p not in sys.path]  # bench_common; a checkout

import torch  # noqa: E402
from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.sdk.trace.sampling import ALWAYS_ON  # noqa: E402

import bench_common  # noqa: E402
import otel_hicache  # noqa: E402
from otel_hicache import TransferTelemetry  # noqa: E402
from otel_hicache import semconv as sc  # noqa: E402

MIB = 1 << 20
BYTES_PER_TOKEN = 114_688  # Qwen3-0.6B-like KV: 28 layers x 8 heads x 128 dims x 2 (K, V) x bf16
PAGE_SIZE = 64
DIRECTIONS = ("offload", "onboard")  # device -> pinned host, pinned host -> device
ATTR_ID = "gpu_validate.id"
WORKER_THREAD = "otel-hicache-poller"
CUDA_SIZES_MIB = (1, 4, 16, 64, 256, 1024)
DRY_SIZES_MIB = (1, 4, 16)
TARGET_RATIO = 0.02  # span duration within 2% of the independent measurement...
TARGET_MIN_MIB = 16  # ...for copies of at least this size
TARGET_ANCHOR_US = 50.0
TARGET_OVERHEAD_US = 5.0
TARGET_RUNTIME_S = 300.0
TRUTH_TOLERANCE_NS = 1_000  # span duration vs the events' own reading (float ms -> ns rounding)
METRIC_SUM_TOLERANCE_S = 1e-6
DRY_LABEL = "dry (not a GPU measurement)"


# -- backends: the only part that differs between a GPU run and the dry run

class CudaBackend:
    """Real CUDA: side streams, ``torch.cuda.Event(enable_timing=True)``, pinned host buffers."""

    name, dry = "cuda", False

    def __init__(self) -> None:
        self._device: Any = None  # resolved on first use, inside the run's error handling

    @property
    def device(self) -> Any:
        if self._device is None:
            torch.cuda.init()
            self._device = torch.device("cuda", torch.cuda.current_device())
        return self._device

    def stream(self) -> Any:
        return torch.cuda.Stream(device=self.device)

    def event(self) -> Any:
        return torch.cuda.Event(enable_timing=True)

    def buffers(self, nbytes: int) -> tuple[Any, Any]:
        """(device buffer, pinned host buffer), the device synchronized after."""
        dev, host = (torch.empty(nbytes, dtype=torch.uint8, device=self.device),
                     torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
        torch.cuda.synchronize(self.device)
        return dev, host

    def copy(self, dst: Any, src: Any, stream: Any) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def truth_ns(self, start: Any, finish: Any) -> int:
        """What the two events say, read after a device synchronize (both completed)."""
        return int(round(start.elapsed_time(finish) * 1e6))

    def free(self) -> None:
        """Cached device and pinned host memory back between sizes (best effort)."""
        torch.cuda.synchronize(self.device)
        try:
            torch.cuda.empty_cache()
            host_empty = getattr(torch._C, "_host_emptyCache", None)  # pylint: disable=protected-access
            if callable(host_empty):
                host_empty()
        except Exception as exc:  # only memory held longer; never a reason to stop
            print(f"[gpu_validate] freeing cached memory: {exc!r} (ignored)", flush=True)

    def bench(self, fn: Callable[[], Any], stream: Any) -> dict[str, Any]:
        """``triton.testing.do_bench`` of ``fn`` on ``stream`` (median ms), if triton imports."""
        try:
            from triton.testing import do_bench
        except Exception as exc:  # not installed, or no usable driver
            return {"skipped": f"triton not importable: {exc!r}"}
        with torch.cuda.stream(stream):  # do_bench records its events on the current stream
            try:
                ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                method = "triton.testing.do_bench(warmup=25, rep=100, return_mode='median')"
            except TypeError:  # an older triton without return_mode: its default (mean)
                ms = do_bench(fn, warmup=25, rep=100)
                method = "triton.testing.do_bench(warmup=25, rep=100) (mean)"
        torch.cuda.synchronize(self.device)
        return {"method": method, "ms": float(ms[0] if isinstance(ms, (list, tuple)) else ms)}

    def environment(self) -> dict[str, Any]:
        props = torch.cuda.get_device_properties(self.device)
        env: dict[str, Any] = {
            "backend": "cuda", "device_name": torch.cuda.get_device_name(self.device),
            "device_index": self.device.index, "device_count": torch.cuda.device_count(),
            "compute_capability": f"{props.major}.{props.minor}",
            "device_memory_gib": round(props.total_memory / (1 << 30), 1), "torch_cuda": torch.version.cuda}
        fields = ("name,driver_version,pci.bus_id,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,"
                  "pcie.link.width.max")
        try:
            out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader", "-i",
                                  str(self.device.index)], capture_output=True, text=True, timeout=20, check=True)
            env["nvidia_smi"] = dict(zip(fields.split(","), (x.strip() for x in out.stdout.strip().split(","))))
            env["driver_version"] = env["nvidia_smi"].get("driver_version")
        except (OSError, subprocess.SubprocessError) as exc:
            env["nvidia_smi"] = f"unavailable: {exc!r}"
        return env


class StandInEvent:
    """``torch.cuda.Event(enable_timing=True)`` for the dry run. Its "device clock" is
    ``perf_counter_ns``, not the wall clock, so the anchor really maps one to the other; CPU
    copies are synchronous, so an event is complete once recorded."""

    def __init__(self) -> None:
        self.at_ns: int | None = None

    def record(self, stream: Any = None) -> None:
        self.at_ns = time.perf_counter_ns()

    def query(self) -> bool:
        return self.at_ns is not None

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "StandInEvent") -> float:
        if self.at_ns is None or end.at_ns is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end.at_ns - self.at_ns) / 1e6

    def anchor_factory(self) -> Callable[[], "StandInEvent"]:
        return _stand_in_anchor


def _stand_in_anchor() -> StandInEvent:
    event = StandInEvent()
    event.record()
    return event


class DryBackend:
    """CPU stand-in: real torch copies between two CPU buffers, :class:`StandInEvent` timing."""

    name, dry = "dry", True

    def stream(self) -> Any:
        return None  # CPU copies are synchronous: no stream

    def event(self) -> Any:
        return StandInEvent()

    def buffers(self, nbytes: int) -> tuple[Any, Any]:
        return torch.zeros(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)

    def copy(self, dst: Any, src: Any, stream: Any) -> None:
        dst.copy_(src)

    def synchronize(self) -> None:
        pass

    def truth_ns(self, start: Any, finish: Any) -> int:
        """The stand-in's own timeline, not ``elapsed_time()``: a lying event is caught."""
        return int(finish.at_ns - start.at_ns)

    def free(self) -> None:
        pass

    def bench(self, fn: Callable[[], Any], stream: Any) -> dict[str, Any]:
        """Stand-in for do_bench (which needs a GPU): the median of event-bracketed repeats."""
        fn()
        times = []
        for _ in range(5):
            start, end = self.event(), self.event()
            start.record(stream)
            fn()
            end.record(stream)
            times.append(start.elapsed_time(end))
        return {"method": "stand-in: median of 5 event-bracketed repeats (dry; do_bench needs a GPU)",
                "ms": statistics.median(times)}

    def environment(self) -> dict[str, Any]:
        return {"backend": "dry", "device_name": "none (CPU stand-in)", "cuda_available": torch.cuda.is_available()}


# -- the table of checks

class Report:
    """Check rows: ``wiring`` (always decide the exit), ``target`` (decide it on CUDA), ``info``
    (never). A check that raised is an ERROR row, which decides it in both modes."""

    def __init__(self, dry: bool) -> None:
        self.dry = dry
        self.rows: list[dict[str, Any]] = []
        self.errors: list[dict[str, Any]] = []

    def add(self, check: str, kind: str, measured: str, target: str, ok: bool | None | str) -> None:
        """``ok``: True, False, None (no target) or "SKIP" (``measured`` says why)."""
        status = ok if isinstance(ok, str) else "INFO" if ok is None else "PASS" if ok else "FAIL"
        if self.dry and kind != "wiring" and status != "SKIP":
            status += f", {DRY_LABEL}"
        self.rows.append({"check": check, "kind": kind, "measured": measured, "target": target, "status": status})

    def error(self, where: str, exc: BaseException, kind: str = "wiring", target: str = "") -> None:
        self.errors.append({"where": where, "error": repr(exc), "traceback": traceback.format_exc()})
        self.rows.append({"check": where, "kind": kind, "measured": f"raised {type(exc).__name__}: {exc}"[:160],
                          "target": target, "status": "ERROR"})

    @contextmanager
    def guard(self, where: str, kind: str = "wiring", target: str = "") -> Iterator[None]:
        """Run a check; if it raises, an ERROR row, and the next check still runs."""
        try:
            yield
        except Exception as exc:  # one failing check must not hide the others
            print(f"[gpu_validate] {where}: raised {exc!r}", flush=True)
            self.error(where, exc, kind, target)

    def failures(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["status"] == "ERROR"
                or r["status"].startswith("FAIL") and (r["kind"] == "wiring" or not self.dry)]


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def _pct(values: Sequence[float], q: float) -> float:
    return bench_common.percentile(sorted(values), q) if values else float("nan")


def _gbs(nbytes: int, ns: float) -> float:
    return nbytes / ns if ns and ns > 0 else float("nan")  # bytes per ns == GB/s


def _mib(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // 1024} KiB"


def _worst(ratios: Sequence[float]) -> float:
    return max(ratios, key=lambda r: abs(r - 1.0))


def _jsonable(obj: Any) -> Any:
    """JSON-safe: NaN and infinities become None, other objects their repr."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    return obj if obj is None or isinstance(obj, (str, int, bool)) else repr(obj)


# -- the run

class Validation:
    """One run: a telemetry instance on private SDK providers, the phases, the checks."""

    def __init__(self, backend: Any, args: argparse.Namespace, report: Report) -> None:
        self.backend, self.args, self.report, self.sizes = backend, args, report, [int(m * MIB) for m in args.sizes]
        self.ops: list[dict[str, Any]] = []  # every submit, by id
        self._events: dict[int, tuple[Any, Any]] = {}  # an op's events until read
        self.bench: list[dict[str, Any]] = []
        self.overhead: dict[str, Any] = {}
        self.analysis: dict[str, Any] = {}
        self.worker_seen, self.stray, self.span_count = False, 0, 0  # stray: spans of no op
        self.stream = backend.stream()  # first: an unusable device leaves nothing started
        self.exporter = InMemorySpanExporter()
        self.tracer_provider = TracerProvider(sampler=ALWAYS_ON, shutdown_on_exit=False)
        self.tracer_provider.add_span_processor(
            BatchSpanProcessor(self.exporter, max_queue_size=1 << 17, max_export_batch_size=512))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader], shutdown_on_exit=False)
        # whatever the environment says: enabled, SDK on (spans at 100% by the sampler)
        with bench_common.env(OTEL_HICACHE_ENABLED="true", OTEL_SDK_DISABLED="false"):
            self.tel = TransferTelemetry(self.tracer_provider, self.meter_provider,
                                         {"tp_rank": 0, "gpu_validate.backend": backend.name})

    def _check_worker(self) -> None:
        self.worker_seen |= any(t.name == WORKER_THREAD and t.is_alive() for t in threading.enumerate())

    def _register(self, phase: str, direction: str, nbytes: int, start: Any, finish: Any,
                  expect_ack: bool = False) -> dict[str, Any]:
        op = {"id": len(self.ops), "phase": phase, "direction": direction, "bytes": nbytes, "expect_ack": expect_ack}
        self.ops.append(op)
        self._events[op["id"]] = (start, finish)
        return op

    def _submit(self, op: dict[str, Any], start: Any, finish: Any) -> Any:
        return self.tel.submit(op["direction"], {"kv": max(1, op["bytes"] // BYTES_PER_TOKEN)}, op["bytes"],
                               page_size=PAGE_SIZE, start_event=start, finish_event=finish, io_backend="direct",
                               attributes={ATTR_ID: op["id"]}, expect_ack=op["expect_ack"])

    def quiesce(self) -> None:
        """Let the worker report what it has, so it is idle while a host stamp is taken."""
        self.tel.force_flush(5.0)

    def _timed_copy(self, phase: str, direction: str, nbytes: int, dst: Any, src: Any,
                    expect_ack: bool = False) -> tuple[dict[str, Any], Any]:
        """One copy alone on the side stream: independent events outside the telemetry's, host
        stamps around it, the device synchronized before and after."""
        backend, stream = self.backend, self.stream
        ref0, ev0, ev1, ref1 = backend.event(), backend.event(), backend.event(), backend.event()
        self.quiesce()
        backend.synchronize()
        ref0.record(stream)
        host_before = time.time_ns()
        ev0.record(stream)
        host_launch = time.time_ns()
        backend.copy(dst, src, stream)
        ev1.record(stream)
        ref1.record(stream)
        op = self._register(phase, direction, nbytes, ev0, ev1, expect_ack)
        handle = self._submit(op, ev0, ev1)
        backend.synchronize()
        host_after = time.time_ns()
        op["wall_minus_monotonic_ns"] = time.time_ns() - time.perf_counter_ns()  # moves if the wall clock steps
        op.update(host_before_ns=host_before, host_launch_ns=host_launch, host_after_ns=host_after,
                  host_ns=host_after - host_before, ref_ns=backend.truth_ns(ref0, ref1),
                  events_ns=backend.truth_ns(ev0, ev1), submitted=handle is not None)
        self._events.pop(op["id"], None)
        return op, handle

    def _each_direction(self, nbytes: int, body: Callable[[str, Any, Any], None]) -> None:
        """``body(direction, dst, src)`` over fresh buffers of ``nbytes``, freed after."""
        dev, host = self.backend.buffers(nbytes)
        try:
            for direction in DIRECTIONS:
                body(direction, *((host, dev) if direction == "offload" else (dev, host)))
        finally:
            del dev, host  # no reference left: free() can give the memory back
            self.backend.free()

    # -- phases
    def phase_copies(self) -> None:
        for nbytes in self.sizes:
            print(f"[gpu_validate] copies: {_mib(nbytes)} x {self.args.reps} per direction", flush=True)
            with self.report.guard(f"phase: copies, {_mib(nbytes)}"):  # a failing size stops no other
                self._each_direction(nbytes, lambda d, dst, src: self._copies(d, nbytes, dst, src))

    def _copies(self, direction: str, nbytes: int, dst: Any, src: Any) -> None:
        for _ in range(2):  # warm-up, not reported
            self.backend.copy(dst, src, self.stream)
            self.backend.synchronize()
        for rep in range(self.args.reps):
            self._timed_copy("copies", direction, nbytes, dst, src)[0]["rep"] = rep
            self._check_worker()
        if not self.args.no_bench:
            self._bench(direction, nbytes, dst, src)

    def _bench(self, direction: str, nbytes: int, dst: Any, src: Any) -> None:
        entry: dict[str, Any] = {"direction": direction, "bytes": nbytes}
        try:
            non_blocking = not self.backend.dry
            entry.update(self.backend.bench(lambda: dst.copy_(src, non_blocking=non_blocking), self.stream))
        except Exception as exc:  # reported, not fatal: the 2% target uses the event reference
            entry["error"] = repr(exc)
            self.report.errors.append({"where": f"do_bench {direction} {_mib(nbytes)}", "error": repr(exc),
                                       "traceback": traceback.format_exc()})
        self.bench.append(entry)

    def late_ack_size(self) -> int:
        big = [s for s in self.sizes if s >= TARGET_MIN_MIB * MIB]
        return min((s for s in big if s >= 64 * MIB), default=max(big or self.sizes))

    def phase_late_ack(self) -> None:
        nbytes, args = self.late_ack_size(), self.args
        print(f"[gpu_validate] late ack: {_mib(nbytes)}, acked {args.ack_delay_ms:g} ms after the copy, "
              f"x {args.ack_reps} per direction", flush=True)

        def late_acks(direction: str, dst: Any, src: Any) -> None:
            self.backend.copy(dst, src, self.stream)  # warm-up
            self.backend.synchronize()
            for _ in range(args.ack_reps):
                op, handle = self._timed_copy("late_ack", direction, nbytes, dst, src, expect_ack=True)
                time.sleep(args.ack_delay_ms / 1e3)  # the copy finished by host_after
                op["ack_host_ns"] = time.time_ns()
                self.tel.ack(handle)
                self._check_worker()

        self._each_direction(nbytes, late_acks)

    def phase_overhead(self) -> None:
        """``submit()`` alone, with real recorded events and a small copy in flight, one op every
        ``--interval-us`` (the worker runs between ops), against an empty call with the same
        arguments; which goes first alternates."""
        backend, stream, args, perf = self.backend, self.stream, self.args, time.perf_counter_ns
        n, nbytes, tokens = args.overhead_ops, 64 * 1024, {"kv": 1}
        print(f"[gpu_validate] caller overhead: {n} submit() calls, one every {args.interval_us} us", flush=True)
        dev, host = backend.buffers(nbytes)
        events = [(backend.event(), backend.event()) for _ in range(n)]
        times: dict[str, list[int]] = {"submit": [], "empty": []}

        def empty(*_args: Any, **_kwargs: Any) -> None:
            return None

        def timed(name: str, fn: Callable[..., Any]) -> Any:
            t0 = perf()
            out = fn(direction, tokens, nbytes, page_size=PAGE_SIZE, start_event=ev0, finish_event=ev1,
                     io_backend="direct", attributes=attrs, expect_ack=False)
            times[name].append(perf() - t0)
            return out

        self.quiesce()
        deadline = perf()
        for i in range(n):
            direction, (ev0, ev1) = DIRECTIONS[i % 2], events[i]
            dst, src = (host, dev) if direction == "offload" else (dev, host)
            op = self._register("overhead", direction, nbytes, ev0, ev1)
            attrs = {ATTR_ID: op["id"]}
            deadline = bench_common.wait_until(deadline + int(args.interval_us * 1000), spin_ns=20_000)
            ev0.record(stream)
            backend.copy(dst, src, stream)
            ev1.record(stream)
            if i % 2:
                timed("empty", empty)
            op["submitted"] = timed("submit", self.tel.submit) is not None
            if not i % 2:
                timed("empty", empty)
            if i % 256 == 0:
                self._check_worker()
        backend.synchronize()  # what each op's own events say
        for ident, (start, finish) in list(self._events.items()):
            self.ops[ident]["events_ns"] = backend.truth_ns(start, finish)
            del self._events[ident]
        del dev, host
        backend.free()
        self.overhead = {"ops": n, "copy_bytes": nbytes, "interval_us": args.interval_us,
                         "submit_ns": times["submit"], "empty_call_ns": times["empty"]}

    def collect(self) -> list[Any]:
        """Flush until every op's span is exported (or 30 s passed); the spans."""
        deadline = time.monotonic() + 30.0
        want = {op["id"] for op in self.ops if op.get("submitted")}
        while True:
            self.tel.force_flush(10.0)
            spans = list(self.exporter.get_finished_spans())
            if want <= {s.attributes.get(ATTR_ID) for s in spans} or time.monotonic() > deadline:
                return spans
            time.sleep(0.05)

    def metric_points(self) -> dict[str, list[Any]]:
        found: dict[str, list[Any]] = {}
        data = self.reader.get_metrics_data()
        for rm in data.resource_metrics if data else ():
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    found.setdefault(metric.name, []).extend(metric.data.data_points)
        return found

    def close(self) -> None:
        try:
            self.tel.shutdown()
        finally:
            self.tracer_provider.shutdown()
            self.meter_provider.shutdown()

    # -- analysis and checks
    def attach_spans(self, spans: list[Any]) -> None:
        """Each op's span (by ``gpu_validate.id``), and what follows from it."""
        by_id: dict[Any, list[Any]] = {}
        for span in spans:
            by_id.setdefault(span.attributes.get(ATTR_ID), []).append(span)
        ids = {op["id"] for op in self.ops}
        self.stray, self.span_count = sum(len(v) for k, v in by_id.items() if k not in ids), len(spans)
        for op in self.ops:
            found = by_id.get(op["id"], [])
            op["spans"] = len(found)
            if not found:
                continue
            span, attrs = found[0], found[0].attributes
            op.update(span_start_ns=span.start_time, span_end_ns=span.end_time,
                      span_ns=span.end_time - span.start_time,
                      timing_source=attrs.get(sc.TIMING_SOURCE), origin=attrs.get(sc.ORIGIN),
                      anchored=sc.QUEUE_WAIT_US in attrs,  # set only when the anchor placed the span
                      acked=attrs.get(sc.ACKED), ack_delay_us=attrs.get(sc.ACK_DELAY_US),
                      error=attrs.get(sc.ERROR_TYPE))  # error spans are not in the transfer metrics
            if op.get("events_ns"):
                op["ratio_events"] = op["span_ns"] / op["events_ns"]
            if op.get("ref_ns"):
                op.update(ratio_ref=op["span_ns"] / op["ref_ns"], gbs_ref=_gbs(op["bytes"], op["ref_ns"]))
            if op["span_ns"] > 0:
                op["gbs_span"] = _gbs(op["bytes"], op["span_ns"])
            if "host_before_ns" in op:
                op["anchor_error_ns"] = op["span_start_ns"] - op["host_before_ns"]

    def _ids(self, pick: Callable[[dict[str, Any]], Any]) -> list[int]:
        return [op["id"] for op in self.ops if pick(op)]

    def check_spans(self) -> None:
        refused, missing = self._ids(lambda op: not op.get("submitted")), self._ids(lambda op: op["spans"] == 0)
        dupes = self._ids(lambda op: op["spans"] > 1)
        not_device = self._ids(lambda op: op["spans"] and op.get("timing_source") != "device_event")
        not_anchored = self._ids(lambda op: op["spans"] and not op.get("anchored"))
        self.report.add("spans: one per op, device_event, anchored", "wiring",
                        f"{len(self.ops) - len(missing)}/{len(self.ops)} ops; refused {len(refused)}, "
                        f"dup {len(dupes)}, stray {self.stray}, not device_event {len(not_device)}, "
                        f"not anchored {len(not_anchored)}", "one per op, all",
                        bool(self.ops) and not (refused or missing or dupes or self.stray or not_device
                                                or not_anchored))
        self.analysis["spans"] = {"ops": len(self.ops), "spans": self.span_count, "missing": missing[:50],
                                  "duplicated": dupes[:50], "not_device_event": not_device[:50],
                                  "not_anchored": not_anchored[:50]}

    def check_truth(self) -> None:
        pairs = [op for op in self.ops if op["spans"] and op.get("events_ns") is not None]
        worst = max((abs(op["span_ns"] - op["events_ns"]) for op in pairs), default=float("nan"))
        self.report.add(f"span duration == {'stand-in truth' if self.backend.dry else 'its own events (read back)'}",
                        "wiring", f"max |diff| {worst:.0f} ns over {len(pairs)}/{len(self.ops)} ops",
                        f"<= {TRUTH_TOLERANCE_NS} ns, all ops",
                        bool(pairs) and len(pairs) == len(self.ops) and worst <= TRUTH_TOLERANCE_NS)

    def check_metrics(self) -> None:
        """Per direction and timing source, the duration histogram's count and sum against the spans';
        the byte counter against the ops' bytes."""
        points = self.metric_points()
        good = [op for op in self.ops if op["spans"] and op.get("error") is None]
        spans: dict[tuple[Any, Any], list[int]] = {}
        for op in good:
            spans.setdefault((op["direction"], op.get("timing_source")), []).append(op["span_ns"])
        hist: dict[tuple[Any, Any], list[float]] = {}
        for p in points.get(sc.TRANSFER_DURATION[0], []):
            acc = hist.setdefault((p.attributes.get(sc.DIRECTION), p.attributes.get(sc.TIMING_SOURCE)), [0, 0.0])
            acc[0], acc[1] = acc[0] + p.count, acc[1] + p.sum
        problems = [f"{key}: histogram {count} / {total:.6f} s vs spans {len(want)} / {sum(want) / 1e9:.6f} s"
                    for key in set(spans) | {k for k, v in hist.items() if v[0]}
                    for (count, total), want in [(hist.get(key, [0, 0.0]), spans.get(key, []))]
                    if count != len(want) or abs(total - sum(want) / 1e9) > METRIC_SUM_TOLERANCE_S]
        bytes_by_dir: dict[Any, int] = {}
        for p in points.get(sc.TRANSFER_BYTES[0], []):
            d = p.attributes.get(sc.DIRECTION)
            bytes_by_dir[d] = bytes_by_dir.get(d, 0) + int(p.value)
        for d in DIRECTIONS:
            want_bytes = sum(op["bytes"] for op in good if op["direction"] == d)
            if bytes_by_dir.get(d, 0) != want_bytes:
                problems.append(f"{d}: bytes counter {bytes_by_dir.get(d, 0)} vs spans {want_bytes}")
        self.analysis["metrics"] = {"duration_histogram": {f"{k[0]}/{k[1]}": v for k, v in hist.items()},
                                    "bytes": bytes_by_dir, "problems": problems}
        self.report.add("metrics: duration histogram, bytes == spans", "wiring",
                        f"{len(good)} spans without error: " + ("count, sum and bytes equal" if not problems else
                                                                f"{len(problems)} differ (JSON: analysis.metrics)"),
                        "equal", bool(good) and not problems)

    def _groups(self) -> dict[tuple[str, int], list[dict[str, Any]]]:
        """The copies with a span and a reference, by (direction, bytes), sorted."""
        groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for op in self.ops:
            if op["phase"] == "copies" and op.get("ratio_ref") is not None:
                groups.setdefault((op["direction"], op["bytes"]), []).append(op)
        return dict(sorted(groups.items()))

    def check_durations(self) -> None:
        groups = self._groups()
        self.analysis["durations"] = [
            {"direction": d, "bytes": b, "n": len(ops), "ratio_ref_median": _median([op["ratio_ref"] for op in ops]),
             "ratio_ref_min": min(op["ratio_ref"] for op in ops), "ratio_ref_max": max(op["ratio_ref"] for op in ops),
             **{f"{k}_ms_median": _median([op[f"{k}_ns"] for op in ops]) / 1e6 for k in ("span", "ref", "host")}}
            for (d, b), ops in groups.items()]
        target = f"within {TARGET_RATIO:.0%} (>= {TARGET_MIN_MIB} MiB)"
        for direction in DIRECTIONS:
            mine = [(b, op) for (d, b), ops in groups.items() if d == direction for op in ops]
            big = [op["ratio_ref"] for b, op in mine if b >= TARGET_MIN_MIB * MIB]
            small = [op["ratio_ref"] for b, op in mine if b < TARGET_MIN_MIB * MIB]
            gaps = [(op["ref_ns"] - op["span_ns"]) / 1e3 for _, op in mine]
            name = f"duration / independent, {direction}"
            if big:
                self.report.add(name, "target", f"median {_median(big):.4f}, worst {_worst(big):.4f} (n={len(big)})",
                                target, all(abs(r - 1.0) <= TARGET_RATIO for r in big))
            else:
                self.report.add(name, "target", f"no copies >= {TARGET_MIN_MIB} MiB (--sizes)", target, "SKIP")
            if gaps:  # the bracket's cost: constant over sizes, else spans miss part of a copy
                self.report.add(f"independent - span, {direction}, all sizes", "info",
                                f"median {_median(gaps):.1f} us, max {max(gaps):.1f} us (n={len(gaps)})", "report",
                                None)
            if small:
                self.report.add(f"{name}, < {TARGET_MIN_MIB} MiB", "info", f"median {_median(small):.4f}, "
                                f"worst {_worst(small):.4f} (n={len(small)})", "report", None)

    def check_host_clock(self) -> None:
        groups = self._groups()
        smallest = min((b for _d, b in groups), default=None)
        if smallest is None:
            raise RuntimeError("no copies with a span")
        parts = [f"{d} {_median([op['host_ns'] for op in ops]) / _median([op['ref_ns'] for op in ops]):.2f}x"
                 for d in DIRECTIONS for ops in [groups.get((d, smallest), [])] if ops]
        self.report.add(f"host clock around a synchronized copy / device, {_mib(smallest)}", "info",
                        ", ".join(parts), "report (why device events)", None)

    def check_bench_and_bandwidth(self) -> None:
        """Span-derived GB/s per size against the best measured independently (reference pairs and
        do_bench, any size): the link's measured peak, per direction."""
        peak: dict[str, float] = {}
        rows = []
        bench = {(b["direction"], b["bytes"]): b.get("ms") for b in self.bench}
        for (direction, nbytes), ops in self._groups().items():
            span_ns, bench_ms = _median([op["span_ns"] for op in ops]), bench.get((direction, nbytes))
            row = {"direction": direction, "bytes": nbytes, "gbs_span": _gbs(nbytes, span_ns),
                   "gbs_ref": _gbs(nbytes, _median([op["ref_ns"] for op in ops]))}
            if bench_ms:
                row.update(gbs_bench=_gbs(nbytes, bench_ms * 1e6), span_over_bench=span_ns / (bench_ms * 1e6))
            for gbs in (row["gbs_ref"], row.get("gbs_bench", float("nan"))):
                if math.isfinite(gbs):
                    peak[direction] = max(peak.get(direction, 0.0), gbs)
            rows.append(row)
        for row in rows:
            if peak.get(row["direction"]):
                row["span_of_peak"] = row["gbs_span"] / peak[row["direction"]]
        self.analysis["bandwidth"] = {"peak_gbs": peak, "per_size": rows}
        for direction in DIRECTIONS:
            mine = [r for r in rows if r["direction"] == direction]
            if not mine:
                continue
            last, ratios = mine[-1], [r["span_over_bench"] for r in mine if "span_over_bench" in r]
            self.report.add(f"bandwidth {direction}, {_mib(last['bytes'])} (span)", "info",
                            f"{last['gbs_span']:.2f} GB/s = {last.get('span_of_peak', float('nan')):.1%} "
                            f"of measured peak {peak.get(direction, float('nan')):.2f} GB/s", "report", None)
            benches = [b for b in self.bench if b["direction"] == direction]
            if ratios:
                self.report.add(f"duration / do_bench, {direction}", "info", f"{ratios[-1]:.4f} at "
                                f"{_mib(last['bytes'])}; {min(ratios):.3f}..{max(ratios):.3f} over sizes", "report",
                                None)
            elif benches:
                why = benches[0].get("skipped") or benches[0].get("error") or "no result"
                self.report.add(f"duration / do_bench, {direction}", "info", str(why)[:120], "report", "SKIP")

    def check_anchor(self) -> None:
        ops = [op for op in self.ops if op["phase"] == "copies" and op.get("anchor_error_ns") is not None]
        if not ops:
            raise RuntimeError("no copies with a span")
        errors_us = [abs(op["anchor_error_ns"]) / 1e3 for op in ops]
        tol = TARGET_ANCHOR_US * 1e3
        inside = sum(1 for op in ops if op["host_before_ns"] - tol <= op["span_start_ns"] <= op["host_after_ns"])
        launch_us = [(op["host_launch_ns"] - op["host_before_ns"]) / 1e3 for op in ops]
        a = self.analysis["anchor"] = {
            "n": len(ops), "abs_error_us_median": _median(errors_us), "abs_error_us_p99": _pct(errors_us, 0.99),
            "abs_error_us_max": max(errors_us),
            "signed_error_us_median": _median([op["anchor_error_ns"] / 1e3 for op in ops]), "inside_bracket": inside,
            "worst_op": max(ops, key=lambda op: abs(op["anchor_error_ns"]))["id"],
            "host_launch_us_median": _median(launch_us), "host_launch_us_max": max(launch_us)}
        self.report.add("anchor error, median |span start - host before|", "target",
                        f"{a['abs_error_us_median']:.2f} us (signed {a['signed_error_us_median']:+.2f}, n={len(ops)})",
                        f"< {TARGET_ANCHOR_US:g} us", a["abs_error_us_median"] < TARGET_ANCHOR_US)
        self.report.add("anchor error, max", "target",
                        f"{max(errors_us):.2f} us (p99 {a['abs_error_us_p99']:.2f}); {inside}/{len(ops)} inside "
                        f"[before - {TARGET_ANCHOR_US:g} us, after]", f"< {TARGET_ANCHOR_US:g} us, all inside",
                        max(errors_us) < TARGET_ANCHOR_US and inside == len(ops))

    def check_overhead(self) -> None:
        o = self.overhead
        if not o.get("submit_ns"):
            raise RuntimeError("the overhead phase did not run")
        sub_us, emp_us = [x / 1e3 for x in o["submit_ns"]], [x / 1e3 for x in o["empty_call_ns"]]
        net = _median(sub_us) - _median(emp_us)
        o.update(submit_us_median=_median(sub_us), submit_us_p99=_pct(sub_us, 0.99),
                 empty_call_us_median=_median(emp_us), net_us_median=net,
                 net_us_p99=_pct(sub_us, 0.99) - _median(emp_us), worker_alive=self.worker_seen)
        self.report.add("caller: submit() per op, real events, net", "target",
                        f"median {net:.2f} us (submit {_median(sub_us):.2f}, empty call {_median(emp_us):.2f}),"
                        f" p99 {_pct(sub_us, 0.99):.2f} us, n={len(sub_us)}", f"<= {TARGET_OVERHEAD_US:g} us median",
                        net <= TARGET_OVERHEAD_US)

    def check_worker(self) -> None:
        self.report.add("poller running during the run", "wiring",
                        "yes" if self.worker_seen else f"no {WORKER_THREAD} thread seen", "yes", self.worker_seen)

    def check_late_ack(self) -> None:
        ops = [op for op in self.ops if op["phase"] == "late_ack"]
        if not ops:
            raise RuntimeError("the late-ack phase did not run")
        delay_ms, nan = self.args.ack_delay_ms, float("nan")
        for op in ops:
            op["late_ack_ok"] = (op["spans"] == 1 and op.get("ratio_ref") is not None
                                 and abs(op["ratio_ref"] - 1.0) <= TARGET_RATIO and op.get("acked") is True
                                 and op.get("origin") == "merged_op"
                                 and op.get("ack_delay_us") is not None
                                 and op["ack_delay_us"] >= delay_ms * 1e3 - TARGET_ANCHOR_US)
        ratios = [op["ratio_ref"] for op in ops if op.get("ratio_ref") is not None]
        delays = [op["ack_delay_us"] / 1e3 for op in ops if op.get("ack_delay_us") is not None]
        ok = sum(1 for op in ops if op["late_ack_ok"])
        self.report.add(f"late ack ({delay_ms:g} ms, {_mib(ops[0]['bytes'])}): duration unchanged", "target",
                        f"{ok}/{len(ops)} ok; duration/independent {min(ratios, default=nan):.4f}.."
                        f"{max(ratios, default=nan):.4f}, span "
                        f"{_median([op['span_ns'] / 1e6 for op in ops if op.get('span_ns') is not None]):.3f} ms, "
                        f"ack_delay {min(delays, default=nan):.1f}..{max(delays, default=nan):.1f} ms",
                        f"within {TARGET_RATIO:.0%}, acked, delay >= {delay_ms:g} ms", ok == len(ops))

    def checks(self) -> list[tuple[str, Callable[[], None], str, str]]:
        """(name, check, kind, target) in the table's order."""
        return [("check: spans", self.check_spans, "wiring", ""),
                ("check: durations vs events", self.check_truth, "wiring", ""),
                ("check: metrics", self.check_metrics, "wiring", ""),
                ("check: duration vs independent", self.check_durations, "target", f"within {TARGET_RATIO:.0%}"),
                ("check: host clock", self.check_host_clock, "info", ""),
                ("check: do_bench, bandwidth", self.check_bench_and_bandwidth, "info", ""),
                ("check: anchor error", self.check_anchor, "target", f"< {TARGET_ANCHOR_US:g} us"),
                ("check: caller overhead", self.check_overhead, "target", f"<= {TARGET_OVERHEAD_US:g} us median"),
                ("check: worker", self.check_worker, "wiring", ""),
                ("check: late ack", self.check_late_ack, "target", f"within {TARGET_RATIO:.0%}")]


# -- main

def _sizes(text: str) -> list[float]:
    sizes = [float(x) for x in text.split(",") if x.strip()]
    if not sizes or any(s <= 0 for s in sizes):
        raise argparse.ArgumentTypeError("sizes: comma-separated positive MiB values, e.g. 1,4,16")
    return sizes


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry", action="store_true",
                        help="CPU stand-in backend (automatic when torch.cuda.is_available() is False)")
    parser.add_argument("--require-cuda", action="store_true",
                        help="exit 2 instead of falling back to the dry mode when CUDA is not available")
    parser.add_argument("--sizes", type=_sizes, default=None, help=f"copy sizes in MiB (default "
                        f"{','.join(map(str, CUDA_SIZES_MIB))}; dry {','.join(map(str, DRY_SIZES_MIB))})")
    parser.add_argument("--reps", type=int, default=None, help="copies per size and direction (default 20; dry 3)")
    parser.add_argument("--overhead-ops", type=int, default=None, help="submit() calls timed (default 2000; dry 400)")
    parser.add_argument("--interval-us", type=float, default=200.0, help="pacing of the overhead ops (default 200)")
    parser.add_argument("--ack-delay-ms", type=float, default=50.0, help="late ack delay (default 50)")
    parser.add_argument("--ack-reps", type=int, default=None, help="late-ack ops per direction (default 3; dry 2)")
    parser.add_argument("--no-bench", action="store_true", help="skip triton.testing.do_bench")
    parser.add_argument("--out", default="gpu_validate_results.json", help="full results (JSON)")
    parser.add_argument("--watchdog-s", type=float, default=420.0,
                        help="dump every thread's stack and exit if the run takes longer (0: off)")
    args = parser.parse_args(argv)
    for name in ("reps", "overhead_ops", "ack_reps"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def _defaults(args: argparse.Namespace, dry: bool) -> None:
    for name, dry_value, cuda_value in (("sizes", list(DRY_SIZES_MIB), list(CUDA_SIZES_MIB)), ("reps", 3, 20),
                                        ("overhead_ops", 400, 2000), ("ack_reps", 2, 3)):
        if getattr(args, name) is None:
            setattr(args, name, dry_value if dry else cuda_value)


def environment(backend: Any) -> dict[str, Any]:
    """What ran. A backend that cannot describe itself leaves ``backend_environment_error``."""
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = "not installed"
    env = bench_common.machine("otel_hicache", otel_hicache.__version__, torch=torch.__version__, triton=triton_version)
    env["timestamp_utc"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    # OTEL_HICACHE_* values (they tune the pipeline); other OTEL_* names only (headers hold secrets)
    env["otel_hicache_variables"] = {k: v for k, v in os.environ.items() if k.startswith("OTEL_HICACHE_")}
    env["other_otel_variables_set"] = sorted(k for k in os.environ
                                             if k.startswith("OTEL_") and not k.startswith("OTEL_HICACHE_"))
    try:
        env.update(backend.environment())
    except Exception as exc:  # the facts above are still worth having
        env["backend_environment_error"] = repr(exc)
    return env


def _write(path: Path, results: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_jsonable(results), indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _backend(args: argparse.Namespace) -> tuple[Any, str]:
    """CUDA when available, else the dry backend and why (None: --require-cuda without CUDA)."""
    if args.dry:
        return DryBackend(), "--dry"
    if torch.cuda.is_available():
        return CudaBackend(), ""
    return (None, "") if args.require_cuda else (DryBackend(), "torch.cuda.is_available() is False")


def run(v: Validation, report: Report, save: Callable[[], None]) -> None:
    """The phases (the results saved after each), then the checks."""
    for name, phase in (("phase: copies", v.phase_copies), ("phase: late ack", v.phase_late_ack),
                        ("phase: caller overhead", v.phase_overhead)):
        with report.guard(name):
            phase()
        save()
    with report.guard("collect spans"):
        v.attach_spans(v.collect())
    for name, check, kind, target in v.checks():
        with report.guard(name, kind, target):
            check()


def main(argv: Sequence[str] | None = None, backend: Any = None, started: float | None = None) -> int:
    """Run everything; returns the exit status. ``backend``: a stand-in for tests (default: CUDA if
    available, else the dry backend). ``started``: ``perf_counter()`` at process start."""
    args = parse_args(argv)
    began = time.perf_counter() if started is None else started
    note = ""
    if backend is None:
        backend, note = _backend(args)
        if backend is None:
            print("gpu_validate: --require-cuda, but torch.cuda.is_available() is False", file=sys.stderr)
            return 2
    _defaults(args, backend.dry)
    if args.watchdog_s > 0:
        faulthandler.dump_traceback_later(args.watchdog_s, exit=True)
    if backend.dry:
        print(f"[gpu_validate] DRY MODE ({note or 'stand-in backend'}): stand-in events on the CPU; targets are "
              f"printed but are not a GPU measurement; only the wiring decides the exit status", flush=True)
    report, out = Report(backend.dry), Path(args.out)
    results: dict[str, Any] = {
        "tool": "benchmarks/gpu_validate.py", "mode": "dry" if backend.dry else "cuda", "dry_reason": note or None,
        "complete": False, "settings": dict(vars(args)),
        "targets": {"duration_ratio_within": TARGET_RATIO, "duration_ratio_min_bytes": TARGET_MIN_MIB * MIB,
                    "anchor_error_us": TARGET_ANCHOR_US, "caller_overhead_us_median": TARGET_OVERHEAD_US,
                    "runtime_s": TARGET_RUNTIME_S}}
    validation: Validation | None = None

    def gather() -> None:
        if validation is not None:
            results.update(ops=validation.ops, do_bench=validation.bench, overhead=validation.overhead,
                           analysis=validation.analysis)
        results.update(checks=report.rows, errors=report.errors)

    def save() -> None:
        gather()
        try:
            _write(out, results)
        except Exception as exc:  # the final write reports it in the table
            print(f"[gpu_validate] cannot write {out}: {exc!r}", flush=True)

    try:
        with report.guard("environment", "info"):
            results["environment"] = environment(backend)
            if "backend_environment_error" in results["environment"]:
                report.add("environment", "info", results["environment"]["backend_environment_error"][:120],
                           "device facts", False)
        with report.guard("set-up"):
            validation = Validation(backend, args, report)
        if validation is not None:
            run(validation, report, save)
            save()
    finally:
        if validation is not None:
            with report.guard("shutdown"):
                validation.close()
        results["runtime_s"] = runtime = time.perf_counter() - began
        report.add("runtime", "target", f"{runtime:.1f} s", f"< {TARGET_RUNTIME_S:g} s", runtime < TARGET_RUNTIME_S)
        gather()
        finish(results, report, out)
        save()
        if args.watchdog_s > 0:
            faulthandler.cancel_dump_traceback_later()
        print_table(results, report, out)
    return results["exit_status"]


def finish(results: dict[str, Any], report: Report, out: Path) -> None:
    """The results written and read back, and the overall row: what decides the exit status."""
    try:
        _write(out, results)
        n_ops = len(json.loads(out.read_text(encoding="utf-8")).get("ops") or [])
        report.add("results json", "wiring", f"{out} ({n_ops} ops), read back", "written", n_ops > 0)
    except Exception as exc:  # pylint: disable=broad-except
        report.error("results json", exc)
    failures = report.failures()
    decided = "wiring and checks that raised" if report.dry else "wiring and targets"
    report.rows.append({"check": "overall", "kind": "wiring", "measured": f"{len(failures)} failing ({decided})",
                        "target": "none failing", "status": "FAIL" if failures else "PASS"})
    results.update(complete=True, exit_status=1 if failures else 0)


def print_table(results: dict[str, Any], report: Report, out: Path) -> None:
    env = results.get("environment") or {}
    print(f"\n== gpu_validate, {'DRY MODE, ' + DRY_LABEL if report.dry else 'CUDA'}: {env.get('device_name', '?')}, "
          f"torch {torch.__version__}, CUDA {env.get('torch_cuda', '-')}, driver {env.get('driver_version', '-')}, "
          f"otel-hicache {otel_hicache.__version__}; full results: {out}", flush=True)
    print(bench_common.table([[r["check"], r["measured"], r["target"], r["status"]] for r in report.rows],
                             ["check", "measured", "target", "result"], left=4), flush=True)


if __name__ == "__main__":
    status = main(started=_STARTED)
    # the table stays last: no interpreter teardown, where extensions (triton's nanobind) may print;
    # everything was shut down, flushed and written
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
