"""The entry-point group ``otel_hicache.adapters``: causes and doctor sections come from it."""

import io
import sys
import textwrap

import pytest

from otel_hicache import adapters, diagnostics
from otel_hicache.doctor import _adapters


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """Installs adapters (a dist-info and a module each) on sys.path for one test."""
    def install(name, source):
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        info = tmp_path / f"{name}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[{adapters.GROUP}]\n{name} = {name}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "path", [str(tmp_path)] + [p for p in sys.path if "site-packages" not in p])
    for cached in (adapters.registered, adapters.causes, adapters.direct_causes):
        cached.cache_clear()
    diagnostics.reset_warnings()
    yield install
    for cached in (adapters.registered, adapters.causes, adapters.direct_causes):
        cached.cache_clear()


def test_an_adapters_causes_come_before_other_and_a_broken_one_is_left_out(installed, caplog):
    installed("zeta", """
        CAUSES = {"offload": ("spill", "other"), "onboard": ("reuse",)}
        DIRECT_CAUSES = ("spill",)
        def doctor(out, check):
            print(f"Zeta check={check}", file=out)
    """)
    installed("alpha", "raise ImportError('no framework here')")
    assert adapters.causes() == {"offload": ("spill", "other"), "onboard": ("reuse", "other")}
    assert adapters.direct_causes() == frozenset({"spill"})
    assert [name for name, _ in adapters.registered()] == ["zeta"]
    assert "adapter alpha not loaded (ImportError: no framework here)" in caplog.text
    out = io.StringIO()
    _adapters(out, False)
    assert out.getvalue() == "Zeta check=False\n"


def test_without_adapters_every_direction_has_other(installed):
    assert adapters.causes() == {"offload": ("other",), "onboard": ("other",)}
    assert adapters.direct_causes() == frozenset()
