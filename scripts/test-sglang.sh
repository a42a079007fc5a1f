#!/usr/bin/env bash
# Run the SGLang adapter's tests on each SGLang release it supports, each with the torch that
# release pins (its lock: requirements/sglang/<release>.txt). One venv per torch version: the
# dev venv for the newest release's torch, "<dev venv>-torch<version>" for another (built once,
# reused while its pins stay the same); a release the venv does not hold goes in an overlay
# directory inside it, put first on PYTHONPATH. On an older torch the core's tests that touch
# torch run too: the low end of the core's torch range.
#
#   scripts/test-sglang.sh [RELEASE ...]   (default: every release but the newest, which
#                                           scripts/test.sh runs with the whole suite)
# Extra pytest arguments after "--".
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
releases=() pytest_args=()
while [ $# -gt 0 ]; do
  if [ "$1" = -- ]; then shift; pytest_args=("$@"); break; fi
  releases+=("$1"); shift
done
if [ ${#releases[@]} -eq 0 ]; then
  mapfile -t releases < <("$python" "$root/scripts/sglang_release.py" list | head -n -1)
fi
# The CPU harness's radix-cache stack (sglang_cpu.build_stack) is written for this release and
# later; before it, the release checks and the tests that need no stack (docs/sglang.md).
harness_since=0.5.22
adapter_tests="$root/instrumentation/otel-hicache-sglang/tests"
default_torch="$(sed -n 's/^torch==//p' "$root/requirements/demo.txt")"
failed=()
for release in "${releases[@]}"; do
  torch="$("$python" "$root/scripts/sglang_release.py" torch "$release")"
  if [ "$torch" = "$default_torch" ]; then
    venv="$(bash "$root/scripts/bootstrap.sh" dev | tail -n 1)"
  else
    venv="$(bash "$root/scripts/bootstrap.sh" dev-torch "$torch" | tail -n 1)"
  fi
  overlay="$venv/sglang-$release"
  want="$(sha256sum < "$root/requirements/sglang/$release.txt" | cut -c1-16)"
  if [ "$(cat "$overlay/.stamp" 2>/dev/null || true)" != "$want" ]; then
    rm -rf "$overlay"
    echo "test-sglang: installing SGLang $release into $overlay" >&2
    "$venv/bin/python" "$root/scripts/sglang_release.py" overlay "$release" "$overlay" >/dev/null
    mkdir -p "$overlay" && echo "$want" > "$overlay/.stamp"
  fi
  if [ "$(printf '%s\n' "$harness_since" "$release" | sort -V | head -n 1)" = "$harness_since" ]; then
    tests=("$adapter_tests")
  else
    tests=("$adapter_tests/test_sglang_releases.py" "$adapter_tests/test_patching.py"
           "$adapter_tests/test_cause_sites.py")
  fi
  if [ "$torch" != "$default_torch" ]; then
    tests+=("$root/tests/test_device.py" "$root/tests/test_records.py" "$root/tests/test_host_residence.py"
            "$root/tests/test_example_workload.py")
  fi
  echo "== SGLang $release on torch $torch" >&2
  if ! (cd "$root" && PYTHONPATH="$overlay" "$venv/bin/python" -m pytest -q -p no:cacheprovider \
        "${tests[@]}" "${pytest_args[@]}"); then
    failed+=("$release")
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "test-sglang: failed on SGLang ${failed[*]}" >&2
  exit 1
fi
