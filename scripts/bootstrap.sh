#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment. Prints the venv path on its last line.
#
#   scripts/bootstrap.sh demo   what the main job needs: requirements/demo.txt (torch, the
#                               OpenTelemetry SDK and OTLP exporters) and this checkout
#   scripts/bootstrap.sh dev    (default) everything the tests and benchmarks need:
#                               requirements/dev.txt, then the newest tested SGLang for the
#                               CPU integration tests (its lock in requirements/sglang/,
#                               --no-deps), this checkout and its SGLang adapter
#   scripts/bootstrap.sh dev-torch VERSION
#                               dev's requirements on another torch, without SGLang, in a venv
#                               of its own (an older SGLang release's: scripts/test-sglang.sh)
#
# A venv set up for dev serves demo too. Each profile is reused while its pins and the
# Python version stay the same (a stamp per profile in the venv).
#   HICACHE_DEV_VENV  where the venv lives (default: .venv in the checkout); dev-torch's is
#                     $HICACHE_DEV_VENV-torch<VERSION>
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
profile="${1:-dev}"
venv="${HICACHE_DEV_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
req="$root/requirements"
case "$profile" in
  demo) files=("$req/demo.txt") ;;
  dev)
    newest="$req/sglang/$("$python" "$root/scripts/sglang_release.py" list | tail -n 1).txt"
    files=("$req/demo.txt" "$req/dev.txt" "$newest") ;;
  dev-torch)
    torch="${2:?usage: scripts/bootstrap.sh dev-torch VERSION}"
    venv="$venv-torch$torch"
    # demo.txt and dev.txt with that torch (dev.txt includes demo.txt by its name)
    req="$(mktemp -d)"; trap 'rm -rf "$req"' EXIT
    sed "s/^torch==.*/torch==$torch/" "$root/requirements/demo.txt" > "$req/demo.txt"
    cp "$root/requirements/dev.txt" "$req/dev.txt"
    files=("$req/demo.txt" "$req/dev.txt") ;;
  *) echo "usage: scripts/bootstrap.sh [demo|dev|dev-torch VERSION]" >&2; exit 2 ;;
esac
pyver="$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
stamp() { echo "$(cat "$@" | sha256sum | cut -c1-16)-$pyver"; }
want="$(stamp "${files[@]}")"
if [ ! -x "$venv/bin/python" ]; then
  echo "bootstrap: creating $venv" >&2
  "$python" -m venv "$venv"
fi
if [ "$(cat "$venv/.stamp-$profile" 2>/dev/null || true)" != "$want" ]; then
  echo "bootstrap: installing the pinned $profile requirements" >&2
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  if [ "$profile" = demo ]; then
    "$venv/bin/python" -m pip install -q -r "$req/demo.txt" >&2
  else
    "$venv/bin/python" -m pip install -q -r "$req/dev.txt" >&2
    if [ "$profile" = dev ]; then
      "$venv/bin/python" -m pip install -q --no-deps -r "$newest" >&2
      stamp "$req/demo.txt" > "$venv/.stamp-demo"  # dev holds demo's pins
    fi
  fi
  echo "$want" > "$venv/.stamp-$profile"
else
  echo "bootstrap: reusing $venv ($profile)" >&2
fi
# always (re)install this checkout: a reused venv may point at another clone (setuptools'
# editable-install banner filtered: it warns of nothing this layout has)
export PYTHONWARNINGS="ignore:Editable installation"
if [ "$profile" = demo ]; then
  "$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$root" >&2
else
  "$venv/bin/python" -m pip install -q --no-deps --no-build-isolation \
    -e "$root" -e "$root/instrumentation/otel-hicache-sglang" >&2
fi
echo "$venv"
