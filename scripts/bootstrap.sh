#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install the pinned
# requirements (requirements/dev.txt, then SGLang for the CPU integration tests:
# requirements/sglang-cpu.txt, --no-deps), this checkout and its SGLang adapter.
# Prints the venv path on its last line.
#   HICACHE_DEV_VENV  where the venv lives (default: .venv in the checkout)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${HICACHE_DEV_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
stamp_want="$(cat "$root/requirements/dev.txt" "$root/requirements/sglang-cpu.txt" | sha256sum | cut -c1-16)-$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
if [ ! -x "$venv/bin/python" ]; then
  echo "bootstrap: creating $venv" >&2
  "$python" -m venv "$venv"
fi
if [ "$(cat "$venv/.requirements-stamp" 2>/dev/null || true)" != "$stamp_want" ]; then
  echo "bootstrap: installing pinned requirements" >&2
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  "$venv/bin/python" -m pip install -q -r "$root/requirements/dev.txt" >&2
  "$venv/bin/python" -m pip install -q --no-deps -r "$root/requirements/sglang-cpu.txt" >&2
  echo "$stamp_want" > "$venv/.requirements-stamp"
else
  echo "bootstrap: reusing $venv" >&2
fi
# always (re)install this checkout: a reused venv may point at another clone
"$venv/bin/python" -m pip install -q --no-deps --no-build-isolation \
  -e "$root" -e "$root/instrumentation/otel-hicache-sglang" >&2
echo "$venv"
