"""The nominal capacity of the host link of this process's GPU, from NVML.

``hicache.link.nominal_bandwidth`` is the bytes/s per direction that the link between
the GPU and host memory is built for: PCIe (generation and width) or NVLink-C2C
(Grace Hopper). Divided into the achieved busy-time throughput
(``rate(hicache.transfer.bytes) / rate(hicache.transfer.busy_time)``) it gives the link
efficiency. ``pci.bus_id`` is written as DCGM writes its ``pci_bus_id`` label
(``00000000:3B:00.0``), so the gauge joins DCGM's ``DCGM_FI_PROF_PCIE_{RX,TX}_BYTES``.

Which GPU: the current CUDA device of the thread that built the telemetry (the
serving framework's rank has set its device by then), found by its PCI bus id, read
by the capture with ``capture.device.current_device()`` *without* initializing CUDA. NVML itself is read once,
by :meth:`LinkCapacity.info`, in the sinks at start-up (never on the hot
path) and the value kept: the gauge's callback only returns it.

Never fails: without ``pynvml`` (``pip install otel-hicache[nvml]``), without a GPU,
or with any NVML error, nothing is exported and one DEBUG line of the ``otel_hicache``
logger says why.

PCIe nominal, per direction: ``lanes x GT/s x line-code efficiency / 8`` at the
link's *max* generation and width for this GPU in this system
(``nvmlDeviceGetMaxPcieLinkGeneration``/``Width``: ``min(GPU, slot)``). Not the
current ones: GPUs drop to a lower generation when idle, as they are at start-up.
Line codes: gen1/2 8b/10b, gen3/4/5 128b/130b; gen6 (64 GT/s PAM4, FLIT mode) has no
line code, so its efficiency is taken as 1 (FLIT CRC/FEC, like TLP/DLLP overhead on
every generation, is protocol overhead and not in the nominal). C2C: the sum of the
active links' ``NVML_FI_DEV_C2C_LINK_GET_MAX_BW`` (MB/s, taken as 10^6 bytes/s and
per direction, as NCCL reads it).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Final, Mapping

from .. import semconv as sc
from ..diagnostics import logger
from ..record import DIRECTIONS
from ..version import __version__

# hicache.link.type values
PCIE: Final = "pcie"
C2C: Final = "c2c"

PCIE_GENERATIONS: Final[Mapping[int, tuple[Fraction, Fraction]]] = {
    # generation: (GT/s per lane, line-code efficiency)
    1: (Fraction(5, 2), Fraction(8, 10)),
    2: (Fraction(5), Fraction(8, 10)),
    3: (Fraction(8), Fraction(128, 130)),
    4: (Fraction(16), Fraction(128, 130)),
    5: (Fraction(32), Fraction(128, 130)),
    6: (Fraction(64), Fraction(1)),  # PAM4, FLIT mode: no line code (see the module docstring)
}

from ..record import BUS_ID, INDEX, NONE, ONLY, UUID  # noqa: F401  # (kind, value) of the device

_NVML_SUCCESS = 0
_BUS_ID = re.compile(r"^\s*(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])\s*$")


def pcie_bytes_per_second(generation: int, lanes: int) -> float | None:
    """Nominal bytes/s per direction of a PCIe link; None for an unknown generation."""
    rate = PCIE_GENERATIONS.get(generation)
    if rate is None or lanes <= 0:
        return None
    gts, efficiency = rate
    return float(lanes * gts * 10**9 * efficiency / 8)  # exact, then rounded once


def dcgm_bus_id(text: Any) -> str | None:
    """A PCI address as DCGM (and NVML's ``busId``) writes it: ``00000000:3B:00.0``.

    Accepts bytes, a 4- or 8-digit domain (``0000:3b:00.0``) or none (``3b:00.0``)."""
    if isinstance(text, bytes):
        text = text.decode("ascii", "replace")
    match = _BUS_ID.match(str(text)) if text is not None else None
    if match is None:
        return None
    domain, bus, device, function = match.groups()
    return f"{int(domain or '0', 16):08X}:{int(bus, 16):02X}:{int(device, 16):02X}.{function}"


@dataclass(frozen=True)
class LinkInfo:
    """The host link of one GPU, as read from NVML at start-up."""

    link_type: str  # PCIE or C2C
    bytes_per_second: float  # nominal, per direction
    width: int  # PCIe lanes, or active C2C links
    generation: int | None = None  # PCIe only
    pci_bus_id: str | None = None  # DCGM's format
    current_generation: int | None = None  # PCIe, at start-up (idle: often lower); not exported
    current_width: int | None = None

    def attributes(self) -> dict[str, Any]:
        attrs: dict[str, Any] = {sc.LINK_TYPE: self.link_type, sc.LINK_WIDTH: self.width}
        if self.generation is not None:
            attrs[sc.LINK_GENERATION] = self.generation
        if self.pci_bus_id is not None:
            attrs[sc.PCI_BUS_ID] = self.pci_bus_id
        return attrs

    def describe(self) -> str:
        if self.link_type == PCIE:
            link = f"PCIe gen{self.generation} x{self.width}"
            if self.current_generation is not None and self.current_width is not None:
                link += f" (now gen{self.current_generation} x{self.current_width})"
        else:
            link = f"NVLink-C2C, {self.width} active links"
        return f"{link}, {self.bytes_per_second / 1e9:.2f} GB/s per direction, bus id {self.pci_bus_id}"


class _Unavailable(Exception):
    """No link capacity to report; the message says why."""


def _handle(nvml: Any, device: tuple[str, Any]) -> Any:
    kind, value = device
    if kind == BUS_ID:
        return nvml.nvmlDeviceGetHandleByPciBusId(value)
    if kind == UUID:
        handle = nvml.nvmlDeviceGetHandleByUUID(value)
        if str(value).startswith("MIG-") and hasattr(nvml, "nvmlDeviceGetDeviceHandleFromMigDeviceHandle"):
            handle = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)  # the link is the GPU's
        return handle
    if kind == INDEX:
        return nvml.nvmlDeviceGetHandleByIndex(int(value))
    if kind == ONLY:
        count = nvml.nvmlDeviceGetCount()
        if count != 1:
            raise _Unavailable(f"NVML sees {count} GPUs and CUDA is not initialized in this process: "
                               "which one is unknown")
        return nvml.nvmlDeviceGetHandleByIndex(0)
    raise _Unavailable(str(value))


def _field_ok(field: Any) -> bool:
    return getattr(field, "nvmlReturn", None) == _NVML_SUCCESS


def _c2c(nvml: Any, handle: Any) -> tuple[float, int] | None:
    """(bytes/s, active links) of an enabled NVLink-C2C host link, else None."""
    mode_info = getattr(nvml, "nvmlDeviceGetC2cModeInfoV", None)
    if mode_info is None:  # a pynvml older than C2C
        return None
    try:
        enabled = bool(getattr(mode_info(handle), "isC2cEnabled", 0))
    except Exception:  # pylint: disable=broad-except  # NVMLError (not supported): no C2C
        return None
    if not enabled:
        return None
    try:
        (count,) = nvml.nvmlDeviceGetFieldValues(handle, [nvml.NVML_FI_DEV_C2C_LINK_COUNT])
        links = int(count.value.uiVal) if _field_ok(count) else 0
        total_mbps, active = 0, 0
        for link in range(links):
            status, bandwidth = nvml.nvmlDeviceGetFieldValues(
                handle, [(nvml.NVML_FI_DEV_C2C_LINK_GET_STATUS, link), (nvml.NVML_FI_DEV_C2C_LINK_GET_MAX_BW, link)])
            if _field_ok(status) and status.value.uiVal == 1 and _field_ok(bandwidth):
                total_mbps += int(bandwidth.value.uiVal)
                active += 1
    except Exception as exc:  # pylint: disable=broad-except
        raise _Unavailable(f"NVLink-C2C is enabled but its bandwidth cannot be read ({exc!r})") from exc
    if not active or total_mbps <= 0:
        raise _Unavailable("NVLink-C2C is enabled but NVML reports no active link with a bandwidth")
    return total_mbps * 1e6, active


def _first(nvml: Any, handle: Any, *names: str) -> int | None:
    """The value of the first of these NVML getters that answers."""
    for name in names:
        try:
            return int(getattr(nvml, name)(handle))
        except Exception:  # pylint: disable=broad-except  # NVMLError, or a pynvml without it
            continue
    return None


def _bus_id(nvml: Any, handle: Any, device: tuple[str, Any]) -> str | None:
    try:
        info = nvml.nvmlDeviceGetPciInfo(handle)
        found = dcgm_bus_id(getattr(info, "busId", None)) or dcgm_bus_id(getattr(info, "busIdLegacy", None))
        if found:
            return found
    except Exception:  # pylint: disable=broad-except
        pass
    return device[1] if device[0] == BUS_ID else None


def _read(nvml: Any, device: tuple[str, Any]) -> LinkInfo:
    handle = _handle(nvml, device)
    bus_id = _bus_id(nvml, handle, device)
    c2c = _c2c(nvml, handle)
    if c2c is not None:
        return LinkInfo(C2C, c2c[0], c2c[1], pci_bus_id=bus_id)
    current_gen = _first(nvml, handle, "nvmlDeviceGetCurrPcieLinkGeneration")
    current_width = _first(nvml, handle, "nvmlDeviceGetCurrPcieLinkWidth")
    generation = _first(nvml, handle, "nvmlDeviceGetMaxPcieLinkGeneration") or current_gen
    width = _first(nvml, handle, "nvmlDeviceGetMaxPcieLinkWidth") or current_width
    if not generation or not width:
        raise _Unavailable("NVML reports no PCIe link generation and width for this GPU")
    nominal = pcie_bytes_per_second(generation, width)
    if nominal is None:
        raise _Unavailable(f"PCIe generation {generation} has no known per-lane rate")
    return LinkInfo(PCIE, nominal, width, generation, bus_id, current_gen, current_width)


def read_link(device: tuple[str, Any]) -> tuple[LinkInfo | None, str]:
    """``(LinkInfo, "")``, or ``(None, why)``. Initializes NVML and shuts it down again
    (NVML counts its initializations: other users in the process are not affected).
    Never raises."""
    if device[0] == NONE:
        return None, str(device[1])
    try:
        import pynvml as nvml  # pylint: disable=import-outside-toplevel
    except Exception as exc:  # pylint: disable=broad-except  # ImportError, or a broken install
        return None, f"pynvml is not importable ({type(exc).__name__}: {exc}); pip install otel-hicache[nvml]"
    try:
        nvml.nvmlInit()
    except Exception as exc:  # pylint: disable=broad-except  # NVMLError: no driver, no GPU
        return None, f"nvmlInit() failed ({type(exc).__name__}: {exc})"
    try:
        return _read(nvml, device), ""
    except _Unavailable as exc:
        return None, str(exc)
    except Exception as exc:  # pylint: disable=broad-except
        return None, f"NVML query failed for {device[0]} {device[1]!r} ({type(exc).__name__}: {exc})"
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # pylint: disable=broad-except
            pass


class LinkCapacity:
    """``hicache.link.nominal_bandwidth`` of one telemetry instance.

    :param attributes: static attributes (ranks...) on every point.
    :param device: the serving process's ``capture.device.current_device()``.

    :meth:`bind` registers the gauge on a ``MeterProvider`` (again after a fork, with the
    child's provider); NVML is read on the first :meth:`info` or :meth:`bind`, once.
    """

    def __init__(self, attributes: Mapping[str, Any] | None = None, device: tuple[str, Any] | None = None) -> None:
        self._static = dict(attributes or {})
        self.device = tuple(device) if device else (NONE, "the serving process named no device")
        self._read = False
        self._info: LinkInfo | None = None
        self.unavailable = ""  # why there is no value, once read
        self._bound: Any = None

    def info(self) -> LinkInfo | None:
        """The link, read from NVML the first time (one DEBUG line), or None."""
        if not self._read:
            self._read = True
            self._info, self.unavailable = read_link(self.device)
            if logger.isEnabledFor(logging.DEBUG):
                if self._info is None:
                    logger.debug("otel-hicache: no %s (%s)", sc.LINK_NOMINAL_BANDWIDTH[0], self.unavailable)
                else:
                    logger.debug("otel-hicache: host link %s", self._info.describe())
        return self._info

    def bind(self, meter_provider: Any) -> None:
        """Register the observable gauge on ``meter_provider``'s meter, if there is a link to report."""
        try:
            info = self.info()
            if info is None:
                return
            from opentelemetry.metrics import Observation  # pylint: disable=import-outside-toplevel

            link = {**self._static, **info.attributes()}
            observations = [Observation(info.bytes_per_second, {**link, sc.DIRECTION: d}) for d in DIRECTIONS]
            name, unit, description = sc.LINK_NOMINAL_BANDWIDTH
            meter = meter_provider.get_meter(sc.SCOPE_NAME, __version__)
            self._bound = meter.create_observable_gauge(
                name, callbacks=[lambda _options: observations], unit=unit, description=description)
        except Exception as exc:  # pylint: disable=broad-except  # never into the host application
            logger.debug("otel-hicache: %s not registered (%r)", sc.LINK_NOMINAL_BANDWIDTH[0], exc)
