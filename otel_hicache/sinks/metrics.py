"""OTel metrics of the ops the capture sends, through the public metrics API.

Recorded from every op whatever the sampler keeps, so counters are exact. Counter increments
are summed per series and handed to the SDK at each :meth:`TransferMetrics.flush`, not per op;
histograms are recorded per op. Only the duration and ack-delay histograms are recorded in the
op's sampled span's context, so only their points carry exemplars (a slow bucket's trace, which
the dashboard and alerts open); the others get the consumer's context, which holds no span.
Every point carries the static attributes (ranks...), and zero series exist from start-up. The
gauges show the capture's ``record.STATE``; the ages are computed when the SDK collects.
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

SERIES_CAP = 2000
"""Series of one kind whose attributes come from a caller (pool names, I/O backends) kept apart at
most (the SDK's default cardinality limit per metric); the rest share one overflow series."""
_COUNTERS = ("bytes", "blocks", "tokens", "busy_time", "dropped", "failed", "reloaded_bytes", "wasted_bytes",
             "wasted_tokens")


def _tiers(direction: str) -> tuple[tuple[str, str], ...]:
    src, dst = TIERS[direction]
    return (sc.DIRECTION, direction), (sc.SRC_TIER, src), (sc.DST_TIER, dst)


class TransferMetrics:
    """Every otel-hicache transfer instrument on one meter provider, as ``semconv`` defines them."""

    def __init__(self, meter_provider: Any, static: Mapping[str, Any], clock: Callable[[], int] = time.time_ns) -> None:
        from opentelemetry.metrics import Observation

        meter = meter_provider.get_meter(sc.SCOPE_NAME, __version__)

        def counter(spec: tuple[str, str, str], make: Any = meter.create_counter) -> Any:
            return make(spec[0], unit=spec[1], description=spec[2])

        def histogram(spec: tuple[str, str, str], buckets: tuple[float, ...]) -> Any:
            return meter.create_histogram(spec[0], unit=spec[1], description=spec[2],
                                          explicit_bucket_boundaries_advisory=buckets)

        def gauge(spec: tuple[str, str, str], observe: Callable[[], list[Any]]) -> None:
            meter.create_observable_gauge(spec[0], callbacks=[lambda _options: observe()], unit=spec[1],
                                          description=spec[2])

        self.duration = histogram(sc.TRANSFER_DURATION, sc.DURATION_BUCKETS_S)
        self.bandwidth = histogram(sc.TRANSFER_BANDWIDTH, sc.BANDWIDTH_BUCKETS)
        self.queue_wait = histogram(sc.TRANSFER_QUEUE_WAIT, sc.DURATION_BUCKETS_S)
        self.ack_delay = histogram(sc.TRANSFER_ACK_DELAY, sc.DURATION_BUCKETS_S)
        self.residence = histogram(sc.HOST_RESIDENCE_TIME, sc.RESIDENCE_BUCKETS_S)
        self.bytes, self.blocks, self.tokens = map(counter, (sc.TRANSFER_BYTES, sc.TRANSFER_BLOCKS, sc.TRANSFER_TOKENS))
        self.busy_time, self.dropped, self.failed = map(counter, (sc.TRANSFER_BUSY_TIME, sc.RECORDS_DROPPED,
                                                                  sc.RECORDS_FAILED))
        self.reloaded_bytes, self.wasted_bytes, self.wasted_tokens = map(counter, (
            sc.HOST_RELOADED_BYTES, sc.HOST_WASTED_BYTES, sc.HOST_WASTED_TOKENS))
        self.inflight = counter(sc.TRANSFER_INFLIGHT, meter.create_up_down_counter)
        self._static, self._clock = dict(static), clock
        self._series: dict[tuple[Any, ...], dict[str, Any]] = {}  # (attribute, value) pairs -> attributes
        self._capped = {sc.POOL: 0, sc.IO_BACKEND: 0}  # series made of caller values, per kind
        self._pending: dict[tuple[int, int], list[Any]] = {}  # (instrument, attributes) ids -> [.., .., sum]
        self._totals: dict[tuple[int, int], list[Any]] = {}  # the same, what was handed over in all
        self._queue_size, self._inflight_sent = 0, dict.fromkeys(DIRECTIONS, 0)
        self._oldest: tuple[Mapping[str, Any], Mapping[str, Any]] = ({}, {})
        self._default_io_backend = str(self._static.get(sc.IO_BACKEND, "unknown"))
        gauge(sc.QUEUE_SIZE, lambda: [Observation(self._queue_size, self._static)])
        for index, spec in enumerate((sc.TRANSFER_OLDEST_INFLIGHT_AGE, sc.TRANSFER_OLDEST_UNACKED_AGE)):
            gauge(spec, lambda index=index: self._ages(index, Observation))
        self._zero_series()

    def _attrs(self, *pairs: tuple[str, Any], capped: str | None = None) -> dict[str, Any]:
        """One series' attributes (the static ones first), built once and reused; ``capped``: the
        attribute whose values a caller chose (:data:`SERIES_CAP`)."""
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
                self.blocks.add(0, self._attrs((sc.DIRECTION, d), (sc.ORIGIN, o)))
            for cause in causes()[d]:  # each cause with the origin(s) its copies have
                for o in ORIGINS if cause == sc.CAUSE_OTHER else (DIRECT,) if cause in direct_causes() else (MERGED_OP,):
                    self.bytes.add(0, self._attrs(*_tiers(d), (sc.ORIGIN, o), (sc.CAUSE, cause)))
                    self.tokens.add(0, self._pool_attrs(d, o, cause, "kv"))
            self.busy_time.add(0, self._attrs((sc.DIRECTION, d)))
            self.inflight.add(0, self._attrs((sc.DIRECTION, d)))
        for reason in sc.DROP_REASONS:
            self.dropped.add(0, self._attrs((sc.REASON, reason)))
        for reason in sc.FAIL_REASONS:
            self.failed.add(0, self._attrs((sc.REASON, reason)))
        for cause in OFFLOAD_CAUSES:
            for instrument in (self.reloaded_bytes, self.wasted_bytes, self.wasted_tokens):
                instrument.add(0, self._attrs((sc.OFFLOAD_CAUSE, cause)))

    def _pool_attrs(self, direction: str, origin: str, cause: str, pool: str) -> dict[str, Any]:
        return self._attrs((sc.DIRECTION, direction), (sc.ORIGIN, origin), (sc.CAUSE, cause), (sc.POOL, pool),
                           capped=sc.POOL)

    # -- the capture's state (record.STATE), and the gauges that show it ----------------
    def state(self, inflight: Mapping[str, int], oldest_inflight: Mapping[str, Any],
              oldest_unacked: Mapping[str, Any], queue_size: int) -> None:
        for direction, count in inflight.items():
            change = count - self._inflight_sent.get(direction, 0)
            if change and direction in self._inflight_sent:
                self._inflight_sent[direction] = count
                self._add(self.inflight, self._attrs((sc.DIRECTION, direction)), change)
        self._oldest = (oldest_inflight, oldest_unacked)
        self._queue_size = queue_size

    def _ages(self, index: int, observation: Any) -> list[Any]:
        oldest, now = self._oldest[index], self._clock()
        return [observation(max(0.0, (now - oldest[d]) / 1e9) if oldest.get(d) is not None else 0.0,
                            self._attrs((sc.DIRECTION, d))) for d in DIRECTIONS]

    # -- counters: summed, handed over at each flush -------------------------------------
    def _add(self, instrument: Any, attrs: dict[str, Any], amount: float) -> None:
        key = (id(instrument), id(attrs))
        entry = self._pending.get(key)
        if entry is None:
            self._pending[key] = [instrument, attrs, amount]
        else:
            entry[2] += amount

    def pending(self) -> bool:
        """Whether increments wait for the next :meth:`flush`."""
        return bool(self._pending)

    def flush(self) -> None:
        """Hand the summed counter increments to the SDK."""
        pending, self._pending = self._pending, {}
        for key, entry in pending.items():
            instrument, attrs, amount = entry
            if not amount:
                continue
            kept = self._totals.get(key)
            total = amount if kept is None else kept[2] + amount
            if type(total) is int and not -INT64_MAX <= total <= INT64_MAX:  # would fail every export from now on
                warn_once(f"overflow:{instrument.name}", "otel-hicache: %s would pass 2**63-1, the largest count "
                          "OTLP can encode; its increments are left out from now on", instrument.name)
                continue
            if kept is None:
                self._totals[key] = entry
            else:
                kept[2] = total
            instrument.add(amount, attrs)

    def checkpoint(self) -> list[list[Any]]:
        """Each monotonic counter's total per series handed over so far, as ``[name, attributes,
        value]``: where a successor's counters go on from."""
        return [[instrument.name, attrs, total] for instrument, attrs, total in self._totals.values()
                if total and instrument is not self.inflight]

    def seed(self, totals: list[list[Any]]) -> None:
        """Go on from a predecessor's :meth:`checkpoint` (what is not one of ours is skipped)."""
        instruments = {i.name: i for i in (getattr(self, name) for name in _COUNTERS)}
        for name, attrs, value in totals:
            instrument = instruments.get(name)
            if instrument is not None and type(attrs) is dict and type(value) in (int, float) and value > 0:
                # (a list arrives for a tuple: metric points need hashable attribute values)
                self._add(instrument, {k: tuple(v) if type(v) is list else v for k, v in attrs.items()}, value)
        self.flush()

    # -- per op ---------------------------------------------------------------------------
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
        self.ack_delay.record(max(0, record.ack_ns - record.end_ns) / 1e9, self._attrs((sc.DIRECTION, record.direction)),
                              record.exemplar_context)

    def failed_record(self, reason: str) -> None:
        self._add(self.failed, self._attrs((sc.REASON, reason)), 1)

    def dropped_records(self, reason: str, count: int = 1) -> None:
        self._add(self.dropped, self._attrs((sc.REASON, reason)), count)

    # -- host residence (at intake, in submission order) ------------------------------------
    def host_waste(self, waste: Waste, page_size: int) -> None:
        """Host pages freed or overwritten never read since written."""
        for cause, num_bytes, pages in zip(OFFLOAD_CAUSES, waste.bytes_by_cause, waste.pages_by_cause):
            if pages:
                self._add(self.wasted_bytes, self._attrs((sc.OFFLOAD_CAUSE, cause)), num_bytes)
                self._add(self.wasted_tokens, self._attrs((sc.OFFLOAD_CAUSE, cause)), pages * page_size)

    def host_reuse(self, cause: str, reuse: Reuse) -> None:
        """A load-back's pages: their residence (one value per writing offload) and bytes."""
        for offload_cause, num_bytes in zip(OFFLOAD_CAUSES, reuse.bytes_by_cause):
            if num_bytes:
                self._add(self.reloaded_bytes, self._attrs((sc.OFFLOAD_CAUSE, offload_cause)), num_bytes)
        for residence_ns, offload_cause in zip(reuse.residence_ns, reuse.causes):
            self.residence.record(residence_ns / 1e9, self._attrs((sc.CAUSE, cause), (sc.OFFLOAD_CAUSE, offload_cause)))
