"""Run shutdown hooks at process exit, including ``multiprocessing`` children.

``atexit`` handlers do not run in a ``multiprocessing`` child: its bootstrap
ends with ``os._exit()``, after running only ``multiprocessing.util``
finalizers. SGLang starts its schedulers that way (spawn), so each hook is
registered both ways; hooks must be idempotent (the second call does nothing).
Higher ``priority`` runs first in a child; in the main process ``atexit`` runs
hooks in reverse registration order.
"""

from __future__ import annotations

import atexit
from typing import Any, Callable


def on_exit(hook: Callable[..., Any], *args: Any, priority: int = 0) -> None:
    atexit.register(hook, *args)
    try:
        from multiprocessing import util

        util.Finalize(None, hook, args=args, exitpriority=priority)
    except Exception:  # pylint: disable=broad-except  # atexit alone still covers the main process
        pass
