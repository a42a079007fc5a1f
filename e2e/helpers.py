"""Clients of the HTTP APIs the UIs use (Prometheus, Jaeger), a bounded poll, child processes."""

import contextlib
import json
import os
import random
import re
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
STACK = ROOT / "deploy/local/stack.sh"
DIRECTIONS = ("offload", "onboard")
SPAN_NAMES = {d: f"hicache.{d}" for d in DIRECTIONS}
SERVICE = "hicache-e2e"  # of conftest.truth's workload
# series only a GPU run has: the queue wait of device-timed ops
GPU_ONLY = ("hicache_transfer_queue_wait_seconds",)


def binary(name: str) -> str:
    found = subprocess.run(["bash", STACK, "path", name], capture_output=True, text=True)
    assert found.returncode == 0, found.stderr + " (bash deploy/local/stack.sh install)"
    return found.stdout.strip()


def clean_env(**extra: str) -> dict[str, str]:
    """This environment less OTEL_* and the stack's variables, plus extra."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "JAEGER_", "HICACHE_"))} | extra


def free_port() -> int:
    """A free port below Linux's ephemeral range (32768 up): one a server's children pick at random
    for themselves (SGLang's ranks) cannot take it before the server binds it."""
    for _ in range(200):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            with contextlib.suppress(OSError):
                s.bind(("127.0.0.1", port))
                return port
    raise RuntimeError("no free port in 20000-32000")


def get(url: str, **params: Any) -> Any:
    """GET url?params as JSON, an error's too (it says what)."""
    try:
        with urllib.request.urlopen(f"{url}?{urllib.parse.urlencode(params)}", timeout=60) as r:
            return json.load(r)
    except urllib.error.HTTPError as error:
        return json.loads(error.read() or b"{}")


def settle(fetch: Callable[[], Any], done: Callable[[Any], bool], timeout: float, procs: tuple = (),
           every: float = 0.5) -> Any:
    """fetch() until done(value) or timeout, failing if one of procs died; the last value."""
    deadline = time.monotonic() + timeout
    while not done(value := fetch()) and time.monotonic() < deadline:
        for proc in procs:
            proc.check()
        time.sleep(every)
    return value


class Prom:
    def __init__(self, url: str = "http://127.0.0.1:9090") -> None:
        self.url = url

    def api(self, path: str, **params: Any) -> Any:
        body = get(self.url + path, **params)
        assert body.get("status") == "success", f"{params}: {body.get('error')}"
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        data = self.api("/api/v1/query", query=expr)
        return data["result"] if data["resultType"] == "vector" else [{"metric": {}, "value": data["result"]}]

    def by(self, expr: str, *labels: str) -> dict[tuple, float]:
        """{label values: value}, zeros (series made before first use) left out."""
        return {tuple(s["metric"].get(k, "") for k in labels): float(s["value"][1])
                for s in self.query(expr) if float(s["value"][1])}


class Jaeger:
    def __init__(self, url: str = "http://127.0.0.1:16686") -> None:
        self.url = url

    def traces(self, service: str, **params: Any) -> list[dict]:
        """The service's traces of the last hour."""
        now = int(time.time() * 1e6)
        body = get(self.url + "/api/traces", service=service, start=now - 3600 * 10**6, end=now + 60 * 10**6,
                   **{"limit": 5000} | params)
        assert not body.get("errors"), body
        return body["data"]

    def spans(self, service: str, operation: str | None = None, **params: Any) -> list[dict]:
        """The service's spans named operation (or hicache.*) plus "attrs" (its process tags, the
        resource's, with its own: ranks are process tags), "service", "parent"."""
        found = {}
        for trace in self.traces(service, **params, **{"operation": operation} if operation else {}):
            names = {s["spanID"]: s["operationName"] for s in trace["spans"]}
            for s in trace["spans"]:
                if s["operationName"] == operation or not operation and s["operationName"].startswith("hicache."):
                    found[s["traceID"], s["spanID"]] = s | {
                        "attrs": {t["key"]: t["value"] for t in trace["processes"][s["processID"]].get("tags", [])
                                  + s["tags"]}, "service": _service(trace, s),
                        "parent": next((names.get(p) for _, p in refs(s, "CHILD_OF")), None)}
        return list(found.values())

    def trace(self, trace_id: str) -> dict[str, dict]:
        """spanID -> span (with "service") of a trace; {} when Jaeger has none."""
        trace = (get(f"{self.url}/api/traces/{trace_id}").get("data") or [{}])[0]
        return {s["spanID"]: s | {"service": _service(trace, s)} for s in trace.get("spans", [])}


def _service(trace: dict, span: dict) -> str:
    return trace["processes"][span["processID"]]["serviceName"]


def refs(span: dict, kind: str = "FOLLOWS_FROM") -> list[tuple[str, str]]:
    """(trace id, span id) of the span's references of a kind (links: FOLLOWS_FROM)."""
    return [(r["traceID"], r["spanID"]) for r in span.get("references") or [] if r["refType"] == kind]


def shipped_queries() -> list[tuple[str, str, str]]:
    """(kind, name, PromQL) of each shipped rule and panel; Grafana variables match all."""
    import yaml

    def panels(items: list) -> list:
        return [p for item in items for p in [item, *panels(item.get("panels", []))]]

    return [("alert" if "alert" in r else "record", r.get("alert") or r["record"], r["expr"])
            for path in ROOT.glob("deploy/prometheus/rules/*.yml")
            for group in yaml.safe_load(path.read_text())["groups"] for r in group["rules"]] + [
        ("panel", f"{p['title']} {t['refId']}",
         re.sub(r"\$[a-z_]\w*", ".*", t["expr"].replace("$__rate_interval", "1m")))
        for path in ROOT.glob("deploy/grafana/dashboards/*.json")
        for p in panels(json.loads(path.read_text())["panels"]) for t in p.get("targets", []) if "expr" in t]


class Proc:
    """A child process; check() fails once it ended unasked (a server at all)."""

    def __init__(self, name: str, cmd: list[str], env: dict, logs: Path, health: str = "") -> None:
        self.name, self.cmd, self.env, self.logs, self.health, self.process = name, cmd, env, logs, health, None

    def start(self, timeout: float = 60.0) -> None:
        with open(self.logs / f"{self.name}-{time.monotonic_ns()}.log", "w") as log:
            self.process = subprocess.Popen(self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        assert settle(lambda: not self.health or _answers(self.health), bool, timeout, (self,), 0.1), self.log()

    def check(self) -> None:
        code = self.process.poll() if self.process else None
        assert code is None or code == 0 and not self.health, f"{self.name} ended ({code}):\n{self.log()}"

    def wait(self, timeout: float, procs: tuple = ()) -> None:
        """Until it ends with 0 (a dead one of procs fails first)."""
        settle(lambda: self.process.poll() is not None, bool, timeout, procs)
        assert self.process.poll() == 0, f"{self.name} ended ({self.process.poll()}):\n{self.log()}"

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def log(self, tail: int = 3000) -> str:  # tail=0: all of each log
        return "\n".join(p.read_text(errors="replace")[-tail:] for p in sorted(self.logs.glob(f"{self.name}-*.log")))


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False
