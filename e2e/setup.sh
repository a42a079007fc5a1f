#!/usr/bin/env bash
# Build and cache what the real pipeline test (e2e/run.sh) runs, without Docker and
# without installing anything system-wide:
#
#   1. Prometheus + promtool: the .deb of this machine's own Debian suite
#      (`apt-get download prometheus`, then `dpkg-deb -x`);
#   2. vmagent (victoria-metrics from Debian trixie) and an OpenTelemetry Collector core
#      built offline (GOPATH mode) from Debian sid's golang-opentelemetry-collector-dev and
#      the golang-*-dev packages it needs, with e2e/collector/main.go; both through a
#      private apt state (the machine's /etc/apt and /var/lib/apt are not touched).
#      If the Collector cannot be built (sid moves), rotel from PyPI is the OTLP hop instead;
#   3. Arize Phoenix (trace store with an OTLP receiver and a query API) in its own venv.
#
# Everything lives under ${XDG_CACHE_HOME:-$HOME/.cache}/otel-hicache/e2e; a second run
# reuses it (the Collector binary is keyed by the versions of the Debian packages it was
# built from). What run.sh should start is written to state.env there.
#
# Environment:
#   PYTHON                        interpreter for the Phoenix/rotel venvs (default python3)
#   HICACHE_E2E_PIPELINE          otelcol (default) or rotel (skip the Collector build)
#   HICACHE_E2E_APT_MAX_AGE_DAYS  refresh the private trixie/sid package lists when older
#                                 (default 7; the Collector is rebuilt only if versions moved)
#   HICACHE_E2E_MIRROR            Debian mirror (default http://deb.debian.org/debian)
set -euo pipefail

PHOENIX_VERSION=20.26.1
ROTEL_VERSION=0.0.1a15
VM_VERSION=1.112.0+ds1-2
VM_SUITE=trixie

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/otel-hicache/e2e"
python="${PYTHON:-python3}"
mirror="${HICACHE_E2E_MIRROR:-http://deb.debian.org/debian}"
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
max_age_days="${HICACHE_E2E_APT_MAX_AGE_DAYS:-7}"
arch="$(dpkg --print-architecture)"
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9   # one setup at a time on this cache

t_total=$EPOCHREALTIME
since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }
say() { echo "setup: $*"; }
loud() {
  echo "setup: ################################################################" >&2
  local line; for line in "$@"; do echo "setup: ## $line" >&2; done
  echo "setup: ################################################################" >&2
}

# -- private apt states ----------------------------------------------------------------
# apt_state NAME "SOURCES LINE"...: a sources list, lists and cache of its own under
# $cache/apt-NAME; nothing under /etc/apt or /var/lib/apt is read for packages or written.
apt_opts() {
  local d="$cache/apt-$1"
  APT=(-o Dir::Etc::sourcelist="$d/sources.list" -o Dir::Etc::sourceparts="$d/empty.d"
       -o Dir::Etc::preferences="$d/empty.d/preferences" -o Dir::Etc::preferencesparts="$d/empty.d"
       -o Dir::State="$d/state" -o Dir::State::Lists="$d/lists" -o Dir::State::status="$d/status"
       -o Dir::Cache="$d/cache" -o APT::Architecture="$arch" -o APT::Architectures="$arch"
       -o Acquire::Languages=none -o APT::Sandbox::User=root)
}
apt_state() {
  local name="$1" d="$cache/apt-$1"; shift
  mkdir -p "$d/lists/partial" "$d/cache/archives/partial" "$d/state" "$d/empty.d"
  touch "$d/status"
  printf '%s\n' "$@" > "$d/sources.list.new"
  if ! cmp -s "$d/sources.list.new" "$d/sources.list"; then
    mv "$d/sources.list.new" "$d/sources.list"; rm -f "$d/updated"
  else
    rm -f "$d/sources.list.new"
  fi
}
apt_update() {  # apt_update NAME [force]
  local d="$cache/apt-$1"
  if [ "${2:-}" = force ] || [ ! -e "$d/updated" ] || [ -n "$(find "$d/updated" -mtime "+$max_age_days")" ]; then
    local t=$EPOCHREALTIME
    apt_opts "$1"
    apt-get "${APT[@]}" -qq update
    touch "$d/updated"
    say "apt lists for $(awk '{print $4}' "$d/sources.list" | paste -sd+) refreshed ($(since "$t") s)"
  fi
}

# -- 1. Prometheus + promtool from this machine's own suite ----------------------------
t=$EPOCHREALTIME
own_suite="$(. /etc/os-release && echo "${VERSION_CODENAME:-}")"
[ -n "$own_suite" ] || { echo "setup: cannot tell this machine's Debian suite (/etc/os-release)" >&2; exit 1; }
prom_dir="$cache/prometheus"
if [ ! -x "$prom_dir/root/usr/bin/prometheus" ] || [ ! -x "$prom_dir/root/usr/bin/promtool" ]; then
  apt_state own "deb [signed-by=$keyring] $mirror $own_suite main" \
                "deb [signed-by=$keyring] $mirror $own_suite-updates main" \
                "deb [signed-by=$keyring] ${mirror%/debian}/debian-security $own_suite-security main"
  apt_update own
  rm -rf "$prom_dir.tmp"; mkdir -p "$prom_dir.tmp/debs"
  apt_opts own
  (cd "$prom_dir.tmp/debs" && apt-get "${APT[@]}" -qq download prometheus)
  deb="$(ls "$prom_dir.tmp/debs"/prometheus_*.deb)"
  dpkg-deb -x "$deb" "$prom_dir.tmp/root"
  dpkg-deb -f "$deb" Version > "$prom_dir.tmp/version"
  rm -rf "$prom_dir.tmp/debs" "$prom_dir"; mv "$prom_dir.tmp" "$prom_dir"
  prom_how=downloaded
else
  prom_how=cached
fi
prometheus="$prom_dir/root/usr/bin/prometheus"
promtool="$prom_dir/root/usr/bin/promtool"
prom_version="$(cat "$prom_dir/version")"
"$prometheus" --version >/dev/null 2>&1 && "$promtool" --version >/dev/null 2>&1 \
  || { echo "setup: the extracted prometheus/promtool do not run" >&2; exit 1; }
say "prometheus $prom_version ($own_suite, $prom_how): $("$prometheus" --version 2>&1 | head -1) [$(since "$t") s]"

# -- 2a. vmagent from trixie (pinned) ---------------------------------------------------
apt_state next "deb [signed-by=$keyring] $mirror trixie main" "deb [signed-by=$keyring] $mirror sid main"
t=$EPOCHREALTIME
vm_dir="$cache/victoria-metrics"
if [ ! -x "$vm_dir/root/usr/bin/vmagent" ] || [ "$(cat "$vm_dir/version" 2>/dev/null)" != "$VM_VERSION" ]; then
  apt_update next
  apt_opts next
  rm -rf "$vm_dir.tmp"; mkdir -p "$vm_dir.tmp/debs"
  if ! (cd "$vm_dir.tmp/debs" && apt-get "${APT[@]}" -qq download "victoria-metrics=$VM_VERSION" 2>/dev/null); then
    apt_update next force
    if ! (cd "$vm_dir.tmp/debs" && apt-get "${APT[@]}" -qq download "victoria-metrics=$VM_VERSION"); then
      loud "victoria-metrics=$VM_VERSION is no longer on the mirror;" \
           "using $VM_SUITE's current victoria-metrics instead (update VM_VERSION in e2e/setup.sh)"
      (cd "$vm_dir.tmp/debs" && apt-get "${APT[@]}" -qq download "victoria-metrics/$VM_SUITE")
    fi
  fi
  deb="$(ls "$vm_dir.tmp/debs"/victoria-metrics_*.deb)"
  dpkg-deb -x "$deb" "$vm_dir.tmp/root"
  dpkg-deb -f "$deb" Version > "$vm_dir.tmp/version"
  [ "$(cat "$vm_dir.tmp/version")" = "$VM_VERSION" ] || VM_VERSION="$(cat "$vm_dir.tmp/version")"
  rm -rf "$vm_dir.tmp/debs" "$vm_dir"; mv "$vm_dir.tmp" "$vm_dir"
  vm_how=downloaded
else
  vm_how=cached
fi
vmagent="$vm_dir/root/usr/bin/vmagent"
vm_version="$(cat "$vm_dir/version")"
"$vmagent" -version >/dev/null 2>&1 || { echo "setup: the extracted vmagent does not run" >&2; exit 1; }
say "vmagent: victoria-metrics $vm_version ($VM_SUITE, $vm_how) [$(since "$t") s]"

# -- 2b. OpenTelemetry Collector core from Debian sid's Go sources ------------------------
# build_collector: sets otlp_bin/otlp_version, or returns non-zero with fail_reason set.
build_collector() {
  local t=$EPOCHREALTIME
  apt_update next
  apt_opts next
  local closure
  closure="$(apt-cache "${APT[@]}" depends --recurse --no-recommends --no-suggests --no-conflicts \
               --no-breaks --no-replaces --no-enhances --no-pre-depends \
               golang-opentelemetry-collector-dev golang-go 2>/dev/null | grep -E '^golang-' | sort -u || true)"
  if ! grep -qx golang-opentelemetry-collector-dev <<<"$closure"; then
    fail_reason="golang-opentelemetry-collector-dev not found in sid's package lists"; return 1
  fi
  # the exact .deb file names (package_version_arch) of the closure, without downloading
  local uris
  if ! uris="$(apt-get "${APT[@]}" --print-uris -qq download $closure 2>"$cache/print-uris.err")"; then
    fail_reason="cannot resolve the Go package closure: $(tail -n1 "$cache/print-uris.err")"; return 1
  fi
  local files key versions col_ver go_ver
  files="$(awk '{print $2}' <<<"$uris" | sort)"
  key="$( { echo "$files"; sha256sum < "$here/collector/main.go"; } | sha256sum | cut -c1-16)"
  col_ver="$(grep '^golang-opentelemetry-collector-dev_' <<<"$files" | cut -d_ -f2)"
  go_ver="$(grep '^golang-go_' <<<"$files" | cut -d_ -f2)"
  col_ver="${col_ver//%3a/:}"; go_ver="${go_ver//%3a/:}"
  say "collector sources: golang-opentelemetry-collector-dev $col_ver, golang-go $go_ver," \
      "$(wc -l <<<"$files") golang-* packages from sid (build key $key)"
  local out="$cache/collector/$key"
  if [ -x "$out/otelcorecol" ] && "$out/otelcorecol" --version >/dev/null 2>&1; then
    otlp_bin="$out/otelcorecol"; otlp_version="$("$otlp_bin" --version | awk '{print $NF}')"
    say "collector: reusing $otlp_bin (built from the same package versions) [$(since "$t") s]"
    return 0
  fi
  if [ -r "$cache/collector-failed/$key" ]; then  # go build failed on these very versions before
    fail_reason="$(cat "$cache/collector-failed/$key") (remembered for build key $key;"
    fail_reason+=" delete $cache/collector-failed to retry)"
    return 1
  fi
  local b="$cache/collector-build"
  rm -rf "$b"; mkdir -p "$b/debs" "$b/root"
  local log="$cache/collector-build.log"
  : > "$log"
  if ! (cd "$b/debs" && apt-get "${APT[@]}" -qq download $closure) >>"$log" 2>&1; then
    # package lists older than the mirror (sid removes superseded versions): refresh once
    apt_update next force
    apt_opts next
    if ! (cd "$b/debs" && apt-get "${APT[@]}" -qq download $closure) >>"$log" 2>&1; then
      fail_reason="downloading the Go packages failed: $(tail -n1 "$log")"; rm -rf "$b"; return 1
    fi
    # the versions may have moved with the refresh: key the build by what was downloaded
    files="$(cd "$b/debs" && ls -- *.deb | sort)"
    key="$( { echo "$files"; sha256sum < "$here/collector/main.go"; } | sha256sum | cut -c1-16)"
    out="$cache/collector/$key"
  fi
  say "collector: downloaded $(ls "$b/debs" | wc -l) debs, $(du -sh "$b/debs" | cut -f1) [$(since "$t") s]"
  if ! ls "$b/debs"/*.deb | xargs -P "$(nproc)" -I{} dpkg-deb -x {} "$b/root" >>"$log" 2>&1; then
    fail_reason="extracting the Go packages failed: $(tail -n1 "$log")"; rm -rf "$b"; return 1
  fi
  rm -rf "$b/debs"
  say "collector: extracted $(du -sh "$b/root" | cut -f1) [$(since "$t") s]"
  local goroot
  goroot="$(ls -d "$b"/root/usr/lib/go-1.* 2>/dev/null | sort -V | tail -n1)"
  if [ -z "$goroot" ] || [ ! -x "$goroot/bin/go" ]; then
    fail_reason="no Go toolchain in the extracted golang packages"; rm -rf "$b"; return 1
  fi
  mkdir -p "$b/gopath/src/otelhicache-e2e/otelcorecol"
  cp "$here/collector/main.go" "$b/gopath/src/otelhicache-e2e/otelcorecol/main.go"
  if ! (cd "$b/gopath/src/otelhicache-e2e/otelcorecol" &&
        env GOROOT="$goroot" PATH="$goroot/bin:$PATH" GO111MODULE=off GOENV=off GOFLAGS= GOPROXY=off \
            GOTOOLCHAIN=local GOPATH="$b/gopath:$b/root/usr/share/gocode" GOCACHE="$b/gocache" CGO_ENABLED=0 \
            go build -trimpath -ldflags "-s -w -X main.version=${col_ver%%-*}" -o "$b/otelcorecol" .) >>"$log" 2>&1; then
    fail_reason="go build failed with $("$goroot/bin/go" version | cut -d' ' -f3): $(grep -m1 -E 'cannot find|undefined|error|\.go:[0-9]+' "$log" || tail -n1 "$log")"
    echo "setup: ---- last lines of the Collector build log ($log) ----" >&2
    tail -n 25 "$log" >&2
    mkdir -p "$cache/collector-failed"; echo "$fail_reason" > "$cache/collector-failed/$key"
    rm -rf "$b"; return 1
  fi
  if ! "$b/otelcorecol" --version >/dev/null 2>&1; then
    fail_reason="the built collector does not run"; rm -rf "$b"; return 1
  fi
  rm -rf "$cache/collector"; mkdir -p "$out"   # keep only the current build
  mv "$b/otelcorecol" "$out/otelcorecol"
  { echo "# golang-* packages (Debian sid) otelcorecol was built from, with $("$goroot/bin/go" version | cut -d' ' -f3)"
    echo "$files"; } > "$out/packages.txt"
  rm -rf "$b"
  otlp_bin="$out/otelcorecol"; otlp_version="$("$otlp_bin" --version | awk '{print $NF}')"
  say "collector: built $("$otlp_bin" --version), $(du -h "$otlp_bin" | cut -f1) [$(since "$t") s]"
}

install_rotel() {
  local t=$EPOCHREALTIME v="$cache/rotel-venv"
  if [ "$(cat "$v/.stamp" 2>/dev/null)" != "$ROTEL_VERSION" ]; then
    rm -rf "$v"
    "$python" -m venv "$v"
    "$v/bin/python" -m pip install -q --disable-pip-version-check "rotel==$ROTEL_VERSION"
    echo "$ROTEL_VERSION" > "$v/.stamp"
  fi
  # the wheel ships the binary inside the package, not on the venv's PATH
  otlp_bin="$("$v/bin/python" -c 'import os, rotel; print(os.path.join(os.path.dirname(rotel.__file__), "rotel-agent"))')"
  otlp_version="$ROTEL_VERSION ($("$otlp_bin" --version 2>&1 | head -n1))"
  say "rotel $otlp_version from PyPI [$(since "$t") s]"
}

t=$EPOCHREALTIME
pipeline=otelcol fail_reason="" otlp_bin="" otlp_version=""
if [ "${HICACHE_E2E_PIPELINE:-otelcol}" = rotel ]; then
  pipeline=rotel fail_reason="HICACHE_E2E_PIPELINE=rotel"
elif ! build_collector; then
  pipeline=rotel
  loud "COULD NOT BUILD THE OPENTELEMETRY COLLECTOR FROM DEBIAN SID:" "  $fail_reason" \
       "FALLING BACK TO rotel $ROTEL_VERSION (PyPI) AS THE OTLP HOP."
fi
if [ "$pipeline" = rotel ]; then
  install_rotel
fi
say "OTLP hop: $pipeline $otlp_version [$(since "$t") s]"

# -- 3. Arize Phoenix, the trace store --------------------------------------------------
t=$EPOCHREALTIME
phx="$cache/phoenix-venv"
phx_stamp="$PHOENIX_VERSION-$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
if [ "$(cat "$phx/.stamp" 2>/dev/null)" != "$phx_stamp" ]; then
  rm -rf "$phx"
  "$python" -m venv "$phx"
  "$phx/bin/python" -m pip install -q --disable-pip-version-check "arize-phoenix==$PHOENIX_VERSION"
  "$phx/bin/python" -c 'import phoenix.server.main' || { echo "setup: phoenix does not import" >&2; exit 1; }
  echo "$phx_stamp" > "$phx/.stamp"
  phx_how="installed, $(du -sh "$phx" | cut -f1)"
else
  phx_how=cached
fi
[ -x "$phx/bin/phoenix" ] || { echo "setup: $phx/bin/phoenix missing" >&2; exit 1; }
say "phoenix: arize-phoenix $PHOENIX_VERSION ($phx_how) [$(since "$t") s]"

# -- state for run.sh -----------------------------------------------------------------
{
  printf 'E2E_PIPELINE=%q\n' "$pipeline"
  printf 'E2E_OTLP_BIN=%q\n' "$otlp_bin"
  printf 'E2E_OTLP_VERSION=%q\n' "$otlp_version"
  printf 'E2E_FALLBACK_REASON=%q\n' "$fail_reason"
  printf 'E2E_PROMETHEUS=%q\n' "$prometheus"
  printf 'E2E_PROMTOOL=%q\n' "$promtool"
  printf 'E2E_PROMETHEUS_VERSION=%q\n' "$prom_version"
  printf 'E2E_VMAGENT=%q\n' "$vmagent"
  printf 'E2E_VM_VERSION=%q\n' "$vm_version"
  printf 'E2E_PHOENIX=%q\n' "$phx/bin/phoenix"
  printf 'E2E_PHOENIX_VERSION=%q\n' "$PHOENIX_VERSION"
} > "$cache/state.env.tmp"
mv "$cache/state.env.tmp" "$cache/state.env"
say "state written to $cache/state.env"
say "total $(since "$t_total") s"
