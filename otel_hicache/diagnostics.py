"""One-time warnings (never raised into the host), values quoted short, secrets withheld, userinfo masked."""

from __future__ import annotations

import logging
import re
import threading
from typing import Any, Iterable, Iterator
from urllib.parse import unquote

logger = logging.getLogger("otel_hicache")

_lock = threading.Lock()
_warned: set[str] = set()
_secrets: frozenset[str] = frozenset()

SHOWN_CHARACTERS = 80
LONGEST_ARGUMENT = 4 * SHOWN_CHARACTERS  # the SDK quotes some arguments whole


def warn_once(key: str, message: str, *args: object) -> bool:
    """Whether it logged: the first time ``key`` is seen in this process."""
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


def _clean(value: Any, longest: int) -> Any:
    if not isinstance(value, str):
        return value
    for secret in _secrets:
        value = value.replace(secret, "<withheld>")
    return value if len(value) <= longest else shown(value)


def _withhold(record: logging.LogRecord) -> bool:
    if isinstance(record.args, tuple):
        record.args = tuple(_clean(arg, LONGEST_ARGUMENT) for arg in record.args)
    elif isinstance(record.args, dict):
        record.args = {key: _clean(arg, LONGEST_ARGUMENT) for key, arg in record.args.items()}
    if isinstance(record.msg, str):  # a template (with arguments) is code: only secrets go
        record.msg = _clean(record.msg, len(record.msg) if record.args else 1000)  # the SDK formats values in
    return True


def withhold(secrets: Iterable[str], sdk_loggers: bool) -> None:
    """From now on no record of our logger (``sdk_loggers``: and the SDK's) shows a secret or a long string."""
    global _secrets
    with _lock:
        _secrets = _secrets | {s for s in secrets if len(s) >= 4}  # a shorter one (``1``) would garble numbers
    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
               if sdk_loggers and name.split(".", 1)[0] == "opentelemetry"]
    for each in [*loggers, logger]:
        if _withhold not in each.filters:
            each.addFilter(_withhold)


# a scheme, then everything up to the authority's last "@" (a password may hold an unencoded one)
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/?#\s]*)@")


def without_userinfo(text: str) -> str:
    return _USERINFO.sub(r"\g<scheme>***@", text)


def userinfo(url: str) -> str:
    """The ``user:password`` of one URL, with or without a scheme ('' when none)."""
    return (url.partition("://")[2] or url).partition("/")[0].rpartition("@")[0]


def userinfo_parts(text: str) -> Iterator[str]:
    """Each URL's userinfo in ``text``, whole and as user and password, also percent-decoded."""
    for match in _USERINFO.finditer(text):
        info = match.group("userinfo")
        for part in (info, *info.split(":", 1)):
            yield from (part, unquote(part))
