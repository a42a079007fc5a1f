"""What every part of otel-hicache does in a forked child (SGLang's schedulers), behind one at-fork
registration: ``os.register_at_fork`` callbacks can never be removed, so objects register weakly
here and a collected one costs nothing in later forks. The registration is made with the first
callback, after the SDK objects ``configure()`` built registered theirs (callbacks run in
registration order). Callbacks must not take foreign locks nor open anything: a child's channel is
opened by its first submit, after fork() returned (``tests/test_fork_exit.py``)."""

from __future__ import annotations

import os
import threading
import time
import weakref
from typing import Any, Callable

from ..diagnostics import warn_once

_lock = threading.Lock()
_callbacks: list[Callable[[], Callable[[], Any] | None]] = []  # weak handles: call one for the callback
_registered = False
_prune_at = 64  # dead handles are dropped when the list reaches this length (then twice the live ones)


def after_fork_in_child(callback: Callable[[], Any]) -> None:
    """Call ``callback()`` in every child forked after this, while it is alive (a bound method is
    held weakly, a function strongly)."""
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


# gRPC skips its fork handlers while another thread is inside a call, and a child forked then can
# never export over gRPC: a fork waits (at most FORK_WAIT_S) for otel-hicache's exports to end and
# holds new ones back until fork() returned.
FORK_WAIT_S = 2.0
_exports = threading.Condition()
_exporting = 0
_forking = False
_gate_registered = False


def quiet_at_fork(export: Callable[..., Any]) -> Callable[..., Any]:
    """``export`` so that a ``fork()`` never happens while it runs."""
    global _gate_registered
    with _lock:
        if not _gate_registered and hasattr(os, "register_at_fork"):
            os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                                after_in_child=_after_fork_in_child_exports)
            _gate_registered = True

    def gated(*args: Any, **kwargs: Any) -> Any:
        global _exporting
        with _exports:
            while _forking:
                _exports.wait()
            _exporting += 1
        try:
            return export(*args, **kwargs)
        finally:
            with _exports:
                _exporting -= 1
                _exports.notify_all()

    return gated


def _before_fork() -> None:
    global _forking
    deadline = time.monotonic() + FORK_WAIT_S
    with _exports:
        _forking = True
        while _exporting and (left := deadline - time.monotonic()) > 0:
            _exports.wait(left)


def _after_fork_in_parent() -> None:
    global _forking
    with _exports:
        _forking = False
        _exports.notify_all()


def _after_fork_in_child_exports() -> None:
    global _exports, _exporting, _forking
    _exports, _exporting, _forking = threading.Condition(), 0, False  # the parent's exports are not ours
