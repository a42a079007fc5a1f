"""Credentials out of what otel-hicache prints: the userinfo of a URL (``http://user:password@host``).

An OTLP endpoint may carry credentials in its userinfo; a log line or a report
that names the endpoint keeps the scheme, host, port and path, and shows the
userinfo as ``***``.
"""

from __future__ import annotations

import re
from typing import Iterator
from urllib.parse import unquote

_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/?#\s]*)@")
"""A scheme, then everything up to the authority's last ``@`` (a password may hold an unencoded one)."""


def without_userinfo(text: str) -> str:
    """``text`` with the userinfo of every URL in it as ``***``: ``http://***@host:4318/v1/traces``."""
    return _USERINFO.sub(r"\g<scheme>***@", text)


def userinfo(url: str) -> str:
    """The ``user:password`` of one URL, with or without a scheme ('' when none)."""
    host = url.partition("://")[2] if "://" in url else url
    return host.partition("/")[0].rpartition("@")[0]


def userinfo_parts(text: str) -> Iterator[str]:
    """The userinfo of each URL in ``text``, whole and as its user and password, also percent-decoded."""
    for match in _USERINFO.finditer(text):
        userinfo = match.group("userinfo")
        for part in (userinfo, *userinfo.split(":", 1)):
            yield part
            yield unquote(part)
