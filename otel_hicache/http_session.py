"""The ``requests`` session of the OTLP/HTTP exporters: ``OTEL_EXPORTER_OTLP_CERTIFICATE`` wins.

The SDK's HTTP exporters put the certificate from ``OTEL_EXPORTER_OTLP_CERTIFICATE``
(or its per-signal form) on ``Session.verify``. ``requests`` then lets
``REQUESTS_CA_BUNDLE`` or ``CURL_CA_BUNDLE``, set machine-wide in many containers
and corporate images, override a session's ``verify``, so the collector's
self-signed certificate is silently ignored and every export fails with
``CERTIFICATE_VERIFY_FAILED`` (gRPC is not affected). This session keeps the
certificate the OTLP variables named; everything else the environment sets
(proxies, ``NO_PROXY``) still applies.
"""

from __future__ import annotations

from typing import Any


def certificate_session() -> Any:
    """A ``requests.Session`` whose own ``verify`` (a CA file path) beats the CA-bundle variables."""
    import requests

    class CertificateSession(requests.Session):
        def merge_environment_settings(self, url: Any, proxies: Any, stream: Any, verify: Any, cert: Any) -> Any:
            settings = super().merge_environment_settings(url, proxies, stream, verify, cert)
            if isinstance(self.verify, str) and verify in (None, True):
                settings["verify"] = self.verify  # the OTLP certificate, not REQUESTS_CA_BUNDLE
            return settings

    return CertificateSession()
