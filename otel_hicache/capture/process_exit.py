"""Run shutdown hooks at process exit, including ``multiprocessing`` children.

``atexit`` handlers do not run in a ``multiprocessing`` child: its bootstrap
ends with ``os._exit()``, after running only ``multiprocessing.util``
finalizers. SGLang starts its schedulers that way (spawn), so each hook is
registered both ways; hooks must be idempotent (the second call does nothing).
A child started with the *fork* method inherits the parent's finalizers, but
its bootstrap clears them: the hooks are registered again there, from
``multiprocessing``'s own after-fork callbacks (which run after that clear).
Higher ``priority`` runs first in a child; in the main process ``atexit`` runs
hooks in reverse registration order.
"""

from __future__ import annotations

import atexit
from typing import Any, Callable


class _Hooks:
    """Every hook registered in this process (a weak-referenceable holder for
    ``multiprocessing.util.register_after_fork``)."""

    def __init__(self) -> None:
        self.items: list[tuple[Callable[..., Any], tuple[Any, ...], int]] = []


_hooks = _Hooks()


def on_exit(hook: Callable[..., Any], *args: Any, priority: int = 0) -> None:
    atexit.register(hook, *args)
    _hooks.items.append((hook, args, priority))
    _finalize(hook, args, priority)


def _finalize(hook: Callable[..., Any], args: tuple[Any, ...], priority: int) -> None:
    try:
        from multiprocessing import util

        util.Finalize(None, hook, args=args, exitpriority=priority)
    except Exception:  # pylint: disable=broad-except  # atexit alone still covers the main process
        pass


def _after_fork_in_multiprocessing_child(hooks: _Hooks) -> None:
    for hook, args, priority in hooks.items:
        _finalize(hook, args, priority)


try:
    from multiprocessing import util as _mp_util

    _mp_util.register_after_fork(_hooks, _after_fork_in_multiprocessing_child)
except Exception:  # pylint: disable=broad-except
    pass
