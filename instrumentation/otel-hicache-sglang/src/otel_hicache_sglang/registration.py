"""What the SGLang adapter registers with the core (entry-point group ``otel_hicache.adapters``):
SGLang's causes, and its section of ``otel-hicache doctor``."""

from __future__ import annotations

import os
from typing import TextIO

WRITE_THROUGH = "write_through"
WRITE_THROUGH_SELECTIVE = "write_through_selective"
WRITE_BACK = "write_back"
STORAGE_BACKUP = "storage_backup"
DECODE_OFFLOAD = "decode_offload"
RETRACTION_BACKUP = "retraction_backup"
PREFIX_HIT = "prefix_hit"
STORAGE_PREFETCH = "storage_prefetch"
RETRACTION_RESTORE = "retraction_restore"

CAUSES = {  # where in SGLang each comes from: docs/reference.md
    "offload": (WRITE_THROUGH, WRITE_THROUGH_SELECTIVE, WRITE_BACK, STORAGE_BACKUP, DECODE_OFFLOAD,
                RETRACTION_BACKUP),
    "onboard": (PREFIX_HIT, STORAGE_PREFETCH, RETRACTION_RESTORE),
}
DIRECT_CAUSES = (RETRACTION_BACKUP, RETRACTION_RESTORE)  # retraction copies bypass the queues: nobody acks them


def doctor(out: TextIO, check: bool) -> None:
    """SGLang's section: the version guard, the plugin entry point, and which patch groups
    would apply here (``check=False`` skips importing SGLang's modules: seconds)."""
    from importlib.metadata import PackageNotFoundError, entry_points, version

    import otel_hicache_sglang as adapter

    print("SGLang", file=out)
    try:
        installed = version("sglang")
    except PackageNotFoundError:
        print("  sglang          not installed", file=out)
        return
    try:
        from opentelemetry.instrumentation.dependencies import get_dependency_conflicts

        wanted = adapter.SGLangHiCacheInstrumentor().instrumentation_dependencies()
        conflict = get_dependency_conflicts(wanted)
        guard = "supported" if conflict is None else f"NOT supported: {conflict}"
        print(f"  sglang          {installed} ({guard}; the adapter instruments {', '.join(wanted)})", file=out)
    except Exception as exc:
        print(f"  sglang          {installed} (version guard not checked: {type(exc).__name__}: {exc})", file=out)
    plugin = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "otel_hicache"]
    print(f"  adapter         otel-hicache-sglang {adapter.__version__}; SGLang plugin entry point "
          f"{'registered' if plugin else 'NOT registered (reinstall otel-hicache-sglang)'}", file=out)
    allowed = [p.strip() for p in os.environ.get("SGLANG_PLUGINS", "").split(",") if p.strip()]
    if allowed and "otel_hicache" not in allowed:
        print(f"  WARNING         SGLANG_PLUGINS={os.environ['SGLANG_PLUGINS']!r} does not list otel_hicache: SGLang "
              f"will not load the adapter (add otel_hicache, or use opentelemetry-instrument)", file=out)
    if not check:
        print("  patch groups    not checked (--skip-adapters)", file=out)
        return
    print("  patch groups    (importing SGLang's modules: seconds; --skip-adapters skips it)", file=out)
    out.flush()
    try:
        groups = adapter.patch_groups()
    except Exception as exc:
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
