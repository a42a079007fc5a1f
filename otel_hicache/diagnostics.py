"""One-time warnings and strict mode.

Instrumentation must never raise into the host application: misuse and
failures are reported once per distinct problem through the ``otel_hicache``
logger, and counted in self-metrics. ``OTEL_HICACHE_STRICT=true`` turns API misuse
into exceptions for tests.
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("otel_hicache")

_lock = threading.Lock()
_warned: set[str] = set()


def warn_once(key: str, message: str, *args: object) -> bool:
    """Log ``message`` at WARNING the first time ``key`` is seen in this process.

    Returns True when the warning was emitted.
    """
    with _lock:
        if key in _warned:
            return False
        _warned.add(key)
    logger.warning(message, *args)
    return True


def reset_warnings() -> None:
    """Forget which warnings were emitted (tests, and the child after fork)."""
    with _lock:
        _warned.clear()
