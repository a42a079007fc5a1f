#!/usr/bin/env bash
# SGLang (>= 0.5.20, < 0.5.24) with HiCache, its L1<->L2 transfers reported over OTLP (gRPC 4317).
#   pip install otel-hicache otel-hicache-sglang
#   MODEL=Qwen/Qwen3-8B TP=2 bash examples/sglang_launch.sh
#   OTEL_LAUNCHER=opentelemetry-instrument bash examples/sglang_launch.sh   # the other way in
set -euo pipefail
# Standard OTel variables only; the metric interval (ms) suits a Prometheus scrape.
export OTEL_SERVICE_NAME="${OTEL_SERVICE_NAME:-sglang}"
export OTEL_RESOURCE_ATTRIBUTES="${OTEL_RESOURCE_ATTRIBUTES:-deployment.environment=dev}"
export OTEL_EXPORTER_OTLP_ENDPOINT="${OTEL_EXPORTER_OTLP_ENDPOINT:-http://127.0.0.1:4317}"
export OTEL_METRIC_EXPORT_INTERVAL="${OTEL_METRIC_EXPORT_INTERVAL:-10000}"
# The SDK's self-metrics (otel.sdk.*, off by default): deploy/'s delivery panels and alerts read them.
export OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED="${OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED:-true}"
# A SGLANG_PLUGINS list must name the adapter's plugin.
if [ -n "${SGLANG_PLUGINS:-}" ]; then export SGLANG_PLUGINS="$SGLANG_PLUGINS,otel_hicache"; fi
exec ${OTEL_LAUNCHER:-} python -m sglang.launch_server --model-path "${MODEL:-Qwen/Qwen3-8B}" \
  --tp-size "${TP:-1}" --enable-hierarchical-cache --hicache-ratio "${HICACHE_RATIO:-2}" \
  --hicache-write-policy "${HICACHE_WRITE_POLICY:-write_through}" \
  --hicache-io-backend "${HICACHE_IO_BACKEND:-kernel}" --enable-metrics "$@"
