"""``TransferTelemetry``: the public API adapters and applications call.

``submit()`` and ``ack()`` are the hot path: no OTel SDK call, no device
synchronization, no ``elapsed_time()``, no log formatting, never raise. They
stamp the host clock and the current OTel context and append a small record to
a bounded queue; the completion worker (:mod:`otel_hicache.pipeline`) does the
rest.
"""

from __future__ import annotations

import os
import time
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Sequence

from opentelemetry import context as otel_context
from opentelemetry import metrics as otel_metrics
from opentelemetry import trace as otel_trace

from . import configuration, fork, sdk_internals
from .bounded_flush import bounded
from .cache_events import CacheEvents
from .link_capacity import LinkCapacity
from . import environment_variables as ev
from .device import timing_event_pair
from .diagnostics import warn_once
from .host_residence import HostFree, make_host_pool
from .logs import TransferLog
from .metrics import TransferMetrics
from .process_exit import on_exit
from .pipeline import CompletionPipeline, PipelineSettings, Sinks
from .records import S_ACK_NS, TransferRecord, submission, validate
from .self_metrics import TelemetryCpu
from .settings import env_bool, env_float, sdk_disabled
from .span_sampling import SpanSamplingSettings
from .spans import _valid_value, make_span_builder

# The capacity a forked child's TransferTelemetry holds until its first submit() or host_freed():
# below any queue length, so the capacity check every submit makes anyway sends that one call
# to _first_in_child (no check of its own on the hot path).
_BUILD_FIRST = -1


def _context_getter() -> Callable[[], Any]:
    """The current OTel context, read straight from the runtime's ContextVar
    when it is the default one (half the cost of ``context.get_current()``)."""
    return sdk_internals.context_getter() or otel_context.get_current


_get_current_context = _context_getter()


def _static_attributes(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    static: dict[str, Any] = {}
    for key, value in (attributes or {}).items():
        if isinstance(key, str) and key and _valid_value(value):
            static[key] = tuple(value) if isinstance(value, list) else value
        else:
            warn_once(
                f"static:{key!r}",
                "otel-hicache: static attribute %r=%r is not a string/bool/int/float (or a list of them); ignored",
                key,
                value,
            )
    return static


def _shutdown_at_exit(ref: "weakref.ref[TransferTelemetry]") -> None:
    telemetry = ref()
    if telemetry is not None:
        telemetry.shutdown()


class TransferTelemetry:
    """Turns L1<->L2 transfers into device-timed spans and exact metrics.

    :param tracer_provider: defaults to the one :func:`otel_hicache.configure`
        built, else the global one.
    :param meter_provider: likewise.
    :param attributes: static attributes (ranks, model...) put on every span and
        metric point.
    :param clock: host clock in ns (default ``time.time_ns``); simulations and
        tests pass their own.
    :param anchor_event_factory: returns a freshly recorded timing event, for the
        wall-clock anchor; derived from the events themselves when omitted.

    ``cache_events`` (:class:`~otel_hicache.cache_events.CacheEvents`) counts
    the cache events that are not transfers (prefix hits per tier, dropped and
    evicted tokens) with the same static attributes.
    """

    def __init__(
        self,
        tracer_provider: Any = None,
        meter_provider: Any = None,
        attributes: Mapping[str, Any] | None = None,
        *,
        clock: Callable[[], int] | None = None,
        anchor_event_factory: Callable[[], Any] | None = None,
    ) -> None:
        self._tracer_provider = tracer_provider
        self._meter_provider = meter_provider
        self._static = _static_attributes(attributes)
        self._strict = env_bool(ev.OTEL_HICACHE_STRICT)
        self._clock = clock or time.time_ns
        self._fast_path = env_bool(ev.OTEL_HICACHE_SPAN_FAST_PATH)
        self._span_sampling = SpanSamplingSettings.from_environment()
        self._shutdown_timeout_s = env_float(ev.OTEL_HICACHE_SHUTDOWN_TIMEOUT_S)
        self._pipeline: CompletionPipeline | None = None
        self._from_configuration = False
        self._resolve_providers()
        self._providers_pid = os.getpid()
        # prefix hits, dropped and evicted tokens: counted on the caller's thread
        # with a dict update, exported by observable counters once bound
        self.cache_events = CacheEvents(self._static)
        # A plain attribute, not a property: adapters guard their own argument
        # building with ``if tel.enabled:`` for a ~20 ns disabled path.
        self.enabled = False
        if not (env_bool(ev.OTEL_HICACHE_ENABLED) and not sdk_disabled()):
            return
        settings = PipelineSettings.from_environment()
        self._cap = self._max_queue_size = settings.max_queue_size
        # the host link's nominal capacity: the current device is taken here, on the
        # caller's thread (it is per thread); NVML is read once, by the worker
        self._link_capacity = LinkCapacity(self._static)
        self._pipeline = CompletionPipeline(settings, self._build_sinks, self._clock, anchor_event_factory)
        self.enabled = True
        on_exit(_shutdown_at_exit, weakref.ref(self), priority=20)  # also in multiprocessing children
        fork.after_fork_in_child(self._after_fork_in_child)  # after the pipeline's (registration order)

    # -- providers and sinks ------------------------------------------------------
    def _resolve_providers(self) -> tuple[Any, Any]:
        """Explicit providers, else those configure() built, else the global ones.

        Resolved at construction (call ``configure()`` first) and again in a
        forked child, where providers built by ``configure()`` are rebuilt."""
        tracer_provider, meter_provider = self._tracer_provider, self._meter_provider
        if tracer_provider is None or meter_provider is None:
            configured = configuration.configured()
            if configured is None and self._from_configuration:
                configured = configuration.configure()  # a forked child: its own exporters
            if configured is not None:
                self._from_configuration = True
            if tracer_provider is None:
                tracer_provider = configured.tracer_provider if configured else otel_trace.get_tracer_provider()
            if meter_provider is None:
                meter_provider = configured.meter_provider if configured else otel_metrics.get_meter_provider()
        self._providers = (tracer_provider, meter_provider)
        return self._providers

    def _after_fork_in_child(self) -> None:
        """Builds nothing (at-fork callbacks take no foreign locks): the child's first submit() builds
        its new providers and sinks, on the caller's thread, so none is built in an exit hook, where the
        SDK's resource detectors can no longer start their thread pool (and a child that ends right
        after its submits lost them all). Until then the parent's providers are not this child's:
        a flush or shutdown before any submit touches none (their locks may have been held at fork)."""
        if self._meter_provider is not None:  # the caller's, copied: its own metric readers
            if sdk_internals.reinit_metric_locks_in_fork_child(self._meter_provider):
                warn_once("fork:metric_locks", "otel-hicache: the meter provider passed to TransferTelemetry was "
                          "exporting or collecting when this process forked; its locks held then were freed in "
                          "the child (the SDK keeps them held there forever). Build providers in the child after "
                          "fork, or use otel_hicache.configure() (docs/configuration.md, fork)")
        if self._pipeline is not None:
            self._cap = _BUILD_FIRST
            self._providers = (None, None)

    def _first_in_child(self, pipeline: CompletionPipeline) -> bool:
        """A forked child's first submit() (the capacity is _BUILD_FIRST until then): its sinks built
        now. False when it is not that call, or the queue is full after all."""
        if self._cap != _BUILD_FIRST:
            return False
        try:
            # New providers only: on the caller's own (the parent's copies) a lock we missed could
            # hang this thread; the worker builds on those, off the caller's thread
            if self._tracer_provider is None and self._meter_provider is None:
                pipeline.build_sinks()
        except Exception as exc:  # the worker builds them when it takes the record in
            warn_once(f"fork:build:{type(exc).__name__}",
                      "otel-hicache: a forked child could not build its telemetry at its first submit (%r)", exc)
        self._cap = self._max_queue_size
        return len(pipeline.queue) + pipeline.held < self._cap

    def _build_sinks(self) -> Sinks:
        """Called by the worker: at start-up, and again in a forked child."""
        if self._providers_pid != os.getpid():
            self._resolve_providers()
            self._providers_pid = os.getpid()  # (once resolved: a failed attempt is retried)
        tracer_provider, meter_provider = self._providers
        self.cache_events.bind(meter_provider)
        self._link_capacity.bind(meter_provider)
        metrics = TransferMetrics(meter_provider, self._static, queue_size=self._queue_size,
                                  fast_path=self._fast_path)
        TelemetryCpu(meter_provider, tracer_provider, self._static, self._worker_thread)  # its own CPU, at collection
        spans = make_span_builder(tracer_provider, self._static, self._fast_path,
                                  self._span_sampling.policy(self._static), metrics.span_decision)
        return Sinks(spans, metrics, TransferLog())

    def _queue_size(self) -> int:
        pipeline = self._pipeline
        return pipeline.size() if pipeline is not None else 0

    def _worker_thread(self) -> Any:
        pipeline = self._pipeline
        return pipeline._worker if pipeline is not None else None  # its thread (a new one after fork)

    # -- hot path ---------------------------------------------------------------
    def submit(
        self,
        direction: str,
        tokens_by_pool: Mapping[str, int] | None = None,
        num_bytes: int = 0,
        page_size: int = 1,
        start_event: Any = None,
        finish_event: Any = None,
        timing_enabled: bool = False,
        io_backend: str | None = None,
        attributes: Mapping[str, Any] | None = None,
        *,
        expect_ack: bool = True,
        host_start_ns: int | None = None,
        host_end_ns: int | None = None,
        ack_watch: tuple[Any, Any] | None = None,
        cause: str | Sequence[Any] | Callable[[], Any] | None = None,
        host_slots: tuple[Any, Any] | None = None,
        requests: Any = None,
    ) -> list | None:
        """Report one merged op (or one direct copy). Returns the handle for ``ack()``.

        ``tokens_by_pool`` and ``attributes`` are read on the worker: pass
        mappings you do not mutate afterwards. ``expect_ack=False`` for copies
        nobody acknowledges (the span is emitted at completion).
        ``host_start_ns``/``host_end_ns``: host times the caller already knows
        (synchronous copies); used when there are no timing events.
        ``host_start_ns`` is then also the op's submit time.
        ``ack_watch=(container, item)``: for consumers you cannot call ``ack()``
        from, the op counts as acked when the worker sees ``item`` (by
        identity) gone from ``container`` (a list or deque the consumer pops
        or clears), within a poll interval.
        ``cause``: why the bytes moved, one of ``semconv.CAUSES[direction]`` (None:
        ``other``); or, for a merged op whose queued ops had different causes, its parts
        ``[(cause, tokens_by_pool, num_bytes), ...]``, which must sum to the op's totals
        (its tokens and bytes are then counted per part, the op as ``mixed``); or a deferred
        call returning one of these (a callable, or ``(function, *args)``, cheaper to build
        than a ``partial``), made on the worker in submission order: work the cause out off
        the hot path.
        ``host_slots=(pool, slots)``: the op's token slots in a host pool made by
        :meth:`host_pool` (an index array, a sequence of them, or a callable returning
        one; read on the worker, so pass what you do not mutate): the pages an offload
        wrote or a load-back read, for the host residence metrics and span links.
        ``requests``: the span contexts (or spans, or contexts) of the traced requests the op
        served or whose KV it wrote, or a callable returning them (read on the worker): the
        span links to them (:mod:`otel_hicache.request_links`).
        """
        pipeline = self._pipeline
        if pipeline is None:
            return None
        try:
            if self._strict:
                self._check(direction, tokens_by_pool, num_bytes, page_size)
            if len(pipeline.queue) + pipeline.held >= self._cap and not self._first_in_child(pipeline):
                next(pipeline.refused)
                return None
            # records.SUBMISSION_FIELDS, spelled out: a list literal is the cheapest
            # build (no call); tests/test_records.py checks it keeps that order.
            record = [
                direction,
                tokens_by_pool,
                num_bytes,
                page_size,
                start_event,
                finish_event,
                timing_enabled,
                io_backend,
                attributes,
                expect_ack,
                self._clock() if host_start_ns is None else host_start_ns,
                _get_current_context(),
                host_start_ns,
                host_end_ns,
                ack_watch,
                cause,
                host_slots,
                requests,
                None,  # ack time, set by ack() or the worker (ack_watch)
            ]
            pipeline.queue.append(record)
            return record
        except (TypeError, ValueError):
            if self._strict:
                raise
            return None
        except Exception:  # never raise into the host application
            return None

    def host_pool(self, slots: int, page_size: int, name: str = "kv") -> Any:
        """Host residence bookkeeping for one host pool of ``slots`` token slots in pages of
        ``page_size`` (:mod:`otel_hicache.host_residence`; preallocated, 42 bytes per
        page): pass it with the ops' ``host_slots`` and to :meth:`host_freed`. None when
        disabled, without NumPy, or for a bad size (warned once)."""
        if self._pipeline is None or not env_bool(ev.OTEL_HICACHE_HOST_RESIDENCE):
            return None
        return make_host_pool(slots, page_size, name)

    def host_freed(self, pool: Any, slots: Any) -> None:
        """The host application freed ``slots`` of ``pool`` (from :meth:`host_pool`): pages
        written and never loaded back since count as wasted offloads. Ordered with the ops
        submitted before and after it; never refused (frees are tiny and must not be lost).
        Never raises."""
        pipeline = self._pipeline
        if pipeline is None or pool is None:
            return
        try:
            if self._cap == _BUILD_FIRST:
                self._first_in_child(pipeline)
            pipeline.queue.append(HostFree(pool, slots))
        except Exception:  # never raise into the host application
            return

    def ack(self, handle: list | None) -> None:
        """The consumer took this op's ack (optional). Never raises."""
        try:
            if handle is not None and handle[S_ACK_NS] is None:
                handle[S_ACK_NS] = self._clock()
        except (TypeError, IndexError, KeyError):
            if self._strict:
                raise TypeError(f"ack() expects a handle returned by submit(), got {type(handle).__name__}")
            warn_once("ack:handle", "otel-hicache: ack() got %s, not a handle from submit(); ignored",
                      type(handle).__name__)

    @staticmethod
    def _check(direction: Any, tokens_by_pool: Any, num_bytes: Any, page_size: Any) -> None:
        validate(TransferRecord(submission(direction, tokens_by_pool, num_bytes, page_size)))

    # -- convenience --------------------------------------------------------------
    @contextmanager
    def transfer(
        self,
        direction: str,
        tokens_by_pool: Mapping[str, int] | None = None,
        num_bytes: int = 0,
        page_size: int = 1,
        stream: Any = None,
        io_backend: str | None = None,
        attributes: Mapping[str, Any] | None = None,
        cause: str | None = None,
        host_slots: tuple[Any, Any] | None = None,
        requests: Any = None,
    ) -> Iterator[None]:
        """Time the copies enqueued inside the block and report them as one op
        (``cause``, ``host_slots`` and ``requests`` as for :meth:`submit`).

        With ``stream`` (a ``torch.cuda.Stream`` or any stream whose backend has
        timing events) a start and a finish timing event are recorded on it
        around the block: device time, nothing synchronized. Without one the
        block is timed on the host clock (right for synchronous CPU copies).
        If the block raises, nothing is reported and the exception propagates.
        """
        if self._pipeline is None:
            yield None
            return
        events = None
        if stream is not None:
            try:
                events = timing_event_pair(stream)
                events[0].record(stream)
            except Exception as exc:
                events = None
                warn_once(f"stream:{type(stream).__name__}",
                          "otel-hicache: cannot record timing events on %s (%r); using the host clock",
                          type(stream).__name__, exc)
        host_start = self._clock()
        yield None
        if events is not None:
            try:
                events[1].record(stream)
            except Exception:
                events = None
        if events is not None:
            self.submit(direction, tokens_by_pool, num_bytes, page_size, events[0], events[1], True,
                        io_backend, attributes, expect_ack=False, host_start_ns=host_start, cause=cause,
                        host_slots=host_slots, requests=requests)
        else:
            self.submit(direction, tokens_by_pool, num_bytes, page_size, None, None, False, io_backend,
                        attributes, expect_ack=False, host_start_ns=host_start, host_end_ns=self._clock(),
                        cause=cause, host_slots=host_slots, requests=requests)

    # -- lifecycle ------------------------------------------------------------------
    def force_flush(self, timeout_s: float = 10.0) -> bool:
        """Report every completed op (acked or not waiting for an ack) and export. Bounded."""
        pipeline = self._pipeline
        if pipeline is None:
            return True
        deadline = time.monotonic() + timeout_s
        flushed = pipeline.flush(timeout_s)
        tracer_provider, meter_provider = self._providers
        # export what was processed even if something was still in flight
        remaining = max(0.1 * timeout_s, deadline - time.monotonic())
        exported = bounded("force_flush", tracer_provider, meter_provider, remaining)
        return flushed and exported

    def shutdown(self) -> None:
        """Stop accepting, report what was recorded (unacked spans with
        ``hicache.acked=false``), export. Bounded by OTEL_HICACHE_SHUTDOWN_TIMEOUT_S."""
        pipeline, self._pipeline = self._pipeline, None
        self.enabled = False
        if pipeline is None:
            return
        timeout = self._shutdown_timeout_s
        deadline = time.monotonic() + timeout
        pipeline.stop(timeout)
        remaining = max(0.1, deadline - time.monotonic())
        tracer_provider, meter_provider = self._providers
        bounded("force_flush", tracer_provider, meter_provider, remaining)
