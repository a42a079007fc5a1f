"""The OTLP hop of the pipeline test (the Collector e2e/setup.sh built, or its rotel
fallback) as a process that can be started, killed and restarted by PID, forwarding
everything over OTLP/HTTP to a sink. Used by e2e/test_collector_faults.py and
benchmarks/soak.py."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path

CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "otel-hicache" / "e2e"


def _state() -> dict[str, str]:
    path = CACHE / "state.env"
    if not path.exists():
        raise RuntimeError(f"{path} missing: run e2e/setup.sh first")
    state = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            key, value = line.split("=", 1)
            parts = shlex.split(value)
            state[key.strip()] = parts[0] if parts else ""
    return state


STATE = _state()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


class Collector:
    """The pipeline test's OTLP hop as a process we can kill and restart by PID."""

    def __init__(self, tmp: Path, sink: str, tls: dict[str, str] | None = None) -> None:
        self.tmp = tmp
        self.sink = sink
        self.tls = tls
        self.grpc_port, self.http_port = _free_port(), _free_port()
        self.process: subprocess.Popen | None = None
        self.starts = 0
        self.kind = STATE["E2E_PIPELINE"]
        self.binary = STATE["E2E_OTLP_BIN"]
        self.command = self._otelcol() if self.kind == "otelcol" else self._rotel()

    def _otelcol(self) -> list[str]:
        components = subprocess.run([self.binary, "components"], capture_output=True, text=True).stdout
        otlphttp = "otlp_http" if any(line.strip().lstrip("- ").strip() == "name: otlp_http"
                                      for line in components.splitlines()) else "otlphttp"
        tls = ""
        if self.tls:
            tls = f', tls: {{cert_file: "{self.tls["cert"]}", key_file: "{self.tls["key"]}"}}'
        config = self.tmp / "otelcol.yaml"
        config.write_text(f"""# test-only configuration (e2e/test_collector_faults.py)
receivers:
  otlp:
    protocols:
      grpc: {{endpoint: "127.0.0.1:{self.grpc_port}"{tls}}}
      http: {{endpoint: "127.0.0.1:{self.http_port}"{tls}}}
processors:
  batch: {{timeout: 100ms}}
exporters:
  {otlphttp}:
    endpoint: "{self.sink}"
    compression: none
service:
  telemetry:
    metrics: {{level: none}}
  pipelines:
    traces: {{receivers: [otlp], processors: [batch], exporters: [{otlphttp}]}}
    metrics: {{receivers: [otlp], processors: [batch], exporters: [{otlphttp}]}}
""", encoding="utf-8")
        return [self.binary, f"--config={config}"]

    def _rotel(self) -> list[str]:
        if self.tls:
            raise RuntimeError("the rotel fallback is not configured for TLS here; the TLS case needs the Collector")
        return [self.binary, "start", "--otlp-grpc-endpoint", f"127.0.0.1:{self.grpc_port}",
                "--otlp-http-endpoint", f"127.0.0.1:{self.http_port}", "--otlp-receiver-logs-disabled",
                "--exporter", "otlp", "--otlp-exporter-protocol", "http", "--otlp-exporter-compression", "none",
                "--batch-timeout", "100ms",
                "--otlp-exporter-traces-endpoint", f"{self.sink}/v1/traces",
                "--otlp-exporter-metrics-endpoint", f"{self.sink}/v1/metrics",
                "--otlp-exporter-logs-endpoint", f"{self.sink}/unused/v1/logs"]

    def endpoint(self, protocol: str) -> str:
        scheme = "https" if self.tls else "http"
        host = "localhost" if self.tls else "127.0.0.1"
        return f"{scheme}://{host}:{self.grpc_port if protocol == 'grpc' else self.http_port}"

    def start(self) -> float:
        """Start and wait until both receivers accept connections; returns the time.time() it was ready."""
        self.starts += 1
        log = open(self.tmp / f"collector-{self.starts}.log", "w", encoding="utf-8")
        self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not (_open(self.grpc_port) and _open(self.http_port)):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"collector did not start:\n{self.log()}")
            time.sleep(0.05)
        return time.time()

    def kill(self) -> float:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(10)
        return time.time()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def log(self) -> str:
        return "\n".join(p.read_text(encoding="utf-8")[-2000:] for p in sorted(self.tmp.glob("collector-*.log")))
