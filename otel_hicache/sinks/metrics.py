"""Metrics, whatever the sampler keeps: exact counters (totals kept here), histograms with exemplars."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Mapping

from opentelemetry.metrics import Observation

from .. import semconv as sc
from ..adapters import causes, direct_causes
from ..diagnostics import warn_once
from ..record import DIRECT, DIRECTIONS, INT64_MAX, MERGED_OP, ORIGINS, TIERS
from ..version import __version__
from .host_residence import OFFLOAD_CAUSES

SERIES_CAP = 2000  # per caller-chosen attribute (pool, I/O backend); the rest share one


def _int64(name: str, total: Any) -> Any:
    if total <= INT64_MAX:
        return total
    warn_once(f"overflow:{name}", "otel-hicache: %s passed 2**63-1; reported as that from now on", name)
    return INT64_MAX


class TransferMetrics:
    def __init__(self, meter_provider: Any, static: Mapping, clock: Callable[[], int], io_backend: str,
                 location: str) -> None:
        meter = meter_provider.get_meter(sc.SCOPE_NAME, __version__)
        self._static = static = dict(static)
        self._clock, self._io_backend, self._series = clock, io_backend, {}
        self._capped = {sc.POOL: 0, sc.IO_BACKEND: 0}
        self._totals = {}  # counter name -> id(attributes) -> [attributes, total]
        self._queue_size, self._inflight, self._oldest = 0, dict.fromkeys(DIRECTIONS, 0), ({}, {})
        self.poller_cpu_s = None
        gauge, count = meter.create_observable_gauge, meter.create_observable_counter

        def observe(make, spec, values):
            make(spec[0], [lambda _options: [Observation(v, a) for a, v in values()]], *spec[1:])

        def counter(spec):
            table = self._totals[spec[0]] = {}
            observe(count, spec, lambda: [(a, _int64(spec[0], v)) for a, v in list(table.values())])
            return table

        self.duration, self.bandwidth, self.queue_wait, self.ack_delay, self.residence = (
            meter.create_histogram(*spec, explicit_bucket_boundaries_advisory=buckets) for spec, buckets in (
                (sc.TRANSFER_DURATION, sc.DURATION_BUCKETS_S), (sc.TRANSFER_BANDWIDTH, sc.BANDWIDTH_BUCKETS),
                (sc.TRANSFER_QUEUE_WAIT, sc.DURATION_BUCKETS_S), (sc.TRANSFER_ACK_DELAY, sc.DURATION_BUCKETS_S),
                (sc.HOST_RESIDENCE_TIME, sc.RESIDENCE_BUCKETS_S)))
        (self.bytes, self.blocks, self.tokens, self.busy_time, self.dropped, self.failed, self.reloaded_bytes,
         self.wasted_bytes, self.wasted_tokens) = map(counter, (
            sc.TRANSFER_BYTES, sc.TRANSFER_BLOCKS, sc.TRANSFER_TOKENS, sc.TRANSFER_BUSY_TIME, sc.RECORDS_DROPPED,
            sc.RECORDS_FAILED, sc.HOST_RELOADED_BYTES, sc.HOST_WASTED_BYTES, sc.HOST_WASTED_TOKENS))
        by_d = {d: self._attrs((sc.DIRECTION, d)) for d in DIRECTIONS}
        process = {**static, sc.THREAD: sc.THREAD_TELEMETRY_PROCESS}
        observe(meter.create_observable_up_down_counter, sc.TRANSFER_INFLIGHT,
                lambda: [(by_d[d], n) for d, n in self._inflight.items()])
        observe(gauge, sc.QUEUE_SIZE, lambda: [(static, self._queue_size)])
        for i, spec in enumerate((sc.TRANSFER_OLDEST_INFLIGHT_AGE, sc.TRANSFER_OLDEST_UNACKED_AGE)):
            observe(gauge, spec, lambda i=i: [(by_d[d], 0.0 if t is None else max(0.0, (self._clock() - t) / 1e9))
                                              for d in DIRECTIONS for t in (self._oldest[i].get(d),)])
        observe(count, sc.POLLER_CPU_TIME, lambda: [] if self.poller_cpu_s is None else [(static, self.poller_cpu_s)])
        observe(count, sc.EXPORT_CPU_TIME,
                lambda: [(process, time.process_time())] if location == sc.LOCATION_TELEMETRY_PROCESS else [])
        observe(gauge, sc.SINKS, lambda: [({**static, sc.LOCATION: location}, 1)])
        for d in DIRECTIONS:  # zero series from the start
            self._count(self.busy_time, 0, (sc.DIRECTION, d))
            for o in ORIGINS:
                self._count(self.blocks, 0, (sc.DIRECTION, d), (sc.ORIGIN, o))
            for cause in causes()[d]:
                for o in ORIGINS if cause == sc.CAUSE_OTHER else (DIRECT if cause in direct_causes() else MERGED_OP,):
                    self._moved(d, (sc.ORIGIN, o), cause, 0, ("kv",), (0,))
        for table, reasons in ((self.dropped, sc.DROP_REASONS), (self.failed, sc.FAIL_REASONS)):
            for reason in reasons:
                self._count(table, 0, (sc.REASON, reason))
        for table in (self.reloaded_bytes, self.wasted_bytes, self.wasted_tokens):
            for cause in OFFLOAD_CAUSES:
                self._count(table, 0, (sc.OFFLOAD_CAUSE, cause))

    def _attrs(self, *pairs: tuple, capped: str | None = None) -> dict:
        attrs = self._series.get(pairs)
        if attrs is None:
            if capped:
                if self._capped[capped] >= SERIES_CAP:
                    warn_once(f"cardinality:{capped}", "otel-hicache: more than %d series by %s; the rest share "
                              "one with otel.metric.overflow=true", SERIES_CAP, capped)
                    return self._attrs(("otel.metric.overflow", True))
                self._capped[capped] += 1
            attrs = self._series[pairs] = {**self._static, **dict(pairs)}
        return attrs

    def _count(self, table: dict, amount: float, *pairs: tuple, capped: str | None = None) -> None:
        attrs = self._attrs(*pairs, capped=capped)
        table.setdefault(id(attrs), [attrs, 0])[1] += amount

    def _moved(self, d: str, origin: tuple, cause: str, num_bytes: int, pools: Any, tokens: Any) -> None:
        src, dst = TIERS[d]
        self._count(self.bytes, num_bytes, (sc.DIRECTION, d), (sc.SRC_TIER, src), (sc.DST_TIER, dst), origin,
                    (sc.CAUSE, cause))
        for pool, n in zip(pools, tokens):
            self._count(self.tokens, n, (sc.DIRECTION, d), origin, (sc.CAUSE, cause), (sc.POOL, pool), capped=sc.POOL)

    def state(self, inflight: Mapping, oldest_inflight: Mapping, oldest_unacked: Mapping, queue_size: int,
              poller_cpu_s: float | None) -> None:
        self._inflight.update((d, n) for d, n in inflight.items() if d in self._inflight)
        self._oldest, self._queue_size, self.poller_cpu_s = (oldest_inflight, oldest_unacked), queue_size, poller_cpu_s

    def checkpoint(self) -> list:
        return [[name, a, v] for name, table in self._totals.items() for a, v in list(table.values()) if v]

    def seed(self, totals: list) -> None:
        for name, attrs, value in totals:
            table = self._totals.get(name)
            if table is not None and type(attrs) is dict and type(value) in (int, float) and value > 0:
                pairs = [(k, tuple(v) if type(v) is list else v) for k, v in attrs.items() if k not in self._static]
                with contextlib.suppress(TypeError):  # (unhashable)
                    self._count(table, value, *pairs)

    def completed(self, r: Any, busy_added_ns: int) -> None:
        d, timing, seconds = r.direction, r.timing_source, r.duration_ns / 1e9
        by_d, origin, src, dst = (sc.DIRECTION, d), (sc.ORIGIN, r.origin), *TIERS[d]
        self._count(self.blocks, r.blocks, by_d, origin)
        # a mixed merged op counts each part under its own cause
        for cause, pools, tokens, num_bytes in r.cause_parts or ((r.cause, r.pool_names, r.pool_tokens, r.num_bytes),):
            self._moved(d, origin, cause, num_bytes, pools, tokens)
        if busy_added_ns:
            self._count(self.busy_time, busy_added_ns / 1e9, by_d)
        io_backend = self._io_backend if r.io_backend is None else str(r.io_backend)
        self.duration.record(seconds, self._attrs(
            by_d, (sc.SRC_TIER, src), (sc.DST_TIER, dst), origin, (sc.IO_BACKEND, io_backend),
            (sc.TIMING_SOURCE, timing), (sc.CAUSE, r.cause), capped=sc.IO_BACKEND), r.exemplar_context)
        if seconds > 0:
            self.bandwidth.record(r.num_bytes / seconds, self._attrs(by_d, (sc.TIMING_SOURCE, timing)))
        if r.queue_wait_ns is not None:
            self.queue_wait.record(r.queue_wait_ns / 1e9, self._attrs(by_d))

    def acked(self, r: Any) -> None:
        self.ack_delay.record(max(0, r.ack_ns - r.end_ns) / 1e9, self._attrs((sc.DIRECTION, r.direction)),
                              r.exemplar_context)

    def failed_record(self, reason: str) -> None:
        self._count(self.failed, 1, (sc.REASON, reason))

    def dropped_records(self, reason: str, count: int = 1) -> None:
        self._count(self.dropped, count, (sc.REASON, reason))

    def host_waste(self, waste: Any) -> None:
        for cause, num_bytes, tokens in zip(OFFLOAD_CAUSES, *(waste or ((), ()))):
            if tokens:
                self._count(self.wasted_bytes, num_bytes, (sc.OFFLOAD_CAUSE, cause))
                self._count(self.wasted_tokens, tokens, (sc.OFFLOAD_CAUSE, cause))

    def host_reuse(self, cause: str, reuse: Any) -> None:
        for offload_cause, num_bytes in zip(OFFLOAD_CAUSES, reuse.bytes_by_cause):
            if num_bytes:
                self._count(self.reloaded_bytes, num_bytes, (sc.OFFLOAD_CAUSE, offload_cause))
        for ns, offload_cause in zip(reuse.residence_ns, reuse.causes):
            self.residence.record(ns / 1e9, self._attrs((sc.CAUSE, cause), (sc.OFFLOAD_CAUSE, offload_cause)))
