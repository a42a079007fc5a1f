"""One-time warnings on the ``otel_hicache`` logger (never raised into the host), values quoted short, and
secrets withheld from our logger and, in our own process, the SDK's."""

from __future__ import annotations

import logging
import threading
from typing import Any, Iterable

logger = logging.getLogger("otel_hicache")

_lock = threading.Lock()
_warned: set[str] = set()

SHOWN_CHARACTERS = 80
LONGEST_ARGUMENT = 4 * SHOWN_CHARACTERS  # the SDK quotes some arguments whole
LONGEST_MESSAGE = 1000  # the SDK formats some values into a message
WITHHELD = "<withheld>"
SECRET_CHARACTERS = 4  # replacing a shorter one (a ``1``) would garble every number in a line


def warn_once(key: str, message: str, *args: object) -> bool:
    """Log at WARNING the first time ``key`` is seen in this process; whether it did."""
    with _lock:
        if key in _warned:
            return False
        _warned.add(key)
    logger.warning(message, *args)
    return True


def warned() -> list[str]:
    with _lock:
        return sorted(_warned)


def mark_warned(keys: list[str]) -> None:
    with _lock:
        _warned.update(keys)


def reset_warnings() -> None:
    with _lock:
        _warned.clear()


def shown(value: object) -> str:
    """A string quoted (an error unquoted), cut to :data:`SHOWN_CHARACTERS` with its length when longer."""
    quote, text = (repr, value) if isinstance(value, str) else (str, str(value))
    if len(text) <= SHOWN_CHARACTERS:
        return quote(text)
    return f"{quote(text[:SHOWN_CHARACTERS])}... ({len(text)} characters)"


class _Withhold(logging.Filter):
    secrets: frozenset[str] = frozenset()

    def _clean(self, value: Any, longest: int) -> Any:
        if not isinstance(value, str):
            return value
        for secret in self.secrets:
            value = value.replace(secret, WITHHELD)
        return value if len(value) <= longest else shown(value)

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(self._clean(arg, LONGEST_ARGUMENT) for arg in record.args)
        elif isinstance(record.args, dict):
            record.args = {key: self._clean(arg, LONGEST_ARGUMENT) for key, arg in record.args.items()}
        if isinstance(record.msg, str):  # a template (with arguments) is code: only secrets go
            record.msg = self._clean(record.msg, LONGEST_MESSAGE if not record.args else len(record.msg))
        return True


_withhold = _Withhold()


def withhold(secrets: Iterable[str], sdk_loggers: bool) -> None:
    """From now on no record of our logger (``sdk_loggers``: and the SDK's) shows a secret or a long string."""
    with _lock:
        _withhold.secrets = _withhold.secrets | {s for s in secrets if len(s) >= SECRET_CHARACTERS}
    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
               if sdk_loggers and name.split(".", 1)[0] == "opentelemetry"]
    for each in [*loggers, logger]:
        if _withhold not in each.filters:
            each.addFilter(_withhold)
