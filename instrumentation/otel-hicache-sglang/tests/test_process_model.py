"""Spawned scheduler processes get instrumented the two ways users launch SGLang.

SGLang starts schedulers with ``multiprocessing`` (spawn); each calls
``load_plugins()`` first. These tests spawn such a child, let it run real
HiCache transfers on CPU, and receive its spans and metrics over real OTLP, as
a Collector would.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
from otlp_receiver import GrpcReceiver, attributes

pytestmark = pytest.mark.slow  # processes, receivers, seconds each: CI's later step (pytest -m slow)

HERE = Path(__file__).resolve().parent
SPAWN_TIMEOUT_S = 180
# (the decode-offload causes: only where its module is imported)
ALL_GROUPS = ["L1<->L2 transfers", "transfer causes", "transfer causes: buffer-only host mode", "host residence"]


def _otlp_env(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    monkeypatch.setenv("OTEL_SERVICE_NAME", "sglang")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=ci")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")


def _spawn_scheduler() -> tuple[dict[str, Any], int]:
    import sglang_child

    ctx = multiprocessing.get_context("spawn")  # what SGLang's Engine forces
    results = ctx.Queue()
    child = ctx.Process(target=sglang_child.scheduler_like, args=(results,))
    child.start()
    try:
        [report] = sglang_child.collect(results, [child], SPAWN_TIMEOUT_S)
    finally:
        child.join(SPAWN_TIMEOUT_S)
    return report, child.exitcode


def _check_exported(received: Any, report: dict[str, Any]) -> None:
    spans = received.spans()
    by_origin: dict[tuple[str, str], list[dict[str, Any]]] = {}
    ranks = {"tp_rank", "pp_rank", "dp_rank", "attn_cp_rank"}  # the telemetry process's resource has them
    for resource, span in spans:
        assert attributes(resource.attributes)["service.name"] == "sglang"
        assert ranks <= set(attributes(resource.attributes))
        attrs = attributes(span.attributes)
        assert not ranks & set(attrs)
        by_origin.setdefault((attrs["hicache.direction"], attrs["hicache.origin"]), []).append(attrs)
    # one span per copy: two merged ops, two retraction copies (instrumented once)
    assert sorted((k, len(v)) for k, v in by_origin.items()) == [
        (("offload", "direct"), 1), (("offload", "merged_op"), 1),
        (("onboard", "direct"), 1), (("onboard", "merged_op"), 1)]
    sglang = report["sglang"]
    assert by_origin["offload", "merged_op"][0]["hicache.tokens"] == sglang[
        "sglang:hicache_backup_tokens_total{'pool': 'kv'}"] == report["write_through"]["offload_tokens"]
    assert by_origin["onboard", "merged_op"][0]["hicache.bytes"] == sglang["sglang:load_back_bytes_total{}"]
    assert by_origin["offload", "direct"][0]["hicache.tokens"] == report["retraction"]["direct_offload_tokens"]
    # the metrics exported at the child's exit agree with SGLang's counters
    tokens = {}
    for point in received.last_points("hicache.transfer.tokens"):
        a = attributes(point.attributes)
        assert not ranks & set(a)
        tokens[a["hicache.direction"], a["hicache.origin"]] = tokens.get(
            (a["hicache.direction"], a["hicache.origin"]), 0) + getattr(point, point.WhichOneof("value"))
    assert tokens["offload", "merged_op"] == sglang["sglang:hicache_backup_tokens_total{'pool': 'kv'}"]
    assert tokens["onboard", "merged_op"] == sglang["sglang:load_back_tokens_total{'pool': 'kv'}"]
    assert tokens["offload", "direct"] == report["retraction"]["direct_offload_tokens"]


def test_the_adapter_is_registered_in_both_entry_point_groups():
    plugins = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    instrumentors = {ep.name: ep.value for ep in entry_points(group="opentelemetry_instrumentor")}
    assert plugins.get("otel_hicache") == "otel_hicache_sglang:plugin"
    assert instrumentors.get("sglang_hicache") == "otel_hicache_sglang:SGLangHiCacheInstrumentor"


def test_a_spawned_scheduler_is_instrumented_through_sglang_load_plugins(monkeypatch):
    receiver = GrpcReceiver()
    try:
        _otlp_env(monkeypatch, receiver.endpoint)
        monkeypatch.setenv("SGLANG_PLUGINS", "otel_hicache")  # SGLang's whitelist names ours
        report, exitcode = _spawn_scheduler()
        assert exitcode == 0
        assert report["instrumented"] is True
        assert report["groups"] == ALL_GROUPS
        # SGLang's own global TracerProvider (--enable-trace) is left alone
        assert report["global_tracer_provider"] == "ProxyTracerProvider"
        _check_exported(receiver.received, report)
    finally:
        receiver.stop()


def test_sglang_plugins_whitelist_without_ours_leaves_sglang_uninstrumented(monkeypatch):
    receiver = GrpcReceiver()
    try:
        _otlp_env(monkeypatch, receiver.endpoint)
        monkeypatch.setenv("SGLANG_PLUGINS", "some_other_plugin")
        report, exitcode = _spawn_scheduler()
        assert exitcode == 0
        assert report["instrumented"] is False
        assert report["write_through"]["bit_exact"] is True
        assert receiver.received.spans() == []
    finally:
        receiver.stop()


def test_opentelemetry_instrument_reaches_the_spawned_scheduler(monkeypatch, tmp_path):
    """sitecustomize is inherited by the spawned child and patches SGLang on import."""
    receiver = GrpcReceiver()
    try:
        _otlp_env(monkeypatch, receiver.endpoint)
        monkeypatch.setenv("SGLANG_PLUGINS", "some_other_plugin")  # only opentelemetry-instrument can do it
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
        monkeypatch.setenv("OTEL_METRICS_EXPORTER", "otlp")
        monkeypatch.setenv("OTEL_LOGS_EXPORTER", "none")
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
        driver = (
            "import json, multiprocessing as mp, sglang_child\n"
            "if __name__ == '__main__':\n"
            "    ctx = mp.get_context('spawn'); q = ctx.Queue()\n"
            "    p = ctx.Process(target=sglang_child.scheduler_like, args=(q,)); p.start()\n"
            f"    print(json.dumps(q.get(timeout={SPAWN_TIMEOUT_S}))); p.join({SPAWN_TIMEOUT_S})\n"
            "    raise SystemExit(p.exitcode)\n"
        )
        script = tmp_path / "driver.py"
        script.write_text(driver)
        instrument = Path(sys.executable).with_name("opentelemetry-instrument")
        done = subprocess.run([str(instrument), sys.executable, str(script)], capture_output=True, text=True,
                              timeout=2 * SPAWN_TIMEOUT_S, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        report = json.loads(done.stdout.strip().splitlines()[-1])
        assert report["instrumented"] is True
        # patched on import: SGLang was imported after sitecustomize ran the instrumentor
        assert report["groups"] == ALL_GROUPS
        # the distro owns the global provider; otel-hicache kept its own private one
        assert report["global_tracer_provider"] == "TracerProvider"
        _check_exported(receiver.received, report)
    finally:
        receiver.stop()
