#!/usr/bin/env bash
# Set up and run the test suite. Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(bash "$root/scripts/bootstrap.sh" | tail -n 1)"
cd "$root"
exec "$venv/bin/python" -m pytest -q "$@"
