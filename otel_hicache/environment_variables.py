"""The ``OTEL_HICACHE_*`` variables (what no standard ``OTEL_*`` one covers), each with its default
(``docs/configuration.md``); a malformed value warns once and its default is used (:mod:`.settings`)."""

OTEL_HICACHE_ENABLED = "OTEL_HICACHE_ENABLED"
"""``false``: every ``submit()`` returns at once. Default: ``true``"""

OTEL_HICACHE_MAX_QUEUE_SIZE = "OTEL_HICACHE_MAX_QUEUE_SIZE"
"""Most records held before their span; beyond it new ones are dropped and counted. Default: ``16384``"""

OTEL_HICACHE_POLL_INTERVAL_MS = "OTEL_HICACHE_POLL_INTERVAL_MS"
"""How often the poller polls finish events while records are pending. Default: ``10``"""

OTEL_HICACHE_ACK_TIMEOUT_S = "OTEL_HICACHE_ACK_TIMEOUT_S"
"""How long a completed op waits for ``ack()`` before its span says ``hicache.acked=false``. Default: ``30``"""

OTEL_HICACHE_TRANSFER_TIMEOUT_S = "OTEL_HICACHE_TRANSFER_TIMEOUT_S"
"""A transfer not finished after this long is an error span (``transfer_timeout``). Default: ``60``"""

OTEL_HICACHE_ANCHOR_INTERVAL_S = "OTEL_HICACHE_ANCHOR_INTERVAL_S"
"""How often the poller re-synchronizes its wall-clock anchor event. Default: ``1``"""

OTEL_HICACHE_SHUTDOWN_TIMEOUT_S = "OTEL_HICACHE_SHUTDOWN_TIMEOUT_S"
"""Bound on ``shutdown()`` and the flush at exit, even with the collector unreachable. Default: ``5``"""

OTEL_HICACHE_HOST_RESIDENCE = "OTEL_HICACHE_HOST_RESIDENCE"
"""``false``: ``host_pool()`` returns None and no host pages are tracked. Default: ``true``"""

OTEL_HICACHE_TELEMETRY_PROCESS = "OTEL_HICACHE_TELEMETRY_PROCESS"
"""Where ``configure()``'s sinks run: ``true`` a telemetry process, ``false`` embedded.
Default: unset (the telemetry process when an exporter sends over OTLP)"""

DEFAULTS = {
    OTEL_HICACHE_ENABLED: True,
    OTEL_HICACHE_MAX_QUEUE_SIZE: 16384,
    OTEL_HICACHE_POLL_INTERVAL_MS: 10.0,
    OTEL_HICACHE_ACK_TIMEOUT_S: 30.0,
    OTEL_HICACHE_TRANSFER_TIMEOUT_S: 60.0,
    OTEL_HICACHE_ANCHOR_INTERVAL_S: 1.0,
    OTEL_HICACHE_SHUTDOWN_TIMEOUT_S: 5.0,
    OTEL_HICACHE_HOST_RESIDENCE: True,
    OTEL_HICACHE_TELEMETRY_PROCESS: None,
}
"""The documented default of every ``OTEL_HICACHE_*`` variable."""
