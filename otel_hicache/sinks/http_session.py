"""The ``requests`` session of the OTLP/HTTP exporters: the OTLP certificate wins, and only a 2xx answer is a delivery.

The certificate: the SDK's HTTP exporters put the certificate from
``OTEL_EXPORTER_OTLP_CERTIFICATE`` (or its per-signal form) on ``Session.verify``.
``requests`` then lets ``REQUESTS_CA_BUNDLE`` or ``CURL_CA_BUNDLE``, set machine-wide in
many containers and corporate images, override a session's ``verify``, so the
collector's self-signed certificate is silently ignored and every export fails with
``CERTIFICATE_VERIFY_FAILED`` (gRPC is not affected). This session keeps the
certificate the OTLP variables named; everything else the environment sets (proxies,
``NO_PROXY``) still applies.

The answer: the SDK's HTTP exporters take any status below 400 as success, so a
collector answering a redirect (a 308 to ``https://`` is what many proxies say to
plain text) has every span and point counted as exported while none arrived; and for
an error status (429, 500, ...) their ``otel.sdk.exporter.*.exported`` self-metrics
carry no ``error.type``, so the loss is counted as exported too. This session follows
no redirect, and turns every answer outside 2xx into an exception the exporter
reports as a failed export (:class:`Refused`, with the status named, also in the
self-metrics' ``error.type``), warned about once per endpoint and status. The
statuses the OTLP specification says to retry raise :class:`Busy`, which the
exporter retries with its own backoff; the collector's ``Retry-After`` is kept by
refusing, without a request, any retry sooner than it asked (:data:`RETRY_GAP_S`).
"""

from __future__ import annotations

import functools
import re
import os
import threading
import weakref
import time
from email.utils import parsedate_to_datetime
from http import HTTPStatus
from typing import Any

from ..diagnostics import warn_once
from .redaction import without_userinfo

RETRYABLE = frozenset({429, 502, 503, 504})
"""The statuses the OTLP/HTTP specification says a client retries (with backoff)."""
RETRY_GAP_S = 0.5
"""A request this soon after a retryable refusal, the first only, is not sent: the exporter
repeats a failed request at once when it was a connection error (a stale pooled
connection), which to a collector that answered only adds load; its backoff, from 0.8 s,
is longer."""
MAX_RETRY_AFTER_S = 3600.0
"""A longer ``Retry-After`` is taken as this: a misbehaving collector cannot hold exports back longer."""
WANTS_TLS = "the collector wants TLS; set an https endpoint"
"""What a redirect from ``http://`` to ``https://`` means (:func:`describe`)."""
REFUSAL = re.compile(r"HTTP (?P<status>\d{3})(?: [\w'-]+)*(?: \(to [^()]*\))?")
"""How a refusal is named (:func:`describe`), in the exception and the warning: what the doctor reads."""


@functools.cache
def errors() -> tuple[type, type]:
    """(``Refused``, ``Busy``): the exceptions a refusal raises; their names are the ``error.type``
    of the SDK's self-metrics. Made on first use: ``requests`` is imported only for OTLP/HTTP."""
    import requests

    class Refused(requests.exceptions.HTTPError):
        """The collector answered outside 2xx: nothing in that request was delivered."""

    class Busy(Refused, requests.exceptions.ConnectionError):
        """A retryable refusal (:data:`RETRYABLE`): a connection error is what the SDK's HTTP
        exporters retry with their backoff, when they are handed an exception."""

    for cls in (Refused, Busy):
        cls.__qualname__ = cls.__name__
        cls.__module__ = __name__
    return Refused, Busy


def describe(status: int, reason: str | None, location: str | None, url: str) -> str:
    """``HTTP 308 Permanent Redirect (to https://...: ...)``: the status, its meaning, and for a
    redirect where it points and what to do (no userinfo of either URL)."""
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = " ".join(re.findall(r"[\w'-]+", reason or "")[:8])  # the words REFUSAL reads
    text = f"HTTP {status} {phrase}".rstrip()
    if 300 <= status < 400:
        target = without_userinfo(location.strip())[:200] if location else None
        if target and target.lower().startswith("https://") and url.lower().startswith("http://"):
            advice = WANTS_TLS
        elif target:
            advice = "redirects are not followed; set the endpoint to where it points"
        else:
            advice = "redirects are not followed; check the endpoint"
        text += f" (to {(target or 'nowhere given').replace('(', '%28').replace(')', '%29')}: {advice})"
    return text


def _retry_after_s(value: str | None) -> float:
    """The seconds a ``Retry-After`` header asks for (a number or an HTTP date), 0 when none or unreadable."""
    if not value:
        return 0.0
    try:
        seconds = float(value.strip())
    except ValueError:
        try:
            seconds = parsedate_to_datetime(value.strip()).timestamp() - time.time()
        except (TypeError, ValueError, OverflowError):
            return 0.0
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S) if seconds == seconds else 0.0  # NaN: none


def otlp_session() -> Any:
    """A ``requests.Session`` for one OTLP/HTTP exporter (see the module docstring)."""
    # requests imports netrc at its first request: were that on a thread of the parent at a
    # fork, the child would keep the module's import lock held, and hang in its own first export
    import netrc  # noqa: F401  # pylint: disable=unused-import

    import requests

    refused, busy = errors()

    class OtlpSession(requests.Session):
        def __init__(self) -> None:
            super().__init__()
            self._gate = threading.Lock()
            self._not_before = 0.0  # time.monotonic(): no request before this (Retry-After)
            self._repeat_before = 0.0  # the next request only, if this soon: the exporter's repeat at once
            self._busy = ""  # the refusal that set them
            if hasattr(os, "register_at_fork"):  # (a handful of sessions a process: one registration each)
                own = weakref.WeakMethod(self._after_fork_in_child)
                os.register_at_fork(after_in_child=lambda: (own() or (lambda: None))())

        def _after_fork_in_child(self) -> None:
            # Another thread of the parent may have been inside a request at the fork, holding
            # a connection pool's lock, which would then stay held in the child forever: new
            # pools (and gate), without touching the old ones.
            self._gate = threading.Lock()
            for prefix in list(self.adapters):
                self.mount(prefix, requests.adapters.HTTPAdapter())

        def merge_environment_settings(self, url: Any, proxies: Any, stream: Any, verify: Any, cert: Any) -> Any:
            settings = super().merge_environment_settings(url, proxies, stream, verify, cert)
            if isinstance(self.verify, str) and verify in (None, True):
                settings["verify"] = self.verify  # the OTLP certificate, not REQUESTS_CA_BUNDLE
            return settings

        def _held_back(self) -> str | None:
            """Why this request is not sent (the collector's Retry-After, or a repeat at once), or None."""
            with self._gate:
                now, repeat, self._repeat_before = time.monotonic(), self._repeat_before, 0.0
                if now < self._not_before:
                    return f"{self._busy} (not sent again within the {self._not_before - now:.1f} s it asked for)"
                return f"{self._busy} (not sent again at once)" if now < repeat else None

        def send(self, request: Any, **kwargs: Any) -> Any:
            held = self._held_back()
            if held is not None:
                raise busy(held, request=request)
            kwargs["allow_redirects"] = False  # a redirected POST would be a delivery nobody checked
            response = super().send(request, **kwargs)
            status = response.status_code
            if 200 <= status < 300:
                return response
            url = without_userinfo(str(request.url))
            what = describe(status, response.reason, response.headers.get("Location"), url)
            retryable = status in RETRYABLE
            if retryable:
                with self._gate:
                    now = time.monotonic()
                    self._not_before = now + _retry_after_s(response.headers.get("Retry-After"))
                    self._repeat_before, self._busy = now + RETRY_GAP_S, what
            warn_once(f"http_session:{url}:{status}", "otel-hicache: the OTLP export to %s was refused: %s; nothing "
                      "in a refused request is delivered (counted as failed%s)", url, what,
                      "; retried within the export timeout" if retryable else "")
            response.close()
            raise (busy if retryable else refused)(what, request=request, response=response)

    return OtlpSession()
