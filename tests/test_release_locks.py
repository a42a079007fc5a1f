"""The SGLang releases tested (one lock each in requirements/sglang/) are the ranges the packages
declare: the adapter's ``_instruments`` and ``instruments`` extra, the core's torch extra, the
demo's torch, and the docs' release table."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import sglang_release  # noqa: E402

ADAPTER = ROOT / "instrumentation" / "otel-hicache-sglang"


def _next(version: str, part: int) -> str:
    parts = list(sglang_release.version_key(version))[: part + 1]
    parts[part] += 1
    return ".".join(map(str, parts))


def test_each_lock_is_its_release_and_starts_with_the_torch_it_pins():
    releases = sglang_release.releases()
    assert len(releases) >= 2
    for release in releases:
        pins = sglang_release.lock_pins(release)
        assert list(pins)[:2] == ["torch", "sglang"] and pins["sglang"] == release


def test_the_adapter_declares_exactly_the_tested_range():
    releases = sglang_release.releases()
    want = f"sglang >= {releases[0]}, < {_next(releases[-1], 2)}"
    namespace: dict = {}
    exec((ADAPTER / "src" / "otel_hicache_sglang" / "package.py").read_text(), namespace)
    assert namespace["_instruments"] == (want,)
    assert f'instruments = ["{want}"]' in (ADAPTER / "pyproject.toml").read_text()


def test_the_core_torch_range_is_the_tested_torches():
    torches = sorted({sglang_release.lock_pins(r)["torch"] for r in sglang_release.releases()},
                     key=sglang_release.version_key)
    low, high = ".".join(torches[0].split(".")[:2]), _next(torches[-1], 1)
    assert f'torch = ["torch>={low},<{high}"]' in (ROOT / "pyproject.toml").read_text()
    newest = sglang_release.lock_pins(sglang_release.releases()[-1])["torch"]
    assert re.search(rf"^torch=={re.escape(newest)}$", (ROOT / "requirements" / "demo.txt").read_text(), re.M)


def test_the_docs_have_a_row_per_release_with_its_torch():
    text = (ROOT / "docs" / "sglang.md").read_text()
    for release in sglang_release.releases():
        torch = sglang_release.lock_pins(release)["torch"]
        assert re.search(rf"^\| {re.escape(release)} \| {re.escape(torch)} \|", text, re.M), release


def test_the_release_list_is_what_the_ci_script_runs():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "sglang_release.py"), "list"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == sglang_release.releases()
