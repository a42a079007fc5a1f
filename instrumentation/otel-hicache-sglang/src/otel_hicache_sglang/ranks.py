"""The rank labels SGLang puts on its own series (``RadixCacheMetricsCollector``'s, and ``attn_cp_rank``)."""

from __future__ import annotations

from typing import Any

from otel_hicache.diagnostics import logger

RANK_LABELS = ("tp_rank", "pp_rank", "dp_rank", "attn_cp_rank")


def rank_attributes() -> dict[str, Any]:
    """This scheduler's rank labels; 0 for any the runtime has not set."""
    ranks: dict[str, Any] = dict.fromkeys(RANK_LABELS, 0)
    try:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
    except Exception as exc:
        logger.debug("otel-hicache: no SGLang runtime context (%r); ranks default to 0", exc)
        return ranks
    try:
        from sglang.srt.layers.dp_attention import is_dp_attention_enabled
        from sglang.srt.observability.metrics_collector import radix_cache_metric_labels

        labels = radix_cache_metric_labels("", parallel, is_dp_attention_enabled())
        ranks.update((key, int(labels[key])) for key in ("tp_rank", "pp_rank", "dp_rank"))
    except Exception as exc:  # uninitialized fields raise on read
        logger.debug("otel-hicache: SGLang ranks not published yet (%r); using what is set", exc)
        labels = {}
    for key in ("tp_rank", "pp_rank", "attn_cp_rank") if not labels else ("attn_cp_rank",):
        try:
            ranks[key] = int(getattr(parallel, key))
        except Exception:
            pass
    return ranks
