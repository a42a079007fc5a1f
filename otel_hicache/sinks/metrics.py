"""otel-hicache's metrics on the public metrics API, whatever the sampler keeps. Counters are exact:
each series' total is kept here and observed at collection. Duration and ack delay carry exemplars."""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping

from opentelemetry.metrics import Observation

from .. import semconv as sc
from ..adapters import causes, direct_causes
from ..diagnostics import warn_once
from ..record import DIRECT, DIRECTIONS, INT64_MAX, MERGED_OP, ORIGINS, TIERS
from ..version import __version__
from .host_residence import OFFLOAD_CAUSES

SERIES_CAP = 2000  # series of caller values (pools, I/O backends) kept apart; the rest share one


def _int64(name: str, total: Any) -> Any:
    """A total OTLP can carry (one past 2**63-1 would fail every export)."""
    if total <= INT64_MAX:
        return total
    warn_once(f"overflow:{name}", "otel-hicache: %s passed 2**63-1; reported as that from now on", name)
    return INT64_MAX


def _observe(make: Callable[..., Any], spec: tuple[str, ...], values: Callable[[], Any]) -> None:
    """An observable instrument of ``spec`` reporting the ``(attributes, value)`` pairs of ``values()``."""
    make(spec[0], [lambda _options: [Observation(v, a) for a, v in values()]], *spec[1:])


class TransferMetrics:
    """Every transfer instrument on one meter provider; every point carries ``static``."""

    def __init__(self, meter_provider: Any, static: Mapping[str, Any], clock: Callable[[], int] = time.time_ns,
                 io_backend: str = "unknown") -> None:
        meter = meter_provider.get_meter(sc.SCOPE_NAME, __version__)
        self._static, self._clock, self._default_io_backend = dict(static), clock, io_backend
        self._series: dict[tuple, dict] = {}  # (key, value) pairs -> a point's attributes
        self._capped = {sc.POOL: 0, sc.IO_BACKEND: 0}
        self._totals: dict[str, dict] = {}  # counter -> id(attributes) -> [attributes, total]
        self._queue_size, self._inflight, self._oldest = 0, dict.fromkeys(DIRECTIONS, 0), ({}, {})

        def counter(spec):
            table = self._totals[spec[0]] = {}
            _observe(meter.create_observable_counter, spec,
                     lambda: [(a, _int64(spec[0], v)) for a, v in list(table.values())])
            return table

        def histogram(spec, buckets):
            return meter.create_histogram(*spec, explicit_bucket_boundaries_advisory=buckets)

        self.duration = histogram(sc.TRANSFER_DURATION, sc.DURATION_BUCKETS_S)
        self.bandwidth = histogram(sc.TRANSFER_BANDWIDTH, sc.BANDWIDTH_BUCKETS)
        self.queue_wait = histogram(sc.TRANSFER_QUEUE_WAIT, sc.DURATION_BUCKETS_S)
        self.ack_delay = histogram(sc.TRANSFER_ACK_DELAY, sc.DURATION_BUCKETS_S)
        self.residence = histogram(sc.HOST_RESIDENCE_TIME, sc.RESIDENCE_BUCKETS_S)
        (self.bytes, self.blocks, self.tokens, self.busy_time, self.dropped, self.failed, self.reloaded_bytes,
         self.wasted_bytes, self.wasted_tokens) = map(counter, (
            sc.TRANSFER_BYTES, sc.TRANSFER_BLOCKS, sc.TRANSFER_TOKENS, sc.TRANSFER_BUSY_TIME, sc.RECORDS_DROPPED,
            sc.RECORDS_FAILED, sc.HOST_RELOADED_BYTES, sc.HOST_WASTED_BYTES, sc.HOST_WASTED_TOKENS))
        by_d = {d: self._attrs((sc.DIRECTION, d)) for d in DIRECTIONS}
        _observe(meter.create_observable_up_down_counter, sc.TRANSFER_INFLIGHT,
                 lambda: [(by_d[d], n) for d, n in self._inflight.items()])
        _observe(meter.create_observable_gauge, sc.QUEUE_SIZE, lambda: [(self._static, self._queue_size)])
        for i, spec in enumerate((sc.TRANSFER_OLDEST_INFLIGHT_AGE, sc.TRANSFER_OLDEST_UNACKED_AGE)):
            _observe(meter.create_observable_gauge, spec, lambda i=i: [
                (by_d[d], 0.0 if t is None else max(0.0, (self._clock() - t) / 1e9))
                for d in DIRECTIONS for t in (self._oldest[i].get(d),)])
        # zero series from start-up
        for d in DIRECTIONS:
            self._count(self.busy_time, 0, (sc.DIRECTION, d))
            for o in ORIGINS:
                self._count(self.blocks, 0, (sc.DIRECTION, d), (sc.ORIGIN, o))
            for cause in causes()[d]:  # with the origins its copies can have
                for o in ORIGINS if cause == sc.CAUSE_OTHER else (DIRECT if cause in direct_causes() else MERGED_OP,):
                    self._moved(d, (sc.ORIGIN, o), cause, 0, ("kv",), (0,))
        for table, reasons in ((self.dropped, sc.DROP_REASONS), (self.failed, sc.FAIL_REASONS)):
            for reason in reasons:
                self._count(table, 0, (sc.REASON, reason))
        for table in (self.reloaded_bytes, self.wasted_bytes, self.wasted_tokens):
            for cause in OFFLOAD_CAUSES:
                self._count(table, 0, (sc.OFFLOAD_CAUSE, cause))

    def _attrs(self, *pairs: tuple[str, Any], capped: str | None = None) -> dict[str, Any]:
        """One series' attributes, built once; ``capped``: the caller-chosen attribute (SERIES_CAP)."""
        attrs = self._series.get(pairs)
        if attrs is None:
            if capped:
                if self._capped[capped] >= SERIES_CAP:
                    warn_once(f"cardinality:{capped}", "otel-hicache: more than %d series by %s; the rest are one "
                              "series with otel.metric.overflow=true", SERIES_CAP, capped)
                    return self._attrs(("otel.metric.overflow", True))
                self._capped[capped] += 1
            attrs = self._series[pairs] = {**self._static, **dict(pairs)}
        return attrs

    def _count(self, table: dict, amount: float, *pairs: tuple[str, Any], capped: str | None = None) -> None:
        attrs = self._attrs(*pairs, capped=capped)
        table.setdefault(id(attrs), [attrs, 0])[1] += amount  # (_attrs builds each series' dict once)

    def _moved(self, d: str, origin: tuple, cause: str, num_bytes: int, pools: Any, tokens: Any) -> None:
        src, dst = TIERS[d]
        self._count(self.bytes, num_bytes, (sc.DIRECTION, d), (sc.SRC_TIER, src), (sc.DST_TIER, dst), origin,
                    (sc.CAUSE, cause))
        for pool, n in zip(pools, tokens):
            self._count(self.tokens, n, (sc.DIRECTION, d), origin, (sc.CAUSE, cause), (sc.POOL, pool), capped=sc.POOL)

    def state(self, inflight: Mapping[str, int], oldest_inflight: Mapping[str, Any],
              oldest_unacked: Mapping[str, Any], queue_size: int) -> None:
        self._inflight.update((d, n) for d, n in inflight.items() if d in self._inflight)
        self._oldest, self._queue_size = (oldest_inflight, oldest_unacked), queue_size

    def checkpoint(self) -> list[list[Any]]:
        """Every nonzero counter total as ``[name, attributes, total]``, for a successor."""
        return [[name, a, v] for name, table in self._totals.items() for a, v in list(table.values()) if v]

    def seed(self, totals: list[list[Any]]) -> None:
        """Go on from a predecessor's :meth:`checkpoint`, skipping what is not ours."""
        for name, attrs, value in totals:
            table = self._totals.get(name)
            if table is not None and type(attrs) is dict and type(value) in (int, float) and value > 0:
                # (a list arrives for a tuple: metric points need hashable attribute values)
                pairs = [(k, tuple(v) if type(v) is list else v) for k, v in attrs.items() if k not in self._static]
                try:
                    self._count(table, value, *pairs)
                except TypeError:  # a value no metric point can carry
                    pass

    def completed(self, record: Any, busy_added_ns: int) -> None:
        """A transfer finished successfully: counters, duration, bandwidth, queue wait."""
        d, timing, seconds = record.direction, record.timing_source, record.duration_ns / 1e9
        by_d, origin, src, dst = (sc.DIRECTION, d), (sc.ORIGIN, record.origin), *TIERS[d]
        self._count(self.blocks, record.blocks, by_d, origin)
        # a mixed merged op counts each queued op's tokens and bytes under its own cause
        for cause, pools, tokens, num_bytes in record.cause_parts or (
                (record.cause, record.pool_names, record.pool_tokens, record.num_bytes),):
            self._moved(d, origin, cause, num_bytes, pools, tokens)
        if busy_added_ns:
            self._count(self.busy_time, busy_added_ns / 1e9, by_d)
        io_backend = self._default_io_backend if record.io_backend is None else str(record.io_backend)
        self.duration.record(seconds, self._attrs(
            by_d, (sc.SRC_TIER, src), (sc.DST_TIER, dst), origin, (sc.IO_BACKEND, io_backend),
            (sc.TIMING_SOURCE, timing), (sc.CAUSE, record.cause), capped=sc.IO_BACKEND), record.exemplar_context)
        if seconds > 0:
            self.bandwidth.record(record.num_bytes / seconds, self._attrs(by_d, (sc.TIMING_SOURCE, timing)))
        if record.queue_wait_ns is not None:
            self.queue_wait.record(record.queue_wait_ns / 1e9, self._attrs(by_d))

    def acked(self, record: Any) -> None:
        self.ack_delay.record(max(0, record.ack_ns - record.end_ns) / 1e9,
                              self._attrs((sc.DIRECTION, record.direction)), record.exemplar_context)

    def failed_record(self, reason: str) -> None:
        self._count(self.failed, 1, (sc.REASON, reason))

    def dropped_records(self, reason: str, count: int = 1) -> None:
        self._count(self.dropped, count, (sc.REASON, reason))

    def host_waste(self, waste: Any, page_size: int) -> None:
        """Host pages freed or overwritten never read: (bytes, pages) per cause index, or None."""
        for cause, num_bytes, pages in zip(OFFLOAD_CAUSES, *(waste or ((), ()))):
            if pages:
                self._count(self.wasted_bytes, num_bytes, (sc.OFFLOAD_CAUSE, cause))
                self._count(self.wasted_tokens, pages * page_size, (sc.OFFLOAD_CAUSE, cause))

    def host_reuse(self, cause: str, reuse: Any) -> None:
        """A load-back's pages (a ``Reuse`` or None): residence per writing offload, and bytes."""
        if reuse is None:
            return
        for offload_cause, num_bytes in zip(OFFLOAD_CAUSES, reuse.bytes_by_cause):
            if num_bytes:
                self._count(self.reloaded_bytes, num_bytes, (sc.OFFLOAD_CAUSE, offload_cause))
        for ns, offload_cause in zip(reuse.residence_ns, reuse.causes):
            self.residence.record(ns / 1e9, self._attrs((sc.CAUSE, cause), (sc.OFFLOAD_CAUSE, offload_cause)))


class TelemetryCpu:
    """CPU seconds of the poller (``poller_cpu_s``, set from each state) and of the telemetry process
    (none embedded: the SDK's threads are not ours to find), and where the sinks run."""

    def __init__(self, meter_provider: Any, static: Mapping[str, Any], location: str) -> None:
        self.poller_cpu_s: float | None = None
        meter, attrs = meter_provider.get_meter(sc.SCOPE_NAME, __version__), dict(static)
        process, alone = {**attrs, sc.THREAD: sc.THREAD_TELEMETRY_PROCESS}, location == sc.LOCATION_TELEMETRY_PROCESS
        _observe(meter.create_observable_counter, sc.POLLER_CPU_TIME,
                 lambda: [] if self.poller_cpu_s is None else [(attrs, self.poller_cpu_s)])
        _observe(meter.create_observable_counter, sc.EXPORT_CPU_TIME,
                 lambda: [(process, time.process_time())] if alone else [])
        _observe(meter.create_observable_gauge, sc.SINKS, lambda: [({**attrs, sc.LOCATION: location}, 1)])
