"""HiCache's L1<->L2 transfers as OpenTelemetry spans and metrics: ``configure()``, then ``submit()``/``ack()``."""

from .configuration import Configuration, configure, configured, shutdown
from .capture.records import TransferRecord
from .capture.telemetry import TransferTelemetry
from .record import DEVICE_EVENT, HOST_CLOCK, OFFLOAD, ONBOARD
from .version import __version__

__all__ = ["Configuration", "DEVICE_EVENT", "HOST_CLOCK", "OFFLOAD", "ONBOARD", "TransferRecord", "TransferTelemetry",
           "__version__", "configure", "configured", "shutdown"]
