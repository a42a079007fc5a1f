"""The cause sites and the queued-op tags (``otel_hicache_sglang.causes``), on stand-in objects."""

from __future__ import annotations

import logging

from otel_hicache_sglang.causes import QueuedCauses, Site, backup_cause
from otel_hicache_sglang.transfers import _Capture as Local


class Controller:
    def __init__(self, write_policy="write_through"):
        self.write_queue, self.load_queue = [], []
        self.write_policy = write_policy


class Cache:
    def __init__(self, controller):
        self.cache_controller = controller


def _sites(queued):
    """Two sites: `backup` queues a write, `load_back` queues a load and, first, runs `inner` (nested)."""
    def backup(cache, n, write_back=False):
        cache.cache_controller.write_queue.append(("write", n))

    def load_back(cache, n, inner=None):
        if inner:
            inner()
        cache.cache_controller.load_queue.append(("load", n))
        cache.cache_controller.write_queue.append(("write-in-load", n))  # an outer site's own write

    make = lambda cause, fn: queued.site(Site("m", "C.f", cause, lambda c: c.cache_controller)).make(fn)
    return make(backup_cause, backup), make("prefix_hit", load_back)


def test_ops_are_tagged_with_the_site_that_queued_them_and_start_takes_them():
    queued = QueuedCauses(Local())
    backup, load_back = _sites(queued)
    cache = Cache(Controller())
    backup(cache, 1)
    backup(cache, 2, write_back=True)
    cache.cache_controller.write_queue.append(("by hand", 3))  # no site: other
    assert queued.take(cache.cache_controller.write_queue) == (
        [("write", 1), ("write", 2), ("by hand", 3)], ["write_through", "write_back", "other"])
    cache.cache_controller.write_queue.clear()
    backup(cache, 4)
    assert queued.take(cache.cache_controller.write_queue) == "write_through"  # one cause: a string


def test_a_nested_site_keeps_its_own_ops_and_the_outer_site_tags_only_the_rest():
    queued = QueuedCauses(Local())
    backup, load_back = _sites(queued)
    cache = Cache(Controller())
    load_back(cache, 1, inner=lambda: backup(cache, 9, write_back=True))
    controller = cache.cache_controller
    assert queued.take(controller.load_queue) == "prefix_hit"
    assert queued.take(controller.write_queue) == ([("write", 9), ("write-in-load", 1)], ["write_back", "prefix_hit"])


def test_a_start_inside_a_site_gives_untagged_ops_the_site_cause():
    """HiCacheController.write flushes at once: start_* runs inside the site, before it tags."""
    local = Local()
    queued = QueuedCauses(local)
    seen = []

    def backup(cache, n):
        cache.cache_controller.write_queue.append(("write", n))
        seen.append(queued.take(cache.cache_controller.write_queue))  # start_writing
        cache.cache_controller.write_queue.clear()
        cache.cache_controller.write_queue.append(("queued after the flush", n))

    site = queued.site(Site("m", "C.f", "write_back", lambda c: c.cache_controller)).make(backup)
    cache = Cache(Controller())
    site(cache, 1)
    assert seen == ["write_back"] and local.cause is None
    # the queue was consumed during the call: what is in it now is the site's too
    assert queued.take(cache.cache_controller.write_queue) == "write_back"


def test_selective_policy_and_a_broken_site_never_raise(caplog):
    queued = QueuedCauses(Local())
    backup, _ = _sites(queued)
    cache = Cache(Controller("write_through_selective"))
    backup(cache, 1)
    assert queued.take(cache.cache_controller.write_queue) == "write_through_selective"

    calls = []
    broken = queued.site(Site("m", "C.f", "prefix_hit", lambda c: c.missing_attribute)).make(
        lambda cache, x: calls.append(x) or "result")
    with caplog.at_level(logging.WARNING, logger="otel_hicache"):
        assert broken(cache, 5) == "result" and broken(cache, 6) == "result"
    assert calls == [5, 6]
    assert sum("cannot read the cause" in r.getMessage() for r in caplog.records) == 1


def test_tags_of_ops_that_left_without_a_start_are_pruned():
    """reset() clears SGLang's queues without a start_*: their tags must not pile up."""
    queued = QueuedCauses(Local())
    backup, _ = _sites(queued)
    cache = Cache(Controller())
    for i in range(500):
        backup(cache, i)
        cache.cache_controller.write_queue.clear()  # reset()
    assert len(queued.by_queue[id(cache.cache_controller.write_queue)]) <= 2 + 64


def test_the_cause_and_held_copies_belong_to_the_thread_that_set_them():
    """SGLang copies on its scheduler thread; a copy on another thread meanwhile is not its."""
    import threading

    local = Local()
    local.cause, local.thread = "prefix_hit", threading.get_ident()
    seen = []
    other = threading.Thread(target=lambda: seen.append(local.current_cause()))
    other.start()
    other.join()
    assert seen == [None] and local.current_cause() == "prefix_hit"
