"""Credentials out of what otel-hicache prints: a URL's userinfo shows as ``***``."""

from __future__ import annotations

import re
from typing import Iterator
from urllib.parse import unquote

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
