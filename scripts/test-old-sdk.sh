#!/usr/bin/env bash
# Run the core tests on an OpenTelemetry SDK older than the range otel_hicache/sdk_internals.py
# knows (requirements/old-sdk.txt): the shape check must report the mismatch and every fast
# path give way to the public API with the same results (tests/test_sdk_internals.py asserts
# which path each SDK takes). Extra arguments go to pytest.
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
"$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$root" >&2
"$venv/bin/python" -c 'from otel_hicache import sdk_internals; print("test-old-sdk:", sdk_internals.report().summary())' >&2
cd "$root"
# The core tests that exercise the engine, and the span export helper (public constructors only). Left out:
# - test_records.py::test_integer_like_counts_and_str_enum_pool_names_are_accepted and
#   test_host_residence.py::test_torch_cpu_indices_are_read_in_place import torch (not installed here);
# - test_prometheus_exposition.py: its exact exposition has the otel_scope_* labels that Prometheus
#   exporter releases after 0.51b0 add (the values are the same);
# - test_span_export_process.py::test_the_sdk_self_metrics_count_every_span_from_both_processes: SDK 1.30
#   has no otel.sdk.* self-metrics to count with.
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider \
  tests/test_sdk_internals.py tests/test_telemetry.py tests/test_hot_path.py tests/test_records.py \
  tests/test_busy_time.py tests/test_clock.py tests/test_cache_events.py tests/test_transfer_causes.py \
  tests/test_host_residence.py tests/test_request_links.py tests/test_span_export_process.py \
  --deselect tests/test_records.py::test_integer_like_counts_and_str_enum_pool_names_are_accepted \
  --deselect tests/test_host_residence.py::test_torch_cpu_indices_are_read_in_place \
  --deselect tests/test_span_export_process.py::test_the_sdk_self_metrics_count_every_span_from_both_processes \
  "$@"
