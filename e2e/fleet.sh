#!/usr/bin/env bash
# The two-tier topology of deploy/fleet.md with the real binaries (e2e/test_fleet.py): two
# agents (deploy/otel-collector/agent.yaml), two gateways (gateway.yaml) with tail sampling,
# Jaeger and Prometheus (deploy/prometheus/fleet.yml) on 127.0.0.0/8, two workload "nodes",
# one gateway killed (SIGKILL) and restarted mid-run; TLS and a bearer token between agents and
# gateways, and clients without them refused. About 90 s. Extra arguments go to pytest.
#
# Binaries: deploy/local/stack.sh path NAME (run `deploy/local/stack.sh install` first), else
# HICACHE_OTELCOL_BIN, HICACHE_JAEGER_BIN, HICACHE_PROMETHEUS_BIN. Prometheus runs in a private
# mount namespace (unshare --mount) so the shipped fleet.yml's gateway names resolve.
#
# Environment: HICACHE_DEV_VENV (the repo venv, default .venv).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${HICACHE_DEV_VENV:-$root/.venv}/bin/python"
[ -x "$py" ] || { echo "fleet: no repo venv at $py (bash scripts/bootstrap.sh creates it)" >&2; exit 1; }
command -v unshare >/dev/null || { echo "fleet: Prometheus needs the unshare command (util-linux)" >&2; exit 1; }
cd "$root"
exec "$py" -m pytest -q -s -p no:cacheprovider e2e/test_fleet.py "$@"
