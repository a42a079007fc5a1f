"""OTel metrics derived from completed transfer records.

Recorded on the completion worker from every record, before and independently
of trace sampling, so counters are exact whatever the sampler drops.

Cost control: counter increments are summed per attribute set in plain dicts
and handed to the SDK at most every 50 ms of the worker and on every flush
(:meth:`TransferMetrics.flush`; the periodic one a few SDK calls a worker cycle,
:meth:`TransferMetrics.flush_steps`), not once per op. Histograms are recorded per op (the SDK offers no batch
record), with the span context of the op so trace-based exemplars link a
bucket to its trace, through :mod:`otel_hicache.metrics_fast_path` (no
per-record attribute work) where that is exactly equivalent. Attribute dicts
are built once per attribute set and reused.

Every point carries the static attributes (ranks...), so per-rank series never
sum by accident. Zero-valued series for both directions (and every drop
reason) exist from start-up.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

from . import semconv as sc
from .diagnostics import warn_once
from .metrics_fast_path import BoundHistogram, resolver_for
from .host_residence import OFFLOAD_CAUSES, Reuse, Waste
from .records import DIRECT, DIRECTIONS, INT64_MAX, MERGED_OP, ORIGINS, TIERS, TransferRecord
from .version import __version__


class TransferInstruments:
    """Every otel-hicache instrument on one meter, as ``semconv`` defines them.

    Also what ``benchmarks/overhead.py`` uses for its naive in-thread baseline, so
    both produce the same telemetry."""

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
        self.span_decisions = counter(sc.SPANS)
        self.residence = histogram(sc.HOST_RESIDENCE_TIME, sc.RESIDENCE_BUCKETS_S)
        self.reloaded_bytes = counter(sc.HOST_RELOADED_BYTES)
        self.wasted_bytes = counter(sc.HOST_WASTED_BYTES)
        self.wasted_tokens = counter(sc.HOST_WASTED_TOKENS)


class TransferMetrics(TransferInstruments):
    def __init__(
        self,
        meter_provider: Any,
        static: Mapping[str, Any],
        queue_size: Callable[[], int] | None = None,
        fast_path: bool = True,
    ) -> None:
        meter = meter_provider.get_meter(sc.SCOPE_NAME, __version__)
        super().__init__(meter)
        self._resolver = resolver_for(meter_provider, fast_path)
        self._bound: dict[tuple[int, int], BoundHistogram] = {}
        self._static = dict(static)
        if queue_size is not None:
            from opentelemetry.metrics import Observation

            static_attrs = self._static
            meter.create_observable_gauge(
                sc.QUEUE_SIZE[0],
                callbacks=[lambda _options: [Observation(queue_size(), static_attrs)]],
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
        self._by_span_decision: dict[tuple[str, str], dict[str, Any]] = {
            key: self._attrs({sc.DECISION: key[0], sc.REASON: key[1]}) for key in sc.SPAN_DECISION_SERIES
        }
        self._by_timing: dict[tuple[str, str], dict[str, Any]] = {}
        self._by_offload_cause = {c: self._attrs({sc.OFFLOAD_CAUSE: c}) for c in OFFLOAD_CAUSES}
        self._by_residence: dict[tuple[str, str], dict[str, Any]] = {}  # (load-back cause, offload cause)
        self._default_io_backend = str(self._static.get(sc.IO_BACKEND, "unknown"))
        # pending counter increments: (instrument, attrs id) -> [attrs, amount]
        self._pending: dict[tuple[int, int], list[Any]] = {}
        self._totals: dict[tuple[int, int], int] = {}  # integer counters' sums handed over, per series
        self._zero_series()
        # stuck and late transfers: ages the pipeline computes at collection time
        # (bind_oldest_ages); both directions report 0 until bound and while none
        self._age_sources: tuple[Callable[[], Mapping[str, float]], ...] | None = None
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
            attrs = self._by_pool[key] = self._attrs(
                {sc.DIRECTION: direction, sc.ORIGIN: origin, sc.CAUSE: cause, sc.POOL: pool})
        return attrs

    def _duration_attrs(self, record: TransferRecord) -> dict[str, Any]:
        io_backend = self._default_io_backend if record.io_backend is None else str(record.io_backend)
        key = (record.direction, record.origin, io_backend, record.timing_source, record.cause)
        attrs = self._by_duration.get(key)
        if attrs is None:
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

    def _bandwidth_attrs(self, record: TransferRecord) -> dict[str, Any]:
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
            for cause in sc.CAUSES[d]:  # each cause with the origin(s) its copies have
                for o in ORIGINS if cause == sc.CAUSE_OTHER else (
                        (DIRECT,) if cause in sc.DIRECT_CAUSES else (MERGED_OP,)):
                    self.bytes.add(0, self._bytes_attrs(d, o, cause))
                    self.tokens.add(0, self._pool_attrs(d, o, cause, "kv"))
            self.busy_time.add(0, self._by_direction[d])
            self.inflight.add(0, self._by_direction[d])
        for reason in sc.DROP_REASONS:
            self.dropped.add(0, self._reason_attrs(reason))
        for reason in sc.FAIL_REASONS:
            self.failed.add(0, self._reason_attrs(reason))
        for attrs in self._by_span_decision.values():
            self.span_decisions.add(0, attrs)
        for attrs in self._by_offload_cause.values():
            self.reloaded_bytes.add(0, attrs)
            self.wasted_bytes.add(0, attrs)
            self.wasted_tokens.add(0, attrs)

    # -- oldest in-flight / un-acked age (the SDK's collection thread) -----------
    def bind_oldest_ages(
        self, inflight: Callable[[], Mapping[str, float]], unacked: Callable[[], Mapping[str, float]]
    ) -> None:
        """Where the oldest_inflight_age and oldest_unacked_age gauges read their
        values: each returns seconds per direction (the completion pipeline's)."""
        self._age_sources = (inflight, unacked)

    def _age_callback(self, index: int) -> Callable[[Any], list[Any]]:
        from opentelemetry.metrics import Observation

        def observe(_options: Any) -> list[Any]:
            sources = self._age_sources
            if sources is None:
                return [Observation(0.0, self._by_direction[d]) for d in DIRECTIONS]
            try:
                ages = sources[index]()
            except Exception as exc:  # no point rather than a 0 that reads as healthy
                warn_once(f"oldest_age:{type(exc).__name__}",
                          "otel-hicache: cannot compute the oldest transfer ages (%r); not reported", exc)
                return []
            return [Observation(ages.get(d, 0.0), self._by_direction[d]) for d in DIRECTIONS]

        return observe

    # -- batched counters -------------------------------------------------
    def _add(self, instrument: Any, attrs: dict[str, Any], amount: float) -> None:
        key = (id(instrument), id(attrs))
        entry = self._pending.get(key)
        if entry is None:
            self._pending[key] = [instrument, attrs, amount]
        else:
            entry[2] += amount

    def _histogram(self, instrument: Any, attrs: dict[str, Any]) -> BoundHistogram:
        key = (id(instrument), id(attrs))
        bound = self._bound.get(key)
        if bound is None:
            bound = self._bound[key] = BoundHistogram(instrument, attrs, self._resolver)
        return bound

    def revalidate(self) -> None:
        """Re-check the histogram fast path's bindings that aggregate values at once (every
        worker cycle: an aggregation the SDK replaced or a reader added since must not lose the
        next values). Bindings whose values all wait for the flush are checked there."""
        for bound in self._bound.values():
            if not bound.bulk:
                bound.revalidate()

    def flush_steps(self) -> Iterator[None]:
        """The flush below, one hand-off to the SDK per step: the worker runs a periodic one a
        few steps a cycle, so that no cycle holds the GIL for all of it (0.4-0.6 ms on a 2-vCPU
        VM, counter adds of ~20 us each, cold). Values kept and increments summed after a
        step wait for the next flush."""
        for bound in list(self._bound.values()):  # a record completed between two steps may bind another
            bound.revalidate()
            bound.flush_values()
            yield
        pending = self._pending
        if not pending:
            return
        self._pending = {}
        totals = self._totals
        for key, (instrument, attrs, amount) in pending.items():
            if amount:
                if type(amount) is int:  # a cumulative count past int64 would fail every export from then on
                    total = totals.get(key, 0) + amount
                    if not -INT64_MAX <= total <= INT64_MAX:
                        name = getattr(instrument, "name", "a counter")
                        warn_once(f"overflow:{name}", "otel-hicache: %s would pass 2**63-1, the largest count OTLP "
                                  "can encode; its increments are left out from now on", name)
                        continue
                    totals[key] = total
                instrument.add(amount, attrs)
                yield

    def dropped_now(self, reason: str, count: int) -> None:
        """Records dropped, handed to the SDK at once: for when the worker, which hands over
        the summed increments, is itself stuck (any thread; the SDK's add is thread-safe)."""
        self.dropped.add(count, self._reason_attrs(reason))

    def flush(self, pause: Callable[[], None] | None = None) -> None:
        """Re-check the bindings and hand the summed counter increments and the kept
        histogram values to the SDK (every ``_COUNTER_FLUSH_INTERVAL_NS`` of the worker,
        and on every flush). ``pause()`` after each SDK hand-off: the worker's GIL slice."""
        for _ in self.flush_steps():
            if pause is not None:
                pause()

    # -- per record ---------------------------------------------------------
    def submitted(self, record: TransferRecord) -> None:
        record.in_flight = True
        self._add(self.inflight, self._by_direction[record.direction], 1)

    def left_flight(self, record: TransferRecord) -> None:
        if record.in_flight:
            record.in_flight = False
            self._add(self.inflight, self._by_direction[record.direction], -1)

    def completed(self, record: TransferRecord, busy_added_ns: int) -> None:
        """A transfer finished successfully: counters, duration, bandwidth, queue wait."""
        direction, origin = record.direction, record.origin
        by_direction = self._by_direction[direction]
        context = record.exemplar_context
        self.left_flight(record)
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
        self._histogram(self.duration, self._duration_attrs(record)).record(duration_s, context)
        # exemplars (trace links) on the duration and ack-delay histograms, where a
        # slow bucket needs its trace; bandwidth and queue wait stay cheaper
        if record.duration_ns > 0:
            self._histogram(self.bandwidth, self._bandwidth_attrs(record)).record(record.num_bytes / duration_s, None)
        if record.queue_wait_ns is not None:
            self._histogram(self.queue_wait, by_direction).record(record.queue_wait_ns / 1e9, None)

    def acked(self, record: TransferRecord) -> None:
        delay_ns = max(0, record.ack_ns - record.end_ns)
        self._histogram(self.ack_delay, self._by_direction[record.direction]).record(
            delay_ns / 1e9, record.exemplar_context
        )

    # -- host residence (at intake, in submission order) -----------------------
    def host_waste(self, waste: Waste, page_size: int) -> None:
        """Host pages freed or overwritten without a load-back since written."""
        for index, (num_bytes, pages) in enumerate(zip(waste.bytes_by_cause, waste.pages_by_cause)):
            if pages:
                attrs = self._by_offload_cause[OFFLOAD_CAUSES[index]]
                self._add(self.wasted_bytes, attrs, num_bytes)
                self._add(self.wasted_tokens, attrs, pages * page_size)

    def host_reuse(self, record: TransferRecord, reuse: Reuse) -> None:
        """A load-back's pages: their residence (one value per writing offload) and bytes."""
        for index, num_bytes in enumerate(reuse.bytes_by_cause):
            if num_bytes:
                self._add(self.reloaded_bytes, self._by_offload_cause[OFFLOAD_CAUSES[index]], num_bytes)
        cause = record.cause
        for residence_ns, offload_cause in zip(reuse.residence_ns, reuse.causes):
            key = (cause, offload_cause)
            attrs = self._by_residence.get(key)
            if attrs is None:
                attrs = self._by_residence[key] = self._attrs({sc.CAUSE: cause, sc.OFFLOAD_CAUSE: offload_cause})
            self._histogram(self.residence, attrs).record(residence_ns / 1e9, None)

    def failed_record(self, record: TransferRecord, reason: str) -> None:
        self.left_flight(record)
        self._add(self.failed, self._reason_attrs(reason), 1)

    def span_decision(self, decision: str, reason: str) -> None:
        """One span kept or skipped (otel_hicache.spans; the span builder calls it per op)."""
        attrs = self._by_span_decision.get((decision, reason))
        if attrs is None:  # a pair not decided by the worker itself (a non-SDK tracer's own sampler)
            attrs = self._by_span_decision[decision, reason] = self._attrs({sc.DECISION: decision, sc.REASON: reason})
        self._add(self.span_decisions, attrs, 1)

    def dropped_records(self, reason: str, count: int = 1) -> None:
        self._add(self.dropped, self._reason_attrs(reason), count)

    def _reason_attrs(self, reason: str) -> dict[str, Any]:
        attrs = self._by_reason.get(reason)
        if attrs is None:
            attrs = self._by_reason[reason] = self._attrs({sc.REASON: reason})
        return attrs
