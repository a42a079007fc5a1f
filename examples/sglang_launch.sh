#!/usr/bin/env bash
# Launch an SGLang server with HiCache, its L1<->L2 transfers reported by otel-hicache.
# Needs a GPU machine with SGLang (>= 0.5.20, < 0.5.24) and an OpenTelemetry Collector
# listening for OTLP (gRPC 4317 by default).
#
#   pip install otel-hicache otel-hicache-sglang      # from a checkout: pip install . ./instrumentation/otel-hicache-sglang
#   MODEL=Qwen/Qwen3-8B TP=2 bash examples/sglang_launch.sh
#   OTEL_LAUNCHER=opentelemetry-instrument bash examples/sglang_launch.sh   # the other way in
set -euo pipefail

# Standard OpenTelemetry variables: nothing SGLang- or otel-hicache-specific is required.
export OTEL_SERVICE_NAME="${OTEL_SERVICE_NAME:-sglang}"
export OTEL_RESOURCE_ATTRIBUTES="${OTEL_RESOURCE_ATTRIBUTES:-deployment.environment=dev}"
export OTEL_EXPORTER_OTLP_ENDPOINT="${OTEL_EXPORTER_OTLP_ENDPOINT:-http://127.0.0.1:4317}"
export OTEL_METRIC_EXPORT_INTERVAL="${OTEL_METRIC_EXPORT_INTERVAL:-10000}"   # ms, Prometheus-friendly
# The SDK's own self-metrics (otel.sdk.*: spans exported, lost in failed exports, dropped on a
# full queue; the span queue), off by default in the Python SDK. The "Telemetry delivery"
# panels and the OtelHiCacheSpansUndelivered alert of deploy/ read them.
export OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED="${OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED:-true}"
# If SGLANG_PLUGINS is set it must name the adapter's plugin.
if [ -n "${SGLANG_PLUGINS:-}" ]; then export SGLANG_PLUGINS="$SGLANG_PLUGINS,otel_hicache"; fi

exec ${OTEL_LAUNCHER:-} python -m sglang.launch_server \
  --model-path "${MODEL:-Qwen/Qwen3-8B}" \
  --tp-size "${TP:-1}" \
  --enable-hierarchical-cache \
  --hicache-ratio "${HICACHE_RATIO:-2}" \
  --hicache-write-policy "${HICACHE_WRITE_POLICY:-write_through}" \
  --hicache-io-backend "${HICACHE_IO_BACKEND:-kernel}" \
  --enable-metrics \
  "$@"
