#!/usr/bin/env bash
# Fault tests with the real Collector in the path (e2e/test_collector_faults.py): the
# Collector killed and restarted by PID mid-run, OTLP over TLS with a self-signed
# certificate and a wrong one. Run deploy/local/stack.sh install first. Extra arguments go to pytest.
#
# Environment: HICACHE_DEV_VENV (the repo venv, default .venv).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${HICACHE_DEV_VENV:-$root/.venv}/bin/python"
[ -x "$py" ] || { echo "faults: no repo venv at $py (bash scripts/bootstrap.sh creates it)" >&2; exit 1; }
command -v openssl >/dev/null || { echo "faults: the TLS cases need the openssl command (apt-get install openssl)" >&2; exit 1; }
cd "$root"
exec "$py" -m pytest -q -s -p no:cacheprovider e2e/test_collector_faults.py "$@"
