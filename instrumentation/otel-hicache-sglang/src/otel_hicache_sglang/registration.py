"""What the SGLang adapter registers with the core (entry-point group ``otel_hicache.adapters``):
SGLang's causes, and its section of ``otel-hicache doctor``."""

from __future__ import annotations

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

CAUSES = {
    "offload": (WRITE_THROUGH, WRITE_THROUGH_SELECTIVE, WRITE_BACK, STORAGE_BACKUP, DECODE_OFFLOAD,
                RETRACTION_BACKUP),
    "onboard": (PREFIX_HIT, STORAGE_PREFETCH, RETRACTION_RESTORE),
}
"""Where in SGLang each comes from: docs/reference.md."""
DIRECT_CAUSES = (RETRACTION_BACKUP, RETRACTION_RESTORE)
"""Retraction copies bypass the controller's queues: nobody acks them."""


def doctor(out: TextIO, check: bool) -> None:
    """SGLang's section; ``check=False`` skips importing SGLang's modules (seconds)."""
    from importlib.metadata import PackageNotFoundError, version

    print("SGLang", file=out)
    try:
        installed = version("sglang")
    except PackageNotFoundError:
        print("  sglang          not installed", file=out)
        return
    from .doctor import report

    report(out, installed, check)
