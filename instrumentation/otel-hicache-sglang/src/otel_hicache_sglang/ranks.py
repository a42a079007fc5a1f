"""The rank labels SGLang itself puts on its Prometheus series.

``radix_cache_metric_labels`` gives ``tp_rank``/``pp_rank``/``dp_rank`` exactly
as SGLang's ``RadixCacheMetricsCollector`` labels them (attention-TP/DP ranks
under DP attention), and the runtime context adds ``attn_cp_rank``. Same label
names, so PromQL can join otel-hicache and ``sglang:*`` series on them.
"""

from __future__ import annotations

from typing import Any

from otel_hicache.diagnostics import logger

RANK_LABELS = ("tp_rank", "pp_rank", "dp_rank", "attn_cp_rank")


def rank_attributes() -> dict[str, Any]:
    """Rank labels of this scheduler process; 0 for any the runtime has not set
    (a single-rank process, or one that is not a scheduler)."""
    ranks: dict[str, Any] = dict.fromkeys(RANK_LABELS, 0)
    try:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
    except Exception as exc:  # pylint: disable=broad-except
        logger.debug("otel-hicache: no SGLang runtime context (%r); ranks default to 0", exc)
        return ranks
    try:
        from sglang.srt.layers.dp_attention import is_dp_attention_enabled
        from sglang.srt.observability.metrics_collector import radix_cache_metric_labels

        labels = radix_cache_metric_labels("", parallel, is_dp_attention_enabled())
        for key in ("tp_rank", "pp_rank", "dp_rank"):
            ranks[key] = int(labels[key])
    except Exception as exc:  # pylint: disable=broad-except  # uninitialized fields raise on read
        logger.debug("otel-hicache: SGLang ranks not published yet (%r); using what is set", exc)
        for key, field in (("tp_rank", "tp_rank"), ("pp_rank", "pp_rank")):
            try:
                ranks[key] = int(getattr(parallel, field))
            except Exception:  # pylint: disable=broad-except
                pass
    try:
        ranks["attn_cp_rank"] = int(parallel.attn_cp_rank)
    except Exception:  # pylint: disable=broad-except
        pass
    return ranks
