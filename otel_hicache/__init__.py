"""otel-hicache: KV-cache transfer observability for LLM serving.

Every HiCache L1<->L2 merged op becomes an OpenTelemetry span timed with device events, and exact
counters and histograms from the same records, exported over OTLP.

    configure()                      # private providers from OTEL_* variables
    tel = TransferTelemetry(attributes={"tp_rank": 0})
    handle = tel.submit("onboard", {"kv": 1408}, 161_480_704, page_size=64, start_event=ev0, finish_event=ev1)
    tel.ack(handle)
"""

from .configuration import Configuration, configure, configured, shutdown
from .capture.records import TransferRecord
from .capture.telemetry import TransferTelemetry
from .record import DEVICE_EVENT, HOST_CLOCK, OFFLOAD, ONBOARD
from .version import __version__

__all__ = [
    "Configuration",
    "DEVICE_EVENT",
    "HOST_CLOCK",
    "OFFLOAD",
    "ONBOARD",
    "TransferRecord",
    "TransferTelemetry",
    "__version__",
    "configure",
    "configured",
    "shutdown",
]
