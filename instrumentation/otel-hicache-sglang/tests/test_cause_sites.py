"""The cause sites and the queued-op tags (``otel_hicache_sglang.causes``), on stand-in objects."""

from __future__ import annotations

from typing import Any

import logging
import sys
import threading
import types

from otel_hicache_sglang.causes import MAX_ID_RANGES, MAX_LOG, Local, QueuedCauses, Site, backup_cause


class Op:
    """A stand-in for SGLang's CacheOperation: numbered in creation order."""

    counter = 0

    def __init__(self, what, n):
        self.what, self.n = what, n
        self.id = Op.counter
        Op.counter += 1

    def __eq__(self, other):
        return (self.what, self.n) == other

    def __repr__(self):
        return f"Op({self.what!r}, {self.n})"


class Controller:
    def __init__(self, write_policy="write_through"):
        self.write_queue, self.load_queue = [], []
        self.write_policy = write_policy

    def _num_tokens_by_pool(self, op):  # SGLang's, for a mixed merged op's parts
        return {"kv": op.n}

    def _transfer_num_bytes(self, op):
        return 10 * op.n


class Cache:
    def __init__(self, controller):
        self.cache_controller = controller


def _queued(local=None):
    return QueuedCauses(local or Local(), operations=Op)


def _hand_over(queued, controller, name):
    """What start_* passes to submit() (as transfers.py does): (cause, requests)."""
    other = controller.load_queue if name == "write_queue" else controller.write_queue
    cause, requests = queued.pending(controller, list(getattr(controller, name)), other)
    return queued.hand_over(cause), requests


def _take(queued, controller, name):
    """What start_* hands the worker, then what the worker works out: (cause or parts, requests)."""
    cause, requests = _hand_over(queued, controller, name)
    return (cause[0](*cause[1:]) if type(cause) is tuple else cause), (requests or None)


def _wrapped(wrapper, fn):
    """``fn(instance, ...)`` called through a wrapt-style ``wrapper``, as the patcher installs it."""
    return lambda instance, *args, **kwargs: wrapper(lambda *a, **kw: fn(instance, *a, **kw), instance, args, kwargs)


def _sites(queued):
    """Two sites: `backup` queues a write, `load_back` queues a load and, first, runs `inner` (nested)."""
    def backup(cache, n, write_back=False):
        cache.cache_controller.write_queue.append(Op("write", n))

    def load_back(cache, n, inner=None):
        if inner:
            inner()
        cache.cache_controller.load_queue.append(Op("load", n))
        cache.cache_controller.write_queue.append(Op("write-in-load", n))  # an outer site's own write

    return _site(queued, backup_cause, backup), _site(queued, "prefix_hit", load_back)


def _site(queued, cause, fn):
    """``fn(cache, ...)`` wrapped as a cause site of ``cause``, its controller the cache's."""
    return _wrapped(queued.site(Site("m", "C.f", cause, lambda c: c.cache_controller)), fn)


def test_ops_are_tagged_with_the_site_that_queued_them_and_start_takes_them():
    queued = _queued()
    backup, load_back = _sites(queued)
    cache = Cache(Controller())
    controller = cache.cache_controller
    backup(cache, 1)
    backup(cache, 2, write_back=True)
    controller.write_queue.append(Op("by hand", 3))  # no site: other
    assert _take(queued, controller, "write_queue") == (
        [("write_through", {"kv": 1}, 10), ("write_back", {"kv": 2}, 20), ("other", {"kv": 3}, 30)], None)
    controller.write_queue.clear()
    backup(cache, 4)
    assert _take(queued, controller, "write_queue") == ("write_through", None)  # one cause: a string


def test_a_nested_site_keeps_its_own_ops_and_the_outer_site_tags_only_the_rest():
    queued = _queued()
    backup, load_back = _sites(queued)
    cache = Cache(Controller())
    Op("made before, queued by hand", 0)  # ids in between that no queue holds
    load_back(cache, 1, inner=lambda: backup(cache, 9, write_back=True))
    controller = cache.cache_controller
    assert _take(queued, controller, "load_queue") == ("prefix_hit", None)
    controller.load_queue.clear()  # start_loading consumed it
    assert _take(queued, controller, "write_queue") == (
        [("write_back", {"kv": 9}, 90), ("prefix_hit", {"kv": 1}, 10)], None)
    assert queued.by_controller[id(controller)] == ([], [])  # nothing waits: every id range dropped


def test_id_ranges_of_ops_waiting_in_the_other_queue_are_kept():
    queued = _queued()
    backup, load_back = _sites(queued)
    cache = Cache(Controller())
    controller = cache.cache_controller
    load_back(cache, 1)  # a load and a write
    for i in range(3):
        backup(cache, 10 + i)
    assert _take(queued, controller, "write_queue")[0] == [
        ("prefix_hit", {"kv": 1}, 10), ("write_through", {"kv": 10}, 100), ("write_through", {"kv": 11}, 110),
        ("write_through", {"kv": 12}, 120)]
    controller.write_queue.clear()
    ends, _ = queued.by_controller[id(controller)]
    assert len(ends) == 4  # the load waits: no id range ending after it is dropped
    assert _take(queued, controller, "load_queue") == ("prefix_hit", None)
    assert ends == []  # then nothing waits


def test_a_start_that_submits_nothing_hands_nothing_over():
    """A start_* whose copy has no ack (or that copies nothing) leaves the log to the next one."""
    queued = _queued()
    backup, _ = _sites(queued)
    cache = Cache(Controller())
    controller = cache.cache_controller
    backup(cache, 1)
    queued.pending(controller, list(controller.write_queue), controller.load_queue)
    assert len(queued.log) == 1
    assert _take(queued, controller, "write_queue") == ("write_through", None) and not queued.log


def test_a_merged_op_asked_twice_sorts_its_log_in_once():
    """Two copies of one merged op carry the same deferred call: the log of another controller's
    sites, handed over with it, is sorted in once (its id ranges stay in order)."""
    queued = _queued()
    backup, _ = _sites(queued)
    cache, other = Cache(Controller()), Cache(Controller())
    backup(other, 1)  # logged for the other controller
    cache.cache_controller.write_queue.append(Op("by hand", 2))
    cause, _ = _hand_over(queued, cache.cache_controller, "write_queue")
    assert cause[0](*cause[1:]) is None and cause[0](*cause[1:]) is None  # no site: other, twice
    assert len(queued.by_controller[id(other.cache_controller)][0]) == 1


def test_a_start_inside_a_site_gives_untagged_ops_the_site_cause():
    """HiCacheController.write flushes at once: start_* runs inside the site, before it returns."""
    local = Local()
    queued = _queued(local)
    seen = []

    def backup(cache, n):
        controller = cache.cache_controller
        controller.write_queue.append(Op("write", n))
        seen.append(_take(queued, controller, "write_queue"))  # start_writing
        controller.write_queue.clear()
        controller.write_queue.append(Op("queued after the flush", n))

    site = _site(queued, "write_back", backup)
    cache = Cache(Controller())
    site(cache, 1)
    assert seen == [("write_back", None)] and local.cause is None
    # the queue was consumed during the call: what is in it now is the site's too
    assert _take(queued, cache.cache_controller, "write_queue") == ("write_back", None)


def test_requests_of_request_causes_are_taken_with_the_cause():
    local = Local()
    queued = _queued(local)
    backup, load_back = _sites(queued)
    cache = Cache(Controller())
    controller = cache.cache_controller
    request = {"a request": "context"}
    queued.linking = True  # request sites wrapped
    local.request, local.thread = request, threading.get_ident()
    load_back(cache, 1)
    backup(cache, 2, write_back=True)  # a write-back belongs to no one request
    local.request = None
    assert _take(queued, controller, "load_queue") == ("prefix_hit", [request])
    assert _take(queued, controller, "write_queue") == (
        [("prefix_hit", {"kv": 1}, 10), ("write_back", {"kv": 2}, 20)], [request])


def test_selective_policy_and_a_broken_site_never_raise(caplog):
    queued = _queued()
    backup, _ = _sites(queued)
    cache = Cache(Controller("write_through_selective"))
    backup(cache, 1)
    assert _take(queued, cache.cache_controller, "write_queue") == ("write_through_selective", None)

    calls = []
    broken = _wrapped(queued.site(Site("m", "C.f", "prefix_hit", lambda c: c.missing_attribute)),
                      lambda cache, x: calls.append(x) or Op("write", x))
    with caplog.at_level(logging.WARNING, logger="otel_hicache"):
        assert broken(cache, 5) == ("write", 5) and broken(cache, 6) == ("write", 6)
        assert _take(queued, cache.cache_controller, "write_queue") == (None, None)  # logged, not tagged
    assert calls == [5, 6]
    assert sum("cannot tag queued ops" in r.getMessage() for r in caplog.records) == 1


def test_the_log_and_the_id_ranges_of_ops_that_left_without_a_start_are_bounded(caplog):
    """reset() clears SGLang's queues without a start_*: their site calls must not pile up,
    neither logged (no merged op hands them over) nor sorted (another controller's merged
    ops do); a merged op of their own controller drops them."""
    queued = _queued()
    backup, _ = _sites(queued)
    cache, busy = Cache(Controller()), Cache(Controller())
    controller = cache.cache_controller
    with caplog.at_level(logging.WARNING, logger="otel_hicache"):
        for i in range(MAX_LOG + 10):
            backup(cache, i)
            controller.write_queue.clear()  # reset()
        assert len(queued.log) == MAX_LOG
        controller.write_queue.append(Op("by hand", 0))  # the next merged op hands the log over
        assert _take(queued, controller, "write_queue") == ("other", None) and not queued.log
        assert queued.by_controller[id(controller)] == ([], [])  # the ops reset() dropped are done with
        controller.write_queue.clear()
        for i in range(3 * MAX_ID_RANGES):
            backup(cache, i)
            controller.write_queue.clear()
            backup(busy, i)
            assert _take(queued, busy.cache_controller, "write_queue") == ("write_through", None)
            busy.cache_controller.write_queue.clear()
    assert len(queued.by_controller[id(controller)][0]) <= MAX_ID_RANGES
    assert queued.by_controller[id(busy.cache_controller)] == ([], [])
    for message in ("no merged op followed", "id ranges of queued ops kept for one controller"):
        assert sum(message in r.getMessage() for r in caplog.records) == 1
    backup(cache, 1)
    assert _take(queued, controller, "write_queue") == ("write_through", None)
    assert queued.by_controller[id(controller)] == ([], [])  # the ops reset() dropped are done with


def test_without_sglangs_counter_nothing_is_tagged_and_it_is_said_once(caplog, monkeypatch):
    module = types.SimpleNamespace(CacheOperation=object)  # a CacheOperation without .counter
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.cache_controller", module)
    queued = QueuedCauses(Local(), operations=None)
    backup, _ = _sites(queued)
    cache = Cache(Controller())
    with caplog.at_level(logging.WARNING, logger="otel_hicache"):
        backup(cache, 1)
        backup(cache, 2)
    assert _take(queued, cache.cache_controller, "write_queue") == (None, None)
    assert sum("CacheOperation.counter is missing" in r.getMessage() for r in caplog.records) == 1


def test_the_cause_and_held_copies_belong_to_the_thread_that_set_them():
    """SGLang copies on its scheduler thread; a copy on another thread meanwhile is not its."""
    local = Local()
    local.cause, local.thread = "prefix_hit", threading.get_ident()
    seen = []
    other = threading.Thread(target=lambda: seen.append(local.current_cause()))
    other.start()
    other.join()
    assert seen == [None] and local.current_cause() == "prefix_hit"


def test_the_worker_resolves_later_and_keeps_the_ranges_of_ops_queued_since():
    """start_* hands over copies of the queues; the worker resolves them after more sites ran."""
    queued = _queued()
    backup, load_back = _sites(queued)
    cache = Cache(Controller())
    controller = cache.cache_controller
    backup(cache, 1)
    first, _ = _hand_over(queued, controller, "write_queue")
    controller.write_queue.clear()  # start_writing merged it
    backup(cache, 2, write_back=True)  # queued before the worker got to the first merged op
    load_back(cache, 3)
    resolve, *args = first
    assert resolve(*args) == "write_through" and resolve(*args) == "write_through"  # asked again: the same answer
    assert _take(queued, controller, "load_queue") == ("prefix_hit", None)
    controller.load_queue.clear()
    assert _take(queued, controller, "write_queue") == (
        [("write_back", {"kv": 2}, 20), ("prefix_hit", {"kv": 3}, 30)], None)
    assert queued.by_controller[id(controller)] == ([], [])
    controller.write_queue.clear()
    controller.write_queue.append(Op("by hand", 4))
    assert _take(queued, controller, "write_queue") == (None, None)  # other
    assert _hand_over(_queued(), controller, "write_queue") == (None, None)  # no site


def test_causes_stay_exact_while_the_worker_resolves_beside_the_sites():
    """Sites and start_* on one thread, resolve() on another (the worker), switching often."""
    import queue
    import random
    import sys

    queued = _queued()

    def write(cache, n, truth):
        op = Op("write", n)
        op.truth = truth
        cache.cache_controller.write_queue.append(op)

    def load(cache, n, truth):
        op = Op("load", n)
        op.truth = truth
        cache.cache_controller.load_queue.append(op)

    backup = _site(queued, "write_through", lambda cache, n: write(cache, n, "write_through"))
    evict = _site(queued, "write_back", lambda cache, n: write(cache, n, "write_back"))
    load_back = _site(queued, "prefix_hit", lambda cache, n: (load(cache, n, "prefix_hit"), backup(cache, n)))
    cache = Cache(Controller())
    controller = cache.cache_controller
    handed: queue.Queue = queue.Queue()
    wrong: list[Any] = []

    def worker():
        while (item := handed.get()) is not None:
            cause, ops = item
            got = (cause[0](*cause[1:]) if type(cause) is tuple else cause) or "other"  # None: other
            truths = [op.truth for op in ops]
            want = truths[0] if len(set(truths)) == 1 else [(t, {"kv": op.n}, 10 * op.n) for op, t in zip(ops, truths)]
            if got != want:
                wrong.append((got, want))

    thread = threading.Thread(target=worker)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread.start()
    try:
        rng = random.Random(7)
        for n in range(1, 20001):
            step = rng.random()
            if step < 0.3:
                backup(cache, n)
            elif step < 0.4:
                evict(cache, n)
            elif step < 0.55:
                load_back(cache, n)
            elif step < 0.6:
                write(cache, n, "other")  # queued by hand: no site
            name = rng.choice(("write_queue", "load_queue")) if step > 0.7 else None
            if name and getattr(controller, name):
                ops = getattr(controller, name)
                other = controller.load_queue if name == "write_queue" else controller.write_queue
                cause, _ = queued.pending(controller, list(ops), other)
                handed.put((queued.hand_over(cause), list(ops)))
                ops.clear()
    finally:
        handed.put(None)
        thread.join()
        sys.setswitchinterval(interval)
    assert wrong == []
