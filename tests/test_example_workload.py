"""The example workload (examples/hicache_workload.py, run as a script from a checkout;
not shipped in the wheel, so it is loaded here by path)."""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")

from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402

import otel_hicache  # noqa: E402
from otel_hicache import TransferTelemetry  # noqa: E402
from otel_hicache import semconv as sc  # noqa: E402

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "hicache_workload.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("hicache_workload", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


hw = _load_example()

SMALL = ["--ops", "20", "--pool-tokens", "512", "--layers", "2", "--quiet"]

_ENV = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
    "OTEL_TRACES_EXPORTER",
    "OTEL_METRICS_EXPORTER",
    "OTEL_TRACES_SAMPLER",
    "OTEL_SDK_DISABLED",
    "OTEL_HICACHE_ENABLED",
)


@pytest.fixture(autouse=True)
def embedded_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)


def table_rows(out: str) -> dict[str, dict[str, str]]:
    """The summary table as {direction: {column: cell}} (column names joined by '_')."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("direction"))
    header = lines[start].replace("tokens ", "tokens_").replace(" ms", "_ms").split()
    rows = {}
    for line in lines[start + 1:start + 3]:
        cells = line.split()
        rows[cells[0]] = dict(zip(header, cells))
    return rows


def as_int(cell: str) -> int:
    return int(cell.replace(",", ""))


# -- histogram_quantile ------------------------------------------------------------------
BOUNDS = (1.0, 2.0, 4.0)
COUNTS = (2, 3, 5, 0)  # per bucket: (-inf,1] (1,2] (2,4] (4,+inf)


@pytest.mark.parametrize(
    "q, expected",
    [
        (0.1, 0.5),  # rank 1 in the first bucket, lower bound taken as 0
        (0.2, 1.0),  # rank 2: the first bucket's upper bound
        (0.5, 2.0),  # rank 5: the end of (1, 2]
        (0.3, 1.0 + 1.0 * (1 / 3)),  # rank 3: one of three in (1, 2]
        (0.9, 3.6),  # rank 9: four of five in (2, 4]
        (1.0, 4.0),
        (0.0, 0.0),
    ],
)
def test_histogram_quantile_interpolates_like_prometheus(q: float, expected: float) -> None:
    assert hw.histogram_quantile(q, BOUNDS, COUNTS) == pytest.approx(expected, rel=1e-12, abs=0)


def test_histogram_quantile_edges() -> None:
    # rank in the +Inf bucket: the largest finite bound
    assert hw.histogram_quantile(0.99, BOUNDS, (0, 0, 1, 1)) == 4.0
    assert hw.histogram_quantile(0.5, BOUNDS, (0, 0, 0, 7)) == 4.0
    assert math.isnan(hw.histogram_quantile(0.5, BOUNDS, (0, 0, 0, 0)))
    # empty buckets before the rank are skipped: rank 1 of 2 lands at the end of (2, 4]
    assert hw.histogram_quantile(0.5, BOUNDS, (0, 0, 1, 1)) == 4.0
    assert hw.histogram_quantile(0.25, BOUNDS, (0, 0, 2, 0)) == 2.5


# -- summarize / compare on data exported by the real SDK ----------------------------------------
def test_summarize_reads_exported_metrics_exactly() -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    tel = TransferTelemetry(tracer_provider=None, meter_provider=provider, attributes={"tp_rank": 0})
    try:
        base = time.time_ns()
        # offload: 1, 2, 3 and 20 ms, disjoint (busy time = 26 ms); kv 100 tokens = 2 pages of 64
        for k, ms in enumerate((1, 2, 3, 20)):
            start = base + k * 50_000_000
            tel.submit("offload", {"kv": 100, "swa": 64}, 1_000_000, page_size=64, io_backend="direct",
                       expect_ack=False, host_start_ns=start, host_end_ns=start + ms * 1_000_000,
                       cause="write_back" if k == 3 else "write_through")
        start = base + 500_000_000
        tel.submit("onboard", {"kv": 64}, 5_000_000, page_size=64, expect_ack=False, host_start_ns=start,
                   host_end_ns=start + 4_000_000)
        tel.submit("sideways", {"kv": 64}, 1, page_size=64)  # invalid: dropped and counted
        assert tel.force_flush(5.0)
        summary = hw.summarize(reader.get_metrics_data())
    finally:
        tel.shutdown()
        provider.shutdown()
    off, on = summary.directions["offload"], summary.directions["onboard"]
    assert (off.ops, off.blocks, off.bytes) == (4, 8, 4_000_000)
    assert off.tokens == {"kv": 400, "swa": 256}
    assert off.timing_sources == {"host_clock": 4}
    assert off.busy_s == pytest.approx(0.026, rel=1e-9)
    assert off.bandwidth == pytest.approx(4_000_000 / 0.026, rel=1e-9)
    # ranks 2 and 3.96 of 4 in buckets (0.001, 0.0025] and (0.01, 0.025]
    assert off.p50_s == pytest.approx(0.0025, rel=1e-12)
    assert off.p99_s == pytest.approx(0.01 + 0.015 * 0.96, rel=1e-12)
    assert (on.ops, on.blocks, on.bytes, on.tokens) == (1, 1, 5_000_000, {"kv": 64})
    assert (off.bytes_by_cause, on.bytes_by_cause) == ({"write_through": 3_000_000, "write_back": 1_000_000},
                                                       {"other": 5_000_000})
    assert on.p50_s == pytest.approx(0.0025 + 0.0025 * 0.5, rel=1e-12)  # rank 0.5 in (0.0025, 0.005]
    assert summary.dropped.get(sc.DROP_INVALID_INPUT) == 1

    truth = {
        "offload": hw.DirectionSummary("offload", 4, {"kv": 400, "swa": 256}, 8, 4_000_000,
                                       bytes_by_cause={"write_through": 3_000_000, "write_back": 1_000_000}),
        "onboard": hw.DirectionSummary("onboard", 1, {"kv": 64}, 1, 5_000_000, bytes_by_cause={"other": 5_000_000}),
    }
    assert hw.compare(summary, truth) == ["1 records dropped/failed (invalid_input)"]
    summary.dropped.clear()
    assert hw.compare(summary, truth) == []
    truth["onboard"].ops = 2
    truth["offload"].tokens["swa"] = 255
    problems = hw.compare(summary, truth)
    assert "onboard ops: metrics 1 != workload 2" in problems
    assert any(p.startswith("offload tokens by pool") for p in problems)
    truth["offload"].bytes_by_cause["write_back"] -= 1
    assert any(p.startswith("offload bytes by cause") for p in hw.compare(summary, truth))


def test_copy_pages_coalesces_runs_and_copies_bytes() -> None:
    src = torch.arange(8 * 4 * 16, dtype=torch.int64).to(torch.uint8).view(8, 4, 16)
    dst = torch.zeros(10, 4, 16, dtype=torch.uint8)
    moved = hw.copy_pages(dst, [5, 6, 7, 0], src, [1, 2, 3, 6], non_blocking=False)
    assert moved == 4 * 4 * 16
    for s, d in ((1, 5), (2, 6), (3, 7), (6, 0)):
        assert torch.equal(dst[d], src[s])
    assert not dst[1:5].any() and not dst[8:].any()


# -- the workload itself ------------------------------------------------------------------------
def test_workload_spans_and_metrics_match_ground_truth() -> None:
    cfg = hw.WorkloadConfig(ops=24, seed=3, layers=2, pool_tokens=512, max_op_pages=4)
    pipeline = hw.EmbeddedPipeline()
    tel = TransferTelemetry(tracer_provider=pipeline.tracer_provider, meter_provider=pipeline.meter_provider,
                            attributes={"tp_rank": 0})
    try:
        workload = hw.HiCacheWorkload(cfg, torch.device("cpu"))
        truth = workload.run(tel)
        checked, problems = workload.verify()
        assert tel.force_flush(5.0)
        summary = hw.summarize(pipeline.metric_reader.get_metrics_data())
        spans = pipeline.span_exporter.get_finished_spans()
    finally:
        tel.shutdown()
        pipeline.shutdown()
    assert problems == [] and checked >= 3 * cfg.device_pages
    assert hw.compare(summary, truth) == []
    assert sum(t.ops for t in truth.values()) == 24
    assert truth["offload"].ops > 0 and truth["onboard"].ops > 0
    assert len(spans) == 24
    kv_bpt = 2 * 2 * 8 * 128 * 2
    for span in spans:
        attrs = span.attributes
        assert attrs[sc.POOL_NAMES][0] == "kv"
        kv_tokens = attrs[sc.POOL_TOKENS][0]
        assert attrs[sc.TOKENS] == kv_tokens and kv_tokens % 64 == 0
        assert attrs[sc.BLOCKS] == kv_tokens // 64
        # num_bytes = kv + swa (window of 4 pages) + draft (1 layer, bytes only)
        swa = dict(zip(attrs[sc.POOL_NAMES], attrs[sc.POOL_TOKENS]))["swa"]
        assert swa == min(kv_tokens, 256)
        assert attrs[sc.BYTES] == kv_tokens * kv_bpt + swa * (kv_bpt // 2) + kv_tokens * 4096
        assert attrs[sc.TIMING_SOURCE] == "host_clock"
        assert attrs[sc.IO_BACKEND] == "direct"
    acked = [s for s in spans if s.attributes.get(sc.ACKED) is True]
    assert len(acked) == workload.acked == 24 // hw.TRANSFER_EVERY
    assert all(s.attributes.get(sc.ACKED) is None for s in spans if s not in acked)
    assert sum(s.attributes[sc.BYTES] for s in spans) == sum(t.bytes for t in truth.values())


def test_main_embedded_prints_both_directions_and_matches(capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    assert hw.main(SMALL) == 0
    assert torch.get_num_threads() == threads  # the thread count the CPU copies set is restored
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert set(rows) == {"offload", "onboard"}
    assert as_int(rows["offload"]["ops"]) + as_int(rows["onboard"]["ops"]) == 20
    assert all(as_int(r["ops"]) > 0 and as_int(r["tokens_kv"]) > 0 for r in rows.values())
    assert all(r["timing"] == "host_clock" for r in rows.values())
    assert all(float(r["GB/s"]) > 0 and float(r["p50_ms"]) <= float(r["p99_ms"]) for r in rows.values())
    assert "spans exported: 20 " in out
    assert "copies verified: yes" in out
    assert "counters match ground truth: yes" in out
    assert re.search(r"\d+ offload and \d+ load-back spans link to the request they served; every link to an "
                     r"exported example.request span: yes", out)
    assert otel_hicache.configured() is None  # embedded mode never configures the OTEL_* providers


def test_main_fails_when_request_links_are_lost(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    submit = hw.TransferTelemetry.submit
    monkeypatch.setattr(hw.TransferTelemetry, "submit", lambda self, *a, requests=None, **k: submit(self, *a, **k))
    assert hw.main(SMALL) == 1
    out = capsys.readouterr().out
    assert "counters match ground truth: NO" in out
    assert re.search(r"(offload|onboard) spans linked to a request: \d+ != workload \d+", out)


def test_request_links_of_the_workload() -> None:
    """Write-throughs and prefix hits link to the request they served (a trace of its own),
    with its trace id on a hicache.request event; write-backs and storage prefetches to none."""
    cfg = hw.WorkloadConfig(ops=40, seed=5, layers=2, pool_tokens=512, max_op_pages=4)
    pipeline = hw.EmbeddedPipeline()
    tel = TransferTelemetry(tracer_provider=pipeline.tracer_provider, meter_provider=pipeline.meter_provider)
    try:
        truth = hw.HiCacheWorkload(cfg, torch.device("cpu")).run(
            tel, tracer=pipeline.tracer_provider.get_tracer("test"))
        assert tel.force_flush(5.0)
        spans = pipeline.span_exporter.get_finished_spans()
    finally:
        tel.shutdown()
        pipeline.shutdown()
    linked, dangling = hw.request_links(spans)
    assert dangling == 0 and linked == {d: truth[d].request_links for d in ("offload", "onboard")}
    assert linked["offload"] > 0 and linked["onboard"] > 0
    requests = {s.context.span_id: s for s in spans if s.name == hw.REQUEST_SPAN}
    for span in (s for s in spans if s.name.startswith("hicache.")):
        to = [link for link in span.links if link.attributes.get(sc.LINK_TO) == sc.LINK_TO_REQUEST]
        events = [e for e in span.events if e.name == "hicache.request"]
        if span.attributes[sc.CAUSE] in hw.REQUEST_CAUSES:
            [link] = to
            request = requests[link.context.span_id]
            assert request.parent is None and request.context.trace_id != span.context.trace_id
            assert [e.attributes[sc.REQUEST_TRACE_ID] for e in events] == [f"{request.context.trace_id:032x}"]
        else:
            assert not to and not events


def test_main_fails_when_metrics_miss_ops(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # ops timed by tel.transfer() are lost: the ground-truth check must catch it
    monkeypatch.setattr(hw.TransferTelemetry, "transfer", lambda self, *a, **k: contextlib.nullcontext())
    assert hw.main(SMALL) == 1
    out = capsys.readouterr().out
    assert "counters match ground truth: NO" in out
    assert "spans: exported 5 != ops 20" in out


def test_main_env_mode_prints_ground_truth(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    assert hw.export_requested()
    assert hw.main(SMALL) == 0
    out = capsys.readouterr().out
    assert "workload ground truth" in out and "counters match" not in out
    rows = table_rows(out)
    assert as_int(rows["offload"]["ops"]) + as_int(rows["onboard"]["ops"]) == 20
    assert "p50_ms" not in rows["offload"]
    assert otel_hicache.configured() is None  # shut down at the end


def test_main_with_otel_disabled_reports_ground_truth(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert hw.main(SMALL) == 0
    out = capsys.readouterr().out
    assert "otel-hicache is disabled" in out and "counters match" not in out
    rows = table_rows(out)
    assert as_int(rows["offload"]["ops"]) + as_int(rows["onboard"]["ops"]) == 20


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_main_cuda_without_cuda_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert hw.main(SMALL + ["--device", "cuda"]) == 2
    assert "torch.cuda.is_available() is False" in capsys.readouterr().err


def test_export_requested() -> None:
    assert not hw.export_requested({})
    assert not hw.export_requested({"OTEL_EXPORTER_OTLP_ENDPOINT": " "})
    assert hw.export_requested({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://127.0.0.1:4318/v1/metrics"})
    assert hw.export_requested({"OTEL_TRACES_EXPORTER": "console"})


def test_runs_as_a_script_from_the_checkout() -> None:
    env = {k: v for k, v in os.environ.items() if k not in _ENV}
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--ops", "5", "--pool-tokens", "256", "--layers", "2",
                           "--quiet"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = table_rows(proc.stdout)
    assert as_int(rows["offload"]["ops"]) + as_int(rows["onboard"]["ops"]) == 5
    assert "spans exported: 5 " in proc.stdout
    assert "counters match ground truth: yes" in proc.stdout


def test_main_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        hw.main(["--ops", "0"])
    assert exc.value.code == 2
    assert "--ops" in capsys.readouterr().err
