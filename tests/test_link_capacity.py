"""hicache.link.nominal_bandwidth: the host link's nominal capacity, from a fake NVML
(``pynvml``) on the CPU: the PCIe arithmetic, NVLink-C2C, which GPU, and nothing exported
(and nothing raised) without NVML."""

from __future__ import annotations

import logging
import sys
import types
from fractions import Fraction
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from fake_nvml import FakeNvml, Gpu
from otel_hicache.capture.device import current_device
from otel_hicache.sinks import link_capacity as lc
from otel_hicache import semconv as sc
NAME = sc.LINK_NOMINAL_BANDWIDTH[0]
GEN4_X16 = float(Fraction(16 * 16 * 10**9 * 128, 130 * 8))  # 16 lanes x 16 GT/s x 128/130 / 8 bits


@pytest.fixture(autouse=True)
def _no_cuda_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
        monkeypatch.delenv(key, raising=False)


def install(monkeypatch: pytest.MonkeyPatch, nvml: Any) -> Any:
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return nvml


def points(meter_provider_reader: InMemoryMetricReader) -> list[Any]:
    data = meter_provider_reader.get_metrics_data()
    return [p for rm in (data.resource_metrics if data else ()) for sm in rm.scope_metrics
            for m in sm.metrics if m.name == NAME for p in m.data.data_points]


def bound(capacity: lc.LinkCapacity) -> tuple[InMemoryMetricReader, MeterProvider]:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    capacity.bind(provider)
    return reader, provider


# -- the arithmetic ---------------------------------------------------------------


@pytest.mark.parametrize("generation, lanes, expected", [
    (1, 1, 250_000_000.0),  # 2.5 GT/s x 8/10 / 8
    (2, 16, 8_000_000_000.0),  # 5 GT/s x 8/10 / 8 x 16
    (3, 16, float(Fraction(16 * 8 * 10**9 * 128, 130 * 8))),
    (4, 16, GEN4_X16),
    (4, 8, GEN4_X16 / 2),
    (5, 16, float(Fraction(16 * 32 * 10**9 * 128, 130 * 8))),
    (6, 16, 128_000_000_000.0),  # 64 GT/s PAM4 FLIT: no line code (efficiency 1)
])
def test_pcie_nominal_bytes_per_second(generation, lanes, expected):
    assert lc.pcie_bytes_per_second(generation, lanes) == expected


def test_pcie_gen4_x16_is_31_5_gb_per_second_per_direction():
    assert GEN4_X16 == 31_507_692_307.692307
    assert lc.pcie_bytes_per_second(4, 16) == GEN4_X16


@pytest.mark.parametrize("generation, lanes", [(0, 16), (7, 16), (4, 0)])
def test_unknown_generation_or_no_lanes_has_no_nominal(generation, lanes):
    assert lc.pcie_bytes_per_second(generation, lanes) is None


@pytest.mark.parametrize("text, expected", [
    ("00000000:3B:00.0", "00000000:3B:00.0"),
    ("0000:3b:00.0", "00000000:3B:00.0"),  # NVML's busIdLegacy, sysfs
    (b"00000000:B1:00.0", "00000000:B1:00.0"),  # older pynvml: bytes
    ("3b:00.0", "00000000:3B:00.0"),
    ("00000001:0a:1f.3", "00000001:0A:1F.3"),
    ("not a bus id", None),
    (None, None),
])
def test_bus_id_in_dcgm_format(text, expected):
    assert lc.dcgm_bus_id(text) == expected


# -- which device -------------------------------------------------------------------


class FakeCuda:
    def __init__(self, initialized: bool, current: int = 0, props: list[Any] | None = None,
                 raises: bool = False) -> None:
        self.initialized, self.current, self.props, self.raises = initialized, current, props or [], raises

    def is_initialized(self) -> bool:
        if self.raises:
            raise RuntimeError("broken torch")
        return self.initialized

    def current_device(self) -> int:
        assert self.initialized, "would initialize CUDA"
        return self.current

    def get_device_properties(self, index: int) -> Any:
        assert self.initialized, "would initialize CUDA"
        return self.props[index]


def torch_with(cuda: FakeCuda) -> Any:
    return types.SimpleNamespace(cuda=cuda)


def props(domain: int, bus: int, device: int = 0, uuid: str = "") -> Any:
    return types.SimpleNamespace(pci_domain_id=domain, pci_bus_id=bus, pci_device_id=device, uuid=uuid)


def test_device_is_torch_current_device_by_bus_id():
    cuda = FakeCuda(True, current=1, props=[props(0, 0x1B), props(0, 0x3B)])
    assert current_device(torch_with(cuda), {}) == (lc.BUS_ID, "00000000:3B:00.0")


def test_device_by_uuid_with_a_torch_without_pci_ids():
    cuda = FakeCuda(True, props=[types.SimpleNamespace(uuid="58b7c0de-0000-1111-2222-333344445555")])
    assert current_device(torch_with(cuda), {}) == (lc.UUID, "GPU-58b7c0de-0000-1111-2222-333344445555")


def test_cuda_is_never_initialized_to_find_the_device():
    # FakeCuda asserts if asked for a device before CUDA is initialized
    assert current_device(torch_with(FakeCuda(False)), {}) == (lc.ONLY, None)


@pytest.mark.parametrize("environ, expected", [
    ({}, (lc.ONLY, None)),
    ({"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, (lc.INDEX, 0)),
    ({"CUDA_VISIBLE_DEVICES": "GPU-aaaa,GPU-bbbb"}, (lc.UUID, "GPU-aaaa")),
    ({"CUDA_VISIBLE_DEVICES": "MIG-cccc"}, (lc.UUID, "MIG-cccc")),
    ({"CUDA_VISIBLE_DEVICES": "2,3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, (lc.INDEX, 2)),
])
def test_device_from_the_environment_before_cuda_is_initialized(environ, expected):
    assert current_device(torch_with(FakeCuda(False)), environ) == expected


@pytest.mark.parametrize("environ", [{"CUDA_VISIBLE_DEVICES": "2,3"}, {"CUDA_VISIBLE_DEVICES": ""},
                                     {"CUDA_VISIBLE_DEVICES": "-1"}])
def test_no_device_when_the_environment_cannot_name_it(environ):
    kind, why = current_device(torch_with(FakeCuda(False)), environ)
    assert kind == lc.NONE and "CUDA_VISIBLE_DEVICES" in why


def test_a_broken_torch_falls_back_to_the_environment():
    cuda = FakeCuda(True, raises=True)
    assert current_device(torch_with(cuda), {"CUDA_VISIBLE_DEVICES": "GPU-aaaa"}) == (lc.UUID, "GPU-aaaa")


def test_without_torch_the_environment_decides(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    assert current_device(None, {"CUDA_VISIBLE_DEVICES": "GPU-x"}) == (lc.UUID, "GPU-x")


# -- what is exported -----------------------------------------------------------------


def test_pcie_gen4_x16_through_the_telemetry(monkeypatch, harness):
    nvml = install(monkeypatch, FakeNvml([Gpu(max_gen=4, max_width=16, cur_gen=1, cur_width=16)]))
    h = harness(attributes={"tp_rank": 3})
    found = h.points(NAME)
    assert sorted(p.attributes[sc.DIRECTION] for p in found) == ["offload", "onboard"]
    for p in found:
        assert p.value == GEN4_X16  # the max generation, not the idle one (gen1)
        assert dict(p.attributes) == {"tp_rank": 3, sc.DIRECTION: p.attributes[sc.DIRECTION],
                                      sc.LINK_TYPE: "pcie", sc.LINK_GENERATION: 4, sc.LINK_WIDTH: 16,
                                      sc.PCI_BUS_ID: "00000000:3B:00.0"}
    h.points(NAME)  # collected again: NVML was read once, initialized and shut down again
    assert (nvml.inits, nvml.shutdowns) == (1, 1)


def test_c2c_sums_the_active_links(monkeypatch):
    links = [(1, 45_000)] * 10 + [(0, 45_000)]  # one inactive link does not count
    install(monkeypatch, FakeNvml([Gpu(bus_id="00000009:01:00.0", c2c=links)]))
    capacity = lc.LinkCapacity({"tp_rank": 0}, current_device())
    reader, _ = bound(capacity)
    found = points(reader)
    assert len(found) == 2
    for p in found:
        assert p.value == 450e9  # 10 x 45000 MB/s
        assert dict(p.attributes) == {"tp_rank": 0, sc.DIRECTION: p.attributes[sc.DIRECTION],
                                      sc.LINK_TYPE: "c2c", sc.LINK_WIDTH: 10, sc.PCI_BUS_ID: "00000009:01:00.0"}
    assert "NVLink-C2C, 10 active links, 450.00 GB/s" in capacity.info().describe()


def test_c2c_enabled_but_unreadable_exports_nothing_not_pcie(monkeypatch):
    install(monkeypatch, FakeNvml([Gpu(c2c=[(1, 45_000)], c2c_fields_fail=True)]))
    capacity = lc.LinkCapacity(device=current_device())
    reader, _ = bound(capacity)
    assert points(reader) == []
    assert "C2C" in capacity.unavailable


def test_a_pynvml_without_c2c_reads_pcie(monkeypatch):
    install(monkeypatch, FakeNvml([Gpu(max_gen=5, max_width=16)], no_c2c_api=True))
    reader, _ = bound(lc.LinkCapacity(device=current_device()))
    assert {p.value for p in points(reader)} == {lc.pcie_bytes_per_second(5, 16)}


def test_current_generation_and_width_when_the_max_is_not_supported(monkeypatch):
    install(monkeypatch, FakeNvml([Gpu(max_gen=None, max_width=None, cur_gen=3, cur_width=8, legacy_bus_id=True)]))
    reader, _ = bound(lc.LinkCapacity(device=current_device()))
    found = points(reader)
    assert {p.value for p in found} == {lc.pcie_bytes_per_second(3, 8)}
    assert {p.attributes[sc.PCI_BUS_ID] for p in found} == {"00000000:3B:00.0"}


def test_the_selected_device_among_several(monkeypatch):
    gpus = [Gpu(bus_id="00000000:1B:00.0", max_gen=3, uuid="GPU-a"), Gpu(bus_id="00000000:B1:00.0", max_gen=5,
                                                                          uuid="GPU-b")]
    install(monkeypatch, FakeNvml(gpus))
    for device in ((lc.BUS_ID, "00000000:B1:00.0"), (lc.UUID, "GPU-b"), (lc.INDEX, 1)):
        reader, _ = bound(lc.LinkCapacity(device=device))
        assert {(p.value, p.attributes[sc.PCI_BUS_ID]) for p in points(reader)} == {
            (lc.pcie_bytes_per_second(5, 16), "00000000:B1:00.0")}, device


def test_several_gpus_and_no_way_to_tell_exports_nothing(monkeypatch, caplog):
    install(monkeypatch, FakeNvml([Gpu(), Gpu(bus_id="00000000:B1:00.0")]))
    caplog.set_level(logging.DEBUG, logger="otel_hicache")
    capacity = lc.LinkCapacity(device=(lc.ONLY, None))
    reader, _ = bound(capacity)
    assert points(reader) == []
    assert "NVML sees 2 GPUs" in capacity.unavailable


def _nothing_and_one_line(capacity: lc.LinkCapacity, caplog: pytest.LogCaptureFixture, why: str) -> None:
    caplog.set_level(logging.DEBUG, logger="otel_hicache")
    reader, provider = bound(capacity)
    capacity.bind(provider)  # again (a forked child's rebind): nothing new, no second line
    assert points(reader) == []
    assert capacity.info() is None and why in capacity.unavailable
    lines = [r for r in caplog.records if r.name == "otel_hicache"]
    assert len(lines) == 1 and lines[0].levelno == logging.DEBUG and why in lines[0].getMessage(), lines


def test_nvml_init_failure_exports_nothing_and_raises_nothing(monkeypatch, caplog):
    nvml = install(monkeypatch, FakeNvml(init_error=True))
    _nothing_and_one_line(lc.LinkCapacity(device=current_device()), caplog, "nvmlInit() failed")
    assert nvml.calls == ["nvmlInit"]  # tried once, not per collection


def test_no_pynvml_module_exports_nothing(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    _nothing_and_one_line(lc.LinkCapacity(device=current_device()), caplog, "pynvml is not importable")


def test_unknown_device_exports_nothing(monkeypatch, caplog):
    nvml = install(monkeypatch, FakeNvml())
    _nothing_and_one_line(lc.LinkCapacity(device=(lc.BUS_ID, "00000000:99:00.0")), caplog, "NVML query failed")
    assert (nvml.inits, nvml.shutdowns) == (1, 1)


def test_unknown_pcie_generation_exports_nothing(monkeypatch, caplog):
    install(monkeypatch, FakeNvml([Gpu(max_gen=7)]))
    _nothing_and_one_line(lc.LinkCapacity(device=current_device()), caplog, "generation 7")


def test_no_nameable_device_does_not_touch_nvml(monkeypatch, caplog):
    nvml = install(monkeypatch, FakeNvml())
    _nothing_and_one_line(lc.LinkCapacity(device=(lc.NONE, "no GPU here")), caplog, "no GPU here")
    assert nvml.calls == []


def test_telemetry_without_nvml_still_works(monkeypatch, harness):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    h = harness()
    end = h.device.time_ns()
    h.tel.submit("offload", {"kv": 64}, 4096, 64, host_start_ns=end - 1000, host_end_ns=end, expect_ack=False)
    assert h.points(NAME) == []
    assert h.value(sc.TRANSFER_BYTES[0], **{sc.DIRECTION: "offload"}) == 4096


def test_gpu_validate_reports_the_link_efficiency(monkeypatch, tmp_path, capsys):
    """benchmarks/gpu_validate.py (dry) reads the exported gauge: an efficiency row per direction."""
    import importlib.util
    import json
    from pathlib import Path

    pytest.importorskip("torch")
    install(monkeypatch, FakeNvml([Gpu(max_gen=6, max_width=16)]))
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_validate.py"
    spec = importlib.util.spec_from_file_location("gpu_validate_link", script)
    gv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gv)
    out = tmp_path / "r.json"
    status = gv.main(["--dry", "--sizes", "1", "--reps", "1", "--overhead-ops", "10", "--ack-reps", "1",
                      "--no-bench", "--watchdog-s", "0", "--out", str(out)])
    results = json.loads(out.read_text())
    assert status == 0, results["checks"]
    rows = {r["check"]: r for r in results["checks"]}
    for direction in ("offload", "onboard"):
        row = rows[f"link efficiency {direction} (busy-time throughput / nominal)"]
        assert row["status"] == "INFO, dry (not a GPU measurement)" and "/ 128.00 GB/s" in row["measured"], row
        assert "pcie gen6 x16" in row["measured"], row
    link = results["analysis"]["link"]
    assert link["nominal_gbs"] == {"offload": 128.0, "onboard": 128.0}
    assert link["attributes"][sc.PCI_BUS_ID] == "00000000:3B:00.0"
