#!/usr/bin/env bash
# otel-hicache on a real SGLang server on CPU: set up (the dev venv with SGLang and the pinned
# telemetry stack, built once), then start the stack and `python -m sglang.launch_server` with
# HiCache and the plugin, run requests that force offload and load-back, print the spans and
# bytes per direction and cause beside SGLang's own counters and where to look, and stop
# everything it started. Options go to e2e/real_server/demo.py (--policy, --page-size, --rounds).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(bash "$root/scripts/bootstrap.sh" dev | tail -n 1)"
bash "$root/deploy/local/stack.sh" install >&2
exec "$venv/bin/python" "$root/e2e/real_server/demo.py" "$@"
