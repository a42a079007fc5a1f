#!/usr/bin/env bash
# The otel-hicache telemetry stack without Docker: the OpenTelemetry Collector, Jaeger v2
# and Prometheus 3 on 127.0.0.1, from the very files docker-compose.yml mounts
# (deploy/otel-collector/config.yaml, deploy/jaeger/config.yaml,
# deploy/prometheus/prometheus.yml and its rules), at the versions of deploy/versions.env.
#
#   deploy/local/stack.sh install      find or build the binaries; print where they are
#   deploy/local/stack.sh up           start the stack; wait until every part is healthy
#   deploy/local/stack.sh status       what runs, its health, where its log is
#   deploy/local/stack.sh down [-v]    stop exactly what `up` started (-v: delete Prometheus data)
#   deploy/local/stack.sh path NAME    the binary used for NAME (otelcol, jaeger, prometheus, promtool)
#   deploy/local/stack.sh build NAME   build NAME if not built yet, print its path (also
#                                      composecheck: docker-compose.yml loaded by compose-go,
#                                      the loader of `docker compose config`, for the tests)
#
# Ports are the compose ones: OTLP gRPC 4317 and HTTP 4318, Jaeger UI/API 16686,
# Prometheus 9090; also the Collector's exporter 8889, its own metrics 8888 and health
# check 13133. Jaeger's OTLP, health and metrics listeners would collide with the
# Collector's on one host, so they move to the ports below (the shipped configs read
# them from the environment, with the compose values as defaults).
#
# Service names: the shipped files name the compose services (the Collector exports to
# `jaeger:...`, Prometheus scrapes `otel-collector:8889`). `up` starts the Collector and
# Prometheus in a private mount namespace whose /etc/hosts maps those names to 127.0.0.1
# (`unshare --mount`, or `unshare --user --map-root-user --mount` without root), so the
# files stay identical to what compose mounts. Where no namespace can be made (or with
# HICACHE_STACK_NAMESPACE=false), it says so and runs Prometheus from a copy of
# prometheus.yml with the targets on 127.0.0.1, and the Collector with its Jaeger endpoint
# set on the command line.
#
# Binaries, in this order: a variable naming one (HICACHE_OTELCOL_BIN, HICACHE_JAEGER_BIN,
# HICACHE_PROMETHEUS_BIN, HICACHE_PROMTOOL_BIN), used as it is; one on PATH (otelcol-contrib,
# jaeger, prometheus, promtool: the release binaries), used as it is, unless
# HICACHE_STACK_FROM_PATH=false; else `install` builds them with Go from the modules pinned
# in deploy/local/{otelcol,jaeger,prometheus} into the cache, keyed by version and by the
# hash of those pins, so a second install builds nothing.
#
# Environment: HICACHE_STACK_CACHE (built binaries; default ~/.cache/otel-hicache/stack),
# HICACHE_STACK_STATE (pids, logs, Prometheus data; default ~/.local/state/otel-hicache/stack),
# HICACHE_STACK_WAIT_S (health wait in seconds, default 60). Every number read from the
# environment (HICACHE_STACK_WAIT_S, JAEGER_OTLP_GRPC_PORT, JAEGER_HEALTH_PORT,
# JAEGER_METRICS_PORT) must be plain decimal digits, or the script exits naming it.
#
# Pid files: `up` records each service's pid, start time and binary; `down` and `status`
# trust only a process matching all three. Any other pid file (one from an older stack.sh
# included) is reported stale, and the process it names is left alone.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
# shellcheck source=../versions.env
. "$root/deploy/versions.env"
cache="${HICACHE_STACK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/otel-hicache/stack}"
state="${HICACHE_STACK_STATE:-${XDG_STATE_HOME:-$HOME/.local/state}/otel-hicache/stack}"

say() { echo "stack: $*"; }
die() { echo "stack: $*" >&2; exit 1; }

# Every number read from the environment is checked here, before any arithmetic: bash
# evaluates a variable's value inside $(( )) and [[ -gt ]] as an expression, and an array
# subscript in it runs command substitutions ('SERVICES[$(cmd)]'). An empty value is unset.
number() {  # number NAME DEFAULT MAX: the plain decimal of NAME (at most 6 digits), or exit
  local name="$1" value="${!1:-$2}"
  if ! [[ "$value" =~ ^[0-9]{1,6}$ ]]; then
    die "$name is not a plain number of at most 6 digits (got ${#value} characters, starting $(printf %q "${value:0:12}"))"
  fi
  value=$((10#$value))
  if [ "$value" -lt 1 ] || [ "$value" -gt "$3" ]; then die "$name must be 1 to $3 (got $value)"; fi
  echo "$value"
}
wait_s="$(number HICACHE_STACK_WAIT_S 60 86400)"

# Listeners that move on one host (compose keeps each in its own container).
export JAEGER_LISTEN_HOST=127.0.0.1 OTELCOL_LISTEN_HOST=127.0.0.1
JAEGER_OTLP_GRPC_PORT="$(number JAEGER_OTLP_GRPC_PORT 14317 65535)"
JAEGER_HEALTH_PORT="$(number JAEGER_HEALTH_PORT 14133 65535)"
JAEGER_METRICS_PORT="$(number JAEGER_METRICS_PORT 14888 65535)"
export JAEGER_OTLP_GRPC_PORT JAEGER_HEALTH_PORT JAEGER_METRICS_PORT
PROMETHEUS_PORT=9090
COLLECTOR_PORTS="4317 4318 8888 8889 13133"
JAEGER_PORTS="16686 16685 $JAEGER_OTLP_GRPC_PORT $JAEGER_HEALTH_PORT $JAEGER_METRICS_PORT"
SERVICES=(jaeger otel-collector prometheus)
since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }

# -- binaries ----------------------------------------------------------------------------
# name -> build module dir, release binary name on PATH, variable, version, Go package, ldflags
component_info() {
  case "$1" in
    otelcol)    echo "otelcol otelcol-contrib HICACHE_OTELCOL_BIN $OTELCOL_VERSION . -X=main.version=$OTELCOL_VERSION" ;;
    jaeger)     echo "jaeger jaeger HICACHE_JAEGER_BIN $JAEGER_VERSION github.com/jaegertracing/jaeger/cmd/jaeger -X=github.com/jaegertracing/jaeger/internal/version.latestVersion=v$JAEGER_VERSION" ;;
    prometheus) echo "prometheus prometheus HICACHE_PROMETHEUS_BIN $PROMETHEUS_VERSION github.com/prometheus/prometheus/cmd/prometheus -X=github.com/prometheus/common/version.Version=$PROMETHEUS_VERSION" ;;
    promtool)   echo "prometheus promtool HICACHE_PROMTOOL_BIN $PROMETHEUS_VERSION github.com/prometheus/prometheus/cmd/promtool -X=github.com/prometheus/common/version.Version=$PROMETHEUS_VERSION" ;;
    composecheck) echo "composecheck - HICACHE_COMPOSECHECK_BIN $(awk '/compose-spec\/compose-go/ {print $NF; exit}' "$here/composecheck/go.mod") . -X=main.version=dev" ;;
    *) die "unknown component '$1' (otelcol, jaeger, prometheus, promtool, composecheck)" ;;
  esac
}

build_key() {  # the pins of a module dir and the Go toolchain, hashed
  local dir="$here/$1"
  { cat "$dir"/go.mod "$dir"/go.sum "$dir"/*.go 2>/dev/null; go version; } | sha256sum | cut -c1-12
}

built_path() {  # where `install` puts (or put) NAME
  local name="$1" module _path _var version
  read -r module _path _var version _ <<<"$(component_info "$name")"
  command -v go >/dev/null || { echo ""; return; }
  echo "$cache/bin/$name-$version-$(build_key "$module")/$name"
}

# resolve NAME: prints "PATH HOW"; HOW is variable, PATH or built; empty when none yet
resolve() {
  local name="$1" module release var version found
  read -r module release var version _ <<<"$(component_info "$name")"
  if [ -n "${!var:-}" ]; then
    [ -x "${!var}" ] || die "$var=${!var} is not an executable"
    echo "${!var} variable"; return
  fi
  if [ "$release" != - ] && [ "${HICACHE_STACK_FROM_PATH:-true}" != false ] && found="$(command -v "$release" 2>/dev/null)"; then
    echo "$found PATH"; return
  fi
  found="$(built_path "$name")"
  if [ -n "$found" ] && [ -x "$found" ]; then echo "$found built"; fi
}

build() {  # build NAME into the cache (no-op when the same pins were built before)
  local name="$1" module release var version pkg ldflags out tmp t=$EPOCHREALTIME
  read -r module release var version pkg ldflags <<<"$(component_info "$name")"
  command -v go >/dev/null || die "no Go toolchain to build $name: install Go, or put the $release release binary on PATH (or name it in $var)"
  out="$(built_path "$name")"
  if [ -x "$out" ]; then say "$name $version: built before, $out"; return; fi
  tmp="$out.tmp.$$"
  mkdir -p "$(dirname "$out")"
  say "$name $version: building from $(realpath --relative-to="$root" "$here/$module")/go.mod (a few minutes on 2 cores)..."
  # GOTOOLCHAIN=local: go.mod names the Go these pins were tidied with; never fetch another.
  # -mod=readonly with the committed go.sum: the exact modules, or a clear error.
  if ! (cd "$here/$module" && CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS="-mod=readonly -buildvcs=false" \
          go build -trimpath -ldflags "-s -w $ldflags" -o "$tmp" "$pkg") >"$cache/build-$name.log" 2>&1; then
    tail -n 20 "$cache/build-$name.log" >&2
    rm -f "$tmp"; die "building $name failed (log: $cache/build-$name.log)"
  fi
  mv "$tmp" "$out"
  say "$name $version: built in $(since "$t") s, $(du -h "$out" | cut -f1), $out"
}

version_of() {  # the version a binary reports about itself
  case "$1" in
    otelcol) "$2" --version 2>/dev/null | awk '{print $NF; exit}' ;;
    jaeger) "$2" version 2>/dev/null | sed -n 's/.*"gitVersion":"v\{0,1\}\([^"]*\)".*/\1/p' | head -n1 ;;
    prometheus|promtool) "$2" --version 2>&1 | sed -n 's/^[a-z]*, version \([^ ]*\).*/\1/p' | head -n1 ;;
  esac
}

cmd_install() {
  mkdir -p "$cache"
  local name path how module release var version got
  for name in otelcol jaeger prometheus promtool; do
    read -r module release var version _ <<<"$(component_info "$name")"
    read -r path how <<<"$(resolve "$name")"
    if [ -z "${path:-}" ]; then
      build "$name"
      read -r path how <<<"$(resolve "$name")"
    fi
    got="$(version_of "$name" "$path")"
    if [ "$got" != "$version" ]; then
      echo "stack: WARNING: $name at $path reports version '${got:-?}', deploy/versions.env pins $version" >&2
    fi
    printf 'stack: %-10s %-8s %s (%s)\n' "$name" "${got:-?}" "$path" "$how"
  done
}

cmd_path() {
  local path how
  read -r path how <<<"$(resolve "${1:?path NAME}")"
  [ -n "${path:-}" ] || die "${1} is not installed: run deploy/local/stack.sh install"
  echo "$path"
}

# -- processes ---------------------------------------------------------------------------
tcp_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
http_ok() { curl -sf -o /dev/null --max-time 2 "$1"; }

# A pid file holds "PID START EXE": the pid, its start time (field 22 of /proc/PID/stat, clock
# ticks since boot: a pid reused by another process has another one) and the binary `up`
# started. `down` and `status` trust only a process matching all three; any other pid file is
# stale, and the process it names is left alone.
start_time() {  # start_time PID: field 22 of /proc/PID/stat; empty when gone or a zombie
  local stat fields
  stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 0
  # after the command name, which may hold spaces and parentheses: field 3 on
  read -r -a fields <<<"${stat##*) }"
  [ "${fields[0]:-Z}" != Z ] && echo "${fields[19]:-}"
  return 0
}

# ours NAME [started]: the pid file names the process `up` started for NAME, still running its
# binary (with `started`: pid and start time only, for a process of this `up` that may still be
# setsid/unshare/sh about to exec it). Sets PID; STALE says why not, empty when there is no file.
ours() {
  local pidf="$state/$1.pid" start exe now
  PID="" STALE=""
  [ -e "$pidf" ] || return 1
  read -r PID start exe < "$pidf" 2>/dev/null || true
  if [ -z "$exe" ] && [[ "$start" == /* ]]; then
    STALE="written by an older stack.sh (pid and path only, no start time)"; return 1
  fi
  if ! [[ "$PID" =~ ^[0-9]{1,10}$ && "$start" =~ ^[0-9]{1,20}$ ]] || [ "$PID" -le 1 ] || [ -z "$exe" ]; then
    STALE="not in the form 'PID START-TIME EXECUTABLE'"; return 1
  fi
  now="$(start_time "$PID")"
  if [ -z "$now" ]; then STALE="pid $PID has exited"; return 1; fi
  if [ "$now" != "$start" ]; then STALE="pid $PID is another process now (start time $now, not $start)"; return 1; fi
  [ "${2:-}" = started ] && return 0
  now="$(readlink "/proc/$PID/exe" 2>/dev/null || true)"
  if [ "$now" != "$exe" ]; then STALE="pid $PID runs ${now:-an unreadable executable}, not $exe"; return 1; fi
}

health_url() {
  case "$1" in
    otel-collector) echo "http://127.0.0.1:13133/" ;;
    jaeger) echo "http://127.0.0.1:$JAEGER_HEALTH_PORT/status" ;;
    prometheus) echo "http://127.0.0.1:$PROMETHEUS_PORT/-/ready" ;;
  esac
}

# How to give a process the compose service names: a private mount namespace with our
# hosts file on /etc/hosts. Sets NS (a command prefix) or leaves it empty.
namespace_prefix() {
  NS=()
  [ "${HICACHE_STACK_NAMESPACE:-true}" = false ] && return
  local try
  for try in "unshare --mount --propagation private" "unshare --user --map-root-user --mount --propagation private"; do
    # shellcheck disable=SC2086
    if $try sh -c 'mount --bind "$0" /etc/hosts && grep -q otel-collector /etc/hosts' "$state/hosts" 2>/dev/null; then
      # shellcheck disable=SC2206
      NS=($try sh -c 'mount --bind "$0" /etc/hosts && exec "$@"' "$state/hosts")
      return
    fi
  done
}

start() {  # start NAME BINARY ARGS...: detached, output to $state/NAME.log, pid to $state/NAME.pid
  local name="$1" bin="$2"; shift 2
  # setsid: the stack outlives the shell that ran `up`; exec chains keep $! the process itself
  setsid "$@" >"$state/$name.log" 2>&1 < /dev/null &
  local pid=$!
  echo "$pid $(start_time "$pid") $(readlink -f "$bin")" > "$state/$name.pid"
}

cmd_up() {
  mkdir -p "$state"
  local name port otelcol jaeger prometheus t=$EPOCHREALTIME
  for name in "${SERVICES[@]}"; do
    ours "$name" && die "$name is already running (deploy/local/stack.sh status; down to stop it)"
  done
  for port in $COLLECTOR_PORTS $JAEGER_PORTS $PROMETHEUS_PORT; do
    tcp_open "$port" && die "port $port on 127.0.0.1 is in use by something else; the stack needs the compose ports"
  done
  otelcol="$(cmd_path otelcol)" jaeger="$(cmd_path jaeger)" prometheus="$(cmd_path prometheus)"
  printf '127.0.0.1 localhost %s\n::1 localhost\n' "${SERVICES[*]} grafana" > "$state/hosts"
  namespace_prefix
  local prom_config="$root/deploy/prometheus/prometheus.yml" col_extra=()
  if [ "${#NS[@]}" -eq 0 ]; then
    echo "stack: WARNING: cannot make a mount namespace here (unshare refused), so the compose" \
         "service names do not resolve: Prometheus runs from a copy of prometheus.yml with the" \
         "targets on 127.0.0.1 ($state/prometheus.yml) and the Collector exports to 127.0.0.1" >&2
    sed -e 's/"otel-collector:/"127.0.0.1:/g' -e "s#- rules/#- $root/deploy/prometheus/rules/#" \
      "$prom_config" > "$state/prometheus.yml"
    prom_config="$state/prometheus.yml"
    col_extra=("--set=exporters::otlp_grpc/jaeger::endpoint=127.0.0.1:$JAEGER_OTLP_GRPC_PORT")
  fi
  mkdir -p "$state/prometheus-data"
  start jaeger "$jaeger" "$jaeger" --config="$root/deploy/jaeger/config.yaml"
  start otel-collector "$otelcol" "${NS[@]}" "$otelcol" --config="$root/deploy/otel-collector/config.yaml" "${col_extra[@]}"
  # the flags of the prometheus service in docker-compose.yml, paths and listen address local
  start prometheus "$prometheus" "${NS[@]}" "$prometheus" --config.file="$prom_config" \
    --storage.tsdb.path="$state/prometheus-data" --storage.tsdb.retention.time=7d \
    --enable-feature=exemplar-storage --web.listen-address="127.0.0.1:$PROMETHEUS_PORT"
  local deadline=$(( $(date +%s) + wait_s )) pending
  while :; do
    pending=()
    for name in "${SERVICES[@]}"; do
      ours "$name" started || { tail -n 20 "$state/$name.log" >&2; stop_all started >/dev/null; die "$name exited during start-up (log: $state/$name.log)"; }
      http_ok "$(health_url "$name")" || pending+=("$name")
    done
    # healthy, and Prometheus scrapes the Collector by its compose name
    if [ "${#pending[@]}" -eq 0 ] && curl -sf "http://127.0.0.1:$PROMETHEUS_PORT/api/v1/targets?state=active" \
         | grep -q '"job":"otel-collector".*"health":"up"\|"health":"up".*"job":"otel-collector"'; then
      break
    fi
    [ "${#pending[@]}" -eq 0 ] && pending=("prometheus scrape of otel-collector:8889")
    if [ "$(date +%s)" -ge "$deadline" ]; then
      stop_all started >/dev/null; die "not healthy after ${wait_s} s: ${pending[*]} (logs in $state)"
    fi
    sleep 0.2
  done
  say "up in $(since "$t") s$([ "${#NS[@]}" -gt 0 ] && echo ", compose service names resolved in a private mount namespace")"
  say "  OTLP gRPC 127.0.0.1:4317, OTLP HTTP 127.0.0.1:4318"
  say "  Jaeger    http://127.0.0.1:16686 (API /api/services, /api/traces)"
  say "  Prometheus http://127.0.0.1:$PROMETHEUS_PORT"
  say "  logs and pids in $state"
}

cmd_status() {
  local name bin health running=0
  for name in "${SERVICES[@]}"; do
    if ours "$name"; then
      read -r _ _ bin < "$state/$name.pid"
      running=$((running + 1))
      health=unhealthy; http_ok "$(health_url "$name")" && health=healthy
      printf 'stack: %-15s running  pid %-8s %-9s %s (log %s)\n' "$name" "$PID" "$health" "$bin" "$state/$name.log"
    elif [ -n "$STALE" ]; then
      printf 'stack: %-15s stopped  (stale pid file %s: %s; that process is left alone)\n' "$name" "$state/$name.pid" "$STALE"
    else
      printf 'stack: %-15s stopped\n' "$name"
    fi
  done
  [ "$running" -eq "${#SERVICES[@]}" ]
}

stop_all() {  # stop_all [started]: stop what the pid files name where it is ours (see ours)
  local name i stopped=()
  for name in prometheus otel-collector jaeger; do
    if ours "$name" "${1:-}"; then
      kill -TERM "$PID" 2>/dev/null || true
      for i in $(seq 1 100); do ours "$name" "${1:-}" || break; sleep 0.1; done
      if ours "$name" "${1:-}"; then kill -KILL "$PID" 2>/dev/null || true; sleep 0.2; fi
      stopped+=("$name($PID)")
    elif [ -n "$STALE" ]; then
      say "$name: stale pid file ($STALE): left that process alone"
    fi
    rm -f "$state/$name.pid"
  done
  say "stopped ${stopped[*]:-nothing}"
}

cmd_down() {
  stop_all
  if [ "${1:-}" = -v ]; then rm -rf "$state/prometheus-data"; say "Prometheus data deleted"; fi
}

cmd_build() {
  local path how
  read -r path how <<<"$(resolve "${1:?build NAME}")"
  if [ -z "${path:-}" ]; then build "$1" >&2; fi
  cmd_path "$1"
}

case "${1:-}" in
  install) cmd_install ;;
  build) shift; cmd_build "$@" ;;
  up) cmd_up ;;
  status) cmd_status ;;
  down) shift; cmd_down "$@" ;;
  path) shift; cmd_path "$@" ;;
  *) sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
