#!/usr/bin/env bash
# Run the core tests on the oldest OpenTelemetry SDK pyproject.toml allows (requirements/old-sdk.txt):
# the core uses the SDK's public API only (tests/test_layout.py), so both ends of the range must
# give the same results. Extra arguments go to pytest.
#
# The venv is built once and reused while requirements/old-sdk.txt and the Python version
# stay the same (a stamp in the venv):
#   HICACHE_OLD_SDK_VENV  where it lives (default: ${XDG_CACHE_HOME:-$HOME/.cache}/otel-hicache/old-sdk-venv)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${HICACHE_OLD_SDK_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/otel-hicache/old-sdk-venv}"
python="${PYTHON:-python3}"
req="$root/requirements/old-sdk.txt"
pyver="$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
want="$(sha256sum < "$req" | cut -c1-16)-$pyver"
if [ "$(cat "$venv/.stamp-old-sdk" 2>/dev/null || true)" != "$want" ]; then
  echo "test-old-sdk: building $venv" >&2
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --no-deps -r "$req" >&2
  echo "$want" > "$venv/.stamp-old-sdk"
else
  echo "test-old-sdk: reusing $venv" >&2
fi
# always (re)install this checkout: a reused venv may point at another clone
"$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$root" \
  -e "$root/instrumentation/otel-hicache-sglang" >&2
"$venv/bin/python" -c 'import opentelemetry.sdk.version as v; print("test-old-sdk: OpenTelemetry SDK", v.__version__)' >&2
cd "$root"
# The core's tests that need neither torch, SGLang nor the telemetry stack. Left out:
# - test_records.py::test_integer_like_counts_and_str_enum_pool_names_are_accepted and
#   test_host_residence.py::test_torch_cpu_indices_are_read_in_place import torch (not installed here).
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider \
  tests/test_telemetry.py tests/test_hot_path.py tests/test_records.py tests/test_pipeline.py \
  tests/test_stuck_transfers.py tests/test_self_cost.py tests/test_spans.py \
  tests/test_busy_time.py tests/test_clock.py tests/test_transfer_causes.py \
  tests/test_host_residence.py tests/test_request_links.py tests/test_telemetry_process.py \
  tests/test_hostile_input.py tests/test_layout.py \
  --deselect tests/test_records.py::test_integer_like_counts_and_str_enum_pool_names_are_accepted \
  --deselect tests/test_host_residence.py::test_torch_cpu_indices_are_read_in_place \
  "$@"
