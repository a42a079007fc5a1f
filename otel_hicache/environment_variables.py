"""The ``OTEL_HICACHE_*`` variables (what no standard ``OTEL_*`` one covers) and their documented defaults
(``docs/configuration.md``); a malformed value warns once and its default is used (:mod:`.settings`)."""

OTEL_HICACHE_ENABLED = "OTEL_HICACHE_ENABLED"
OTEL_HICACHE_MAX_QUEUE_SIZE = "OTEL_HICACHE_MAX_QUEUE_SIZE"
OTEL_HICACHE_POLL_INTERVAL_MS = "OTEL_HICACHE_POLL_INTERVAL_MS"
OTEL_HICACHE_ACK_TIMEOUT_S = "OTEL_HICACHE_ACK_TIMEOUT_S"
OTEL_HICACHE_TRANSFER_TIMEOUT_S = "OTEL_HICACHE_TRANSFER_TIMEOUT_S"
OTEL_HICACHE_ANCHOR_INTERVAL_S = "OTEL_HICACHE_ANCHOR_INTERVAL_S"
OTEL_HICACHE_SHUTDOWN_TIMEOUT_S = "OTEL_HICACHE_SHUTDOWN_TIMEOUT_S"
OTEL_HICACHE_HOST_RESIDENCE = "OTEL_HICACHE_HOST_RESIDENCE"
OTEL_HICACHE_TELEMETRY_PROCESS = "OTEL_HICACHE_TELEMETRY_PROCESS"

DEFAULTS = {
    OTEL_HICACHE_ENABLED: True,  # false: every submit() returns at once
    OTEL_HICACHE_MAX_QUEUE_SIZE: 16384,  # records held before their span; beyond it new ones are dropped, counted
    OTEL_HICACHE_POLL_INTERVAL_MS: 10.0,  # how often finish events are polled while records are pending
    OTEL_HICACHE_ACK_TIMEOUT_S: 30.0,  # then a completed op's span says hicache.acked=false
    OTEL_HICACHE_TRANSFER_TIMEOUT_S: 60.0,  # then an unfinished transfer is an error span (transfer_timeout)
    OTEL_HICACHE_ANCHOR_INTERVAL_S: 1.0,  # how often the wall-clock anchor event is re-synchronized
    OTEL_HICACHE_SHUTDOWN_TIMEOUT_S: 5.0,  # bound on shutdown() and the flush at exit
    OTEL_HICACHE_HOST_RESIDENCE: True,  # false: host_pool() returns None, no host pages tracked
    OTEL_HICACHE_TELEMETRY_PROCESS: None,  # where configure()'s sinks run; unset: a process when OTLP exports
}
