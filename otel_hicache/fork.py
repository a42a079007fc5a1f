"""What every part of otel-hicache does in a forked child, behind one at-fork registration.

SGLang runs its schedulers in child processes. Threads do not survive ``fork()``, and
state copied from the parent (queues, counts, providers) is the parent's, so objects that
hold any register a callback here. ``os.register_at_fork`` callbacks can never be
removed, so this module registers exactly one and keeps weak references to what it
calls: a pipeline or a count that was garbage-collected costs nothing in later forks
(the SDK's batch processor does the same with ``WeakMethod``).

The one registration is made with the first callback, not at import, so it comes after
the SDK objects ``configure()`` builds have registered theirs (callbacks run in
registration order). Callbacks must not take foreign locks: a worker restarted here
builds nothing, and a child's providers are built by its first submit, after fork()
returned (``tests/test_fork.py`` hung when the worker built them at once), never in an
exit hook (``tests/test_fork_exit.py``).
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Callable

from .diagnostics import warn_once

_lock = threading.Lock()
_callbacks: list[Callable[[], Callable[[], Any] | None]] = []  # weak handles: call one for the callback
_registered = False
# Dead handles are dropped when the list reaches this length (then twice the live ones): a
# process that makes telemetry again and again keeps a list as long as what is alive.
_prune_at = 64


def after_fork_in_child(callback: Callable[[], Any]) -> None:
    """Call ``callback()`` in every child forked after this, while it is alive.

    A bound method is held through ``weakref.WeakMethod`` (it does not keep its object
    alive); a plain function is held strongly. Callbacks run in registration order.
    """
    handle: Callable[[], Callable[[], Any] | None]
    if hasattr(callback, "__self__") and hasattr(callback, "__func__"):
        handle = weakref.WeakMethod(callback)
    else:
        def handle(fn: Callable[[], Any] = callback) -> Callable[[], Any]:
            return fn
    global _registered, _prune_at
    with _lock:
        _callbacks.append(handle)
        if len(_callbacks) >= _prune_at:
            _callbacks[:] = [h for h in _callbacks if h() is not None]
            _prune_at = max(64, 2 * len(_callbacks))
        if not _registered and hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=_run_in_child)
            _registered = True


def _run_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # the parent's may have been held by another thread at fork
    alive = []
    for handle in _callbacks:
        callback = handle()
        if callback is None:
            continue
        alive.append(handle)
        try:
            callback()
        except Exception as exc:  # one part's failure must not stop the others or the child
            warn_once(f"fork:{type(exc).__name__}", "otel-hicache: after fork, %r failed: %r", callback, exc)
    _callbacks[:] = alive

