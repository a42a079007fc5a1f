"""The real OpenTelemetry Collector (the binary deploy/local/stack.sh installs) as a
process that can be started, killed and restarted by PID, forwarding everything over
OTLP/HTTP to a sink. Used by e2e/test_collector_faults.py and benchmarks/soak.py (beside
otlp_receiver.py and paced_runs.py, the other helpers those share)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def collector_binary() -> str:
    """The Collector `deploy/local/stack.sh path otelcol` resolves (run its install first)."""
    proc = subprocess.run(["bash", str(ROOT / "deploy/local/stack.sh"), "path", "otelcol"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip() or "deploy/local/stack.sh path otelcol failed")
    return proc.stdout.strip()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


class Collector:
    """The Collector as a process we can kill and restart by PID."""

    def __init__(self, tmp: Path, sink: str, tls: dict[str, str] | None = None) -> None:
        self.tmp = tmp
        self.sink = sink
        self.tls = tls
        self.grpc_port, self.http_port = _free_port(), _free_port()
        self.process: subprocess.Popen | None = None
        self.starts = 0
        self.binary = collector_binary()
        self.command = self._otelcol()

    def _otelcol(self) -> list[str]:
        tls = ""
        if self.tls:
            tls = f', tls: {{cert_file: "{self.tls["cert"]}", key_file: "{self.tls["key"]}"}}'
        config = self.tmp / "otelcol.yaml"
        config.write_text(f"""# test-only configuration (tests/collector_process.py)
receivers:
  otlp:
    protocols:
      grpc: {{endpoint: "127.0.0.1:{self.grpc_port}"{tls}}}
      http: {{endpoint: "127.0.0.1:{self.http_port}"{tls}}}
processors:
  batch: {{timeout: 100ms}}
exporters:
  otlp_http:
    endpoint: "{self.sink}"
    compression: none
service:
  telemetry:
    metrics: {{level: none}}
  pipelines:
    traces: {{receivers: [otlp], processors: [batch], exporters: [otlp_http]}}
    metrics: {{receivers: [otlp], processors: [batch], exporters: [otlp_http]}}
""", encoding="utf-8")
        return [self.binary, f"--config={config}"]

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
                self.stop()  # never leave one behind
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
