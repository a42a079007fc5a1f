#!/usr/bin/env bash
# Set up (the demo's own requirements only: torch and OpenTelemetry) and run the main
# job: the example HiCache workload (examples/hicache_workload.py, run from this
# checkout; it is not part of the otel-hicache wheel). With no
# OTEL_EXPORTER_OTLP_ENDPOINT it prints its summary from an embedded in-memory
# pipeline; with one it exports over OTLP. Extra arguments go to the workload.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(bash "$root/scripts/bootstrap.sh" demo | tail -n 1)"
exec "$venv/bin/python" "$root/examples/hicache_workload.py" "$@"
