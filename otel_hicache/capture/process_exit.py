"""Exit hooks that also run in ``multiprocessing`` children (SGLang's schedulers), whose bootstrap
ends with ``os._exit()`` after ``multiprocessing.util`` finalizers only: each hook is registered
both ways and must be idempotent. A *fork* child's bootstrap clears the inherited finalizers, so
they are registered again from ``multiprocessing``'s after-fork callbacks. Higher ``priority`` runs
first in a child; ``atexit`` runs hooks in reverse registration order."""

from __future__ import annotations

import atexit
from typing import Any, Callable


class _Hooks:
    """Every hook registered here (weak-referenceable, for ``register_after_fork``)."""

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
    except Exception:  # atexit alone still covers the main process
        pass


def _after_fork(hooks: _Hooks) -> None:
    for hook, args, priority in hooks.items:
        _finalize(hook, args, priority)


try:
    from multiprocessing import util as _mp_util

    _mp_util.register_after_fork(_hooks, _after_fork)
except Exception:
    pass
