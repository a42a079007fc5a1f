#!/usr/bin/env bash
# The real pipeline test, what a user runs, no Docker:
#
#   deploy/local/stack.sh up      the real Collector, Jaeger v2 and Prometheus 3, from the
#                                 files docker-compose.yml mounts, unchanged, on 127.0.0.1
#   examples/hicache_workload.py  --OTLP gRPC :4317-->  Collector  --OTLP--> Jaeger
#   e2e/sglang_workload.py        (the real SGLang 0.5.23 HiCache code on CPU, loaded
#                                 through SGLang's plugin entry point)
#                                           Prometheus --scrape :8889--> Collector
#
# Both workloads are configured only by the standard OTEL_* variables. Then
# e2e/check_pipeline.py checks what a user would look at, through the APIs the UIs use:
# Jaeger's HTTP API, Prometheus' HTTP API (counters vs ground truth, every documented
# series, rules, alerts, dashboard queries, exemplars that open in Jaeger), the
# Collector's own metrics, promtool.
#
# Run `deploy/local/stack.sh install` first. The stack's pids, logs and data live in a
# temp dir (HICACHE_STACK_STATE), stopped by `down -v` on exit; printed on failure.
#
# Environment: HICACHE_DEV_VENV (the repo venv, default .venv), HICACHE_E2E_OPS (default
# 600), HICACHE_E2E_RATE (ops/s, default 40: spread over several scrapes), HICACHE_E2E_KEEP=1
# keeps the temp dir after a successful run.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${HICACHE_DEV_VENV:-$root/.venv}/bin/python"
stack="$root/deploy/local/stack.sh"
ops="${HICACHE_E2E_OPS:-600}"
rate="${HICACHE_E2E_RATE:-40}"
[ -x "$py" ] || { echo "run: no repo venv at $py (bash scripts/bootstrap.sh creates it)" >&2; exit 1; }
since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }

tmp="$(mktemp -d -t hicache-e2e.XXXXXX)"
export HICACHE_STACK_STATE="$tmp/stack"
status=1
cleanup() {
  bash "$stack" down -v >/dev/null 2>&1 || true
  if [ "$status" -ne 0 ]; then
    local log
    for log in "$tmp"/stack/*.log "$tmp"/*.log; do
      [ -e "$log" ] || continue
      echo "---- last lines of $log ----"; tail -n 30 "$log"
    done
    echo "run: FAILED; logs kept in $tmp"
  elif [ "${HICACHE_E2E_KEEP:-0}" = 1 ]; then
    echo "run: logs kept in $tmp"
  else
    rm -rf "$tmp"
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

t_stack=$EPOCHREALTIME
bash "$stack" up
echo "run: stack up in $(since "$t_stack") s"

# -- the workloads, configured only by standard OTEL_* variables ---------------------------
# Metrics every second: the shipped Prometheus scrapes every 5 s, and the paced run spans
# several scrapes, so every rate() of the rules and dashboard has points to work on.
export OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317 OTEL_METRIC_EXPORT_INTERVAL=1000
# The SDK's own self-metrics (otel_sdk_*: spans exported and lost, the span queue), which the
# "Telemetry delivery" panels, the OtelHiCacheSpansUndelivered alert and check_pipeline read.
export OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED=true
t_run=$EPOCHREALTIME
OTEL_SERVICE_NAME=hicache-e2e "$py" "$root/examples/hicache_workload.py" --ops "$ops" --rate "$rate" \
  --layers 2 --pool-tokens 2048 --truth-json "$tmp/truth.json" 2>&1 | tee "$tmp/workload.log"
OTEL_SERVICE_NAME=hicache-e2e-sglang "$py" "$root/e2e/sglang_workload.py" --truth-json "$tmp/sglang-truth.json" \
  2>"$tmp/sglang-workload.log" | tee -a "$tmp/sglang-workload.log"
echo "run: workloads done in $(since "$t_run") s"

t_check=$EPOCHREALTIME
"$py" "$root/e2e/check_pipeline.py" --repo "$root" --truth "$tmp/truth.json" --sglang-truth "$tmp/sglang-truth.json" \
  --prometheus http://127.0.0.1:9090 --jaeger http://127.0.0.1:16686 --collector-metrics http://127.0.0.1:8888/metrics \
  --promtool "$(bash "$stack" path promtool)" --service hicache-e2e --sglang-service hicache-e2e-sglang
echo "run: checks done in $(since "$t_check") s; workloads and checks $(since "$t_run") s, total with stack start-up $(since "$t_stack") s"
status=0
