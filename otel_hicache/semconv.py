"""Every span, attribute and metric name otel-hicache emits (docs/reference.md); never a token id, node id or hash."""

SCOPE_NAME = "otel_hicache"
SPAN_OFFLOAD = "hicache.offload"
SPAN_ONBOARD = "hicache.onboard"
EVENT_REQUEST = "hicache.request"

# attributes: POOL, REASON and OFFLOAD_CAUSE are metric-only
DIRECTION = "hicache.direction"
SRC_TIER = "hicache.src_tier"
DST_TIER = "hicache.dst_tier"
TOKENS = "hicache.tokens"
BLOCKS = "hicache.blocks"
BYTES = "hicache.bytes"
PAGE_SIZE = "hicache.page_size"
POOL_NAMES = "hicache.pool.names"
POOL_TOKENS = "hicache.pool.tokens"
POOL = "hicache.pool"
IO_BACKEND = "hicache.io_backend"
ORIGIN = "hicache.origin"
TIMING_SOURCE = "hicache.timing_source"
PLACEMENT_SOURCE = "hicache.placement_source"
QUEUE_WAIT_US = "hicache.queue_wait_us"
ACK_DELAY_US = "hicache.ack_delay_us"
ACKED = "hicache.acked"
BANDWIDTH = "hicache.bandwidth_bytes_per_second"
ERROR_TYPE = "error.type"
REASON = "reason"
CAUSE = "hicache.cause"
CAUSES_ATTR = "hicache.causes"  # a mixed op's, sorted
CAUSE_OTHER = "other"
CAUSE_MIXED = "mixed"
OFFLOAD_CAUSE = "hicache.offload_cause"
RESIDENCE_MIN_US = "hicache.host.residence_min_us"
RESIDENCE_MAX_US = "hicache.host.residence_max_us"
UNKNOWN_PAGES = "hicache.host.unknown_pages"
LINKS_DROPPED = "hicache.host.links_dropped"
REQUEST_TRACE_ID = "hicache.request.trace_id"
REQUEST_LINKS_DROPPED = "hicache.request.links_dropped"
LINK_TO = "hicache.link_to"
LINK_TO_OFFLOAD = "offload"
LINK_TO_REQUEST = "request"
LOCATION = "location"
LOCATION_TELEMETRY_PROCESS = "telemetry_process"
LOCATION_EMBEDDED = "embedded"
LOCATION_EMBEDDED_FALLBACK = "embedded_fallback"
THREAD = "thread"
THREAD_TELEMETRY_PROCESS = "telemetry_process"

# metrics: (name, unit, description)
TRANSFER_DURATION = ("hicache.transfer.duration", "s", "Duration of one L1<->L2 merged op.")
TRANSFER_BYTES = ("hicache.transfer.bytes", "By", "Bytes moved between L1 and L2.")
TRANSFER_BLOCKS = ("hicache.transfer.blocks", "{block}", "Blocks (pages) moved.")
TRANSFER_TOKENS = ("hicache.transfer.tokens", "{token}", "Tokens moved, per host pool.")
TRANSFER_BANDWIDTH = ("hicache.transfer.bandwidth", "By/s", "Bytes / duration, per op.")
TRANSFER_QUEUE_WAIT = ("hicache.transfer.queue_wait", "s", "Host submit to device start.")
TRANSFER_ACK_DELAY = ("hicache.transfer.ack_delay", "s", "Device finish to the ack.")
TRANSFER_BUSY_TIME = ("hicache.transfer.busy_time", "s", "Union of busy intervals.")
TRANSFER_INFLIGHT = ("hicache.transfer.inflight", "{transfer}", "Ops not yet seen complete.")
TRANSFER_OLDEST_INFLIGHT_AGE = ("hicache.transfer.oldest_inflight_age", "s", "Age of the oldest op in flight.")
TRANSFER_OLDEST_UNACKED_AGE = ("hicache.transfer.oldest_unacked_age", "s", "Age of the oldest unacked op.")
HOST_RESIDENCE_TIME = ("hicache.host.residence_time", "s", "Offload submit to load-back submit.")
HOST_RELOADED_BYTES = ("hicache.host.reloaded_bytes", "By", "Bytes of host pages loaded back.")
HOST_WASTED_BYTES = ("hicache.host.wasted_bytes", "By", "Bytes of host pages never loaded back.")
HOST_WASTED_TOKENS = ("hicache.host.wasted_tokens", "{token}", "Tokens of host pages never loaded back.")
RECORDS_DROPPED = ("otel_hicache.records.dropped", "{record}", "Records dropped before being reported.")
RECORDS_FAILED = ("otel_hicache.records.failed", "{record}", "Transfers reported as error spans only.")
POLLER_CPU_TIME = ("otel_hicache.poller.cpu_time", "s", "CPU time of the poller thread.")
EXPORT_CPU_TIME = ("otel_hicache.export.cpu_time", "s", "CPU time of the telemetry process.")
SINKS = ("otel_hicache.sinks", "{process}", "1 where the sinks run.")
QUEUE_SIZE = ("otel_hicache.queue.size", "{record}", "Records held by the capture.")

DROP_REASONS = DROP_QUEUE_FULL, DROP_INVALID_INPUT, DROP_SHUTDOWN, DROP_INTERNAL_ERROR, DROP_MALFORMED_FRAME = (
    "queue_full", "invalid_input", "shutdown", "internal_error", "malformed_frame")
FAIL_REASONS = FAIL_EVENT_ERROR, FAIL_TRANSFER_TIMEOUT = "event_error", "transfer_timeout"

# buckets: 10 us to 60 s (the SDK's assume ms), 1 ms to 4 h, 100 MB/s to 1 TB/s
DURATION_BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                      0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RESIDENCE_BUCKETS_S = (*DURATION_BUCKETS_S[6:], 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 14400.0)
BANDWIDTH_BUCKETS = (1e8, 2.5e8, 5e8, 1e9, 2.5e9, 5e9, 1e10, 1.5e10, 2e10, 2.5e10, 3e10, 4e10, 5e10, 7.5e10, 1e11,
                     2e11, 4e11, 1e12)
