"""The off-thread completion pipeline.

The caller's thread only appends records to a bounded queue. One daemon
worker per process (per :class:`CompletionPipeline`) does everything else:

1. intake: validate each record (invalid ones are counted and warned about
   once, never raised), count it in flight;
2. completion: poll ``finish_event.query()`` (never ``synchronize()``, never
   ``elapsed_time()`` before both events completed), time out stuck
   transfers;
3. on completion: resolve timing (:mod:`otel_hicache.timing`), add to busy
   time, begin the span, record metrics and the DEBUG lines;
4. finish the span once acked (or the ack wait timed out, or no ack expected);
5. hand the summed counter increments to the SDK (at most every
   ``_COUNTER_FLUSH_INTERVAL_NS``, a few SDK calls a cycle; all at once on every
   flush and at stop).

With ``OTEL_HICACHE_GIL_SLICE_US`` the worker pauses between units of that work
once it has held the GIL for the budget (:mod:`otel_hicache.gil_slice`).

After ``fork()`` the child starts with an empty pipeline and a new worker
(the parent's records stay the parent's), and rebuilds its sinks (see
:class:`otel_hicache.telemetry.TransferTelemetry`).
"""

from __future__ import annotations

import itertools
import math
import operator
import os
import sys
import threading
import time
from collections import deque
from typing import Any, Callable, Iterator

from . import environment_variables as ev
from . import fork
from . import request_links
from . import semconv as sc
from .busy_time import BusyTimeTracker
from .clock import EventTimeline, WallClockAnchor
from .device import anchor_factory_for
from .diagnostics import logger, warn_once
from .environment_variables import DEFAULTS
from .gil_slice import GilSlice
from .host_residence import HostFree
from .records import DIRECTIONS, OFFLOAD, S_ACK_NS, S_SUBMIT_NS, TransferRecord, validate
from .settings import env_float, env_int
from .timing import is_complete, resolve, resolve_host_clock


class Sinks:
    """Where resolved records go: spans, metrics, logs. Built per process."""

    __slots__ = ("spans", "metrics", "log")

    def __init__(self, spans: Any, metrics: Any, log: Any) -> None:
        self.spans = spans
        self.metrics = metrics
        self.log = log


class PipelineSettings:
    """The worker's knobs; the defaults are the documented ones (environment_variables.DEFAULTS)."""

    __slots__ = (
        "max_queue_size",
        "poll_interval_s",
        "ack_timeout_ns",
        "transfer_timeout_ns",
        "anchor_interval_s",
        "gil_slice_us",
        "stall_warning_s",
    )

    def __init__(
        self,
        max_queue_size: int = DEFAULTS[ev.OTEL_HICACHE_MAX_QUEUE_SIZE],
        poll_interval_s: float = DEFAULTS[ev.OTEL_HICACHE_POLL_INTERVAL_MS] / 1e3,
        ack_timeout_s: float = DEFAULTS[ev.OTEL_HICACHE_ACK_TIMEOUT_S],
        transfer_timeout_s: float = DEFAULTS[ev.OTEL_HICACHE_TRANSFER_TIMEOUT_S],
        anchor_interval_s: float = DEFAULTS[ev.OTEL_HICACHE_ANCHOR_INTERVAL_S],
        gil_slice_us: float = DEFAULTS[ev.OTEL_HICACHE_GIL_SLICE_US],
        stall_warning_s: float = 10.0,
    ) -> None:
        self.max_queue_size = max_queue_size
        self.poll_interval_s = poll_interval_s
        self.ack_timeout_ns = int(ack_timeout_s * 1e9)
        self.transfer_timeout_ns = int(transfer_timeout_s * 1e9)
        self.anchor_interval_s = anchor_interval_s
        self.gil_slice_us = gil_slice_us
        # a worker cycle unfinished this long is stuck (an event's query() that never returns):
        # far longer than any cycle of a worker that keeps up, even one catching up a backlog
        self.stall_warning_s = stall_warning_s

    @classmethod
    def from_environment(cls) -> "PipelineSettings":
        """From the ``OTEL_HICACHE_*`` variables (malformed ones: warned, the default used)."""
        return cls(
            max_queue_size=env_int(ev.OTEL_HICACHE_MAX_QUEUE_SIZE),
            poll_interval_s=env_float(ev.OTEL_HICACHE_POLL_INTERVAL_MS, minimum=0.01) / 1e3,
            ack_timeout_s=env_float(ev.OTEL_HICACHE_ACK_TIMEOUT_S),
            transfer_timeout_s=env_float(ev.OTEL_HICACHE_TRANSFER_TIMEOUT_S),
            anchor_interval_s=env_float(ev.OTEL_HICACHE_ANCHOR_INTERVAL_S, minimum=0.01),
            gil_slice_us=env_float(ev.OTEL_HICACHE_GIL_SLICE_US),
        )


_IDLE_WAIT_S = 0.01
_ACTIVE_GRACE_S = 0.1
# Counter increments are summed and handed to the SDK at most this often (and on every
# flush and at stop): each SDK Counter.add costs ~8 us, about 9 of them per hand-off, which
# per 1 ms cycle was half the worker's CPU at 1,000 ops/s. Collections see counters at most
# this much behind the histograms (recorded per op).
_COUNTER_FLUSH_INTERVAL_NS = 50_000_000
# A periodic hand-off runs this many SDK calls a cycle (metrics.flush_steps), the rest in the
# next cycles: at once it held the GIL 0.4-0.6 ms every 50 ms, the longest hold of a paced
# worker but a collection (the p99.9 of a thread waking beside it, docs/performance.md).
_FLUSH_STEPS_PER_CYCLE = 4
_ACK_SCAN_INTERVAL_NS = 5_000_000
# A cycle that starts with more queued than this runs without GIL slices (catching up beats
# pausing for others: a backlog would otherwise end in queue_full drops) and hands the metrics
# over at once (its cycles are long: a hand-off in steps would keep seconds of values).
_UNSLICED_BACKLOG = 256
_GIL_YIELD_EVERY = 16  # records completed between two voluntary GIL releases
_BUSY_LATE_MARGIN_NS = 5 * 10**9  # busy intervals kept this long before the oldest op in flight
_BUSY_FORGET_INTERVAL_NS = 100_000_000
_AGES_LOCK_WAIT_S = 0.05  # the collection thread's longest wait for the intake lock (oldest_inflight_ages, size)


def _ns(value: Any) -> int | float | None:
    """A submit time usable for an age (an int, a NumPy or torch integer, a finite float), else None."""
    if type(value) is int:
        return value
    try:
        return operator.index(value)
    except TypeError:
        return value if isinstance(value, float) and math.isfinite(value) else None


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _where(thread: threading.Thread) -> str:
    """Where a thread of ours is blocked: the first call it made out of otel-hicache (the
    host's event or callback), as ``function (file:line)``, and the innermost function."""
    frame = sys._current_frames().get(thread.ident)  # CPython's only way to see another thread's frame
    if frame is None:
        return "an unknown place"
    innermost, callee = frame, frame
    while frame is not None and not frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        callee, frame = frame, frame.f_back
    code = callee.f_code
    where = f"{getattr(code, 'co_qualname', code.co_name)} ({code.co_filename}:{callee.f_lineno})"
    return where if callee is innermost else f"{where}, in {innermost.f_code.co_name}"


class _Wake:
    """The worker's wake-up: ``wait(timeout)`` is one C call (``threading.Event.wait`` is a
    Condition in Python: ~15 us more CPU per poll on a 2-core VM), ``set()`` from any thread;
    a wait consumes the wake-up (no ``clear()``), so a ``set()`` is never lost between the
    two, and a spurious extra wake-up costs one empty cycle."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        try:
            self._lock.release()
        except RuntimeError:  # already set
            pass

    def wait(self, timeout: float) -> bool:
        return self._lock.acquire(timeout=timeout)


class CompletionPipeline:
    def __init__(
        self,
        settings: PipelineSettings,
        build_sinks: Callable[[], Sinks],
        clock: Callable[[], int] = time.time_ns,
        anchor_factory: Callable[[], Any] | None = None,
    ) -> None:
        self.settings = settings
        self._build_sinks = build_sinks
        self._clock = clock
        self._anchor_factory = anchor_factory
        self._forked = False
        self._init_state()
        self._start_worker()
        fork.after_fork_in_child(self._after_fork_in_child)

    # -- state -----------------------------------------------------------
    def _init_state(self) -> None:
        self.queue: deque[list[Any]] = deque()  # submitted lists, laid out as records.SUBMISSION_FIELDS
        self.held = 0  # records the worker holds (pending + awaiting ack); never below the truth
        self._pending: list[TransferRecord] = []
        self._awaiting: list[tuple[TransferRecord, Any]] = []
        self._intake: list[list[Any]] | tuple[()] = ()  # the batch being taken in (oldest_*_ages)
        self._last_ack_scan = 0
        self._busy = {d: BusyTimeTracker() for d in DIRECTIONS}
        self._last_busy_forget = 0
        self._anchor: WallClockAnchor | None = None
        self._anchor_resolved = False
        self._timeline = EventTimeline()  # places device-timed ops the anchor cannot
        self._sinks: Sinks | None = None
        self._wake = _Wake()
        self._slice = GilSlice(self.settings.gil_slice_us)  # OTEL_HICACHE_GIL_SLICE_US
        # time.monotonic_ns() of the last hand-off of the summed counters: due at the first cycle (even when
        # the clock, which counts from boot, is younger than the interval)
        self._last_counter_flush = time.monotonic_ns() - _COUNTER_FLUSH_INTERVAL_NS
        self._flushing: Iterator[None] | None = None  # a periodic hand-off in progress (its remaining steps)
        self._stopping = False
        self._drain_all = False
        self._flush_waiters: list[tuple[int, threading.Event]] = []
        self._taken = 0  # records taken in from the queue (their intake sequence numbers)
        self._lock = threading.Lock()
        # submit() calls refused on a full queue: next() on a count is atomic, so
        # concurrent submitters never lose one, and it takes no memory per refusal
        self.refused = itertools.count()
        self._refused_reported = 0
        self._refused_reads = 0
        self._refused_lock = threading.Lock()  # the worker and, while it is stuck, stalled() report them
        self._cycle_started: float | None = None  # time.monotonic() of the cycle running now, else None
        self._stall_reported = False
        self._abandoned = False  # stop() gave up on a stuck worker and counted what it held

    def _start_worker(self) -> None:
        self._worker = threading.Thread(target=self._run, name="otel-hicache-completion", daemon=True)
        self._worker.start()

    def _after_fork_in_child(self) -> None:
        self._init_state()
        self._forked = True
        self._start_worker()

    def size(self) -> int:
        """Records queued or held (the otel_hicache.queue.size gauge). Read under the intake's
        lock, with the bounded wait of oldest_inflight_ages: the worker counts a batch in
        ``held`` before it pops it from ``queue`` (so submit() never sees a record in neither
        place), and an unlocked read between the two counts that batch twice."""
        locked = self._lock.acquire(timeout=_AGES_LOCK_WAIT_S)
        try:
            return len(self.queue) + self.held
        finally:
            if locked:
                self._lock.release()

    # -- stuck and late transfers (the metric collection thread) ----------------
    #
    # hicache.transfer.oldest_inflight_age / oldest_unacked_age are computed when
    # the SDK collects, from snapshots of the worker's state: nothing on the hot
    # path and no per-cycle work on the worker (which would cost on every cycle
    # what a collection, every export interval, costs once). The snapshots are
    # safe without a lock on the lists: tuple() of a list is one C call under the
    # GIL, and the worker only appends to a list or replaces it whole. Only the
    # intake is read under the worker's existing lock (a bounded wait), which it
    # holds while it pops: a record is then either still queued or in the batch being taken in
    # (_intake, cleared only once every record of it is in _pending). A snapshot
    # may still show an op that completed a moment ago (worst case: one cycle
    # late), never miss one in flight. Cost per collection: O(records held).

    def oldest_inflight_ages(self) -> dict[str, float]:
        """Seconds since the submit time of the oldest op per direction still in
        flight (queued, being taken in, or not seen complete); 0 when none.
        On the clock that stamps ``submit_ns``."""
        self.stalled()  # every collection checks on the worker: nothing else runs while it is stuck
        oldest: dict[str, Any] = dict.fromkeys(DIRECTIONS)
        # Bounded wait: the SDK calls this holding its collection lock, which the worker
        # needs while it builds its sinks under this one (a forked child on shared
        # providers). Past the wait, a batch in transit may be missed for this collection.
        locked = self._lock.acquire(timeout=_AGES_LOCK_WAIT_S)
        try:
            try:
                queued: tuple[Any, ...] = tuple(self.queue)
            except RuntimeError:  # a deque mutated while copied (one C call: only a GC finalizer could)
                queued = ()
            intake = self._intake
        finally:
            if locked:
                self._lock.release()
        for item in itertools.chain(queued, intake):
            try:
                direction, submit_ns = item[0], _ns(item[S_SUBMIT_NS])
            except Exception:  # not a submission list: the intake drops it as invalid_input
                continue
            if submit_ns is not None and direction in oldest:
                first = oldest[direction]
                if first is None or submit_ns < first:
                    oldest[direction] = submit_ns
        for record in tuple(self._pending):
            submit_ns = _ns(record.submit_ns)  # unchecked by validate(): a bad one ends as internal_error
            first = oldest[record.direction]
            if submit_ns is not None and (first is None or submit_ns < first):
                oldest[record.direction] = submit_ns
        return self._ages(oldest)

    def oldest_unacked_ages(self) -> dict[str, float]:
        """Seconds since the completion of the oldest op per direction still waiting
        for its ack (submitted with ``expect_ack=True``); 0 when none. Measured from
        the completion, as the ack timeout is, so it stays below
        ``OTEL_HICACHE_ACK_TIMEOUT_S`` (plus a scan) while the worker keeps up."""
        oldest: dict[str, Any] = dict.fromkeys(DIRECTIONS)
        for record, _state in tuple(self._awaiting):
            if record.handle[S_ACK_NS] is not None:  # acked, not yet scanned out (at most 5 ms)
                continue
            first = oldest[record.direction]
            completed = record.completed_at_ns
            if first is None or completed < first:
                oldest[record.direction] = completed
        return self._ages(oldest)

    def _ages(self, oldest: dict[str, Any]) -> dict[str, float]:
        now = self._clock()
        return {d: 0.0 if t is None else max(0.0, (now - t) / 1e9) for d, t in oldest.items()}

    # -- a stuck worker (the metric collection thread, flush, stop) ------------
    def stalled(self) -> float:
        """Seconds the worker's current cycle has run when that is past ``stall_warning_s``
        (an event's ``query()`` or a host's deferred call that does not return), else 0.
        Warns once per stall, naming where the worker is blocked, and counts the submits
        refused meanwhile (the worker, which would count them, cannot)."""
        started = self._cycle_started
        if started is None or not self._worker.is_alive():
            return 0.0
        stalled_for = time.monotonic() - started
        if stalled_for < self.settings.stall_warning_s:
            return 0.0
        if not self._stall_reported:
            self._stall_reported = True
            logger.warning(
                "otel-hicache: the completion worker has not finished a cycle for %.0f s; it is blocked in %s. "
                "No transfer is reported until it returns; submits refused meanwhile are counted in "
                "otel_hicache.records.dropped{reason=queue_full}, and hicache.transfer.oldest_inflight_age "
                "shows the age of what waits", stalled_for, _where(self._worker))
        sinks = self._sinks
        if sinks is not None:
            self._report_queue_full(sinks.metrics, at_once=True)
        return stalled_for

    # -- control (any thread) -----------------------------------------------
    def flush(self, timeout_s: float) -> bool:
        """Wait until every record submitted before this call was taken in and is
        no longer in flight (or ``timeout_s`` passed). Records waiting for an ack
        stay held."""
        if not self._worker.is_alive():
            return not (self.queue or self._pending)
        done = threading.Event()
        with self._lock:
            # everything submitted before this call: taken in so far, plus queued now
            self._flush_waiters.append((self._taken + len(self.queue), done))
        self._wake.set()
        if done.wait(timeout_s):
            return True
        self.stalled()  # a flush that times out says why, when the worker is stuck
        return False

    def stop(self, timeout_s: float) -> bool:
        """Flush, emit records still waiting for an ack, stop the worker; all
        within ``timeout_s`` (plus at most 0.1 s for the final cycle)."""
        if not self._worker.is_alive():
            return False
        deadline = time.monotonic() + timeout_s
        flushed = self.flush(timeout_s)
        self._drain_all = True
        self._stopping = True
        self._wake.set()
        self._worker.join(max(0.1, deadline - time.monotonic()))
        stopped = not self._worker.is_alive()
        if stopped and self.queue:
            self._drop_queued_at_shutdown()  # appended by a submit() that raced the final cycle
        elif not stopped and self.stalled():
            self._abandon()
        return flushed and stopped

    def _abandon(self) -> None:
        """At stop, with the worker stuck: what it holds and what is queued is lost, counted
        now (the worker, should its call ever return, reports nothing more)."""
        self._abandoned = True
        sinks = self._sinks
        lost = len(self.queue) + self.held
        if sinks is not None and lost:
            sinks.metrics.dropped_now(sc.DROP_SHUTDOWN, lost)
        logger.warning("otel-hicache: %d transfers held by the stuck completion worker were not reported; "
                       "counted in otel_hicache.records.dropped{reason=shutdown}", lost)

    # -- worker ------------------------------------------------------------
    def _run(self) -> None:
        poll = self.settings.poll_interval_s
        last_active = 0.0
        while True:
            taken = self._taken
            self._slice.begin(sliced=len(self.queue) <= _UNSLICED_BACKLOG)
            self._cycle_started = time.monotonic()
            try:
                self._cycle()
            except Exception as exc:  # keep the worker alive whatever happens
                self._intake = ()  # a batch the error interrupted is not in flight any more
                warn_once("worker", "otel-hicache: completion worker error %r (continuing)", exc)
                logger.debug("otel-hicache worker error", exc_info=True)
            finally:
                self._cycle_started = None
                self._slice.end()
            if self._abandoned:
                return
            if self._stall_reported:
                self._stall_reported = False
                logger.warning("otel-hicache: the completion worker finished its stalled cycle; reporting again")
            if self._stopping:
                self._cycle_final()
                return
            # No wake-up from the hot path: submit() only appends. The worker polls
            # every poll interval while there is (or recently was) work, and backs
            # off to _IDLE_WAIT_S when idle; flush()/stop() wake it explicitly.
            now = time.monotonic()
            if self._pending or self._awaiting or self.queue or self._taken != taken:
                last_active = now  # busy (also when this cycle finished all it took in)
            self._wake.wait(poll if now - last_active < _ACTIVE_GRACE_S else _IDLE_WAIT_S)

    def build_sinks(self) -> None:
        """Build the sinks now, on the calling thread, if they are not built yet."""
        self._sinks_now()

    def _unused_in_child(self) -> bool:
        """A forked child that has queued nothing: nothing to report, no sinks to build (its first
        submit builds them, telemetry.py; never an exit hook, where building fails)."""
        return self._forked and self._sinks is None and not self.queue

    def _sinks_now(self) -> Sinks:
        sinks = self._sinks
        if sinks is None:
            with self._lock:  # built once, whichever thread asks first
                sinks = self._sinks
                if sinks is None:
                    sinks = self._build_sinks()
                    bind = getattr(sinks.metrics, "bind_oldest_ages", None)
                    if bind is not None:  # the oldest in-flight and un-acked ages, observed at collection
                        bind(self.oldest_inflight_ages, self.oldest_unacked_ages)
                    self._sinks = sinks
        return sinks

    def _cycle(self) -> None:
        if self._unused_in_child():
            # A forked child's worker starts inside the at-fork callbacks, before other
            # libraries' ones re-create the locks their threads held at fork (the SDK's,
            # its resource detectors' thread pool): its providers are built only once the
            # child submits, which is after fork() returned. A flush has nothing to wait for.
            if self._flush_waiters:
                self._release_flush_waiters()
            return
        sinks = self._sinks_now()
        metrics = sinks.metrics
        queue = self.queue
        cap = self.settings.max_queue_size
        backlog = len(queue) > _UNSLICED_BACKLOG  # a long cycle: no GIL slices, the hand-off at once
        # 1. intake: at most what the cap leaves room for; the rest stays queued
        # (submit() refuses beyond the cap), so a backlog never stalls reporting
        # and queued + held never exceeds the cap.
        pending = self._pending
        check = self._slice.check  # a pause once the cycle has held the GIL for its slice (or nothing)
        room = cap - len(pending) - len(self._awaiting)
        while queue and room > 0:
            # Pop and count under the flush lock: flush() reads _taken + len(queue) under it, so
            # it never sees a record popped but not yet counted (one batch, one lock, per pass).
            with self._lock:
                count = min(room, len(queue))  # the worker is the only consumer: they are there
                self.held += count  # before the pops: submit() never sees a record in neither place
                first = self._taken
                items = [queue.popleft() for _ in range(count)]
                self._taken = first + count
                self._intake = items  # popped, not yet in _pending: still seen as in flight
            for seq, item in enumerate(items, first):
                check()
                record = None
                try:
                    if type(item) is HostFree:  # freed host pages, in order with the ops around them
                        self.held -= 1
                        self._host_freed(item, metrics)
                        continue
                    record = TransferRecord(item)
                    record.seq = seq
                    try:
                        validate(record)  # may call the host's deferred cause
                        if self._abandoned:
                            return
                    except Exception as exc:  # whatever the caller passed, count it and go on
                        self.held -= 1
                        metrics.dropped_records(sc.DROP_INVALID_INPUT)
                        warn_once(f"invalid:{type(exc).__name__}:{str(exc).split(',')[0]}",
                                  "otel-hicache: dropped a transfer record: %s", exc)
                        continue
                    metrics.submitted(record)
                    if record.host_slots is not None:
                        self._host_pages(record, metrics)
                    pending.append(record)
                    room -= 1  # an invalid record takes no room: the next pass takes another
                except Exception as exc:  # one record lost, counted; never the rest of its batch
                    self.held -= 1
                    self._intake_error(metrics, record, exc)
        self._intake = ()
        self.held = len(pending) + len(self._awaiting)
        now = self._clock()
        # 2./3. completion
        if self._pending:
            if self._anchor is not None:
                self._anchor.maybe_refresh(now)
            still = []
            timeout = self.settings.transfer_timeout_ns
            for index, record in enumerate(self._pending):
                check()
                if index and not index % _GIL_YIELD_EVERY:
                    time.sleep(0)  # let the caller's thread take the GIL: no stall grows with the batch
                try:
                    try:
                        done = is_complete(record)
                    except Exception as exc:
                        self._fail(record, sc.FAIL_EVENT_ERROR, now, exc)
                        continue
                    if self._abandoned:  # it returned after stop() counted it lost
                        return
                    if done:
                        self._complete(record, sinks)
                    elif now - record.submit_ns > timeout:
                        self._fail(record, sc.FAIL_TRANSFER_TIMEOUT, now, None)
                    else:
                        still.append(record)
                except Exception as exc:  # a record is handled once, whatever a sink does
                    self._internal_error(sinks, record, exc)
            self._pending = still
        if now - self._last_busy_forget >= _BUSY_FORGET_INTERVAL_NS:
            self._forget_busy_intervals(now)
        # 4. acks: watched ones every cycle (cheap), the rest (and timeouts) every 5 ms
        watched = self._watch_acks(now) if self._awaiting else 0
        if self._awaiting and (self._drain_all or now - self._last_ack_scan >= _ACK_SCAN_INTERVAL_NS
                               or self._flush_waiters or watched):
            self._last_ack_scan = now
            self._scan_acks(sinks, now)
        self.held = len(self._pending) + len(self._awaiting)
        # 5. counters: refusals counted up to now (a flush registered during this
        # cycle covers them), then every summed increment to the SDK
        self._report_queue_full(metrics)
        mono = time.monotonic_ns()
        due = mono - self._last_counter_flush >= _COUNTER_FLUSH_INTERVAL_NS
        if self._flush_waiters or self._drain_all or (backlog and (due or self._flushing is not None)):
            # (in a backlog's long cycles a hand-off in steps would keep the values of seconds)
            self._last_counter_flush = mono
            self._flush_all(metrics, check)
        else:
            whole = False  # a hand-off at once (sinks without flush_steps) re-checks every binding itself
            if self._flushing is None and due:
                self._last_counter_flush = mono
                steps = getattr(metrics, "flush_steps", None)
                if steps is None:
                    metrics.flush(check)
                    whole = True
                else:
                    self._flushing = steps()
            if self._flushing is not None:
                done = 0
                for _ in itertools.islice(self._flushing, _FLUSH_STEPS_PER_CYCLE):
                    done += 1
                    check()
                if done < _FLUSH_STEPS_PER_CYCLE:
                    self._flushing = None
            revalidate = getattr(metrics, "revalidate", None)
            if revalidate is not None and not whole:
                revalidate()
        if self._flush_waiters:
            self._release_flush_waiters()

    def _flush_all(self, metrics: Any, pause: Callable[[], None] | None = None) -> None:
        """Every value and increment to the SDK now: the rest of a periodic hand-off, then a whole one."""
        flushing, self._flushing = self._flushing, None
        if flushing is not None:
            for _ in flushing:
                if pause is not None:
                    pause()
        metrics.flush(pause)

    def _forget_busy_intervals(self, now: int) -> None:
        """No op still in flight started (on the device) much before it was
        submitted: busy intervals ending before the oldest submit time, less a
        margin, can never overlap one still to come. Keeps the union's memory
        and cost to the ops in flight, not 120 s of history."""
        self._last_busy_forget = now
        oldest = min((r.submit_ns for r in self._pending), default=now)
        queue = self.queue
        if queue:  # a backlog not taken in yet (overload): its oldest op too
            try:
                queued = queue[0][S_SUBMIT_NS]
                if isinstance(queued, int):
                    oldest = min(oldest, queued)
            except IndexError:  # the worker is the only consumer, but never trust a race
                pass
        cutoff = min(oldest, now) - _BUSY_LATE_MARGIN_NS
        for tracker in self._busy.values():
            tracker.forget_before(cutoff)

    def _release_flush_waiters(self) -> None:
        """A flush is done once every record submitted before it was taken in and
        is no longer in flight (later submissions do not hold it up)."""
        oldest_pending = min((r.seq for r in self._pending), default=self._taken)
        with self._lock:
            waiting = []
            for target, done in self._flush_waiters:
                if self._taken >= target and oldest_pending >= target:
                    done.set()
                else:
                    waiting.append((target, done))
            self._flush_waiters = waiting

    def _cycle_final(self) -> None:
        """On stop: what is still in flight is dropped and counted."""
        if self._unused_in_child():
            self._release_flush_waiters()
            return
        sinks = self._sinks_now()
        if self._pending:
            sinks.metrics.dropped_records(sc.DROP_SHUTDOWN, len(self._pending))
            for record in self._pending:
                sinks.metrics.left_flight(record)
            warn_once("shutdown", "otel-hicache: %d transfers still in flight at shutdown were not reported",
                      len(self._pending))
            self._pending = []
        self._scan_acks(sinks, self._clock())
        self.held = 0
        self._report_queue_full(sinks.metrics)
        self._flush_all(sinks.metrics)
        if self.queue:
            self._drop_queued_at_shutdown()
        with self._lock:  # nothing is in flight any more: a flush() waiting elsewhere is done
            waiters, self._flush_waiters = self._flush_waiters, []
        for _target, done in waiters:
            done.set()

    def _drop_queued_at_shutdown(self) -> None:
        """Records submitted but never taken in (the worker has stopped): counted, not lost silently."""
        sinks = self._sinks_now()
        count = 0
        while self.queue:
            self.queue.popleft()
            count += 1
        if count:
            sinks.metrics.dropped_records(sc.DROP_SHUTDOWN, count)
            self._flush_all(sinks.metrics)
            warn_once("shutdown:queued", "otel-hicache: %d transfers submitted during shutdown were not reported",
                      count)

    def _report_queue_full(self, metrics: Any, at_once: bool = False) -> None:
        # next() is the count's only reader: it returns the calls so far, submit()'s
        # refusals and the reads here (each read is one call of its own)
        with self._refused_lock:
            refused = next(self.refused) - self._refused_reads
            self._refused_reads += 1
            drops = refused - self._refused_reported
            self._refused_reported = refused
        if drops:
            if at_once:
                metrics.dropped_now(sc.DROP_QUEUE_FULL, drops)
            else:
                metrics.dropped_records(sc.DROP_QUEUE_FULL, drops)
            warn_once(
                "queue_full",
                "otel-hicache: transfer record queue full (OTEL_HICACHE_MAX_QUEUE_SIZE=%d); dropping "
                "records, counted in otel_hicache.records.dropped{reason=queue_full}",
                self.settings.max_queue_size,
            )

    def _anchor_for(self, record: TransferRecord) -> WallClockAnchor | None:
        if not self._anchor_resolved:
            self._anchor_resolved = True
            factory = self._anchor_factory
            if factory is None:
                try:
                    factory = anchor_factory_for(record.start_event)
                except Exception:
                    factory = None
            if factory is not None:
                self._anchor = WallClockAnchor(factory, self.settings.anchor_interval_s, self._clock)
                self._anchor.refresh()
        return self._anchor

    @staticmethod
    def _host_pages(record: TransferRecord, metrics: Any) -> None:
        """An op's host pages, at intake (submission order): an offload writes them, a
        load-back reads them (its residence and bytes, now; its span, at completion)."""
        pool, slots = record.host_slots
        try:
            if record.direction == OFFLOAD:
                pages, waste = pool.written(slots, record.submit_ns, record.cause, record.num_bytes)
                record.host_written = (pool, pages)
                if waste is not None:
                    metrics.host_waste(waste, pool.page_size)
            else:
                reuse = record.reuse = pool.read(slots, record.submit_ns)
                if reuse is not None:
                    metrics.host_reuse(record, reuse)
        except Exception as exc:  # the op is still reported; its pages are not tracked
            warn_once(f"host_pages:{type(exc).__name__}", "otel-hicache: cannot track an op's host pages (%r)", exc)

    @staticmethod
    def _host_freed(item: HostFree, metrics: Any) -> None:
        try:
            waste = item.pool.freed(item.slots)
            if waste is not None:
                metrics.host_waste(waste, item.pool.page_size)
        except Exception as exc:
            warn_once(f"host_freed:{type(exc).__name__}", "otel-hicache: cannot track freed host pages (%r)", exc)

    def _complete(self, record: TransferRecord, sinks: Sinks) -> None:
        now = self._clock()
        anchor = self._anchor_for(record) if record.timing_enabled and record.start_event is not None else None
        resolve(record, now, anchor, self._timeline)
        busy_added = self._busy[record.direction].add(record.start_ns, record.end_ns)
        if record.reuse is not None:
            try:
                record.links, record.links_dropped = record.host_slots[0].links(record.reuse)
            except Exception as exc:  # the span is still made, without links
                warn_once(f"links:{type(exc).__name__}", "otel-hicache: cannot link a load-back's span (%r)", exc)
        if record.requests is not None:
            self._link_requests(record)
        state = sinks.spans.begin(record)
        self._slice.check()  # a record is three units: its span begun, its metrics, its span ended
        written = record.host_written
        if written is not None and record.span_context is not None and record.span_context.trace_flags.sampled:
            written[0].link(written[1], record.span_context.trace_id, record.span_context.span_id)
        sinks.metrics.completed(record, busy_added)
        self._slice.check()
        sinks.log.completed(record, busy_added)
        if record.expect_ack and record.ack_ns is None and record.ack_watch is not None:
            self._watch_acks(now, [(record, None)])  # taken before we saw it complete?
        if record.expect_ack and record.ack_ns is None:
            record.completed_at_ns = now
            self._awaiting.append((record, state))
        else:
            self._finish(record, state, sinks)

    @staticmethod
    def _link_requests(record: TransferRecord) -> None:
        try:
            record.request_links, record.request_links_dropped = request_links.resolve(record.requests)
        except Exception as exc:  # the span is still made, without them
            warn_once(f"requests:{type(exc).__name__}", "otel-hicache: cannot link an op's requests (%r)", exc)

    def _finish(self, record: TransferRecord, state: Any, sinks: Sinks) -> None:
        if record.ack_ns is not None:
            sinks.metrics.acked(record)
        sinks.spans.finish(record, state)

    def _watch_acks(self, now: int, awaiting: list[tuple[TransferRecord, Any]] | None = None) -> int:
        """Stamp the ack time of watched records whose item left its container.

        One snapshot per container per call (``tuple(list)`` is atomic under
        the GIL), then an identity lookup per record. Returns how many were
        stamped."""
        snapshots: dict[int, set[int] | None] = {}
        stamped = 0
        for record, _state in self._awaiting if awaiting is None else awaiting:
            watch = record.ack_watch
            if watch is None or record.handle[S_ACK_NS] is not None:
                continue
            container, item = watch
            key = id(container)
            present = snapshots.get(key, False)
            if present is False:
                try:
                    present = {id(x) for x in tuple(container)}
                except RuntimeError:  # a deque mutated while copied: next cycle
                    present = None
                except Exception as exc:
                    present = None
                    record.ack_watch = None
                    warn_once(f"ack_watch:{type(container).__name__}",
                              "otel-hicache: cannot read the ack_watch container %s (%r); such ops wait for "
                              "ack() or the ack timeout", type(container).__name__, exc)
                snapshots[key] = present
            if present is not None and id(item) not in present:
                record.handle[S_ACK_NS] = now
                stamped += 1
        return stamped

    def _scan_acks(self, sinks: Sinks, now: int) -> None:
        timeout = self.settings.ack_timeout_ns
        check = self._slice.check
        keep = []
        for record, state in self._awaiting:
            check()
            if record.ack_ns is not None or self._drain_all or now - record.completed_at_ns > timeout:
                try:
                    self._finish(record, state, sinks)
                except Exception as exc:
                    self._internal_error(sinks, record, exc)
            else:
                keep.append((record, state))
        self._awaiting = keep

    @staticmethod
    def _intake_error(metrics: Any, record: TransferRecord | None, exc: BaseException) -> None:
        """A record the intake could not take in (an error of ours, or of a sink): counted as
        internal_error, out of flight if it was counted in; the rest of the batch goes on."""
        try:
            if record is not None:
                metrics.left_flight(record)  # a no-op unless submitted() counted it in flight
        finally:
            metrics.dropped_records(sc.DROP_INTERNAL_ERROR)
            warn_once(f"intake:{type(exc).__name__}", "otel-hicache: a record could not be taken in (%r); "
                      "counted in otel_hicache.records.dropped{reason=internal_error}", exc)
            logger.debug("otel-hicache intake error", exc_info=True)

    @staticmethod
    def _internal_error(sinks: Sinks, record: TransferRecord, exc: BaseException) -> None:
        sinks.metrics.left_flight(record)
        sinks.metrics.dropped_records(sc.DROP_INTERNAL_ERROR)
        warn_once(f"internal:{type(exc).__name__}",
                  "otel-hicache: a record could not be reported (%r); counted in "
                  "otel_hicache.records.dropped{reason=internal_error}", exc)
        logger.debug("otel-hicache internal error", exc_info=True)

    def _fail(self, record: TransferRecord, reason: str, now: int, exc: BaseException | None) -> None:
        sinks = self._sinks_now()
        record.error = reason
        resolve_host_clock(record, now)  # an event misbehaved or never finished: host clock only
        record.expect_ack = False
        if record.requests is not None:
            self._link_requests(record)
        state = sinks.spans.begin(record)
        sinks.metrics.failed_record(record, reason)
        sinks.spans.finish(record, state)
        if reason == sc.FAIL_EVENT_ERROR:
            warn_once(f"event_error:{type(exc).__name__}",
                      "otel-hicache: a transfer's event raised %r; reported as an error span", exc)
        else:
            warn_once("transfer_timeout",
                      "otel-hicache: a transfer did not complete within OTEL_HICACHE_TRANSFER_TIMEOUT_S=%.0f s; "
                      "reported as an error span and its slot freed", self.settings.transfer_timeout_ns / 1e9)
