"""The cause sites and the queued-op tags (``otel_hicache_sglang.causes``), on stand-in objects."""

from __future__ import annotations

import logging
import threading

from otel_hicache_sglang import causes
from otel_hicache_sglang.causes import MAX_ID_RANGES, QueuedCauses, Site, backup_cause
from otel_hicache_sglang.transfers import _Capture as Local


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


class Cache:
    def __init__(self, controller):
        self.cache_controller = controller


def _queued(local=None):
    return QueuedCauses(local or Local(), operations=Op)


def _take(queued, controller, name):
    other = controller.load_queue if name == "write_queue" else controller.write_queue
    return queued.take(controller, getattr(controller, name), other)


def _sites(queued):
    """Two sites: `backup` queues a write, `load_back` queues a load and, first, runs `inner` (nested)."""
    def backup(cache, n, write_back=False):
        cache.cache_controller.write_queue.append(Op("write", n))

    def load_back(cache, n, inner=None):
        if inner:
            inner()
        cache.cache_controller.load_queue.append(Op("load", n))
        cache.cache_controller.write_queue.append(Op("write-in-load", n))  # an outer site's own write

    make = lambda cause, fn: queued.site(Site("m", "C.f", cause, lambda c: c.cache_controller)).make(fn)
    return make(backup_cause, backup), make("prefix_hit", load_back)


def test_ops_are_tagged_with_the_site_that_queued_them_and_start_takes_them():
    queued = _queued()
    backup, load_back = _sites(queued)
    cache = Cache(Controller())
    controller = cache.cache_controller
    backup(cache, 1)
    backup(cache, 2, write_back=True)
    controller.write_queue.append(Op("by hand", 3))  # no site: other
    assert _take(queued, controller, "write_queue") == (
        ([("write", 1), ("write", 2), ("by hand", 3)], ["write_through", "write_back", "other"]), None)
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
        ([("write", 9), ("write-in-load", 1)], ["write_back", "prefix_hit"]), None)
    assert queued.by_controller[id(controller)] == ([], [])  # nothing waits: every id range dropped


def test_id_ranges_of_ops_waiting_in_the_other_queue_are_kept():
    queued = _queued()
    backup, load_back = _sites(queued)
    cache = Cache(Controller())
    controller = cache.cache_controller
    load_back(cache, 1)  # a load and a write
    for i in range(3):
        backup(cache, 10 + i)
    assert _take(queued, controller, "write_queue")[0] == (
        [("write-in-load", 1), ("write", 10), ("write", 11), ("write", 12)],
        ["prefix_hit", "write_through", "write_through", "write_through"])
    controller.write_queue.clear()
    ends, _ = queued.by_controller[id(controller)]
    assert len(ends) == 4  # the load waits: no id range ending after it is dropped
    assert _take(queued, controller, "load_queue") == ("prefix_hit", None)
    assert ends == []  # then nothing waits


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

    site = queued.site(Site("m", "C.f", "write_back", lambda c: c.cache_controller)).make(backup)
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
    local.request, local.thread = request, threading.get_ident()
    load_back(cache, 1)
    backup(cache, 2, write_back=True)  # a write-back belongs to no one request
    local.request = None
    assert _take(queued, controller, "load_queue") == ("prefix_hit", [request])
    assert _take(queued, controller, "write_queue") == (
        ([("write-in-load", 1), ("write", 2)], ["prefix_hit", "write_back"]), [request])


def test_selective_policy_and_a_broken_site_never_raise(caplog):
    queued = _queued()
    backup, _ = _sites(queued)
    cache = Cache(Controller("write_through_selective"))
    backup(cache, 1)
    assert _take(queued, cache.cache_controller, "write_queue") == ("write_through_selective", None)

    calls = []
    broken = queued.site(Site("m", "C.f", "prefix_hit", lambda c: c.missing_attribute)).make(
        lambda cache, x: calls.append(x) or Op("write", x))
    with caplog.at_level(logging.WARNING, logger="otel_hicache"):
        assert broken(cache, 5) == ("write", 5) and broken(cache, 6) == ("write", 6)
    assert calls == [5, 6]
    assert sum("cannot tag queued ops" in r.getMessage() for r in caplog.records) == 1


def test_id_ranges_of_ops_that_left_without_a_start_are_bounded():
    """reset() clears SGLang's queues without a start_*: their id ranges must not pile up."""
    queued = _queued()
    backup, _ = _sites(queued)
    cache = Cache(Controller())
    for i in range(3 * MAX_ID_RANGES):
        backup(cache, i)
        cache.cache_controller.write_queue.clear()  # reset()
    assert len(queued.by_controller[id(cache.cache_controller)][0]) <= MAX_ID_RANGES


def test_without_sglangs_counter_nothing_is_tagged_and_it_is_said_once(caplog, monkeypatch):
    monkeypatch.setattr(causes, "_cache_operation", lambda: None)  # a CacheOperation without .counter
    queued = QueuedCauses(Local(), operations=None)
    with caplog.at_level(logging.WARNING, logger="otel_hicache"):
        backup, _ = _sites(queued)
    cache = Cache(Controller())
    backup(cache, 1)
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
