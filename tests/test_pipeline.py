"""Unit tests of otel_hicache.pipeline.CompletionPipeline with fake sinks that
note every call, a clock the test sets, and events whose ``query()`` the test
controls.

Most tests run the worker's cycle by hand (``ManualPipeline``: no thread, so the
order of calls is exact); flush, stop and the fork restart run the real worker,
bounded by their timeouts."""

from __future__ import annotations

import threading
from collections import deque
from types import SimpleNamespace

import pytest

from otel_hicache import fork
from otel_hicache import pipeline as engine
from otel_hicache.pipeline import CompletionPipeline, PipelineSettings, Sinks
from otel_hicache.records import DEVICE_EVENT, DIRECTIONS, HOST_CLOCK, S_ACK_NS, submission

T0 = 1_767_225_600_000_000_000
MS = 1_000_000
S = 1_000_000_000


class Clock:
    def __init__(self):
        self.now = T0

    def __call__(self):
        return self.now


class Event:
    """``query()`` answers ``done`` (or raises ``query_error``). Notes misuse:
    ``synchronize()``, and ``elapsed_time()`` before both events completed."""

    def __init__(self, done=False, elapsed_ms=1.0, query_error=None):
        self.done, self.elapsed_ms, self.query_error = done, elapsed_ms, query_error
        self.queries = 0
        self.misuse = []

    def query(self):
        self.queries += 1
        if self.query_error is not None:
            raise self.query_error
        return self.done

    def synchronize(self):
        self.misuse.append("synchronize")

    def elapsed_time(self, end):
        if not (self.done and end.done):
            self.misuse.append("elapsed_time before completion")
        return self.elapsed_ms


class Recorder:
    """Fake sinks: every call but metrics.flush() noted in order, records by their
    intake sequence number; ``fail[name]`` makes the next such call raise."""

    def __init__(self):
        self.calls, self.records, self.fail = [], {}, {}
        self.flushes_at = []  # len(calls) at each metrics.flush()

    def note(self, *call):
        self.calls.append(call)
        error = self.fail.pop(call[0], None)
        if error is not None:
            raise error

    def sinks(self):
        return Sinks(FakeSpans(self), FakeMetrics(self), FakeLog(self))


class FakeSpans:
    def __init__(self, rec):
        self.rec = rec

    def begin(self, r):
        self.rec.note("begin", r.seq)
        return f"state{r.seq}"

    def finish(self, r, state):
        self.rec.note("finish", r.seq, state)


class FakeMetrics:
    def __init__(self, rec):
        self.rec = rec

    def submitted(self, r):
        self.rec.records[r.seq] = r
        self.rec.note("submitted", r.seq)

    def left_flight(self, r):
        self.rec.note("left_flight", r.seq)

    def completed(self, r, busy_added_ns):
        self.rec.note("completed", r.seq, busy_added_ns)

    def acked(self, r):
        self.rec.note("acked", r.seq)

    def failed_record(self, r, reason):
        self.rec.note("failed", r.seq, reason)

    def dropped_records(self, reason, count=1):
        self.rec.note("dropped", reason, count)

    def flush(self, pause=None):
        self.rec.flushes_at.append(len(self.rec.calls))
        error = self.rec.fail.pop("flush", None)
        if error is not None:
            raise error


class FakeLog:
    def __init__(self, rec):
        self.rec = rec

    def completed(self, r, busy_added_ns):
        self.rec.note("log", r.seq, busy_added_ns)


class ManualPipeline(CompletionPipeline):
    """No worker thread: the test runs each cycle itself. ``alive`` is what the
    worker's is_alive() answers (flush() registers a waiter only while alive)."""

    alive = False

    def _start_worker(self):
        self._worker = SimpleNamespace(is_alive=lambda: self.alive, join=lambda timeout=None: None)


class Rig:
    def __init__(self, manual=True, cap=8, ack_timeout_s=1.0, transfer_timeout_s=2.0):
        self.rec, self.clock = Recorder(), Clock()
        self.builds, self.built = 0, threading.Event()
        settings = PipelineSettings(max_queue_size=cap, poll_interval_s=0.0005, ack_timeout_s=ack_timeout_s,
                                    transfer_timeout_s=transfer_timeout_s)
        self.p = (ManualPipeline if manual else CompletionPipeline)(settings, self.build, self.clock)

    def build(self):
        self.builds += 1
        self.built.set()
        return self.rec.sinks()

    def submit(self, finish=None, start=None, timing=False, expect_ack=False, direction="offload", **kwargs):
        """What TransferTelemetry.submit() appends to the queue."""
        handle = submission(direction, {"kv": 64}, 4096, 64, start, finish, timing, expect_ack=expect_ack,
                            submit_ns=self.clock(), **kwargs)
        self.p.queue.append(handle)
        return handle

    def ack(self, handle):
        handle[S_ACK_NS] = self.clock()

    def cycle(self, advance_ns=0):
        self.clock.now += advance_ns
        self.p._cycle()

    def take(self):
        """The calls since the last take() (a swap: a worker's append lands in one list or the other)."""
        calls, self.rec.calls = self.rec.calls, []
        return calls


@pytest.fixture
def make():
    rigs = []

    def factory(**kwargs):
        rigs.append(Rig(**kwargs))
        return rigs[-1]

    yield factory
    for rig in rigs:
        if not isinstance(rig.p, ManualPipeline):
            rig.p.stop(1.0)
            rig.p._worker.join(5.0)


def done_op(seq, busy=0):
    """The calls for an op whose completion was seen and that expects no ack."""
    return [("begin", seq), ("completed", seq, busy), ("log", seq, busy), ("finish", seq, f"state{seq}")]


def messages(log, text):
    return [r.getMessage() for r in log.records if text in r.getMessage()]


# -- 1. intake ----------------------------------------------------------------------------------

def test_intake_takes_in_only_what_the_cap_leaves_room_for(make):
    rig = make(cap=3)
    events = [Event() for _ in range(5)]
    for event in events:
        rig.submit(event)
    rig.cycle()
    assert rig.take() == [("submitted", 0), ("submitted", 1), ("submitted", 2)]
    assert (len(rig.p.queue), rig.p.held, rig.p.size()) == (2, 3, 5)
    rig.cycle()
    assert rig.take() == []  # no room: the rest stays queued
    events[1].done = True
    rig.cycle(advance_ns=MS)
    # intake runs before completion: the slot freed here is taken on the next cycle
    assert rig.take() == done_op(1, busy=MS)
    assert (len(rig.p.queue), rig.p.held) == (2, 2)
    rig.cycle()
    assert rig.take() == [("submitted", 3)]
    assert (len(rig.p.queue), rig.p.held, rig.p.size()) == (1, 3, 4)


def test_records_awaiting_their_ack_count_against_the_cap(make):
    rig = make(cap=2)
    handles = [rig.submit(expect_ack=True) for _ in range(3)]  # no events: complete at submit
    rig.cycle()
    assert rig.take() == [("submitted", 0), ("submitted", 1), ("begin", 0), ("completed", 0, 0), ("log", 0, 0),
                          ("begin", 1), ("completed", 1, 0), ("log", 1, 0)]
    rig.cycle(advance_ns=engine._ACK_SCAN_INTERVAL_NS)
    assert rig.take() == [] and len(rig.p.queue) == 1  # two awaiting their ack fill the cap
    rig.ack(handles[0])
    rig.cycle(advance_ns=engine._ACK_SCAN_INTERVAL_NS)
    assert rig.take() == [("acked", 0), ("finish", 0, "state0")]
    rig.cycle()
    assert rig.take()[:1] == [("submitted", 2)]


def test_invalid_records_are_counted_warned_once_per_problem_and_take_no_room(make, warnings_log):
    rig = make(cap=2)
    for bad in (submission("sideways"), submission("sideways"), submission("offload", page_size=0)):
        rig.p.queue.append(bad)
    for _ in range(3):
        rig.submit(Event())
    rig.cycle()
    assert rig.take() == [("dropped", "invalid_input", 1)] * 3 + [("submitted", 3), ("submitted", 4)]
    assert (len(rig.p.queue), rig.p.held) == (1, 2)
    found = messages(warnings_log, "dropped a transfer record")
    assert len(found) == 2 and "direction must be" in found[0] and "page_size must be >= 1" in found[1]


# -- 2./3. completion ---------------------------------------------------------------------------

def test_completion_is_polled_and_elapsed_time_waits_for_both_events(make):
    rig = make()
    start, finish = Event(elapsed_ms=2.5), Event()
    rig.submit(finish, start, timing=True)
    rig.cycle()
    assert rig.take() == [("submitted", 0)]
    assert (finish.queries, start.queries) == (1, 0)
    finish.done = True  # the finish event completed first (another stream)
    rig.cycle()
    assert (finish.queries, start.queries) == (2, 1)
    assert rig.take() == []
    start.done = True
    rig.cycle(advance_ns=MS)
    assert rig.take() == done_op(0, busy=2_500_000)
    r = rig.rec.records[0]
    assert (r.timing_source, r.duration_ns, r.start_ns, r.end_ns) == (DEVICE_EVENT, 2_500_000,
                                                                      T0 + MS - 2_500_000, T0 + MS)
    assert start.misuse == finish.misuse == []  # never synchronize(), no early elapsed_time()


def test_a_transfer_that_never_completes_times_out_as_an_error(make, warnings_log):
    rig = make(transfer_timeout_s=2.0)
    rig.submit(Event(), expect_ack=True)
    rig.submit(Event(), expect_ack=True)
    rig.cycle()
    rig.take()
    rig.cycle(advance_ns=2 * S)
    assert rig.take() == []  # exactly the timeout: not yet
    rig.cycle(advance_ns=1)
    assert rig.take() == [("begin", 0), ("failed", 0, "transfer_timeout"), ("finish", 0, "state0"),
                          ("begin", 1), ("failed", 1, "transfer_timeout"), ("finish", 1, "state1")]
    r = rig.rec.records[0]
    assert (r.error, r.timing_source, r.start_ns, r.end_ns, r.duration_ns, r.expect_ack) == (
        "transfer_timeout", HOST_CLOCK, T0, T0 + 2 * S + 1, 2 * S + 1, False)
    assert (rig.p._pending, rig.p._awaiting, rig.p.held) == ([], [], 0)  # no ack wait for a failed op
    found = messages(warnings_log, "did not complete within")
    assert len(found) == 1 and "OTEL_HICACHE_TRANSFER_TIMEOUT_S=2 s" in found[0]


def test_an_event_that_raises_is_an_error_span_warned_once_per_exception_type(make, warnings_log):
    rig = make()
    for _ in range(2):
        rig.submit(Event(query_error=RuntimeError("CUDA error: an illegal memory access")))
    rig.submit(Event(done=True), start=Event(query_error=ValueError("bad start event")))
    rig.cycle(advance_ns=MS)
    expected = [("submitted", 0), ("submitted", 1), ("submitted", 2)]
    for seq in (0, 1, 2):
        expected += [("begin", seq), ("failed", seq, "event_error"), ("finish", seq, f"state{seq}")]
    assert rig.take() == expected
    r = rig.rec.records[2]
    assert (r.error, r.timing_source, r.start_ns, r.end_ns) == ("event_error", HOST_CLOCK, T0, T0 + MS)
    found = messages(warnings_log, "a transfer's event raised")
    assert len(found) == 2 and "illegal memory access" in found[0] and "bad start event" in found[1]


def test_busy_time_added_per_direction_goes_to_metrics_and_log(make):
    rig = make()
    rig.submit(host_start_ns=T0, host_end_ns=T0 + 4 * MS)
    rig.submit(host_start_ns=T0 + 2 * MS, host_end_ns=T0 + 6 * MS)  # overlaps the first by 2 ms
    rig.submit(direction="onboard", host_start_ns=T0, host_end_ns=T0 + 4 * MS)  # the other direction
    rig.cycle()
    assert [c for c in rig.take() if c[0] in ("completed", "log")] == [
        ("completed", 0, 4 * MS), ("log", 0, 4 * MS), ("completed", 1, 2 * MS), ("log", 1, 2 * MS),
        ("completed", 2, 4 * MS), ("log", 2, 4 * MS)]


def test_a_sink_failing_while_an_acked_op_is_finished_drops_that_record_only(make, warnings_log):
    rig = make()
    handles = [rig.submit(expect_ack=True) for _ in range(2)]
    rig.cycle()
    rig.take()
    rig.rec.fail["finish"] = RuntimeError("span processor exploded")
    for handle in handles:
        rig.ack(handle)
    rig.cycle(advance_ns=engine._ACK_SCAN_INTERVAL_NS)
    assert rig.take() == [("acked", 0), ("finish", 0, "state0"), ("left_flight", 0), ("dropped", "internal_error", 1),
                          ("acked", 1), ("finish", 1, "state1")]
    assert rig.p._awaiting == []  # handled once, not retried
    assert len(messages(warnings_log, "could not be reported")) == 1


# -- 4. acks -------------------------------------------------------------------------------------

def test_an_ack_is_taken_at_the_next_ack_scan_or_at_once_when_a_flush_waits(make):
    rig = make()
    handle = rig.submit(expect_ack=True)
    rig.cycle()
    assert rig.take() == [("submitted", 0), ("begin", 0), ("completed", 0, 0), ("log", 0, 0)]
    rig.ack(handle)
    rig.cycle(advance_ns=engine._ACK_SCAN_INTERVAL_NS - 1)
    assert rig.take() == []  # acks not watched are scanned every _ACK_SCAN_INTERVAL_NS
    rig.cycle(advance_ns=1)
    assert rig.take() == [("acked", 0), ("finish", 0, "state0")]

    handle = rig.submit(expect_ack=True)
    rig.cycle()
    rig.take()
    rig.ack(handle)
    rig.p.alive = True
    assert rig.p.flush(0) is False  # registers a waiter, as a flush() on another thread does
    rig.cycle()
    assert rig.take() == [("acked", 1), ("finish", 1, "state1")]  # no scan interval to wait for
    assert rig.p._flush_waiters == []


def test_no_ack_within_the_ack_timeout_finishes_the_span_unacked(make):
    rig = make(ack_timeout_s=1.0)
    rig.submit(expect_ack=True)
    rig.cycle()
    rig.take()
    rig.cycle(advance_ns=S)
    assert rig.take() == []  # scanned at exactly the timeout: still waiting
    rig.cycle(advance_ns=engine._ACK_SCAN_INTERVAL_NS)
    assert rig.take() == [("finish", 0, "state0")]  # at the next scan; no ("acked", 0)
    assert rig.rec.records[0].ack_ns is None and rig.p.held == 0


def test_an_ack_taken_before_the_completion_was_seen_finishes_the_op_at_completion(make):
    rig = make()
    finish = Event()
    handle = rig.submit(finish, expect_ack=True)
    rig.cycle()
    rig.ack(handle)
    finish.done = True
    rig.cycle()
    assert rig.take() == [("submitted", 0), ("begin", 0), ("completed", 0, 0), ("log", 0, 0), ("acked", 0),
                          ("finish", 0, "state0")]
    assert rig.p._awaiting == []


# -- 5. refused submit() calls ------------------------------------------------------------------------

def test_refused_submissions_are_counted_once_each(make, warnings_log):
    rig = make()
    for _ in range(3):
        next(rig.p.refused)  # what submit() does on a full queue
    rig.cycle()
    assert rig.take() == [("dropped", "queue_full", 3)]
    rig.cycle()
    assert rig.take() == []  # the count's own reads are not refusals
    for _ in range(2):
        next(rig.p.refused)
    rig.cycle()
    assert rig.take() == [("dropped", "queue_full", 2)]
    found = messages(warnings_log, "queue full")
    assert len(found) == 1 and "OTEL_HICACHE_MAX_QUEUE_SIZE=8" in found[0]


# -- busy-interval forgetting -------------------------------------------------------------------------

class SpyTracker:
    def __init__(self):
        self.cutoffs = []

    def forget_before(self, cutoff_ns):
        self.cutoffs.append(cutoff_ns)


NOW = T0 + 60 * S


@pytest.mark.parametrize("pending, queued, oldest", [
    ([], None, NOW),
    ([NOW - 1 * S, NOW - 3 * S], None, NOW - 3 * S),
    ([NOW - 1 * S], NOW - 10 * S, NOW - 10 * S),  # a backlog not taken in yet: its head is older
    ([NOW - 1 * S], "not an int", NOW - 1 * S),  # an invalid queued record says nothing
    ([NOW + 2 * S], None, NOW),  # a submit stamp ahead of the clock: never past now
], ids=["idle", "oldest-in-flight", "queue-head", "invalid-queue-head", "future-stamp"])
def test_busy_intervals_are_forgotten_only_well_before_the_oldest_op_in_flight(make, pending, queued, oldest):
    rig = make()
    rig.p._busy = {d: SpyTracker() for d in DIRECTIONS}
    rig.p._pending = [SimpleNamespace(submit_ns=ns) for ns in pending]
    if queued is not None:
        rig.p.queue.append(submission("offload", submit_ns=queued))
    rig.p._forget_busy_intervals(NOW)
    assert [t.cutoffs for t in rig.p._busy.values()] == [[oldest - engine._BUSY_LATE_MARGIN_NS]] * 2


def test_busy_intervals_are_forgotten_at_most_once_per_interval(make):
    rig = make()
    spy = SpyTracker()
    rig.p._busy = {d: spy if d == "offload" else SpyTracker() for d in DIRECTIONS}
    rig.cycle()
    rig.cycle(advance_ns=engine._BUSY_FORGET_INTERVAL_NS - 1)
    assert len(spy.cutoffs) == 1
    rig.cycle(advance_ns=1)
    assert spy.cutoffs == [T0 - engine._BUSY_LATE_MARGIN_NS,
                           T0 + engine._BUSY_FORGET_INTERVAL_NS - engine._BUSY_LATE_MARGIN_NS]


# -- flush (the real worker) ---------------------------------------------------------------------

def test_flush_waits_for_earlier_submissions_but_not_for_their_acks(make):
    rig = make(manual=False)
    acked = rig.submit(expect_ack=True)
    assert rig.p.flush(5.0) is True  # completed and awaiting its ack: flushed
    assert rig.take() == [("submitted", 0), ("begin", 0), ("completed", 0, 0), ("log", 0, 0)]
    stuck = Event()
    rig.submit(stuck)
    assert rig.p.flush(0.05) is False  # in flight: the flush times out
    stuck.done = True
    rig.ack(acked)
    assert rig.p.flush(5.0) is True
    calls = rig.take()
    # the ack taken before this flush is reported by it (a waiting flush scans the acks)
    assert sorted(calls, key=repr) == sorted([("submitted", 1), ("acked", 0), ("finish", 0, "state0")]
                                             + done_op(1), key=repr)


def test_flush_on_a_stopped_pipeline_answers_at_once(make):
    rig = make(manual=False)
    assert rig.p.stop(5.0) is True
    assert rig.p.flush(60.0) is True
    rig.submit()
    assert rig.p.flush(60.0) is False  # nothing will take it in
    assert rig.p.stop(5.0) is False  # stopped already


def test_a_flush_racing_the_intake_still_waits_for_the_record_being_taken_in(make):
    rig = make()
    rig.p.alive = True
    waiters = []

    class RacingQueue(deque):
        def popleft(self):
            item = super().popleft()
            if not waiters:  # another thread's flush() runs here (the GIL can switch at any bytecode)
                if rig.p._lock.locked():  # unless the intake holds the flush lock: then none can
                    waiters.append(threading.Event())
                else:
                    rig.p.flush(0)
                    waiters.append(rig.p._flush_waiters[-1][1])
            return item

    rig.p.queue = RacingQueue()
    rig.submit(Event())  # submitted before that flush, and still in flight
    rig.cycle()
    assert rig.rec.calls == [("submitted", 0)]
    assert not waiters[0].is_set()


# -- stop and the final cycle (the real worker) ---------------------------------------------------------

def test_stop_drops_what_is_in_flight_and_finishes_what_awaits_an_ack(make, warnings_log):
    rig = make(manual=False)
    rig.submit(expect_ack=True)
    assert rig.p.flush(5.0)
    rig.submit(Event())  # never completes
    assert rig.p.stop(0.2) is False  # its flush timed out
    rig.p._worker.join(5.0)  # a starved worker may finish after stop()'s bounded join
    calls = rig.take()
    assert calls[:5] == [("submitted", 0), ("begin", 0), ("completed", 0, 0), ("log", 0, 0), ("submitted", 1)]
    # the drop is the final cycle's; the span awaiting its ack is finished by the last regular
    # cycle (stop() sets drain-all first) or by the final one, whichever sees the flag first
    assert calls[5:] in ([("finish", 0, "state0"), ("dropped", "shutdown", 1), ("left_flight", 1)],
                         [("dropped", "shutdown", 1), ("left_flight", 1), ("finish", 0, "state0")])
    assert rig.rec.flushes_at[-1] == 8  # counters handed over after the last of them
    assert (rig.p.size(), rig.p._worker.is_alive()) == (0, False)
    assert len(messages(warnings_log, "1 transfers still in flight at shutdown")) == 1


def test_stop_with_nothing_in_flight(make):
    rig = make(manual=False)
    rig.submit()
    assert rig.p.stop(5.0) is True
    assert rig.take() == [("submitted", 0)] + done_op(0)
    assert rig.builds == 1
    assert rig.p.stop(5.0) is False


def test_the_final_cycle_drops_what_is_left_and_finishes_what_awaits_an_ack(make, warnings_log):
    rig = make()  # by hand: the final cycle itself, after the last regular one took X and Z in
    rig.submit(Event())  # X: in flight, never completes
    rig.submit(expect_ack=True)  # Z: complete, its ack never comes
    rig.cycle()
    rig.take()
    rig.submit()  # Y: submitted after that cycle's intake, racing stop()
    rig.p._drain_all = rig.p._stopping = True  # as stop() sets them
    rig.p._cycle_final()
    assert rig.take() == [("dropped", "shutdown", 1), ("left_flight", 0), ("finish", 1, "state1"),
                          ("dropped", "shutdown", 1)]
    assert (len(rig.p.queue), rig.p.size(), rig.rec.flushes_at[-1]) == (0, 0, 4)
    assert len(messages(warnings_log, "were not reported")) == 2


# The final cycle once dropped the records still in flight without releasing the flush waiters: a
# flush() waiting on another thread when stop() ran blocked for its whole timeout, the worker gone.
def test_a_flush_waiting_when_the_pipeline_stops_is_released(make):
    rig = make(manual=False)
    rig.submit(Event())  # never completes
    assert rig.p.flush(0.05) is False  # its waiter stays registered, as a flush() blocked on another thread
    [(_target, waiting)] = list(rig.p._flush_waiters)
    rig.p.stop(0.05)
    rig.p._worker.join(5.0)
    assert rig.rec.calls[-2:] == [("dropped", "shutdown", 1), ("left_flight", 0)]  # nothing left in flight
    assert waiting.is_set()


def test_the_worker_survives_an_error_in_its_cycle(make, warnings_log):
    rig = make(manual=False)
    rig.rec.fail["flush"] = RuntimeError("exporter exploded")
    rig.submit()
    assert rig.p.flush(5.0) is True  # released by a later cycle
    assert rig.take() == [("submitted", 0)] + done_op(0)  # reported once, not lost, not twice
    assert "flush" not in rig.rec.fail
    assert len(messages(warnings_log, "completion worker error RuntimeError('exporter exploded')")) == 1
    rig.submit()
    assert rig.p.flush(5.0) is True


# -- fork ----------------------------------------------------------------------------------------

def test_after_fork_the_child_starts_empty_with_its_own_worker_and_builds_its_sinks_lazily(make):
    rig = make(manual=False)
    p = rig.p
    assert any(handle() == p._after_fork_in_child for handle in fork._callbacks)  # registered for fork()
    for _ in range(2):
        next(p.refused)  # refusals the parent reported
    assert p.stop(5.0) is True  # threads do not survive fork(): the parent's worker is gone in the child
    assert rig.take() == [("dropped", "queue_full", 2)]
    parent_worker = p._worker
    # what the child inherits from the parent: queued, in-flight and awaiting records, refusals
    rig.submit(Event())
    p._pending = [object()]
    p._awaiting = [(object(), None)]
    p.held = 2
    next(p.refused)
    rig.take()
    rig.built.clear()

    p._after_fork_in_child()  # what fork's at-fork callback runs in the child
    assert (len(p.queue), p.held, p.size(), p._pending, p._awaiting) == (0, 0, 0, [], [])
    assert p._worker is not parent_worker and p._worker.is_alive()
    assert not rig.built.wait(0.05)  # idle: no providers built inside the at-fork callbacks
    assert rig.builds == 1

    rig.submit()  # the child's own first op
    assert p.flush(5.0) is True
    assert rig.builds == 2
    assert rig.take() == [("submitted", 0)] + done_op(0)  # numbered from 0, no parent refusal reported
