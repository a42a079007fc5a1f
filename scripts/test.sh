#!/usr/bin/env bash
# Set up (everything: requirements/dev.txt and SGLang for the CPU tests) and run the test
# suite. Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(bash "$root/scripts/bootstrap.sh" dev | tail -n 1)"
cd "$root"
exec "$venv/bin/python" -m pytest -q "$@"
