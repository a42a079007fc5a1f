"""Clients of the HTTP APIs the UIs use (Prometheus, Jaeger), bounded waits and child processes:
shared by the e2e tests, the real-server demo and the cost benchmark (standard library only)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
STACK = ROOT / "deploy" / "local" / "stack.sh"
DIRECTIONS = ("offload", "onboard")
SERVICES = {"example": "hicache-e2e", "sglang": "hicache-e2e-sglang"}  # of the workloads of conftest.truth
SPAN_NAMES = {"offload": "hicache.offload", "onboard": "hicache.onboard"}
# series only a GPU run has: NVML's link capacity, the queue wait of device-timed ops
GPU_ONLY = ("hicache_link_nominal_bandwidth_bytes_per_second", "hicache_transfer_queue_wait_seconds")


def binary(name: str) -> str:
    found = subprocess.run(["bash", str(STACK), "path", name], capture_output=True, text=True)
    assert found.returncode == 0, f"{found.stderr.strip()} (bash deploy/local/stack.sh install)"
    return found.stdout.strip()


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without OTEL_* and the stack's own variables, plus extra."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "JAEGER_", "HICACHE_"))}, **extra}


def get(url: str, timeout: float = 30.0, **params: Any) -> Any:
    """GET url?params as JSON; an error status still gives its JSON body (the API's error)."""
    full = url + ("?" + urllib.parse.urlencode(params) if params else "")
    try:
        with urllib.request.urlopen(full, timeout=timeout) as response:  # noqa: S310 (loopback)
            return json.load(response)
    except urllib.error.HTTPError as error:
        return json.loads(error.read() or b"{}")


def settle(fetch: Callable[[], Any], done: Callable[[Any], bool], timeout: float,
           procs: tuple = (), every: float = 0.5) -> Any:
    """fetch() until done(value) or timeout; the last value, for the caller's assertion. A child
    in procs that died fails at once."""
    deadline = time.monotonic() + timeout
    while True:
        value = fetch()
        if done(value) or time.monotonic() > deadline:
            return value
        for proc in procs:
            proc.check()
        time.sleep(every)


class Prom:
    def __init__(self, url: str = "http://127.0.0.1:9090") -> None:
        self.url = url

    def api(self, path: str, **params: Any) -> Any:
        body = get(self.url + path, **params)
        assert body.get("status") == "success", f"{path} {params}: {body.get('error')}"
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("/api/v1/query", query=expr)
        return data["result"] if data["resultType"] == "vector" else [{"metric": {}, "value": data["result"]}]

    def by(self, expr: str, *labels: str) -> dict[tuple[str, ...], float]:
        """{label values: value} of an instant query, zeros left out (a series not yet used)."""
        return {tuple(s["metric"].get(k, "") for k in labels): float(s["value"][1])
                for s in self.query(expr) if float(s["value"][1])}


class Jaeger:
    def __init__(self, url: str = "http://127.0.0.1:16686") -> None:
        self.url = url

    def api(self, path: str, **params: Any) -> Any:
        body = get(self.url + path, timeout=60, **params)
        assert not body.get("errors"), f"{path} {params}: {body.get('errors')}"
        return body["data"] or []

    def spans(self, service: str, operation: str | None = None, limit: int = 5000, **params: Any) -> list[dict]:
        """Every span named operation (every hicache.* span without one) in the service's traces of
        the last hour, once each, with its "attrs", "service" and "parent" (its name in the trace)."""
        now_us = int(time.time() * 1e6)
        traces = self.api("/api/traces", service=service, limit=limit, start=now_us - 3600 * 10**6,
                          end=now_us + 60 * 10**6, **({"operation": operation} if operation else {}), **params)
        found = {}
        for trace in traces:
            names = {s["spanID"]: s["operationName"] for s in trace["spans"]}
            for span in trace["spans"]:
                if span["operationName"] == operation or (not operation and span["operationName"].startswith("hicache.")):
                    span["attrs"] = {t["key"]: t["value"] for t in span.get("tags") or []}
                    span["service"] = trace["processes"][span["processID"]]["serviceName"]
                    span["parent"] = next((names.get(s) for _, s in refs(span, "CHILD_OF")), None)
                    found[span["traceID"], span["spanID"]] = span
        return list(found.values())

    def trace(self, trace_id: str) -> dict[str, dict]:
        """spanID -> span of one trace, with "service"; empty when Jaeger has no such trace."""
        body = get(f"{self.url}/api/traces/{trace_id}", timeout=60)
        trace = (body.get("data") or [{}])[0]
        return {s["spanID"]: {**s, "service": trace["processes"][s["processID"]]["serviceName"]}
                for s in trace.get("spans") or []}


def refs(span: dict, kind: str = "FOLLOWS_FROM") -> list[tuple[str, str]]:
    """(trace id, span id) of a span's references of one kind (links are FOLLOWS_FROM)."""
    return [(r["traceID"], r["spanID"]) for r in span.get("references") or [] if r["refType"] == kind]


def shipped_queries() -> list[tuple[str, str, str]]:
    """(kind, name, PromQL) of every recording and alerting rule and dashboard query shipped;
    Grafana's variables become a regex matching everything, $__rate_interval 1m."""
    import yaml

    out = []
    for path in sorted((ROOT / "deploy/prometheus/rules").glob("*.yml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            out += [("alert" if "alert" in r else "record", r.get("alert") or r["record"], r["expr"])
                    for r in group["rules"]]

    def panels(items: list) -> list:
        return [p for item in items for p in [item, *panels(item.get("panels") or [])]]

    for path in sorted((ROOT / "deploy/grafana/dashboards").glob("*.json")):
        for panel in panels(json.loads(path.read_text())["panels"]):
            out += [("panel", f"{panel['title']} {t.get('refId', '')}",
                     re.sub(r"\$[A-Za-z_]\w*", ".*", t["expr"].replace("$__rate_interval", "1m")))
                    for t in panel.get("targets") or [] if "expr" in t]
    return out


class Proc:
    """A child process of a test: started (healthy when health answers), killed and stopped by
    its pid; check() fails the test at once when it died unasked (a server, or a failed run)."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], logs: Path, health: str = "") -> None:
        self.name, self.cmd, self.env, self.logs, self.health = name, cmd, env, logs, health
        self.process: subprocess.Popen | None = None
        self.starts = 0

    def start(self, timeout: float = 60.0) -> float:
        self.starts += 1
        with open(self.logs / f"{self.name}-{self.starts}.log", "w", encoding="utf-8") as log:
            self.process = subprocess.Popen(self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, cwd=ROOT)
        healthy = settle(lambda: not self.health or _answers(self.health), bool, timeout, (self,), 0.1)
        assert healthy, f"{self.name} not healthy in {timeout} s:\n{self.log()}"
        return time.time()

    def check(self) -> None:
        if self.process is not None and self.process.poll() not in (None, *((0,) if not self.health else ())):
            raise AssertionError(f"{self.name} exited with {self.process.returncode}:\n{self.log()}")

    def wait(self, timeout: float, procs: tuple = ()) -> None:
        """Until it exits with 0 (failing at once if one of procs dies first)."""
        settle(lambda: self.process.poll() is not None, bool, timeout, procs)
        assert self.process.poll() == 0, f"{self.name} ended with {self.process.poll()}:\n{self.log()}"

    def kill(self) -> int:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(10)
        return time.time_ns()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)

    def log(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(self.logs.glob(f"{self.name}-*.log")))


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):  # noqa: S310 (loopback)
            return True
    except OSError:
        return False
