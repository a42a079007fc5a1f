"""otel_hicache.gil_slice (OTEL_HICACHE_GIL_SLICE_US): pauses past the budget, turns shared by
otel-hicache's threads, a fresh turn after fork, and the worker's use of them."""

from __future__ import annotations

import os
import statistics
import threading
import time

import pytest

from otel_hicache import gil_slice
from otel_hicache.gil_slice import GilSlice
from otel_hicache.pipeline import PipelineSettings
from otel_hicache.records import submission

from test_pipeline import Event, Rig, done_op


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_zero_budget_never_pauses_nor_takes_the_turn():
    off, other = GilSlice(0), GilSlice(50)
    off.begin()
    spin(0.001)
    off.check()
    other.begin()  # the turn is free: it does not wait
    assert other._held is not None
    other.end()
    off.end()
    assert off.pauses == 0 and off._held is None


def test_it_pauses_once_the_budget_is_spent_and_counts_afresh_after():
    sliced = GilSlice(2000)  # 2 ms
    sliced.begin()
    try:
        sliced.check()
        assert sliced.pauses == 0  # well within the budget
        spin(0.003)
        sliced.check()
        assert sliced.pauses == 1
        sliced.check()
        assert sliced.pauses == 1  # the budget counts from the pause
    finally:
        sliced.end()
    assert sliced.check is not sliced._check  # outside a turn: no pauses


def test_an_unsliced_turn_never_pauses():
    sliced = GilSlice(1)
    sliced.begin(sliced=False)
    spin(0.001)
    sliced.check()
    sliced.end()
    assert sliced.pauses == 0


def test_turns_are_taken_one_at_a_time():
    first, second = GilSlice(50), GilSlice(50)
    order = []
    first.begin()

    def other():
        second.begin()
        order.append("second began")
        second.end()

    thread = threading.Thread(target=other)
    thread.start()
    time.sleep(0.02)  # well under the turn's longest wait
    order.append("first ends")
    first.end()
    thread.join(5)
    assert order == ["first ends", "second began"]


def test_a_turn_is_waited_for_a_bounded_time(monkeypatch):
    monkeypatch.setattr(gil_slice, "_TURN_WAIT_S", 0.01)
    stuck, late = GilSlice(50), GilSlice(50)
    stuck.begin()
    try:
        done = threading.Event()

        def other():
            late.begin()  # proceeds without the turn
            late.end()  # and releases nothing it does not hold
            done.set()

        threading.Thread(target=other).start()
        assert done.wait(5)
        assert late._held is None and gil_slice._turn.locked()  # still the stuck one's
    finally:
        stuck.end()
    assert not gil_slice._turn.locked()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_has_a_turn_of_its_own():
    holder = GilSlice(50)
    holder.begin()  # held at fork, as by a worker in the middle of a cycle
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover (the child)
            child = GilSlice(50)
            started = time.monotonic()
            child.begin()
            waited = time.monotonic() - started
            os._exit(0 if child._held is not None and waited < gil_slice._TURN_WAIT_S else 1)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    finally:
        holder.end()


def wake_lateness_beside(budget_us: float) -> float:
    """Median lateness (s) of 1 ms sleeps of this thread while another spins in Python with
    GilSlice(budget_us).check() between units of ~20 us."""
    stop = threading.Event()
    sliced = GilSlice(budget_us)

    def spinner():
        sliced.begin()
        try:
            while not stop.is_set():
                spin(20e-6)
                sliced.check()
        finally:
            sliced.end()

    thread = threading.Thread(target=spinner)
    thread.start()
    late = []
    try:
        time.sleep(0.02)
        for _ in range(60):
            t0 = time.perf_counter()
            time.sleep(0.001)
            late.append(time.perf_counter() - t0 - 0.001)
    finally:
        stop.set()
        thread.join(5)
    return statistics.median(late)


def test_pauses_let_a_sleeping_thread_have_the_gil_when_it_wakes():
    # Side by side in one run, no absolute time: without pauses the spinner lets go of the
    # GIL only at the forced switch (sys.getswitchinterval(), 5 ms); with them, every 200 us.
    unsliced = wake_lateness_beside(0)
    sliced = wake_lateness_beside(200)
    assert sliced < unsliced / 2, (sliced, unsliced)


# -- the completion worker ----------------------------------------------------------------------------

def test_the_worker_reads_its_budget_from_the_environment(monkeypatch):
    monkeypatch.setenv("OTEL_HICACHE_GIL_SLICE_US", "75")
    assert PipelineSettings.from_environment().gil_slice_us == 75.0
    monkeypatch.setenv("OTEL_HICACHE_GIL_SLICE_US", "-1")  # malformed: warned, the default (off)
    assert PipelineSettings.from_environment().gil_slice_us == 0.0


def test_a_sliced_cycle_pauses_between_records_and_reports_them_unchanged():
    rig = Rig(cap=16)
    rig.p._slice = GilSlice(0.001)  # every unit over budget: a pause at each check
    for _ in range(4):
        rig.submit(Event(done=True))
    rig.p._slice.begin()
    try:
        rig.cycle()
    finally:
        rig.p._slice.end()
    calls = rig.take()
    assert calls == [("submitted", i) for i in range(4)] + [c for i in range(4) for c in done_op(i)]
    # 4 intake items, 4 records polled, 2 checks inside each record's completion, the counters' flush
    assert rig.p._slice.pauses >= 16


def test_the_worker_pauses_only_without_a_backlog():
    rig = Rig(manual=False, cap=1000)
    try:
        rig.p._slice = GilSlice(0.001)
        backlog = [submission("offload", {"kv": 64}, 4096, 64, None, Event(done=True), False, submit_ns=rig.clock())
                   for _ in range(300)]
        rig.p.queue.extend(backlog)  # over _UNSLICED_BACKLOG, queued at once (one C call)
        assert rig.p.flush(10)
        assert rig.p._slice.pauses == 0  # the backlog's cycle ran unsliced
        for _ in range(3):
            rig.submit(Event(done=True))
        assert rig.p.flush(10)
        assert rig.p._slice.pauses > 0
        assert sum(1 for c in rig.rec.calls if c[0] == "finish") == 303
    finally:
        rig.p.stop(2)
