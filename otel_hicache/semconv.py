"""Names of every span, attribute and metric otel-hicache emits: one source for the sinks,
the tests and ``docs/reference.md``. No token ids, node ids or hashes are ever attributes."""

from __future__ import annotations

from typing import Final

SCOPE_NAME: Final = "otel_hicache"
SPAN_OFFLOAD: Final = "hicache.offload"
SPAN_ONBOARD: Final = "hicache.onboard"
EVENT_REQUEST: Final = "hicache.request"  # one per linked request: its trace id, searchable in Jaeger

# attributes: spans carry all but POOL, REASON and OFFLOAD_CAUSE (metric-only)
DIRECTION: Final = "hicache.direction"
SRC_TIER: Final = "hicache.src_tier"
DST_TIER: Final = "hicache.dst_tier"
TOKENS: Final = "hicache.tokens"
BLOCKS: Final = "hicache.blocks"
BYTES: Final = "hicache.bytes"
PAGE_SIZE: Final = "hicache.page_size"
POOL_NAMES: Final = "hicache.pool.names"
POOL_TOKENS: Final = "hicache.pool.tokens"
POOL: Final = "hicache.pool"
IO_BACKEND: Final = "hicache.io_backend"
ORIGIN: Final = "hicache.origin"
TIMING_SOURCE: Final = "hicache.timing_source"
PLACEMENT_SOURCE: Final = "hicache.placement_source"  # values: the PLACEMENT_* of capture.clock
QUEUE_WAIT_US: Final = "hicache.queue_wait_us"
ACK_DELAY_US: Final = "hicache.ack_delay_us"
ACKED: Final = "hicache.acked"
BANDWIDTH: Final = "hicache.bandwidth_bytes_per_second"
ERROR_TYPE: Final = "error.type"
REASON: Final = "reason"
CAUSE: Final = "hicache.cause"  # why an op moved its bytes: a cause adapters register, or other
CAUSES_ATTR: Final = "hicache.causes"  # spans of a mixed merged op: its distinct causes, sorted
CAUSE_OTHER: Final = "other"
CAUSE_MIXED: Final = "mixed"  # a merged op of several causes: its tokens and bytes count under each
OFFLOAD_CAUSE: Final = "hicache.offload_cause"  # the cause of the offload that wrote host pages
RESIDENCE_MIN_US: Final = "hicache.host.residence_min_us"  # load-back spans
RESIDENCE_MAX_US: Final = "hicache.host.residence_max_us"
UNKNOWN_PAGES: Final = "hicache.host.unknown_pages"
LINKS_DROPPED: Final = "hicache.host.links_dropped"
REQUEST_TRACE_ID: Final = "hicache.request.trace_id"  # on a hicache.request span event
REQUEST_LINKS_DROPPED: Final = "hicache.request.links_dropped"
LINK_TO: Final = "hicache.link_to"  # on every span link (not the span): what it points to
LINK_TO_OFFLOAD: Final = "offload"  # a load-back's link to an offload span that wrote its pages
LINK_TO_REQUEST: Final = "request"  # a link to the root span of a request (SGLang --enable-trace)
LOCATION: Final = "location"  # on otel_hicache.sinks
LOCATION_TELEMETRY_PROCESS: Final = "telemetry_process"
LOCATION_EMBEDDED: Final = "embedded"
LOCATION_EMBEDDED_FALLBACK: Final = "embedded_fallback"
THREAD: Final = "thread"  # on otel_hicache.export.cpu_time: what ran the export
THREAD_TELEMETRY_PROCESS: Final = "telemetry_process"

# metrics: name, unit, description
TRANSFER_DURATION = ("hicache.transfer.duration", "s", "Duration of one L1<->L2 merged op: device time between "
                     "its timing events (hicache.timing_source=device_event) or host time (host_clock).")
TRANSFER_BYTES = ("hicache.transfer.bytes", "By", "Bytes moved between L1 and L2, per rank.")
TRANSFER_BLOCKS = ("hicache.transfer.blocks", "{block}",
                   "Blocks (pages) moved: ceil(anchor-pool tokens / page size) per op.")
TRANSFER_TOKENS = ("hicache.transfer.tokens", "{token}", "Tokens moved, per host pool (hicache.pool).")
TRANSFER_BANDWIDTH = ("hicache.transfer.bandwidth", "By/s", "Per-op bandwidth: bytes / duration of that op. "
                      "For link throughput use rate(bytes) / rate(busy_time).")
TRANSFER_QUEUE_WAIT = ("hicache.transfer.queue_wait", "s",
                       "Host submit to device start of the copy (needs timing events and a wall-clock anchor).")
TRANSFER_ACK_DELAY = ("hicache.transfer.ack_delay", "s", "Device finish of the copy to the consumer taking its ack.")
TRANSFER_BUSY_TIME = ("hicache.transfer.busy_time", "s",
                      "Union of busy intervals per direction: overlapping ops count once.")
TRANSFER_INFLIGHT = ("hicache.transfer.inflight", "{transfer}",
                     "Ops submitted whose completion has not been observed yet.")
TRANSFER_OLDEST_INFLIGHT_AGE = ("hicache.transfer.oldest_inflight_age", "s", "Age of the oldest op submitted and "
                                "not yet seen complete (since its submit); 0 when none.")
TRANSFER_OLDEST_UNACKED_AGE = ("hicache.transfer.oldest_unacked_age", "s", "Time the oldest completed op submitted "
                               "with expect_ack=True has waited for its ack (since its completion was seen); "
                               "0 when none.")
HOST_RESIDENCE_TIME = ("hicache.host.residence_time", "s", "Time host pages sat in host memory (L2), from the submit "
                       "of the offload that wrote them to the submit of the load-back that read them: one value per "
                       "load-back and writing offload.")
HOST_RELOADED_BYTES = ("hicache.host.reloaded_bytes", "By", "Bytes of host pages loaded back, by the cause of the "
                       "offload that wrote them (hicache.offload_cause).")
HOST_WASTED_BYTES = ("hicache.host.wasted_bytes", "By", "Bytes of host pages freed or overwritten without a "
                     "load-back since the offload that wrote them.")
HOST_WASTED_TOKENS = ("hicache.host.wasted_tokens", "{token}", "Tokens (pages x page size) of host pages freed or "
                      "overwritten without a load-back since written.")
RECORDS_DROPPED = ("otel_hicache.records.dropped", "{record}", "Transfer records otel-hicache dropped before "
                   "reporting them (reason: queue_full, invalid_input, shutdown, internal_error).")
RECORDS_FAILED = ("otel_hicache.records.failed", "{record}", "Transfers reported as error spans, not counted in the "
                  "transfer metrics (reason: event_error, transfer_timeout).")
WORKER_CPU_TIME = ("otel_hicache.worker.cpu_time", "s", "CPU time of otel-hicache's poller thread in the serving "
                   "process (intake, completion, timing; embedded, also the sinks: spans and metrics of every op).")
EXPORT_CPU_TIME = ("otel_hicache.export.cpu_time", "s", "CPU time of otel-hicache's telemetry process: its sinks "
                   "and exports (thread: telemetry_process).")
SINKS = ("otel_hicache.sinks", "{process}", "Where otel-hicache's sinks run: 1 for the place in use (location: "
         "telemetry_process; embedded, asked for by the caller or the configuration; embedded_fallback, when no "
         "telemetry process could run).")
QUEUE_SIZE = ("otel_hicache.queue.size", "{record}", "Records held by the capture (queued, in flight or awaiting "
              "their ack).")

DROP_QUEUE_FULL: Final = "queue_full"
DROP_INVALID_INPUT: Final = "invalid_input"
DROP_SHUTDOWN: Final = "shutdown"
DROP_INTERNAL_ERROR: Final = "internal_error"
DROP_MALFORMED_FRAME: Final = "malformed_frame"  # a frame in the telemetry process's input not the capture's
FAIL_EVENT_ERROR: Final = "event_error"
FAIL_TRANSFER_TIMEOUT: Final = "transfer_timeout"
DROP_REASONS = (DROP_QUEUE_FULL, DROP_INVALID_INPUT, DROP_SHUTDOWN, DROP_INTERNAL_ERROR, DROP_MALFORMED_FRAME)
FAIL_REASONS = (FAIL_EVENT_ERROR, FAIL_TRANSFER_TIMEOUT)

# histogram buckets: seconds from 10 us to 60 s (the SDK's defaults assume ms); residence from 1 ms
# to 4 hours (reused within a step, a minute, a session); bandwidth 100 MB/s to 1 TB/s (PCIe, C2C)
DURATION_BUCKETS_S = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                      0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RESIDENCE_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                       120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 14400.0)
BANDWIDTH_BUCKETS = (1e8, 2.5e8, 5e8, 1e9, 2.5e9, 5e9, 1e10, 1.5e10, 2e10, 2.5e10, 3e10, 4e10, 5e10, 7.5e10, 1e11,
                     2e11, 4e11, 1e12)
