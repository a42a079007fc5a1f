"""A stand-in for the ``pynvml`` module (nvidia-ml-py): the calls otel_hicache.sinks.link_capacity
makes, answered from a list of simulated GPUs. Install with
``monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(...))``."""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

from otel_hicache.sinks.link_capacity import dcgm_bus_id

NVML_SUCCESS = 0
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {NVML_ERROR_NOT_SUPPORTED: "Not Supported", NVML_ERROR_NOT_FOUND: "Not Found"}.get(
            self.value, f"NVML error {self.value}")


@dataclass
class Gpu:
    bus_id: str = "00000000:3B:00.0"
    uuid: str = "GPU-11111111-2222-3333-4444-555555555555"
    max_gen: int | None = 4  # None: the call is not supported
    max_width: int | None = 16
    cur_gen: int | None = 1  # idle: a GPU drops its PCIe generation
    cur_width: int | None = 16
    c2c: list[tuple[int, int]] | None = None  # per link (status, MB/s); None: C2C not supported
    c2c_fields_fail: bool = False
    legacy_bus_id: bool = False  # busId as bytes (older pynvml releases)


@dataclass
class _Value:
    uiVal: int = 0  # pylint: disable=invalid-name


@dataclass
class _Field:
    fieldId: int  # pylint: disable=invalid-name
    scopeId: int = 0  # pylint: disable=invalid-name
    nvmlReturn: int = NVML_SUCCESS  # pylint: disable=invalid-name
    value: _Value = field(default_factory=_Value)


class FakeNvml(types.ModuleType):
    NVML_FI_DEV_C2C_LINK_COUNT = 170
    NVML_FI_DEV_C2C_LINK_GET_STATUS = 171
    NVML_FI_DEV_C2C_LINK_GET_MAX_BW = 172
    NVMLError = NVMLError

    def __init__(self, gpus: list[Gpu] | None = None, init_error: bool = False, no_c2c_api: bool = False) -> None:
        super().__init__("pynvml")
        self.gpus = [Gpu()] if gpus is None else gpus
        self.init_error = init_error
        self.inits = 0
        self.shutdowns = 0
        self.calls: list[str] = []
        if not no_c2c_api:
            self.nvmlDeviceGetC2cModeInfoV = self._c2c_mode_info

    def _initialized(self) -> None:
        if self.inits <= self.shutdowns:
            raise NVMLError(1)  # Uninitialized

    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        if self.init_error:
            raise NVMLError(9)  # Driver Not Loaded
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self._initialized()
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        self._initialized()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Gpu:
        self._initialized()
        if not 0 <= index < len(self.gpus):
            raise NVMLError(2)  # Invalid Argument
        return self.gpus[index]

    def nvmlDeviceGetHandleByPciBusId(self, bus_id: str) -> Gpu:
        self._initialized()
        for gpu in self.gpus:
            if dcgm_bus_id(gpu.bus_id) == dcgm_bus_id(bus_id):
                return gpu
        raise NVMLError(NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Gpu:
        self._initialized()
        for gpu in self.gpus:
            if gpu.uuid == uuid:
                return gpu
        raise NVMLError(NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetPciInfo(self, gpu: Gpu) -> Any:
        self._initialized()
        bus = gpu.bus_id.encode() if gpu.legacy_bus_id else gpu.bus_id
        return types.SimpleNamespace(busId=bus, busIdLegacy=gpu.bus_id[4:])

    def _answer(self, value: int | None) -> int:
        self._initialized()
        if value is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return value

    def nvmlDeviceGetMaxPcieLinkGeneration(self, gpu: Gpu) -> int:
        return self._answer(gpu.max_gen)

    def nvmlDeviceGetMaxPcieLinkWidth(self, gpu: Gpu) -> int:
        return self._answer(gpu.max_width)

    def nvmlDeviceGetCurrPcieLinkGeneration(self, gpu: Gpu) -> int:
        return self._answer(gpu.cur_gen)

    def nvmlDeviceGetCurrPcieLinkWidth(self, gpu: Gpu) -> int:
        return self._answer(gpu.cur_width)

    def _c2c_mode_info(self, gpu: Gpu) -> Any:
        self._initialized()
        if gpu.c2c is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return types.SimpleNamespace(isC2cEnabled=1)

    def nvmlDeviceGetFieldValues(self, gpu: Gpu, field_ids: list[Any]) -> list[_Field]:
        self._initialized()
        if gpu.c2c_fields_fail:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        out = []
        links = gpu.c2c or []
        for spec in field_ids:
            field_id, scope = spec if isinstance(spec, tuple) else (spec, 0)
            f = _Field(field_id, scope)
            if field_id == self.NVML_FI_DEV_C2C_LINK_COUNT:
                f.value.uiVal = len(links)
            elif field_id in (self.NVML_FI_DEV_C2C_LINK_GET_STATUS, self.NVML_FI_DEV_C2C_LINK_GET_MAX_BW) \
                    and scope < len(links):
                status, mbps = links[scope]
                f.value.uiVal = status if field_id == self.NVML_FI_DEV_C2C_LINK_GET_STATUS else mbps
            else:
                f.nvmlReturn = NVML_ERROR_NOT_SUPPORTED
            out.append(f)
        return out
