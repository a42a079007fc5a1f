"""The OTLP/HTTP exporters' session: OTLP certificate first, no redirect, non-2xx a failure, Retry-After kept."""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import weakref
from http import HTTPStatus
from typing import Any

import requests
from urllib3.util import Retry

from ..diagnostics import warn_once, without_userinfo

RETRY_GAP_S = 0.5  # the exporter's repeat at once of a connection error is held back this long after a Busy
_transport = logging.getLogger("otel_hicache.http")  # the doctor reads its DEBUG records
__import__("netrc")  # requests imports it at its first request: a fork then would hang the child


class Refused(requests.exceptions.HTTPError):
    """Nothing in that request was delivered (the SDK counts any answer as exported)."""


class Busy(Refused, requests.exceptions.ConnectionError):
    """A retryable refusal: the SDK's HTTP exporters retry a connection error with their backoff."""


def describe(status: int, reason: str | None, location: str | None, url: str) -> str:
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = " ".join(re.findall(r"[\w'-]+", reason or "")[:8])  # a server's words, not its markup
    text = f"HTTP {status} {phrase}".rstrip()
    if not 300 <= status < 400:
        return text
    target = without_userinfo(location.strip())[:200] if location else ""
    fix = "redirects are not followed; " + ("set the endpoint to where it points" if target else "check the endpoint")
    if target.lower().startswith("https://") and url.lower().startswith("http://"):
        fix = "the collector wants TLS; set an https endpoint"
    return f"{text} (to {(target or 'nowhere given').replace('(', '%28').replace(')', '%29')}: {fix})"


class OtlpSession(requests.Session):
    def __init__(self) -> None:
        super().__init__()
        self._gate = threading.Lock()
        self._not_before = self._repeat_before = 0.0  # time.monotonic(): Retry-After, a repeat at once
        self._busy = ""  # the refusal that set them
        own = weakref.WeakMethod(self._after_fork_in_child)
        os.register_at_fork(after_in_child=lambda: (own() or (lambda: None))())

    def _after_fork_in_child(self) -> None:
        # a pool's lock held by another thread at the fork stays held in the child: new pools
        self._gate = threading.Lock()
        for prefix in list(self.adapters):
            self.mount(prefix, requests.adapters.HTTPAdapter())

    def merge_environment_settings(self, url: Any, proxies: Any, stream: Any, verify: Any, cert: Any) -> Any:
        settings = super().merge_environment_settings(url, proxies, stream, verify, cert)
        if isinstance(self.verify, str) and verify in (None, True):
            settings["verify"] = self.verify  # the OTLP certificate, not REQUESTS_CA_BUNDLE
        return settings

    def send(self, request: Any, **kwargs: Any) -> Any:
        with self._gate:
            now, repeat, self._repeat_before = time.monotonic(), self._repeat_before, 0.0
            if now < max(self._not_before, repeat):
                raise Busy(f"{self._busy} (not sent again " + (f"within the {self._not_before - now:.1f} s it "
                           "asked for)" if now < self._not_before else "at once)"), request=request)
        kwargs["allow_redirects"] = False  # a redirected POST would be a delivery nobody checked
        try:
            response = super().send(request, **kwargs)
        except Exception as exc:
            _transport.debug("%s: %s", type(exc).__name__, exc)
            raise
        if 200 <= (status := response.status_code) < 300:
            return response
        url = without_userinfo(str(request.url))
        what = describe(status, response.reason, response.headers.get("Location"), url)
        if retryable := status in (429, 502, 503, 504):  # what the OTLP/HTTP specification retries
            try:
                wait = min(float(Retry().parse_retry_after(response.headers.get("Retry-After") or "0")), 3600.0)
            except Exception:  # a malformed header asks for nothing
                wait = 0.0
            with self._gate:
                now = time.monotonic()
                self._not_before, self._repeat_before, self._busy = now + wait, now + RETRY_GAP_S, what
        warn_once(f"http_session:{url}:{status}", "otel-hicache: the OTLP export to %s was refused: %s; nothing "
                  "in a refused request is delivered (counted as failed%s)", url, what,
                  "; retried within the export timeout" if retryable else "")
        response.close()
        raise (Busy if retryable else Refused)(what, request=request, response=response)
