"""Each supported SGLang release (run by scripts/test-sglang.sh, each with the torch it pins):
the patch groups docs/sglang.md says are off on it are the ones off, each refused with one
warning, and every other group still reports: a merged op each way, with the ack's bytes."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[3] / "docs" / "sglang.md"


def _documented_off(release: str) -> set[str]:
    """The groups the docs' release table lists as off on ``release`` (its ``**bold**`` names)."""
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == release:
            return set(re.findall(r"\*\*(.+?)\*\*", cells[2]))
    raise AssertionError(f"docs/sglang.md has no row for SGLang {release}")


def _release() -> str:
    from importlib.metadata import version

    return version("sglang")


def test_the_docs_say_which_groups_are_off_on_this_release(sglang_cpu):
    from otel_hicache_sglang import patch_groups

    off = {name for name, why in patch_groups() if why is not None}
    assert off == _documented_off(_release())


def test_the_groups_off_here_refuse_cleanly_and_the_rest_report(sglang_cpu, make_instrumented, caplog):
    from otel_hicache_sglang import _request_groups, patch_groups
    from otel_hicache_sglang.transfers import TransferObserver

    caplog.set_level(logging.WARNING, logger="otel_hicache")
    request_groups = {g.name for g in _request_groups(TransferObserver(lambda ranks: None))}
    expected_off = _documented_off(_release()) - request_groups  # those apply with SGLang's tracing only
    inst = make_instrumented()
    controller, kv, allocator = sglang_cpu.build_controller()
    acks = sglang_cpu.controller_round_trip(controller, kv, allocator)
    all_groups = {name for name, _ in patch_groups()} - request_groups
    assert set(inst.instrumentor.instrumented_groups()) == all_groups - expected_off
    refused = [r.getMessage() for r in caplog.records if "does not match the adapter" in r.getMessage()]
    assert sorted(refused) == sorted(set(refused)) and len(refused) == len(expected_off)
    assert all(any(f"; {name} is not instrumented" in m for m in refused) for name in expected_off)
    spans = inst.finished()
    assert [(s.name, s.attributes["hicache.origin"]) for s in spans] == [
        ("hicache.offload", "merged_op"), ("hicache.onboard", "merged_op")]
    assert [s.attributes["hicache.bytes"] for s in spans] == [acks["write_ack"].num_bytes,
                                                             acks["load_ack"].num_bytes]
    assert inst.metric("hicache.transfer.bytes") == acks["write_ack"].num_bytes + acks["load_ack"].num_bytes


@pytest.mark.parametrize("outside", ["0.5.19", "0.5.24"])
def test_a_release_outside_the_tested_range_is_refused_whole(outside, monkeypatch, sglang_cpu):
    """BaseInstrumentor's dependency check: nothing is wrapped, SGLang runs as it is."""
    from opentelemetry.instrumentation import dependencies
    from otel_hicache_sglang import SGLangHiCacheInstrumentor

    real = dependencies.version
    monkeypatch.setattr(dependencies, "version", lambda name: outside if name == "sglang" else real(name))
    from sglang.srt.managers.cache_controller import HiCacheController

    before = vars(HiCacheController)["start_writing"]
    instrumentor = SGLangHiCacheInstrumentor()
    instrumentor.instrument()
    try:
        assert vars(HiCacheController)["start_writing"] is before
        assert not instrumentor.is_instrumented_by_opentelemetry
    finally:
        instrumentor.uninstrument()
