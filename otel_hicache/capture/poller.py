"""The capture's thread: takes submit()'s lists in, polls and times them, ends their ack waits, writes batches."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import deque, namedtuple
from typing import Any, Callable

from opentelemetry import trace

from .. import environment_variables as ev
from .. import record as rec
from .. import semconv as sc
from ..diagnostics import logger, warn_once
from ..environment_variables import env_float, env_int
from . import fork, request_links
from .attributes import CallAttributes
from .records import S_ACK_NS, S_SUBMIT_NS, SUBMISSION_FIELDS, TransferRecord, validate
from .timing import EventTimeline, WallClockAnchor, is_complete, resolve, resolve_host_clock


class PollerSettings:  # tests set their own values on it
    def __init__(self) -> None:
        self.max_queue_size = env_int(ev.OTEL_HICACHE_MAX_QUEUE_SIZE)
        self.poll_interval_s = env_float(ev.OTEL_HICACHE_POLL_INTERVAL_MS, minimum=0.01) / 1e3
        self.ack_timeout_ns = int(env_float(ev.OTEL_HICACHE_ACK_TIMEOUT_S) * 1e9)
        self.transfer_timeout_ns = int(env_float(ev.OTEL_HICACHE_TRANSFER_TIMEOUT_S) * 1e9)
        self.anchor_interval_s = env_float(ev.OTEL_HICACHE_ANCHOR_INTERVAL_S, minimum=0.01)


_ACTIVE_GRACE_S = 0.1  # under load, polls this long after work
GATHER_S = 0.25  # woken by a sparse submit: waits for more
_ACK_SCAN_INTERVAL_NS = 5_000_000  # unwatched acks and ack timeouts
_STATE_INTERVAL_NS = 50_000_000  # (and at every flush)
_WRITE_INTERVAL_NS, _WRITE_OPS = 50_000_000, 256  # a send (a system call) after this, or this many ops
# GIL held (wall: a CPU clock read is a syscall), checked every 4 records; 4 a cycle
CYCLE_BUDGET_NS, _BUDGET_EVERY, _BUDGETS = 150_000, 4, 4
_INTAKE_PASS = 8  # records popped per lock
_LOCK_WAIT_S = 0.05  # other threads' longest wait for _lock
_FINISH, _START, _END, _WATCH = map(
    SUBMISSION_FIELDS.index, ("finish_event", "start_event", "host_end_ns", "ack_watch"))
HostPoolRef = namedtuple("HostPoolRef", "pool_id name slots page_size")


def _seen_when_polled(item: Any) -> bool:  # its end or ack stamped when polled
    return type(item) is list and (item[_WATCH] is not None or (
        item[_FINISH] is not None and item[_START] is None and item[_END] is None))


def _oldest(times: list[tuple[str, Any]]) -> dict[str, int | None]:
    oldest: dict[str, int | None] = dict.fromkeys(rec.DIRECTIONS)
    for d, ns in times:
        if type(ns) is int and (oldest[d] is None or ns < oldest[d]):
            oldest[d] = ns
    return oldest


class _Wake:
    """A wake-up never lost: a lock is one C call per wait (an Event is Python)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        try:
            self._lock.release()
        except RuntimeError:  # already set
            pass

    def wait(self, timeout: float | None) -> bool:
        return self._lock.acquire(timeout=-1 if timeout is None else timeout)


class Poller:
    """Writes to the channel ``open_channel()`` makes at the first batch (again in a forked child)."""

    def __init__(self, settings: PollerSettings, open_channel: Callable[[], Any], clock: Callable[[], int],
                 anchor_factory: Callable[[], Any] | None = None) -> None:
        self.settings, self._open_channel, self._clock = settings, open_channel, clock
        self._anchor_factory, self._forked = anchor_factory, False
        self.pools: list[HostPoolRef] = []  # announced to every channel opened
        self._init_state()
        fork.after_fork_in_child(self._after_fork_in_child)

    def _init_state(self) -> None:
        self.queue: deque[Any] = deque()  # submitted lists, pools, (pool, slots) freed
        self.held = 0  # pending or awaiting an ack; never below the truth
        self._taken = 0  # records taken (sequence numbers); with held, under _lock
        self._lock, self._open_lock = threading.Lock(), threading.Lock()
        self.refused = itertools.count()  # submit()'s next()s on a full queue
        self._refusals = -1  # next(refused) at our last read (ours count too)
        self._pending: list[TransferRecord] = []
        self._awaiting: list[TransferRecord] = []
        self._inflight = dict.fromkeys(rec.DIRECTIONS, 0)
        self._anchor = WallClockAnchor(self._anchor_factory, self.settings.anchor_interval_s, self._clock)
        self._timeline = EventTimeline()
        self._attributes = CallAttributes()
        self._last_ack_scan = self._last_send = self._last_state = self._ops_out = 0
        self._state_ns = _STATE_INTERVAL_NS
        self.channel = None
        self._out: list[Any] = []  # this cycle's messages
        self._drops: dict[str, int] = {}
        self._unsent_ops = -1  # written, not sent on; -1: nothing written
        self._state_sent: Any = None
        self._cpu_s = 0.0  # thread CPU at the last STATE
        # asleep; the cycle stopped at its budget; a changed STATE held back
        self.idle = self._more = self._state_held = False
        self._wake = _Wake()
        self._flush_waiters: list[Any] = []  # (target, Event)
        self._stopping = self._stop_called = self._abandoned = self._in_cycle = False
        self._start_thread()

    def _start_thread(self) -> None:  # (tests replace it)
        self.thread = threading.Thread(target=self._run, name="otel-hicache-poller", daemon=True)
        self.thread.start()

    def _after_fork_in_child(self) -> None:
        if self.channel is not None:
            self.channel.forget_in_child()
        self._forked = True  # its channel opens at its first batch
        self._init_state()

    def wake(self) -> None:
        self.idle = False
        self._wake.set()

    def add(self, item: Any) -> None:
        """A pool (before the ops that use it), or ``(pool, slots)`` freed."""
        if type(item) is HostPoolRef:
            self.pools.append(item)
        self.queue.append(item)
        if self.idle:
            self.wake()

    def _snapshot(self) -> tuple[tuple[Any, ...], int]:
        locked = self._lock.acquire(timeout=_LOCK_WAIT_S)
        try:
            return tuple(self.queue), len(self.queue) + self.held
        except RuntimeError:  # mutated while copied (a GC finalizer)
            return (), len(self.queue) + self.held
        finally:
            if locked:
                self._lock.release()

    def flush(self, timeout_s: float) -> bool:
        """Waits until every record submitted before is complete and written."""
        if not self.thread.is_alive():
            return not (self.queue or self._pending)
        done = threading.Event()
        with self._lock:
            self._flush_waiters.append((self._taken + len(self.queue), done))
        self.wake()
        return done.wait(timeout_s)

    def stop(self, timeout_s: float) -> bool:
        """Flush, end the ack waits, stop the thread and the channel within ``timeout_s`` (plus 0.1 s)."""
        deadline = time.monotonic() + timeout_s
        if self._stop_called or not self.thread.is_alive():
            return False
        self._stop_called = True  # (at exit: by atexit and by multiprocessing)
        flushed = self.flush(timeout_s)
        self._stopping = True
        self.wake()
        self.thread.join(max(0.1, deadline - time.monotonic()))
        stopped = not self.thread.is_alive()
        if not stopped and self._in_cycle:  # stuck in a host call
            self._abandoned = True
            lost, refused = len(self.queue) + self.held, self._refused_since()
            logger.warning("otel-hicache: %d transfers held by the stuck poller were not reported; "
                           "counted in otel_hicache.records.dropped{reason=shutdown}", lost)
            if self.channel is not None:
                self.channel.write([(rec.DROPPED, sc.DROP_QUEUE_FULL, refused), self._state_message(self._cpu_s),
                                    (rec.DROPPED, sc.DROP_SHUTDOWN, lost)], 0)
        elif stopped and self.queue:  # a submit() raced the final cycle
            self._drop_queued()
            self._write()
        closed = self.channel is None or self.channel.stop(max(0.1, deadline - time.monotonic()), timeout_s)
        return flushed and stopped and closed

    def _run(self) -> None:
        if not self._forked:  # the sinks' zero series exist from start-up
            self.open_channel()
        active = taken = 0.0  # when there was work, and work came in
        interval = _ACTIVE_GRACE_S  # between submits, a capped moving average
        while True:
            now = time.monotonic()
            if self.queue:
                interval += (min(now - taken, _ACTIVE_GRACE_S) / len(self.queue) - interval) / 4
                taken = now
            if self.queue or self._pending or self._awaiting:
                active = now
            self._in_cycle = True  # stop() abandons it only in there
            try:
                self._cycle()
            except Exception as exc:
                warn_once("poller", "otel-hicache: poller error %r (continuing)", exc)
                logger.debug("otel-hicache poller error", exc_info=True)
            self._in_cycle = False
            if self._abandoned:
                return
            if self._stopping:
                self._cycle_final()
                return
            sparse = interval >= self.settings.poll_interval_s
            if self._more:  # the rest after the others had the GIL
                time.sleep(0)
            elif (self._pending or self._awaiting or self._flush_waiters
                  or (not sparse and time.monotonic() - active < _ACTIVE_GRACE_S)):
                self._wake.wait(self.settings.poll_interval_s)
            else:
                self._sleep(gather=sparse)

    def _sleep(self, gather: bool) -> None:
        try:  # cheaper now than a wake-up for them
            if self._state_held and self._state_message(self._cpu_s)[1:5] == self._state_sent:
                self._state_held = False
            if self._unsent_ops >= 0 and not self._out:
                self._send_on()
        except Exception as exc:  # (their timers stay)
            warn_once("poller", "otel-hicache: poller error %r (continuing)", exc)
        now = time.monotonic_ns()
        due = [self._last_state + self._state_ns] if self._state_held else []
        if self._unsent_ops >= 0:
            due.append(self._last_send + _WRITE_INTERVAL_NS)
        if self._out:  # (no channel yet?): try again
            due.append(now + _WRITE_INTERVAL_NS)
        if (at := self._channel_due()) is not None:  # (the cycle just handled it)
            due.append(max(at, now + _ACK_SCAN_INTERVAL_NS))
        self.idle = True
        if not (self.queue or self._stopping):  # (appended before idle was seen)
            self._wake.wait(max(0.0, (min(due) - time.monotonic_ns()) / 1e9) if due else None)
        self.idle = False
        # only while submits are sparse (the channel bounds the queue)
        if gather and self.queue and not (self._flush_waiters or self._stopping):
            with contextlib.suppress(RuntimeError):  # (appended meanwhile)
                if not any(map(_seen_when_polled, self.queue)):
                    self._wake.wait(GATHER_S)  # (a flush or stop cuts it short)

    def _cycle(self) -> None:
        for left in reversed(range(_BUDGETS)):
            end = time.monotonic_ns() + CYCLE_BUDGET_NS if not self._stopping else 1 << 62
            self._more = False
            self._intake(end)
            now = self._clock()
            if self._pending and not self._abandoned:
                self._completions(now, end)
            if not (self._more and left) or self._abandoned:
                break
            time.sleep(0)  # others take the GIL; a pass anew, in order
        if self._abandoned:
            return
        if self._awaiting and (self._watch_acks(now, self._awaiting) or self._stopping or self._flush_waiters
                               or now - self._last_ack_scan >= _ACK_SCAN_INTERVAL_NS):
            self._last_ack_scan = now
            self._scan_acks(now)
        self.held = len(self._pending) + len(self._awaiting)
        self._report_queue_full()
        flushing = bool(self._flush_waiters)
        urgent = flushing or self._stopping
        # forced once a flush can be released (not in a backlog)
        self._state(force=self._stopping or (flushing and not self._more and not self.queue))
        # (a silent forked child opens no channel)
        flush = flushing and not (self._forked and self.channel is None and not self._out and not self._drops)
        if self._out or self._drops or flush:
            self._write(flush)
        mono = time.monotonic_ns()
        if self._unsent_ops >= 0 and (urgent or self._unsent_ops >= _WRITE_OPS
                                      or mono - self._last_send >= _WRITE_INTERVAL_NS) or (
                (at := self._channel_due()) is not None and at <= mono):
            self._send_on()
        if flushing:
            self._release_flush_waiters()

    def _intake(self, end: int) -> None:
        queue = self.queue
        room = self.settings.max_queue_size - len(self._pending) - len(self._awaiting)
        while queue and room > 0 and not self._abandoned:
            if time.monotonic_ns() > end:
                self._more = True
                break
            with self._lock:  # (flush() reads _taken + len(queue))
                count = min(room, len(queue), _INTAKE_PASS)
                self.held += count  # before the pops: never in neither place
                items = [queue.popleft() for _ in range(count)]
                self._taken += count
            for seq, item in enumerate(items, self._taken - count):
                if type(item) is list:
                    room -= self._take_in(item, seq)
                    continue
                self.held -= 1
                if type(item) is HostPoolRef:
                    self._out.append((rec.POOL, *item))
                else:  # (pool, slots) freed
                    self._slots((rec.FREE, item[0].pool_id), item[1])

    def _take_in(self, item: list[Any], seq: int) -> bool:
        try:
            record = TransferRecord(item)
            record.seq = seq
            try:
                validate(record)  # may call the host's deferred cause
            except Exception as exc:
                self.held -= 1
                self._drop(sc.DROP_INVALID_INPUT)
                warn_once(f"invalid:{type(exc).__name__}:{str(exc).split(',')[0]}",
                          "otel-hicache: dropped a transfer record: %s", exc)
                return False
            if record.host_slots is not None:
                pool, slots = record.host_slots
                self._slots((rec.HOST, seq, pool.pool_id, record.direction), slots,
                            (record.submit_ns, record.cause, record.num_bytes))
            self._inflight[record.direction] += 1
            self._pending.append(record)
            return True
        except Exception as exc:  # one record lost, not its batch
            self.held -= 1
            self._internal_error("taken in", exc)
            return False

    def _slots(self, head: tuple[Any, ...], slots: Any, tail: tuple[Any, ...] = ()) -> None:
        try:
            self._out.append((*head, rec.slot_bytes(slots), *tail))
        except Exception as exc:  # the op is still reported
            warn_once(f"host:{head[0]}:{type(exc).__name__}", "otel-hicache: cannot track %s host pages (%r)",
                      "an op's" if head[0] == rec.HOST else "freed", exc)

    def _completions(self, now: int, end: int) -> None:
        self._anchor.maybe_refresh(now)
        still = []
        pending = self._pending
        for index, record in enumerate(pending):
            if index and index % _BUDGET_EVERY == 0 and time.monotonic_ns() > end:
                self._more = True
                still.extend(pending[index:])
                break
            try:
                try:
                    done = is_complete(record)
                except Exception as exc:
                    self._fail(record, sc.FAIL_EVENT_ERROR, now, exc)
                    continue
                if self._abandoned:  # stop() counted it lost
                    return
                if done:
                    self._complete(record, now)
                elif now - record.submit_ns > self.settings.transfer_timeout_ns:
                    self._fail(record, sc.FAIL_TRANSFER_TIMEOUT, now, None)
                else:
                    still.append(record)
            except Exception as exc:  # a record is handled once
                self._inflight[record.direction] -= 1
                self._internal_error("reported", exc)
        self._pending = still

    def _complete(self, record: TransferRecord, now: int) -> None:
        resolve(record, now, self._anchor, self._timeline)
        awaits = record.expect_ack and record.handle[S_ACK_NS] is None
        if awaits:
            record.completed_at_ns = now
            if record.ack_watch is not None:
                self._watch_acks(now, [record])
        self._send(record)
        if awaits and record.handle[S_ACK_NS] is None:
            self._awaiting.append(record)

    def _fail(self, record: TransferRecord, reason: str, now: int, exc: BaseException | None) -> None:
        record.error, record.expect_ack = reason, False
        resolve_host_clock(record, now)
        self._send(record)
        if exc is not None:
            warn_once(f"event_error:{type(exc).__name__}",
                      "otel-hicache: a transfer's event raised %r; reported as an error span", exc)
        else:
            warn_once("transfer_timeout",
                      "otel-hicache: a transfer did not complete within OTEL_HICACHE_TRANSFER_TIMEOUT_S=%.0f s; "
                      "reported as an error span and its slot freed", self.settings.transfer_timeout_ns / 1e9)

    def _send(self, record: TransferRecord) -> None:
        if record.requests is not None:
            try:
                contexts, record.request_links_dropped = request_links.resolve(record.requests)
                record.request_links = tuple(map(rec.context_tuple, contexts))
            except Exception as exc:
                warn_once(f"requests:{type(exc).__name__}", "otel-hicache: cannot link an op's requests (%r)", exc)
        parent = record.parent_context
        if parent is not None:
            parent = rec.context_tuple(trace.get_current_span(parent).get_span_context())
        attributes = record.attributes and self._attributes(record.attributes)
        self._out.append((
            rec.OP, record.seq, record.direction, record.origin, record.cause, record.cause_parts, record.tokens,
            record.blocks, record.pool_names, record.pool_tokens, record.num_bytes, record.page_size,
            record.io_backend, attributes or None, record.timing_source, record.placement,
            record.start_ns, record.end_ns, record.duration_ns, record.queue_wait_ns, record.error,
            record.submit_ns, record.handle[S_ACK_NS], record.expect_ack, parent, record.request_links,
            record.request_links_dropped))
        self._ops_out += 1
        self._inflight[record.direction] -= 1

    def _watch_acks(self, now: int, awaiting: list[TransferRecord]) -> int:
        """Stamps acks whose item left its ``ack_watch`` container; how many."""
        snapshots: dict[int, Any] = {}
        stamped = 0
        for record in awaiting:
            if record.ack_watch is None or record.handle[S_ACK_NS] is not None:
                continue
            container, item = record.ack_watch
            present = snapshots.get(id(container), False)
            if present is False:
                try:
                    present = {id(x) for x in tuple(container)}
                except RuntimeError:  # mutated while copied: next cycle
                    present = None
                except Exception as exc:
                    present = record.ack_watch = None
                    warn_once(f"ack_watch:{type(container).__name__}", "otel-hicache: cannot read the ack_watch "
                              "container %s (%r); such ops wait for ack() or the ack timeout",
                              type(container).__name__, exc)
                snapshots[id(container)] = present
            if present is not None and id(item) not in present:
                record.handle[S_ACK_NS] = now
                stamped += 1
        return stamped

    def _scan_acks(self, now: int) -> None:
        keep = []
        for record in self._awaiting:
            ack_ns = record.handle[S_ACK_NS]
            if ack_ns is not None or self._stopping or now - record.completed_at_ns > self.settings.ack_timeout_ns:
                self._out.append((rec.ACK, record.seq, ack_ns))
            else:
                keep.append(record)
        self._awaiting = keep

    def _channel_due(self) -> int | None:
        due = getattr(self.channel, "due", None)  # (the embedded one has neither)
        return due() if due is not None else None

    def _write(self, flush: bool = False) -> None:
        self._out.extend((rec.DROPPED, reason, count) for reason, count in self._drops.items())
        self._drops = {}
        if flush:  # (after the drops)
            self._out.append((rec.FLUSH, 0))
        if not self._out:
            return
        channel = self.open_channel()
        if channel is None:  # kept; past the cap, counted lost
            if self._ops_out > self.settings.max_queue_size:
                self._out = [m for m in self._out if m[0] not in (rec.OP, rec.HOST)]
                self._drop(sc.DROP_INTERNAL_ERROR, self._ops_out)
                self._ops_out = 0
            return
        out, ops, self._out, self._ops_out = self._out, self._ops_out, [], 0
        channel.write(out, ops)
        self._unsent_ops = max(0, self._unsent_ops) + ops

    def _send_on(self) -> None:
        self._last_send, self._unsent_ops = time.monotonic_ns(), -1
        send = getattr(self.channel, "send", None)
        if send is not None:
            send()

    def open_channel(self) -> Any:
        """The channel, opened now if it is not (never in an exit hook: no threads there)."""
        if self.channel is not None:
            return self.channel
        with self._open_lock:
            if self.channel is None:
                try:
                    channel = self._open_channel()
                    if self.pools:
                        channel.write([(rec.POOL, *pool) for pool in self.pools], 0)
                    self.channel = channel
                except Exception as exc:
                    warn_once(f"channel:{type(exc).__name__}",
                              "otel-hicache: cannot open the telemetry channel (%r)", exc)
        return self.channel

    def _state(self, force: bool) -> None:
        mono = time.monotonic_ns()
        self._state_held = not force and mono - self._last_state < self._state_ns
        if self._state_held or (self._forked and self.channel is None):
            return
        self._last_state, self._cpu_s = mono, time.thread_time()
        message = self._state_message(self._cpu_s)
        # a backlog's scan: at most 1% of a core (0.5 ms per interval)
        self._state_ns = _STATE_INTERVAL_NS * max(1, int((time.thread_time() - self._cpu_s) * 2000))
        if message[1:5] != self._state_sent or force:
            self._state_sent = message[1:5]
            self._out.append(message)

    def _state_message(self, cpu_s: float) -> tuple[Any, ...]:
        """Also for a stuck poller's stop(): from ``tuple()`` snapshots."""
        queued, size = self._snapshot()
        inflight = dict(self._inflight)
        times = [(r.direction, r.submit_ns) for r in tuple(self._pending)]
        for item in queued:  # (not validated yet)
            if type(item) is list and item and type(d := item[0]) is str and d in inflight:
                inflight[d] += 1
                times.append((d, item[S_SUBMIT_NS]))
        unacked = [(r.direction, r.completed_at_ns) for r in tuple(self._awaiting) if r.handle[S_ACK_NS] is None]
        return (rec.STATE, inflight, _oldest(times), _oldest(unacked), size, cpu_s)

    def _release_flush_waiters(self, everyone: bool = False) -> None:
        below = self._pending[0].seq if self._pending else self._taken  # (in intake order)
        with self._lock:
            for target, done in self._flush_waiters:
                if everyone or below >= target:
                    done.set()
            self._flush_waiters = [w for w in self._flush_waiters if not w[1].is_set()]

    def _cycle_final(self) -> None:
        if self._pending:
            self._drop(sc.DROP_SHUTDOWN, len(self._pending))
            for record in self._pending:
                self._inflight[record.direction] -= 1
            warn_once("shutdown", "otel-hicache: %d transfers still in flight at shutdown were not reported",
                      len(self._pending))
            self._pending = []
        self._scan_acks(self._clock())
        self.held = 0
        self._report_queue_full()
        self._drop_queued()
        self._state(force=True)
        self._write()
        self._release_flush_waiters(everyone=True)

    def _drop_queued(self) -> None:
        count = 0
        while self.queue:
            count += type(self.queue.popleft()) is list
        if count:
            self._drop(sc.DROP_SHUTDOWN, count)
            warn_once("shutdown:queued", "otel-hicache: %d transfers submitted during shutdown were not reported",
                      count)

    def _drop(self, reason: str, count: int = 1) -> None:
        self._drops[reason] = self._drops.get(reason, 0) + count

    def _internal_error(self, stage: str, exc: Exception) -> None:
        self._drop(sc.DROP_INTERNAL_ERROR)
        warn_once(f"{stage}:{type(exc).__name__}", "otel-hicache: a record could not be %s (%r); counted in "
                  "otel_hicache.records.dropped{reason=internal_error}", stage, exc)
        logger.debug("otel-hicache error (a record not %s)", stage, exc_info=True)

    def _refused_since(self) -> int:
        with self._lock:  # (stop() reads it for a stuck poller)
            last, self._refusals = self._refusals, next(self.refused)
            return self._refusals - last - 1

    def _report_queue_full(self) -> None:
        drops = self._refused_since()
        if drops:
            self._drop(sc.DROP_QUEUE_FULL, drops)
            warn_once("queue_full", "otel-hicache: transfer record queue full (OTEL_HICACHE_MAX_QUEUE_SIZE=%d); "
                      "dropping records, counted in otel_hicache.records.dropped{reason=queue_full}",
                      self.settings.max_queue_size)
