"""OTel metrics of the ops the capture sends, through the public metrics API, whatever the sampler
keeps. Counters are exact: the sinks keep each one's total per series and report it when the SDK
collects (observable counters, no SDK call per op). Only duration and ack delay are recorded in
the op's sampled span's context, so only they carry exemplars (a slow bucket's trace: the
dashboard and alerts open them). Every point carries the ``static`` attributes (none when they
are in the resource); zero series exist from start-up. The gauges show the capture's ``record.STATE``.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping

from .. import semconv as sc
from ..adapters import causes, direct_causes
from ..diagnostics import warn_once
from .host_residence import OFFLOAD_CAUSES, Reuse, Waste
from ..record import DIRECT, DIRECTIONS, INT64_MAX, MERGED_OP, ORIGINS, TIERS
from ..version import __version__

SERIES_CAP = 2000  # series of caller values (pools, I/O backends) kept apart; the rest share one


def _int64(name: str, total: Any) -> Any:
    """A total OTLP can carry (a count past 2**63-1 would fail every export from then on)."""
    if type(total) is int and total > INT64_MAX:
        warn_once(f"overflow:{name}", "otel-hicache: %s passed 2**63-1, the largest count OTLP can encode; "
                  "it is reported as that from now on", name)
        return INT64_MAX
    return total


def _tiers(direction: str) -> tuple[tuple[str, str], ...]:
    src, dst = TIERS[direction]
    return (sc.DIRECTION, direction), (sc.SRC_TIER, src), (sc.DST_TIER, dst)


class TransferMetrics:
    """Every otel-hicache transfer instrument on one meter provider, as ``semconv`` defines them."""

    def __init__(self, meter_provider: Any, static: Mapping[str, Any], clock: Callable[[], int] = time.time_ns,
                 io_backend: str = "unknown") -> None:
        from opentelemetry.metrics import Observation

        meter = meter_provider.get_meter(sc.SCOPE_NAME, __version__)
        self._static, self._clock = dict(static), clock
        self._series: dict[tuple[Any, ...], dict[str, Any]] = {}  # (attribute, value) pairs -> attributes
        self._capped = {sc.POOL: 0, sc.IO_BACKEND: 0}  # series made of caller values, per kind
        self._totals: dict[str, dict[int, list[Any]]] = {}  # counter -> id(attributes) -> [attributes, total]
        self._queue_size, self._inflight = 0, dict.fromkeys(DIRECTIONS, 0)
        self._oldest: tuple[Mapping[str, Any], Mapping[str, Any]] = ({}, {})
        self._default_io_backend = io_backend  # of an op that names none: the static attribute's, if any

        def histogram(spec: tuple[str, str, str], buckets: tuple[float, ...]) -> Any:
            return meter.create_histogram(spec[0], unit=spec[1], description=spec[2],
                                          explicit_bucket_boundaries_advisory=buckets)

        def observe(spec: tuple[str, str, str], make: Callable[..., Any], values: Callable[[], Any]) -> None:
            make(spec[0], callbacks=[lambda _options: [Observation(v, a) for a, v in values()]], unit=spec[1],
                 description=spec[2])

        def counter(spec: tuple[str, str, str]) -> dict[int, list[Any]]:
            table = self._totals[spec[0]] = {}
            observe(spec, meter.create_observable_counter, lambda: [(a, _int64(spec[0], v)) for a, v in
                                                                     list(table.values())])
            return table

        self.duration = histogram(sc.TRANSFER_DURATION, sc.DURATION_BUCKETS_S)
        self.bandwidth = histogram(sc.TRANSFER_BANDWIDTH, sc.BANDWIDTH_BUCKETS)
        self.queue_wait = histogram(sc.TRANSFER_QUEUE_WAIT, sc.DURATION_BUCKETS_S)
        self.ack_delay = histogram(sc.TRANSFER_ACK_DELAY, sc.DURATION_BUCKETS_S)
        self.residence = histogram(sc.HOST_RESIDENCE_TIME, sc.RESIDENCE_BUCKETS_S)
        self.bytes, self.blocks, self.tokens, self.busy_time, self.dropped, self.failed = map(counter, (
            sc.TRANSFER_BYTES, sc.TRANSFER_BLOCKS, sc.TRANSFER_TOKENS, sc.TRANSFER_BUSY_TIME, sc.RECORDS_DROPPED,
            sc.RECORDS_FAILED))
        self.reloaded_bytes, self.wasted_bytes, self.wasted_tokens = map(counter, (
            sc.HOST_RELOADED_BYTES, sc.HOST_WASTED_BYTES, sc.HOST_WASTED_TOKENS))
        by_direction = {d: self._attrs((sc.DIRECTION, d)) for d in DIRECTIONS}
        observe(sc.TRANSFER_INFLIGHT, meter.create_observable_up_down_counter,
                lambda: [(by_direction[d], n) for d, n in self._inflight.items()])
        observe(sc.QUEUE_SIZE, meter.create_observable_gauge, lambda: [(self._static, self._queue_size)])
        for index, spec in enumerate((sc.TRANSFER_OLDEST_INFLIGHT_AGE, sc.TRANSFER_OLDEST_UNACKED_AGE)):
            observe(spec, meter.create_observable_gauge, lambda index=index: [
                (by_direction[d], max(0.0, (self._clock() - t) / 1e9) if t is not None else 0.0)
                for d in DIRECTIONS for t in (self._oldest[index].get(d),)])
        self._zero_series()

    def _attrs(self, *pairs: tuple[str, Any], capped: str | None = None) -> dict[str, Any]:
        """One series' attributes, built once; ``capped``: the attribute a caller chose (SERIES_CAP)."""
        attrs = self._series.get(pairs)
        if attrs is None:
            if capped is not None:
                if self._capped[capped] >= SERIES_CAP:
                    warn_once(f"cardinality:{capped}", "otel-hicache: more than %d series by %s (values a caller "
                              "passes); the rest are reported as one series with otel.metric.overflow=true",
                              SERIES_CAP, capped)
                    return self._attrs(("otel.metric.overflow", True))
                self._capped[capped] += 1
            attrs = self._series[pairs] = {**self._static, **dict(pairs)}
        return attrs

    def _zero_series(self) -> None:
        for d in DIRECTIONS:
            for o in ORIGINS:
                self._add(self.blocks, self._attrs((sc.DIRECTION, d), (sc.ORIGIN, o)), 0)
            for cause in causes()[d]:  # each cause with the origin(s) its copies have
                origins = ORIGINS if cause == sc.CAUSE_OTHER else (DIRECT if cause in direct_causes() else MERGED_OP,)
                for o in origins:
                    self._add(self.bytes, self._attrs(*_tiers(d), (sc.ORIGIN, o), (sc.CAUSE, cause)), 0)
                    self._add(self.tokens, self._pool_attrs(d, o, cause, "kv"), 0)
            self._add(self.busy_time, self._attrs((sc.DIRECTION, d)), 0)
        for reason in sc.DROP_REASONS:
            self._add(self.dropped, self._attrs((sc.REASON, reason)), 0)
        for reason in sc.FAIL_REASONS:
            self._add(self.failed, self._attrs((sc.REASON, reason)), 0)
        for cause in OFFLOAD_CAUSES:
            for table in (self.reloaded_bytes, self.wasted_bytes, self.wasted_tokens):
                self._add(table, self._attrs((sc.OFFLOAD_CAUSE, cause)), 0)

    def _pool_attrs(self, direction: str, origin: str, cause: str, pool: str) -> dict[str, Any]:
        return self._attrs((sc.DIRECTION, direction), (sc.ORIGIN, origin), (sc.CAUSE, cause), (sc.POOL, pool),
                           capped=sc.POOL)

    def state(self, inflight: Mapping[str, int], oldest_inflight: Mapping[str, Any],
              oldest_unacked: Mapping[str, Any], queue_size: int) -> None:
        self._inflight.update((d, n) for d, n in inflight.items() if d in self._inflight)
        self._oldest = (oldest_inflight, oldest_unacked)
        self._queue_size = queue_size

    @staticmethod
    def _add(table: dict[int, list[Any]], attrs: dict[str, Any], amount: float) -> None:
        table.setdefault(id(attrs), [attrs, 0])[1] += amount  # (attributes are built once: _attrs)

    def checkpoint(self) -> list[list[Any]]:
        """Every counter's total per series so far, as ``[name, attributes, value]``: where a
        successor's counters go on from."""
        return [[name, attrs, total] for name, table in self._totals.items() for attrs, total in list(table.values())
                if total]

    def seed(self, totals: list[list[Any]]) -> None:
        """Go on from a predecessor's :meth:`checkpoint` (what is not one of ours is skipped)."""
        for name, attrs, value in totals:
            table = self._totals.get(name)
            if table is not None and type(attrs) is dict and type(value) in (int, float) and value > 0:
                # (a list arrives for a tuple: metric points need hashable attribute values)
                pairs = [(k, tuple(v) if type(v) is list else v) for k, v in attrs.items() if k not in self._static]
                try:
                    self._add(table, self._attrs(*pairs), value)
                except TypeError:  # an attribute value no metric point can carry
                    continue

    def completed(self, record: Any, busy_added_ns: int) -> None:
        """A transfer finished successfully: counters, duration, bandwidth, queue wait."""
        direction, origin, timing = record.direction, record.origin, record.timing_source
        self._add(self.blocks, self._attrs((sc.DIRECTION, direction), (sc.ORIGIN, origin)), record.blocks)
        # tokens and bytes by cause: the op's own, or (a mixed merged op) each queued op's
        parts = record.cause_parts or ((record.cause, record.pool_names, record.pool_tokens, record.num_bytes),)
        for cause, pool_names, pool_tokens, num_bytes in parts:
            self._add(self.bytes, self._attrs(*_tiers(direction), (sc.ORIGIN, origin), (sc.CAUSE, cause)), num_bytes)
            for pool, tokens in zip(pool_names, pool_tokens):
                self._add(self.tokens, self._pool_attrs(direction, origin, cause, pool), tokens)
        if busy_added_ns:
            self._add(self.busy_time, self._attrs((sc.DIRECTION, direction)), busy_added_ns / 1e9)
        io_backend = self._default_io_backend if record.io_backend is None else str(record.io_backend)
        self.duration.record(record.duration_ns / 1e9, self._attrs(
            *_tiers(direction), (sc.ORIGIN, origin), (sc.IO_BACKEND, io_backend), (sc.TIMING_SOURCE, timing),
            (sc.CAUSE, record.cause), capped=sc.IO_BACKEND), record.exemplar_context)
        if record.duration_ns > 0:  # (its clock said as the duration's)
            self.bandwidth.record(record.num_bytes / (record.duration_ns / 1e9),
                                  self._attrs((sc.DIRECTION, direction), (sc.TIMING_SOURCE, timing)))
        if record.queue_wait_ns is not None:
            self.queue_wait.record(record.queue_wait_ns / 1e9, self._attrs((sc.DIRECTION, direction)))

    def acked(self, record: Any) -> None:
        self.ack_delay.record(max(0, record.ack_ns - record.end_ns) / 1e9,
                              self._attrs((sc.DIRECTION, record.direction)), record.exemplar_context)

    def failed_record(self, reason: str) -> None:
        self._add(self.failed, self._attrs((sc.REASON, reason)), 1)

    def dropped_records(self, reason: str, count: int = 1) -> None:
        self._add(self.dropped, self._attrs((sc.REASON, reason)), count)

    def host_waste(self, waste: Waste | None, page_size: int) -> None:
        """Host pages freed or overwritten never read since written."""
        for cause, num_bytes, pages in zip(OFFLOAD_CAUSES, *(waste or ((), ()))):
            if pages:
                self._add(self.wasted_bytes, self._attrs((sc.OFFLOAD_CAUSE, cause)), num_bytes)
                self._add(self.wasted_tokens, self._attrs((sc.OFFLOAD_CAUSE, cause)), pages * page_size)

    def host_reuse(self, cause: str, reuse: Reuse | None) -> None:
        """A load-back's pages: their residence (one value per writing offload) and bytes."""
        if reuse is None:
            return
        for offload_cause, num_bytes in zip(OFFLOAD_CAUSES, reuse.bytes_by_cause):
            if num_bytes:
                self._add(self.reloaded_bytes, self._attrs((sc.OFFLOAD_CAUSE, offload_cause)), num_bytes)
        for residence_ns, offload_cause in zip(reuse.residence_ns, reuse.causes):
            self.residence.record(residence_ns / 1e9, self._attrs((sc.CAUSE, cause), (sc.OFFLOAD_CAUSE, offload_cause)))
