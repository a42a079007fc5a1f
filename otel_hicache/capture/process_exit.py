"""Idempotent exit hooks, also as ``multiprocessing`` finalizers (again in each fork child, which runs only
those); a higher ``priority`` runs first there."""

from __future__ import annotations

import atexit
from multiprocessing import util
from typing import Any, Callable

_hooks: list[tuple] = []


def on_exit(hook: Callable[..., Any], *args: Any, priority: int) -> None:
    atexit.register(hook, *args)
    _hooks.append((hook, args, priority))
    util.Finalize(None, hook, args=args, exitpriority=priority)


def _after_fork(_: Any) -> None:
    for hook, args, priority in _hooks:
        util.Finalize(None, hook, args=args, exitpriority=priority)


util.register_after_fork(_after_fork, _after_fork)
