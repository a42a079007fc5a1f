"""Unit tests of otel_hicache.capture.poller.Poller: what it writes to its channel.

The poller writes one batch of plain-tuple messages per cycle (otel_hicache.record: OP,
ACK, DROPPED, STATE, FLUSH...) to ``channel.write(batch, ops)``. Here the channel is a fake
that notes every batch (and ``stop()``/``forget_in_child()``), the clock is one the test
sets, and the events' ``query()`` answers what the test says.

Most tests run the poller's cycle by hand (``ManualPoller``: no thread, so every batch is
exact); flush, stop, a stuck poller and the fork restart run the real thread, bounded by
their timeouts. Where a behaviour is the sinks' now (busy time, a sink failing on one op),
the poller's own messages are applied to a ``Consumer`` on in-memory SDK providers.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from types import SimpleNamespace

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_hicache import record as rec
from otel_hicache import semconv as sc
from otel_hicache.capture import fork
from otel_hicache.capture import poller as engine
from otel_hicache.capture.poller import PollerSettings, Poller
from otel_hicache.capture.records import S_ACK_NS
from harness import submission
from otel_hicache.record import DEVICE_EVENT, HOST_CLOCK
from otel_hicache.sinks.consumer import Consumer


@pytest.fixture(autouse=True)
def _write_every_cycle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cycles driven by hand do all their work and write it at once (the poller's write interval
    and cycle budget are real time: test_pipeline.py checks them apart)."""
    from otel_hicache.capture import poller as poller_module

    monkeypatch.setattr(poller_module, "_WRITE_INTERVAL_NS", 0)
    monkeypatch.setattr(poller_module, "CYCLE_BUDGET_NS", 1 << 60)

T0 = 1_767_225_600_000_000_000
MS = 1_000_000
S = 1_000_000_000
IDLE = {"offload": 0, "onboard": 0}
NONE = {"offload": None, "onboard": None}


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


class Hung:
    """An event whose ``query()`` does not return until ``release`` is set."""

    def __init__(self):
        self.release = threading.Event()
        self.entered = threading.Event()

    def query(self):
        self.entered.set()
        self.release.wait(30.0)
        return True


class Channel:
    """A fake channel: ``log`` holds ("write", batch, ops, thread), ("stop",) and ("forget",) in order."""

    def __init__(self):
        self.log = []
        self.fail_write = None  # an exception the next write raises

    def write(self, batch, ops):
        error, self.fail_write = self.fail_write, None
        if error is not None:
            raise error
        assert ops == sum(1 for m in batch if m[0] == rec.OP)  # the poller counts what it sends
        self.log.append(("write", list(batch), ops, threading.current_thread()))

    def stop(self, timeout_s, export_s=None):
        self.log.append(("stop",))
        return True

    def forget_in_child(self):
        self.log.append(("forget",))

    def messages(self):
        return [m for entry in self.log if entry[0] == "write" for m in entry[1]]


class ManualPoller(Poller):
    """No poller thread: the test runs each cycle itself. ``alive`` is what the thread's
    is_alive() answers (flush() registers a waiter only while alive)."""

    alive = False

    def _start_thread(self):
        self.thread = SimpleNamespace(is_alive=lambda: self.alive, join=lambda timeout=None: None, ident=None)


class Rig:
    def __init__(self, manual=True, cap=8, ack_timeout_s=1.0, transfer_timeout_s=2.0):
        self.clock = Clock()
        self.channels = []
        self.open_threads = []
        self.open_errors = []  # exceptions the next open_channel() calls raise
        self._seen = 0
        settings = PollerSettings()
        vars(settings).update(max_queue_size=cap, poll_interval_s=0.0005, ack_timeout_ns=int(ack_timeout_s * 1e9),
                              transfer_timeout_ns=int(transfer_timeout_s * 1e9))
        self.p = (ManualPoller if manual else Poller)(settings, self.open_channel, self.clock)

    def open_channel(self):
        self.open_threads.append(threading.current_thread())
        if self.open_errors:
            raise self.open_errors.pop(0)
        self.channels.append(Channel())
        return self.channels[-1]

    def submit(self, finish=None, start=None, timing=False, expect_ack=False, direction="offload", **kwargs):
        """What TransferTelemetry.submit() appends to the queue."""
        handle = submission(direction, {"kv": 64}, 4096, 64, start if timing else None, finish, expect_ack=expect_ack,
                            submit_ns=self.clock(), **kwargs)
        self.p.queue.append(handle)
        if self.p.idle:  # as submit() does: a poller with nothing to poll sleeps until woken
            self.p.wake()
        return handle

    def ack(self, handle):
        handle[S_ACK_NS] = self.clock()

    def cycle(self, advance_ns=0):
        self.clock.now += advance_ns
        self.p._cycle()

    def messages(self):
        return [m for channel in self.channels for m in channel.messages()]

    def take(self):
        """The messages written since the last take()."""
        messages = self.messages()
        new, self._seen = messages[self._seen:], len(messages)
        return new


@pytest.fixture
def make(monkeypatch):
    # a STATE whenever what the gauges show changed (not at most every 50 ms): exact batches
    monkeypatch.setattr(engine, "_STATE_INTERVAL_NS", 0)
    rigs = []

    def factory(**kwargs):
        rigs.append(Rig(**kwargs))
        return rigs[-1]

    yield factory
    for rig in rigs:
        if not isinstance(rig.p, ManualPoller):
            rig.p.stop(1.0)
            rig.p.thread.join(5.0)


def brief(messages):
    """The messages but STATE, shortly: ("op", seq, error), ("ack", seq, ack_ns), ("dropped", reason,
    count), ("flush",), or the kind's number."""
    out = []
    for m in messages:
        if m[0] == rec.OP:
            out.append(("op", m[1], fields(m)["error"]))
        elif m[0] == rec.ACK:
            out.append(("ack", m[1], m[2]))
        elif m[0] == rec.DROPPED:
            out.append(("dropped", m[1], m[2]))
        elif m[0] == rec.FLUSH:
            out.append(("flush",))
        elif m[0] != rec.STATE:
            out.append((m[0],))
    return out


def fields(message):
    assert message[0] == rec.OP and len(message) == 1 + len(rec.OP_FIELDS)
    return dict(zip(rec.OP_FIELDS, message[1:]))


def ops(messages):
    return {m[1]: fields(m) for m in messages if m[0] == rec.OP}


def states(messages):
    return [dict(zip(rec.STATE_FIELDS, m[1:])) for m in messages if m[0] == rec.STATE]


def dropped(messages, reason):
    return sum(m[2] for m in messages if m[0] == rec.DROPPED and m[1] == reason)


def warned(log, text):
    return [r.getMessage() for r in log.records if text in r.getMessage()]


def wait_until(condition, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


# -- 1. intake ----------------------------------------------------------------------------------

def test_intake_takes_in_only_what_the_cap_leaves_room_for(make):
    rig = make(cap=3)
    events = [Event() for _ in range(5)]
    for event in events:
        rig.submit(event)
    rig.cycle()
    assert brief(rig.take()) == [] and [r.seq for r in rig.p._pending] == [0, 1, 2]
    assert (len(rig.p.queue), rig.p.held, rig.p._snapshot()[1]) == (2, 3, 5)
    rig.cycle()
    assert rig.take() == [] and [r.seq for r in rig.p._pending] == [0, 1, 2]  # no room: the rest stays queued
    events[1].done = True
    rig.cycle(advance_ns=MS)
    # intake runs before completion: the slot freed here is taken on the next cycle
    batch = rig.take()
    assert brief(batch) == [("op", 1, None)]
    assert states(batch)[-1]["inflight"] == {"offload": 4, "onboard": 0}  # 2 pending + 2 queued
    assert (len(rig.p.queue), rig.p.held) == (2, 2)
    rig.cycle()
    assert [r.seq for r in rig.p._pending] == [0, 2, 3]
    assert (len(rig.p.queue), rig.p.held, rig.p._snapshot()[1]) == (1, 3, 4)


def test_a_backlog_state_scan_takes_at_most_one_percent_of_a_core(make, monkeypatch):
    """A STATE reads every record in flight; in a backlog, its interval grows with what the read took."""
    rig = make()
    monkeypatch.setattr(engine, "_STATE_INTERVAL_NS", 50 * MS)
    reads = iter([0.0, 0.002, 1.0, 1.0001])  # the thread's CPU around two reads: 2 ms, then 0.1 ms
    monkeypatch.setattr(engine.time, "thread_time", lambda: next(reads))
    rig.p._state(force=False)
    assert rig.p._state_ns == 200 * MS  # 2 ms of 200 ms
    rig.p._state(force=False)
    assert rig.p._state_held
    rig.p._last_state -= 200 * MS
    rig.p._state(force=False)
    assert not rig.p._state_held and rig.p._state_ns == 50 * MS


def test_a_cycle_lets_go_of_the_gil_at_each_budget_and_writes_once_after_four(make, monkeypatch):
    """Past a budget a cycle yields the GIL and goes on, its write and STATE not redone; after four
    budgets it ends, and the next cycle takes up the rest."""
    rig = make(cap=256)
    monkeypatch.setattr(engine, "CYCLE_BUDGET_NS", 150_000)
    for _ in range(256):
        rig.submit()  # no events: complete at submit
    ticks = iter(range(0, 1 << 62, 30_000))  # each read of the clock 30 us after the last
    monkeypatch.setattr(engine.time, "monotonic_ns", lambda: next(ticks))
    sleeps = []
    monkeypatch.setattr(engine.time, "sleep", sleeps.append)
    rig.cycle()
    writes = [entry for entry in rig.channels[0].log if entry[0] == "write"]
    assert sleeps == [0, 0, 0] and rig.p._more  # three yields between four budgets
    assert len(writes) == 1 and engine._BUDGET_EVERY < writes[0][2] < 256  # more than one pass's ops
    for _ in range(256):
        if not rig.p._more:
            break
        rig.cycle()
    assert [op[1] for op in rig.messages() if op[0] == rec.OP] == list(range(256))


def test_each_budget_of_a_cycle_checks_completions_from_the_first_record(make, monkeypatch):
    """An op seen incomplete before the GIL was let go is checked again before later ones, as
    before budgets were joined into one cycle: the workload ran meanwhile, and a later op seen
    complete first would come before it (a load-back before the offload whose pages it reads)."""
    rig = make()
    answers = {0: iter([False, False])}  # then True; the others: False at intake's pass, then True

    def event(seq):
        answers.setdefault(seq, iter([False]))
        return SimpleNamespace(query=lambda: next(answers[seq], True))

    for seq in range(6):
        rig.submit(finish=event(seq))
    rig.cycle()  # all taken in, none complete
    monkeypatch.setattr(engine, "CYCLE_BUDGET_NS", 150_000)
    ticks = iter(range(0, 1 << 62, 200_000))  # every check of the budget after a pass's start: spent
    monkeypatch.setattr(engine.time, "monotonic_ns", lambda: next(ticks))
    monkeypatch.setattr(engine.time, "sleep", lambda s: None)
    rig.cycle()  # a pass stops at the 4th record (the budget's check), the next starts from the first
    assert [op[1] for op in rig.messages() if op[0] == rec.OP] == [1, 2, 3, 0, 4, 5]


def test_records_awaiting_their_ack_count_against_the_cap(make):
    rig = make(cap=2)
    handles = [rig.submit(expect_ack=True) for _ in range(3)]  # no events: complete at submit
    rig.cycle()
    batch = rig.take()
    assert brief(batch) == [("op", 0, None), ("op", 1, None)]
    assert all(op["expect_ack"] and op["ack_ns"] is None for op in ops(batch).values())  # an ACK will follow
    rig.cycle(advance_ns=engine._ACK_SCAN_INTERVAL_NS)
    assert brief(rig.take()) == [] and len(rig.p.queue) == 1  # two awaiting their ack fill the cap
    rig.ack(handles[0])
    rig.cycle(advance_ns=engine._ACK_SCAN_INTERVAL_NS)
    assert brief(rig.take()) == [("ack", 0, T0 + engine._ACK_SCAN_INTERVAL_NS)]
    rig.cycle()
    assert brief(rig.take()) == [("op", 2, None)]


def test_invalid_records_are_dropped_as_invalid_input_warned_once_per_problem_and_take_no_room(make, warnings_log):
    rig = make(cap=2)
    for bad in (submission("sideways"), submission("sideways"), submission("offload", page_size=0)):
        rig.p.queue.append(bad)
    for _ in range(3):
        rig.submit(Event())
    rig.cycle()
    assert brief(rig.take()) == [("dropped", "invalid_input", 3)]
    assert [r.seq for r in rig.p._pending] == [3, 4]
    assert (len(rig.p.queue), rig.p.held) == (1, 2)
    found = warned(warnings_log, "dropped a transfer record")
    assert len(found) == 2 and "direction must be" in found[0] and "page_size must be >= 1" in found[1]


def test_an_invalid_record_alone_is_still_written_in_its_cycle(make):
    rig = make()
    rig.cycle()  # the first STATE: nothing changes from here on
    rig.take()
    rig.p.queue.append(submission("sideways", submit_ns=T0))
    rig.cycle()
    assert brief(rig.take()) == [("dropped", "invalid_input", 1)]  # not held back until something else is sent


def test_a_record_that_cannot_be_taken_in_is_an_internal_error_and_the_rest_of_its_batch_goes_on(make, warnings_log):
    rig = make()
    rig.p.queue.append(["offload"])  # not a submission list: no record can be made of it
    rig.submit()
    rig.cycle()
    assert brief(rig.take()) == [("op", 1, None), ("dropped", "internal_error", 1)]
    assert rig.p.held == 0
    assert len(warned(warnings_log, "could not be taken in")) == 1


# -- 2./3. completion ---------------------------------------------------------------------------

def test_completion_is_polled_and_elapsed_time_waits_for_both_events(make):
    rig = make()
    start, finish = Event(elapsed_ms=2.5), Event()
    rig.submit(finish, start, timing=True)
    rig.cycle()
    assert brief(rig.take()) == []
    assert (finish.queries, start.queries) == (1, 0)
    finish.done = True  # the finish event completed first (another stream)
    rig.cycle()
    assert (finish.queries, start.queries) == (2, 1)
    assert brief(rig.take()) == []
    start.done = True
    rig.cycle(advance_ns=MS)
    batch = rig.take()
    assert brief(batch) == [("op", 0, None)]
    op = ops(batch)[0]
    assert (op["timing_source"], op["duration_ns"], op["start_ns"], op["end_ns"]) == (
        DEVICE_EVENT, 2_500_000, T0 + MS - 2_500_000, T0 + MS)
    assert (op["direction"], op["tokens"], op["blocks"], op["num_bytes"], op["pool_names"], op["pool_tokens"]) == (
        "offload", 64, 1, 4096, ("kv",), (64,))
    assert start.misuse == finish.misuse == []  # never synchronize(), no early elapsed_time()


def test_a_transfer_that_never_completes_times_out_as_an_error_op(make, warnings_log):
    rig = make(transfer_timeout_s=2.0)
    rig.submit(Event(), expect_ack=True)
    rig.submit(Event(), expect_ack=True)
    rig.cycle()
    rig.take()
    rig.cycle(advance_ns=2 * S)
    assert brief(rig.take()) == []  # exactly the timeout: not yet
    rig.cycle(advance_ns=1)
    batch = rig.take()
    assert brief(batch) == [("op", 0, "transfer_timeout"), ("op", 1, "transfer_timeout")]
    op = ops(batch)[0]
    assert (op["timing_source"], op["start_ns"], op["end_ns"], op["duration_ns"], op["expect_ack"]) == (
        HOST_CLOCK, T0, T0 + 2 * S + 1, 2 * S + 1, False)
    assert states(batch)[-1]["inflight"] == IDLE
    assert (rig.p._pending, rig.p._awaiting, rig.p.held) == ([], [], 0)  # no ack wait for a failed op
    rig.cycle(advance_ns=2 * S)  # past the ack timeout too: no ACK follows a failed op
    assert brief(rig.take()) == []
    found = warned(warnings_log, "did not complete within")
    assert len(found) == 1 and "OTEL_HICACHE_TRANSFER_TIMEOUT_S=2 s" in found[0]


def test_an_event_that_raises_is_an_error_op_warned_once_per_exception_type(make, warnings_log):
    rig = make()
    for _ in range(2):
        rig.submit(Event(query_error=RuntimeError("CUDA error: an illegal memory access")))
    rig.submit(Event(done=True), start=Event(query_error=ValueError("bad start event")), timing=True)
    rig.cycle(advance_ns=MS)
    batch = rig.take()
    assert brief(batch) == [("op", seq, "event_error") for seq in (0, 1, 2)]
    op = ops(batch)[2]
    assert (op["timing_source"], op["start_ns"], op["end_ns"], op["expect_ack"]) == (HOST_CLOCK, T0, T0 + MS, False)
    found = warned(warnings_log, "a transfer's event raised")
    assert len(found) == 2 and "illegal memory access" in found[0] and "bad start event" in found[1]


# -- what the sinks make of the poller's messages (a Consumer on in-memory providers) -------------

class Sinks:
    def __init__(self):
        self.spans = InMemorySpanExporter()
        self.tracer_provider = TracerProvider(shutdown_on_exit=False)
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader], shutdown_on_exit=False)
        self.consumer = Consumer(self.tracer_provider, self.meter_provider, {"attributes": {"tp_rank": 0}})

    def points(self, name):
        return [p for rm in self.reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
                for m in sm.metrics if m.name == name for p in m.data.data_points]

    def close(self):
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


@pytest.fixture
def sinks():
    made = Sinks()
    yield made
    made.close()


def test_busy_time_is_the_union_of_the_ops_intervals_per_direction(make, sinks):
    rig = make()
    rig.submit(host_start_ns=T0, host_end_ns=T0 + 4 * MS)
    rig.submit(host_start_ns=T0 + 2 * MS, host_end_ns=T0 + 6 * MS)  # overlaps the first by 2 ms
    rig.submit(direction="onboard", host_start_ns=T0, host_end_ns=T0 + 4 * MS)  # the other direction
    rig.cycle()
    batch = rig.take()
    assert [(op["start_ns"], op["end_ns"]) for op in ops(batch).values()] == [
        (T0, T0 + 4 * MS), (T0 + 2 * MS, T0 + 6 * MS), (T0, T0 + 4 * MS)]
    sinks.consumer.apply(batch)
    busy = {p.attributes[sc.DIRECTION]: p.value for p in sinks.points(sc.TRANSFER_BUSY_TIME[0])}
    assert busy == pytest.approx({"offload": 0.006, "onboard": 0.004})


def test_an_op_whose_span_cannot_begin_leaves_no_trace_in_another_ops_data(make, sinks):
    """A malformed parent (as a hostile frame could send): that op is counted as an internal error,
    and its interval does not eat into the busy time of an op that overlaps it."""
    rig = make()
    rig.submit(host_start_ns=T0, host_end_ns=T0 + 4 * MS)
    rig.submit(host_start_ns=T0, host_end_ns=T0 + 4 * MS)
    rig.cycle()
    batch = [list(m) for m in rig.take()]
    first = next(m for m in batch if m[0] == rec.OP)
    first[1 + rec.OP_FIELDS.index("parent")] = [1, 2]
    sinks.consumer.apply(batch)
    busy = {p.attributes[sc.DIRECTION]: p.value for p in sinks.points(sc.TRANSFER_BUSY_TIME[0])}
    lost = [p.value for p in sinks.points(sc.RECORDS_DROPPED[0]) if p.attributes[sc.REASON] == "internal_error"]
    assert busy["offload"] == pytest.approx(0.004) and lost == [1] and len(sinks.spans.get_finished_spans()) == 1


def test_a_sink_failing_while_an_acked_op_is_finished_loses_that_span_only(make, sinks, warnings_log):
    rig = make()
    handles = [rig.submit(expect_ack=True) for _ in range(2)]
    rig.cycle()
    sinks.consumer.apply(rig.take())
    for handle in handles:
        rig.ack(handle)
    rig.cycle(advance_ns=engine._ACK_SCAN_INTERVAL_NS)
    batch = rig.take()
    assert brief(batch) == [("ack", 0, T0), ("ack", 1, T0)]
    finish, failed = sinks.consumer.spans.finish, []

    def exploding(op, state):
        if not failed:
            failed.append(op.seq)
            raise RuntimeError("span processor exploded")
        finish(op, state)

    sinks.consumer.spans.finish = exploding
    sinks.consumer.apply(batch)
    assert failed == [0]
    assert [s.attributes[sc.ACKED] for s in sinks.spans.get_finished_spans()] == [True]  # the other one's
    assert sinks.consumer._awaiting == {}  # handled once, not retried
    assert len(warned(warnings_log, "could not be reported")) == 1


def test_a_span_lost_at_its_ack_is_counted_as_an_internal_error(make, sinks):
    rig = make()
    handle = rig.submit(expect_ack=True)
    rig.cycle()
    sinks.consumer.apply(rig.take())
    rig.ack(handle)
    rig.cycle(advance_ns=engine._ACK_SCAN_INTERVAL_NS)

    def exploding(op, state):
        raise RuntimeError("span processor exploded")

    sinks.consumer.spans.finish = exploding
    sinks.consumer.apply(rig.take())
    lost = [p.value for p in sinks.points(sc.RECORDS_DROPPED[0]) if p.attributes[sc.REASON] == "internal_error"]
    assert lost == [1]


# -- 4. acks -------------------------------------------------------------------------------------

def test_an_ack_is_sent_at_the_next_ack_scan_or_at_once_when_a_flush_waits(make):
    rig = make()
    handle = rig.submit(expect_ack=True)
    rig.cycle()
    assert brief(rig.take()) == [("op", 0, None)]
    rig.ack(handle)
    rig.cycle(advance_ns=engine._ACK_SCAN_INTERVAL_NS - 1)
    assert brief(rig.take()) == []  # acks not watched are scanned every _ACK_SCAN_INTERVAL_NS
    rig.cycle(advance_ns=1)
    assert brief(rig.take()) == [("ack", 0, T0)]

    handle = rig.submit(expect_ack=True)
    rig.cycle()
    rig.take()
    rig.ack(handle)
    rig.p.alive = True
    assert rig.p.flush(0) is False  # registers a waiter, as a flush() on another thread does
    rig.cycle()
    # no scan interval to wait for; the sinks are told to hand over what they summed
    assert brief(rig.take()) == [("ack", 1, rig.clock()), ("flush",)]
    assert rig.p._flush_waiters == []


def test_no_ack_within_the_ack_timeout_ends_the_wait_unacked(make):
    rig = make(ack_timeout_s=1.0)
    rig.submit(expect_ack=True)
    rig.cycle()
    rig.take()
    rig.cycle(advance_ns=S)
    assert brief(rig.take()) == []  # scanned at exactly the timeout: still waiting
    rig.cycle(advance_ns=engine._ACK_SCAN_INTERVAL_NS)
    batch = rig.take()
    assert brief(batch) == [("ack", 0, None)]  # at the next scan: timed out
    assert states(batch)[-1]["oldest_unacked_ns"] == NONE and rig.p.held == 0


def test_an_ack_taken_before_the_completion_was_seen_travels_with_the_op(make):
    rig = make()
    finish = Event()
    handle = rig.submit(finish, expect_ack=True)
    rig.cycle()
    rig.clock.now += MS
    rig.ack(handle)
    finish.done = True
    rig.cycle()
    batch = rig.take()
    assert brief(batch) == [("op", 0, None)]
    assert (ops(batch)[0]["ack_ns"], ops(batch)[0]["expect_ack"]) == (T0 + MS, True)  # no ACK follows
    assert rig.p._awaiting == []
    rig.cycle(advance_ns=2 * S)
    assert brief(rig.take()) == []


# -- 5. refused submit() calls ------------------------------------------------------------------------

def test_refused_submissions_are_dropped_as_queue_full_once_each(make, warnings_log):
    rig = make()
    for _ in range(3):
        next(rig.p.refused)  # what submit() does on a full queue
    rig.cycle()
    assert brief(rig.take()) == [("dropped", "queue_full", 3)]
    rig.cycle()
    assert brief(rig.take()) == []  # the count's own reads are not refusals
    for _ in range(2):
        next(rig.p.refused)
    rig.cycle()
    assert brief(rig.take()) == [("dropped", "queue_full", 2)]
    found = warned(warnings_log, "queue full")
    assert len(found) == 1 and "OTEL_HICACHE_MAX_QUEUE_SIZE=8" in found[0]


# -- the channel -----------------------------------------------------------------------------------

def test_the_channel_opens_at_the_first_batch_and_each_batch_says_how_many_ops_it_holds(make):
    rig = make()
    assert rig.channels == []  # by hand, no thread: nothing written yet
    rig.submit()
    rig.submit(Event())
    rig.cycle()
    assert len(rig.channels) == 1 and rig.open_threads == [threading.current_thread()]
    rig.submit()
    rig.cycle()
    # an OP and a STATE, then an OP alone: what the gauges show has not changed (one op in flight)
    assert [(entry[2], [m[0] for m in entry[1]]) for entry in rig.channels[0].log] == [
        (1, [rec.OP, rec.STATE]), (1, [rec.OP])]


def test_ops_of_a_batch_the_channel_could_not_be_opened_for_are_not_lost_silently(make, warnings_log):
    rig = make()
    rig.open_errors.append(RuntimeError("no collector"))
    rig.submit()
    rig.cycle()
    assert rig.channels == [] and len(warned(warnings_log, "cannot open the telemetry channel")) == 1
    rig.submit()
    rig.cycle()  # the next batch opens it
    messages = rig.take()
    assert 1 in ops(messages)
    assert 0 in ops(messages) or dropped(messages, "internal_error") == 1


# -- flush (the real thread) -----------------------------------------------------------------------

def test_flush_waits_for_earlier_submissions_but_not_for_their_acks(make):
    rig = make(manual=False)
    acked = rig.submit(expect_ack=True)
    assert rig.p.flush(5.0) is True  # completed and awaiting its ack: flushed
    assert brief(rig.take())[:1] == [("op", 0, None)]
    stuck = Event()
    rig.submit(stuck)
    assert rig.p.flush(0.05) is False  # in flight: the flush times out
    stuck.done = True
    rig.ack(acked)
    assert rig.p.flush(5.0) is True
    # the ack taken before this flush is written by it (a waiting flush scans the acks)
    found = [m for m in brief(rig.take()) if m[0] != "flush"]
    assert sorted(found, key=repr) == sorted([("op", 1, None), ("ack", 0, T0)], key=repr)


def _first_write_with_ops(rig, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        written = [entry[1] for c in rig.channels for entry in c.log if entry[0] == "write"]
        with_ops = [batch for batch in written if any(m[0] == rec.OP for m in batch)]
        if with_ops:
            return sorted(ops(with_ops[0]))
        time.sleep(0.005)
    return None


def _wait_idle(rig):
    deadline = time.monotonic() + 5.0
    while not rig.p.idle and time.monotonic() < deadline:
        time.sleep(0.001)
    assert rig.p.idle


def test_ops_submitted_while_the_poller_gathers_share_its_cycle(make, monkeypatch):
    """Woken from sleep by a submit, the poller waits for more before its cycle: at low rates
    several ops share one cycle and one write."""
    monkeypatch.setattr(engine, "GATHER_S", 1.0)
    rig = make(manual=False)
    _wait_idle(rig)
    rig.submit()  # complete at submit: its times do not depend on when the poller looks
    time.sleep(0.05)
    rig.submit()
    assert _first_write_with_ops(rig, 5.0) == [0, 1]


@pytest.mark.parametrize("stamped", ["end", "ack"])
def test_an_op_the_poller_stamps_when_it_looks_is_not_gathered(make, monkeypatch, stamped):
    """A host-clock op ends, and a watched ack is taken, when the poller sees it: the poller does not wait."""
    monkeypatch.setattr(engine, "GATHER_S", 30.0)
    rig = make(manual=False)
    _wait_idle(rig)
    if stamped == "end":
        rig.submit(Event(done=True))
    else:
        rig.submit(expect_ack=True, ack_watch=([], object()))
    assert _first_write_with_ops(rig, 10.0) == [0]


@pytest.mark.parametrize("changing", [False, True])
def test_a_queue_changed_while_the_gather_reads_it_is_not_gathered(make, monkeypatch, changing):
    """submit() may append while the poller reads the queue (a deque then raises): no gather, no error."""

    class Changing(deque):
        def __iter__(self):
            raise RuntimeError("deque mutated during iteration")

    rig = make()
    if changing:
        rig.p.queue = Changing()
    rig.submit()
    waits = []
    monkeypatch.setattr(rig.p, "_wake", SimpleNamespace(wait=waits.append))
    rig.p._sleep(gather=True)
    assert waits == ([] if changing else [engine.GATHER_S])


def test_flush_on_a_stopped_poller_answers_at_once(make):
    rig = make(manual=False)
    assert rig.p.stop(5.0) is True
    began = time.monotonic()
    assert rig.p.flush(60.0) is True
    rig.submit()
    assert rig.p.flush(60.0) is False  # nothing will take it in
    assert time.monotonic() - began < 30.0
    assert rig.p.stop(5.0) is False  # stopped already
    assert [entry[0] for entry in rig.channels[0].log].count("stop") == 1


def test_a_flush_racing_the_intake_still_waits_for_the_record_being_taken_in(make):
    rig = make()
    rig.p.alive = True
    racers = []

    class RacingQueue(deque):
        def popleft(self):
            item = super().popleft()
            if not racers:  # another thread's flush() runs here (the GIL can switch at any bytecode)
                if rig.p._lock.locked():  # the intake holds the flush lock: that flush waits for it
                    racers.append(threading.Thread(target=rig.p.flush, args=(0,)))
                    racers[0].start()
                else:
                    racers.append(None)
                    rig.p.flush(0)
            return item

    rig.p.queue = RacingQueue()
    finish = Event()
    rig.submit(finish)  # submitted before that flush, and still in flight
    rig.cycle()
    if racers[0] is not None:
        racers[0].join(5.0)
    [(target, waiting)] = rig.p._flush_waiters
    assert target == 1
    rig.cycle()
    assert not waiting.is_set()  # the record is still in flight
    finish.done = True
    rig.cycle()
    assert waiting.is_set() and rig.p._flush_waiters == []


# -- stop and the final cycle ----------------------------------------------------------------------------

def test_stop_drops_what_is_in_flight_as_shutdown_and_ends_the_ack_waits(make, warnings_log):
    rig = make(manual=False)
    rig.submit(expect_ack=True)
    assert rig.p.flush(5.0)
    rig.submit(Event())  # never completes
    assert rig.p.stop(0.2) is False  # its flush timed out
    rig.p.thread.join(5.0)  # a starved thread may finish after stop()'s bounded join
    messages = rig.take()
    found = [m for m in brief(messages) if m[0] != "flush"]
    assert found[0] == ("op", 0, None)
    assert sorted(found[1:], key=repr) == [("ack", 0, None), ("dropped", "shutdown", 1)]
    last = states(messages)[-1]
    assert (last["inflight"], last["oldest_inflight_ns"], last["oldest_unacked_ns"], last["queue_size"]) == (
        IDLE, NONE, NONE, 0)
    assert (rig.p._snapshot()[1], rig.p.thread.is_alive()) == (0, False)
    assert len(warned(warnings_log, "1 transfers still in flight at shutdown")) == 1


def test_stop_with_nothing_in_flight_writes_everything_then_stops_the_channel(make):
    rig = make(manual=False)
    rig.submit()
    assert rig.p.stop(5.0) is True
    assert [m for m in brief(rig.take()) if m[0] != "flush"] == [("op", 0, None)]
    assert len(rig.channels) == 1
    assert rig.channels[0].log[-1] == ("stop",)  # after the last batch
    assert [entry[0] for entry in rig.channels[0].log].count("stop") == 1
    assert rig.p.stop(5.0) is False


def test_the_final_cycle_drops_what_is_left_and_ends_what_awaits_an_ack(make, warnings_log):
    rig = make()  # by hand: the final cycle itself, after the last regular one took X and Z in
    rig.submit(Event())  # X: in flight, never completes
    rig.submit(expect_ack=True)  # Z: complete, its ack never comes
    rig.cycle()
    rig.take()
    rig.submit()  # Y: submitted after that cycle's intake, racing stop()
    rig.p._stopping = True  # as stop() sets it
    rig.p._cycle_final()
    batch = rig.take()
    assert brief(batch) == [("ack", 1, None), ("dropped", "shutdown", 2)]  # X and Y
    assert states(batch)[-1]["inflight"] == IDLE and states(batch)[-1]["queue_size"] == 0
    assert (len(rig.p.queue), rig.p._snapshot()[1]) == (0, 0)
    assert len(warned(warnings_log, "were not reported")) == 2


# The final cycle once dropped the records still in flight without releasing the flush waiters: a
# flush() waiting on another thread when stop() ran blocked for its whole timeout, the thread gone.
def test_a_flush_waiting_when_the_poller_stops_is_released(make):
    rig = make(manual=False)
    rig.submit(Event())  # never completes
    assert rig.p.flush(0.05) is False  # its waiter stays registered, as a flush() blocked on another thread
    [(_target, waiting)] = list(rig.p._flush_waiters)
    rig.p.stop(0.05)
    rig.p.thread.join(5.0)
    assert dropped(rig.messages(), "shutdown") == 1  # nothing left in flight
    assert waiting.is_set()


def test_the_poller_survives_an_error_in_its_cycle_and_loses_nothing(make, warnings_log):
    rig = make(manual=False)
    failures = []

    state_message = rig.p._state_message

    def exploding(cpu_s):  # called by every STATE: here, the cycle that completed the op raises once
        if not failures and any(m[0] == rec.OP for m in rig.p._out):
            failures.append(1)
            raise RuntimeError("state exploded")
        return state_message(cpu_s)

    rig.p._state_message = exploding
    rig.submit()
    assert rig.p.flush(5.0) is True  # released by a later cycle
    assert failures == [1]
    assert [m for m in brief(rig.take()) if m[0] == "op"] == [("op", 0, None)]  # written once, not lost, not twice
    assert len(warned(warnings_log, "poller error RuntimeError('state exploded')")) == 1
    rig.submit()
    assert rig.p.flush(5.0) is True
    assert [m for m in brief(rig.take()) if m[0] == "op"] == [("op", 1, None)]


def test_the_poller_survives_a_channel_that_raises(make, warnings_log):
    rig = make(manual=False)
    assert rig.p.flush(5.0)  # the channel is open
    rig.channels[0].fail_write = OSError("pipe exploded")
    rig.submit()
    rig.p.flush(1.0)
    rig.submit()
    assert rig.p.flush(5.0) is True
    assert 1 in ops(rig.take())
    assert rig.p.thread.is_alive()
    assert len(warned(warnings_log, "poller error OSError('pipe exploded')")) == 1


# -- a stuck poller ----------------------------------------------------------------------------------

def test_stop_with_a_stuck_poller_counts_what_it_held_and_refused(make, warnings_log):
    rig = make(manual=False)
    hung = Hung()
    rig.submit(hung)
    rig.submit()  # taken in with it, behind it in the completion loop
    assert hung.entered.wait(5.0)
    rig.submit()  # queued behind the stuck cycle
    for _ in range(2):
        next(rig.p.refused)  # what a submit() refused on a full queue does
    assert rig.p.stop(0.3) is False
    assert dropped(rig.messages(), "shutdown") == 3 and dropped(rig.messages(), "queue_full") == 2
    state = states(rig.messages())[-1]
    assert (state["inflight"], state["oldest_inflight_ns"]) == ({"offload": 3, "onboard": 0}, {"offload": T0,
                                                                                               "onboard": None})
    assert rig.channels[0].log[-1] == ("stop",)
    assert len(warned(warnings_log, "3 transfers held by the stuck poller were not reported")) == 1
    hung.release.set()  # it returns after stop() counted it lost: nothing more is written
    rig.p.thread.join(5.0)
    assert not rig.p.thread.is_alive()
    assert ops(rig.messages()) == {}


def test_stop_leaves_the_count_to_a_poller_slow_past_its_cycles(make, warnings_log):
    """A poller whose final write is slow is not stuck in a cycle: stop() neither counts what it
    holds nor writes beside it, and its op in flight is counted once, by the poller."""
    rig = make(manual=False)
    rig.submit(Event())  # in flight at stop: the final step counts it
    wait_until(lambda: rig.p._pending)
    channel, gate, entered = rig.channels[0], threading.Event(), threading.Event()
    write = channel.write

    def slow_final_write(batch, ops):
        if any(m[0] == rec.DROPPED and m[1] == "shutdown" for m in batch):
            entered.set()
            gate.wait(10.0)
        write(batch, ops)

    channel.write = slow_final_write
    stopper = threading.Thread(target=rig.p.stop, args=(0.2,))
    stopper.start()
    assert entered.wait(10.0)
    stopper.join(10.0)  # stop() returned while the final write still waits
    assert not warned(warnings_log, "held by the stuck poller")
    gate.set()
    rig.p.thread.join(5.0)
    assert dropped(rig.messages(), "shutdown") == 1


# -- fork ----------------------------------------------------------------------------------------

def test_after_fork_the_child_starts_empty_with_its_own_thread_and_opens_its_own_channel(make):
    rig = make(manual=False)
    p = rig.p
    assert any(handle() == p._after_fork_in_child for handle in fork._callbacks)  # registered for fork()
    for _ in range(2):
        next(p.refused)  # refusals the parent reported
    assert p.stop(5.0) is True  # threads do not survive fork(): the parent's is gone in the child
    parent = rig.channels[0]
    assert dropped(parent.messages(), "queue_full") == 2
    parent_thread = p.thread
    # what the child inherits from the parent: queued, in-flight and awaiting records, refusals
    rig.submit(Event())
    p._pending = [object()]
    p._awaiting = [object()]
    p.held = 2
    next(p.refused)

    opens = len(rig.open_threads)
    p._after_fork_in_child()  # what fork's at-fork callback runs in the child
    assert rig.open_threads[opens:] in ([], [p.thread])  # never opened by the at-fork callback itself
    assert parent.log[-1] == ("forget",)  # the parent's telemetry process stays the parent's
    assert (len(p.queue), p.held, p._snapshot()[1], p._pending, p._awaiting) == (0, 0, 0, [], [])
    assert p.thread is not parent_thread and p.thread.is_alive()

    rig.submit()  # the child's own first op
    assert p.flush(5.0) is True
    assert len(rig.channels) == 2  # its own channel
    child = rig.channels[1].messages()
    assert list(ops(child)) == [0]  # numbered from 0
    assert dropped(child, "queue_full") == 0  # no parent refusal reported
    assert len(parent.log) == len([e for e in parent.log if e[0] == "write"]) + 2  # nothing more to the parent


def test_an_idle_forked_child_opens_no_channel(make):
    rig = make(manual=False)
    assert rig.p.stop(5.0) is True
    rig.p._after_fork_in_child()
    time.sleep(0.2)  # some hundred idle cycles, nothing submitted
    assert len(rig.open_threads) == 1  # the parent's only
