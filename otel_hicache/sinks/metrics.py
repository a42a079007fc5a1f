"""OTel metrics derived from the ops the capture sends, through the public metrics API.

Recorded from every op, before and independently of trace sampling, so counters are
exact whatever the sampler drops. Counter increments are summed per attribute set in
plain dicts and handed to the SDK at every flush of the consumer (each batch of the
telemetry process, each export), not once per op; histograms are recorded per op, with
the op's span context so trace-based exemplars link a bucket to its trace. Attribute
dicts are built once per attribute set and reused.

The in-flight count, the queue size and the oldest in-flight and un-acked ages come from
the capture's ``record.STATE`` messages; the ages are computed when the SDK collects,
from the times the capture sent.

Every point carries the static attributes (ranks...), so per-rank series never sum by
accident. Zero-valued series for both directions (and every drop reason) exist from
start-up.
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
most; the SDK's default cardinality limit per metric."""
_NO_EXEMPLAR = None
"""The context of a histogram value no exemplar should carry: none (the current one would be the
consumer's, which is no op's)."""


class TransferInstruments:
    """Every otel-hicache instrument on one meter, as ``semconv`` defines them."""

    def __init__(self, meter: Any) -> None:
        def counter(spec: tuple[str, str, str]) -> Any:
            return meter.create_counter(spec[0], unit=spec[1], description=spec[2])

        def histogram(spec: tuple[str, str, str], buckets: tuple[float, ...]) -> Any:
            return meter.create_histogram(
                spec[0], unit=spec[1], description=spec[2], explicit_bucket_boundaries_advisory=buckets
            )

        self.duration = histogram(sc.TRANSFER_DURATION, sc.DURATION_BUCKETS_S)
        self.bandwidth = histogram(sc.TRANSFER_BANDWIDTH, sc.BANDWIDTH_BUCKETS)
        self.queue_wait = histogram(sc.TRANSFER_QUEUE_WAIT, sc.DURATION_BUCKETS_S)
        self.ack_delay = histogram(sc.TRANSFER_ACK_DELAY, sc.DURATION_BUCKETS_S)
        self.bytes = counter(sc.TRANSFER_BYTES)
        self.blocks = counter(sc.TRANSFER_BLOCKS)
        self.tokens = counter(sc.TRANSFER_TOKENS)
        self.busy_time = counter(sc.TRANSFER_BUSY_TIME)
        self.inflight = meter.create_up_down_counter(
            sc.TRANSFER_INFLIGHT[0], unit=sc.TRANSFER_INFLIGHT[1], description=sc.TRANSFER_INFLIGHT[2]
        )
        self.dropped = counter(sc.RECORDS_DROPPED)
        self.failed = counter(sc.RECORDS_FAILED)
        self.residence = histogram(sc.HOST_RESIDENCE_TIME, sc.RESIDENCE_BUCKETS_S)
        self.reloaded_bytes = counter(sc.HOST_RELOADED_BYTES)
        self.wasted_bytes = counter(sc.HOST_WASTED_BYTES)
        self.wasted_tokens = counter(sc.HOST_WASTED_TOKENS)


class TransferMetrics(TransferInstruments):
    def __init__(
        self,
        meter_provider: Any,
        static: Mapping[str, Any],
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        from opentelemetry.metrics import Observation

        meter = meter_provider.get_meter(sc.SCOPE_NAME, __version__)
        super().__init__(meter)
        self._static = dict(static)
        self._clock = clock
        self._queue_size = 0
        self._inflight_sent = dict.fromkeys(DIRECTIONS, 0)
        static_attrs = self._static
        meter.create_observable_gauge(
            sc.QUEUE_SIZE[0],
            callbacks=[lambda _options: [Observation(self._queue_size, static_attrs)]],
            unit=sc.QUEUE_SIZE[1],
            description=sc.QUEUE_SIZE[2],
        )

        # attribute dicts, built once per attribute set
        self._by_direction = {d: self._attrs({sc.DIRECTION: d}) for d in DIRECTIONS}
        self._by_origin = {
            (d, o): self._attrs({sc.DIRECTION: d, sc.ORIGIN: o}) for d in DIRECTIONS for o in ORIGINS
        }
        self._by_tiers: dict[tuple[str, str, str], dict[str, Any]] = {}  # (direction, origin, cause)
        self._by_pool: dict[tuple[str, str, str, str], dict[str, Any]] = {}  # ... and pool
        self._by_duration: dict[tuple[str, str, str, str], dict[str, Any]] = {}
        self._by_reason: dict[str, dict[str, Any]] = {}
        self._overflow_attrs = self._attrs({"otel.metric.overflow": True})
        self._by_timing: dict[tuple[str, str], dict[str, Any]] = {}
        self._by_offload_cause = {c: self._attrs({sc.OFFLOAD_CAUSE: c}) for c in OFFLOAD_CAUSES}
        self._by_residence: dict[tuple[str, str], dict[str, Any]] = {}  # (load-back cause, offload cause)
        self._default_io_backend = str(self._static.get(sc.IO_BACKEND, "unknown"))
        # pending counter increments: (instrument, attrs id) -> [attrs, amount]
        self._pending: dict[tuple[int, int], list[Any]] = {}
        self._totals: dict[tuple[int, int], list[Any]] = {}  # [instrument, attrs, sum handed over], per series
        self._zero_series()
        # stuck and late transfers: the oldest submit and completion times the capture sent,
        # aged when the SDK collects; both directions report 0 while there is none
        self._oldest: tuple[Mapping[str, Any], Mapping[str, Any]] = ({}, {})
        for index, spec in enumerate((sc.TRANSFER_OLDEST_INFLIGHT_AGE, sc.TRANSFER_OLDEST_UNACKED_AGE)):
            meter.create_observable_gauge(
                spec[0], callbacks=[self._age_callback(index)], unit=spec[1], description=spec[2]
            )

    def _attrs(self, extra: Mapping[str, Any]) -> dict[str, Any]:
        attrs = dict(self._static)
        attrs.update(extra)
        return attrs

    def _bytes_attrs(self, direction: str, origin: str, cause: str) -> dict[str, Any]:
        key = (direction, origin, cause)
        attrs = self._by_tiers.get(key)
        if attrs is None:
            src, dst = TIERS[direction]
            attrs = self._by_tiers[key] = self._attrs(
                {sc.DIRECTION: direction, sc.SRC_TIER: src, sc.DST_TIER: dst, sc.ORIGIN: origin, sc.CAUSE: cause})
        return attrs

    def _pool_attrs(self, direction: str, origin: str, cause: str, pool: str) -> dict[str, Any]:
        key = (direction, origin, cause, pool)
        attrs = self._by_pool.get(key)
        if attrs is None:
            if len(self._by_pool) >= SERIES_CAP:
                return self._overflow(sc.POOL)
            attrs = self._by_pool[key] = self._attrs(
                {sc.DIRECTION: direction, sc.ORIGIN: origin, sc.CAUSE: cause, sc.POOL: pool})
        return attrs

    def _overflow(self, attribute: str) -> dict[str, Any]:
        """Past ``SERIES_CAP`` series of a kind, the rest go to one overflow series, as the SDK's
        own cardinality limit does: the counts stay exact in sum, the per-series state bounded."""
        warn_once(f"cardinality:{attribute}", "otel-hicache: more than %d series by %s (values a caller passes); "
                  "the rest are reported as one series with otel.metric.overflow=true", SERIES_CAP, attribute)
        return self._overflow_attrs

    def _duration_attrs(self, record: Any) -> dict[str, Any]:
        io_backend = self._default_io_backend if record.io_backend is None else str(record.io_backend)
        key = (record.direction, record.origin, io_backend, record.timing_source, record.cause)
        attrs = self._by_duration.get(key)
        if attrs is None:
            if len(self._by_duration) >= SERIES_CAP:
                return self._overflow(sc.IO_BACKEND)
            src, dst = TIERS[record.direction]
            attrs = self._by_duration[key] = self._attrs(
                {
                    sc.DIRECTION: record.direction,
                    sc.SRC_TIER: src,
                    sc.DST_TIER: dst,
                    sc.ORIGIN: record.origin,
                    sc.IO_BACKEND: io_backend,
                    sc.TIMING_SOURCE: record.timing_source,
                    sc.CAUSE: record.cause,
                }
            )
        return attrs

    def _bandwidth_attrs(self, record: Any) -> dict[str, Any]:
        """Per-op bandwidth says which clock its duration came from, as the duration does."""
        key = (record.direction, record.timing_source)
        attrs = self._by_timing.get(key)
        if attrs is None:
            attrs = self._by_timing[key] = self._attrs(
                {sc.DIRECTION: record.direction, sc.TIMING_SOURCE: record.timing_source}
            )
        return attrs

    def _zero_series(self) -> None:
        for d in DIRECTIONS:
            for o in ORIGINS:
                self.blocks.add(0, self._by_origin[d, o])
            for cause in causes()[d]:  # each cause with the origin(s) its copies have
                for o in ORIGINS if cause == sc.CAUSE_OTHER else (
                        (DIRECT,) if cause in direct_causes() else (MERGED_OP,)):
                    self.bytes.add(0, self._bytes_attrs(d, o, cause))
                    self.tokens.add(0, self._pool_attrs(d, o, cause, "kv"))
            self.busy_time.add(0, self._by_direction[d])
            self.inflight.add(0, self._by_direction[d])
        for reason in sc.DROP_REASONS:
            self.dropped.add(0, self._reason_attrs(reason))
        for reason in sc.FAIL_REASONS:
            self.failed.add(0, self._reason_attrs(reason))
        for attrs in self._by_offload_cause.values():
            self.reloaded_bytes.add(0, attrs)
            self.wasted_bytes.add(0, attrs)
            self.wasted_tokens.add(0, attrs)

    # -- the capture's state (record.STATE), and the gauges that show it ----------------
    def state(self, inflight: Mapping[str, int], oldest_inflight: Mapping[str, Any],
              oldest_unacked: Mapping[str, Any], queue_size: int) -> None:
        for direction, count in inflight.items():
            change = count - self._inflight_sent.get(direction, 0)
            if change and direction in self._by_direction:
                self._inflight_sent[direction] = count
                self._add(self.inflight, self._by_direction[direction], change)
        self._oldest = (oldest_inflight, oldest_unacked)
        self._queue_size = queue_size

    def _age_callback(self, index: int) -> Callable[[Any], list[Any]]:
        from opentelemetry.metrics import Observation

        def observe(_options: Any) -> list[Any]:
            oldest, now = self._oldest[index], self._clock()
            return [Observation(max(0.0, (now - oldest[d]) / 1e9) if oldest.get(d) is not None else 0.0,
                                self._by_direction[d]) for d in DIRECTIONS]

        return observe

    # -- batched counters -------------------------------------------------
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
        pending = self._pending
        if not pending:
            return
        self._pending = {}
        totals = self._totals
        for key, entry in pending.items():
            instrument, attrs, amount = entry
            if amount:
                kept = totals.get(key)
                total = amount if kept is None else kept[2] + amount
                if type(total) is int and not -INT64_MAX <= total <= INT64_MAX:  # would fail every export from now on
                    name = getattr(instrument, "name", "a counter")
                    warn_once(f"overflow:{name}", "otel-hicache: %s would pass 2**63-1, the largest count OTLP "
                              "can encode; its increments are left out from now on", name)
                    continue
                if kept is None:
                    totals[key] = entry
                else:
                    kept[2] = total
                instrument.add(amount, attrs)

    def checkpoint(self) -> list[list[Any]]:
        """Every monotonic counter's total per series handed to the SDK so far, as
        ``[name, attributes, value]``: where a successor's counters go on from."""
        return [[instrument.name, attrs, total] for instrument, attrs, total in self._totals.values()
                if total and instrument is not self.inflight]

    def seed(self, totals: list[list[Any]]) -> None:
        """Go on from a predecessor's :meth:`checkpoint`: each total is added at once, so these
        counters continue its series rather than restart (one that is not ours is skipped)."""
        instruments = {i.name: i for i in (self.bytes, self.blocks, self.tokens, self.busy_time, self.dropped,
                                           self.failed, self.reloaded_bytes,
                                           self.wasted_bytes, self.wasted_tokens)}
        for name, attrs, value in totals:
            instrument = instruments.get(name)
            if instrument is not None and type(attrs) is dict and type(value) in (int, float) and value > 0:
                # (a list arrives for a tuple: metric points need hashable attribute values)
                self._add(instrument, {k: tuple(v) if type(v) is list else v for k, v in attrs.items()}, value)
        self.flush()

    # -- per record ---------------------------------------------------------
    def completed(self, record: Any, busy_added_ns: int) -> None:
        """A transfer finished successfully: counters, duration, bandwidth, queue wait."""
        direction, origin = record.direction, record.origin
        by_direction = self._by_direction[direction]
        context = record.exemplar_context
        self._add(self.blocks, self._by_origin[direction, origin], record.blocks)
        # tokens and bytes by cause: the op's own, or (a mixed merged op) each queued op's
        parts = record.cause_parts or ((record.cause, record.pool_names, record.pool_tokens, record.num_bytes),)
        for cause, pool_names, pool_tokens, num_bytes in parts:
            self._add(self.bytes, self._bytes_attrs(direction, origin, cause), num_bytes)
            for pool, tokens in zip(pool_names, pool_tokens):
                self._add(self.tokens, self._pool_attrs(direction, origin, cause, pool), tokens)
        if busy_added_ns:
            self._add(self.busy_time, by_direction, busy_added_ns / 1e9)
        duration_s = record.duration_ns / 1e9
        self.duration.record(duration_s, self._duration_attrs(record), context)
        # exemplars (trace links) on the duration and ack-delay histograms, where a
        # slow bucket needs its trace; bandwidth and queue wait stay cheaper
        if record.duration_ns > 0:
            self.bandwidth.record(record.num_bytes / duration_s, self._bandwidth_attrs(record), _NO_EXEMPLAR)
        if record.queue_wait_ns is not None:
            self.queue_wait.record(record.queue_wait_ns / 1e9, by_direction, _NO_EXEMPLAR)

    def acked(self, record: Any) -> None:
        delay_ns = max(0, record.ack_ns - record.end_ns)
        self.ack_delay.record(delay_ns / 1e9, self._by_direction[record.direction], record.exemplar_context)

    # -- host residence (at intake, in submission order) -----------------------
    def host_waste(self, waste: Waste, page_size: int) -> None:
        """Host pages freed or overwritten without a load-back since written."""
        for index, (num_bytes, pages) in enumerate(zip(waste.bytes_by_cause, waste.pages_by_cause)):
            if pages:
                attrs = self._by_offload_cause[OFFLOAD_CAUSES[index]]
                self._add(self.wasted_bytes, attrs, num_bytes)
                self._add(self.wasted_tokens, attrs, pages * page_size)

    def host_reuse(self, cause: str, reuse: Reuse) -> None:
        """A load-back's pages: their residence (one value per writing offload) and bytes."""
        for index, num_bytes in enumerate(reuse.bytes_by_cause):
            if num_bytes:
                self._add(self.reloaded_bytes, self._by_offload_cause[OFFLOAD_CAUSES[index]], num_bytes)
        for residence_ns, offload_cause in zip(reuse.residence_ns, reuse.causes):
            key = (cause, offload_cause)
            attrs = self._by_residence.get(key)
            if attrs is None:
                attrs = self._by_residence[key] = self._attrs({sc.CAUSE: cause, sc.OFFLOAD_CAUSE: offload_cause})
            self.residence.record(residence_ns / 1e9, attrs, _NO_EXEMPLAR)

    def failed_record(self, record: Any, reason: str) -> None:
        self._add(self.failed, self._reason_attrs(reason), 1)

    def dropped_records(self, reason: str, count: int = 1) -> None:
        self._add(self.dropped, self._reason_attrs(reason), count)

    def _reason_attrs(self, reason: str) -> dict[str, Any]:
        attrs = self._by_reason.get(reason)
        if attrs is None:
            attrs = self._by_reason[reason] = self._attrs({sc.REASON: reason})
        return attrs
