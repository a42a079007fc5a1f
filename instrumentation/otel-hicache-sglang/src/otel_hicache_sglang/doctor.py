"""The SGLang section of ``otel-hicache doctor``: the version guard, the plugin entry point, and
which patch groups would apply on the SGLang installed here (SGLang's knowledge, kept here)."""

from __future__ import annotations

import os
from importlib.metadata import entry_points
from typing import TextIO


def report(out: TextIO, installed: str, check_groups: bool) -> None:
    import otel_hicache_sglang as adapter

    try:
        from opentelemetry.instrumentation.dependencies import get_dependency_conflicts

        wanted = adapter.SGLangHiCacheInstrumentor().instrumentation_dependencies()
        conflict = get_dependency_conflicts(wanted)
        guard = "supported" if conflict is None else f"NOT supported: {conflict}"
        print(f"  sglang          {installed} ({guard}; the adapter instruments {', '.join(wanted)})", file=out)
    except Exception as exc:  # pylint: disable=broad-except
        print(f"  sglang          {installed} (version guard not checked: {type(exc).__name__}: {exc})", file=out)
    plugin = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "otel_hicache"]
    print(f"  adapter         otel-hicache-sglang {adapter.__version__}; SGLang plugin entry point "
          f"{'registered' if plugin else 'NOT registered (reinstall otel-hicache-sglang)'}", file=out)
    allowed = [p.strip() for p in os.environ.get("SGLANG_PLUGINS", "").split(",") if p.strip()]
    if allowed and "otel_hicache" not in allowed:
        print(f"  WARNING         SGLANG_PLUGINS={os.environ['SGLANG_PLUGINS']!r} does not list otel_hicache: SGLang "
              f"will not load the adapter (add otel_hicache, or use opentelemetry-instrument)", file=out)
    if not check_groups:
        print("  patch groups    not checked (--skip-sglang)", file=out)
        return
    print("  patch groups    (importing SGLang's modules: seconds; --skip-sglang skips it)", file=out)
    out.flush()
    try:
        groups = adapter.patch_groups()
    except Exception as exc:  # pylint: disable=broad-except
        print(f"                  not checked ({type(exc).__name__}: {exc})", file=out)
        return
    reasons = {why for _, why in groups}
    if len(groups) > 1 and len(reasons) == 1 and None not in reasons:  # one cause: said once
        print(f"                  none would apply: {reasons.pop()}", file=out)
        print(f"                  ({', '.join(group for group, _ in groups)})", file=out)
        return
    for group, why in groups:
        print(f"                  {group}: " + ("would apply" if why is None else f"would NOT apply ({why})"),
              file=out)
