"""Fork hooks, registered after the SDK's: a child's callbacks take no foreign lock and open nothing."""

from __future__ import annotations

import os
import threading
import time
import weakref
from typing import Any, Callable

from ..diagnostics import warn_once

_lock = threading.Lock()
_callbacks: list[Callable[[], Any]] = []  # weak handles (None once collected)
_registered = _gated = False


def after_fork_in_child(callback: Callable[[], Any]) -> None:
    """Call ``callback()`` in every child forked while it lives (a bound method is held weakly)."""
    global _registered
    with _lock:
        if not _registered:
            os.register_at_fork(after_in_child=_run_in_child)
            _registered = True
        _callbacks[:] = [handle for handle in _callbacks if handle() is not None]
        _callbacks.append(weakref.WeakMethod(callback) if hasattr(callback, "__func__") else lambda: callback)


def _run_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # another thread may have held the parent's
    for callback in filter(None, [handle() for handle in _callbacks]):
        try:
            callback()
        except Exception as exc:
            warn_once(f"fork:{type(exc).__name__}", "otel-hicache: after fork, %r failed: %r", callback, exc)


# a child forked while gRPC is inside a call can never export over gRPC: fork() waits for our exports
FORK_WAIT_S = 2.0
_gate = threading.Lock()  # held through a fork
_exports: set[object] = set()  # under way (add and discard are atomic)


def quiet_at_fork(export: Callable[..., Any]) -> Callable[..., Any]:
    """``export``, never running across a ``fork()``."""
    global _gated
    with _lock:
        if not _gated:
            os.register_at_fork(before=_before_fork, after_in_parent=lambda: _gate.release(), after_in_child=_new_gate)
            _gated = True

    def gated(*args: Any, **kwargs: Any) -> Any:
        with _gate:
            _exports.add(key := object())
        try:
            return export(*args, **kwargs)
        finally:
            _exports.discard(key)

    return gated


def _before_fork() -> None:
    _gate.acquire()
    deadline = time.monotonic() + FORK_WAIT_S
    while _exports and time.monotonic() < deadline:
        time.sleep(0.001)


def _new_gate() -> None:
    global _gate
    _gate = threading.Lock()  # the parent's is held
    _exports.clear()
