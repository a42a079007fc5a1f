"""Checks for the real pipeline test (e2e/run.sh), run after the example workload exported
its spans and metrics through the OpenTelemetry Collector.

  (a) counters in Prometheus (OTLP -> Collector -> vmagent -> remote write) equal the
      workload's ground truth (--truth-json of examples/hicache_workload.py), exactly;
  (b) every PromQL expression of the shipped Prometheus rules (deploy/prometheus/rules/*.yml)
      and Grafana dashboards (deploy/grafana/dashboards/*.json) returns data now; recorded
      series exist; alert expressions parse and what they compare returns data;
  (c) the trace store (Arize Phoenix) holds one span per op with consistent attributes, each
      the child of an example.scheduler_step span it also holds;
  (d) promtool: check config, check rules, test rules;
  (e) the Docker deployment's structure: YAML parses, every pipeline component is defined,
      every port the Collector listens on is published, and only on 127.0.0.1.

Prints one PASS/FAIL line per check and exits 1 if any failed. Standard library only, plus
PyYAML (installed in the project's venv) and requests when present.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Callable, Iterable

try:
    import yaml
except ImportError:  # reported as a failure of the checks that need it
    yaml = None

try:
    import requests
except ImportError:
    requests = None

DIRECTIONS = ("offload", "onboard")
SPAN_NAMES = {"offload": "hicache.offload", "onboard": "hicache.onboard"}
STEP_SPAN = "example.scheduler_step"
WAIT_S = 30.0
TRACE_WAIT_S = 120.0

# Series that only device-timed ops produce (docs/reference.md): on a CPU-only run (every op
# timed on the host clock) an expression over them has nothing to return, which is reported
# as SKIP rather than FAIL. Any other empty result fails.
DEVICE_ONLY = {
    "hicache_transfer_queue_wait_seconds":
        "hicache.transfer.queue_wait is recorded only for device_event ops with a wall-clock anchor",
}

GRAFANA_BUILTINS = {
    "__rate_interval": "1m", "__interval": "15s", "__range": "5m",
    "__interval_ms": "15000", "__range_s": "300", "__range_ms": "300000",
}


# --------------------------------------------------------------------------------------
# results
# --------------------------------------------------------------------------------------
class Results:
    def __init__(self) -> None:
        self.passed = 0
        self.failed: list[str] = []
        self.no_data: list[str] = []
        self.skipped = 0
        self.device_timed = True  # set from the data in check_counters

    def skip(self, name: str, detail: str) -> None:
        print(f"SKIP {name}: {detail}", flush=True)
        self.skipped += 1

    def check_data(self, name: str, expr: str, ok: bool, result: list, err: str, shown: str = "") -> None:
        """A query that must return data, unless it only reads device-only series and this run
        had no device-timed op."""
        if ok and not result and not self.device_timed:
            why = [why for metric, why in DEVICE_ONLY.items() if metric in expr]
            if why:
                self.no_data.append(f"{name} (expected on a CPU-only run: {why[0]}): {' '.join(expr.split())}")
                self.skip(name, f"no data, expected: no device-timed op in this run and {why[0]}; `{shown or expr}`")
                return
        if not (ok and result):
            self.no_data.append(f"{name}: {' '.join(expr.split())}")
        self.check(name, ok and bool(result), (err or describe(result)) + (f"; `{shown}`" if shown else ""))

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
        if ok:
            self.passed += 1
        else:
            self.failed.append(name)
        return ok

    def section(self, title: str) -> None:
        print(f"-- {title}", flush=True)


# --------------------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------------------
def get_json(url: str, params: dict[str, Any] | None = None, timeout: float = 10.0) -> tuple[int, Any]:
    """GET url?params -> (HTTP status, decoded JSON or text); status 0 when unreachable."""
    if requests is not None:
        try:
            r = requests.get(url, params=params, timeout=timeout)
        except requests.RequestException as exc:
            return 0, str(exc)
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, r.text
    full = url + ("?" + urllib.parse.urlencode(params) if params else "")
    try:
        with urllib.request.urlopen(full, timeout=timeout) as resp:
            status, body = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, body = exc.code, exc.read()
    except (urllib.error.URLError, OSError) as exc:
        return 0, str(exc)
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body.decode("utf-8", "replace")


def wait_until(fn: Callable[[], Any], timeout: float, interval: float = 0.5) -> Any:
    """Call fn until it returns a truthy value or timeout passes; return its last value."""
    end = time.monotonic() + timeout
    while True:
        value = fn()
        if value or time.monotonic() >= end:
            return value
        time.sleep(interval)


class Prometheus:
    def __init__(self, base: str) -> None:
        self.base = base.rstrip("/")

    def query(self, expr: str) -> tuple[bool, list[dict[str, Any]], str]:
        """Instant query now -> (ok, result vector, error)."""
        status, body = get_json(self.base + "/api/v1/query", {"query": expr})
        if isinstance(body, dict) and body.get("status") == "success":
            data = body["data"]
            result = data["result"]
            if data.get("resultType") == "scalar":
                result = [{"metric": {}, "value": result}]
            return True, result, ""
        if isinstance(body, dict):
            return False, [], f"HTTP {status}: {body.get('errorType')}: {body.get('error')}"
        return False, [], f"HTTP {status}: {str(body)[:200]}"

    def by_labels(self, expr: str, labels: Iterable[str]) -> dict[tuple[str, ...], float]:
        ok, result, _ = self.query(expr)
        labels = tuple(labels)
        return {tuple(s["metric"].get(k, "") for k in labels): float(s["value"][1]) for s in result} if ok else {}


def describe(result: list[dict[str, Any]]) -> str:
    values = [float(s["value"][1]) for s in result]
    nan = sum(1 for v in values if math.isnan(v))
    return f"{len(result)} series" + (f" ({nan} NaN)" if nan else "")


# --------------------------------------------------------------------------------------
# (a) counters vs ground truth
# --------------------------------------------------------------------------------------
def check_counters(res: Results, prom: Prometheus, truth: dict[str, Any], service: str) -> None:
    res.section("(a) counters in Prometheus vs the workload's ground truth")
    sel = f'{{service_name="{service}"}}'
    checks = [
        ("bytes per direction", f"sum by (hicache_direction) (hicache_transfer_bytes_total{sel})",
         ("hicache_direction",), {(d,): t["bytes"] for d, t in truth.items()}),
        ("blocks per direction", f"sum by (hicache_direction) (hicache_transfer_blocks_total{sel})",
         ("hicache_direction",), {(d,): t["blocks"] for d, t in truth.items()}),
        ("tokens per direction and pool",
         f"sum by (hicache_direction, hicache_pool) (hicache_transfer_tokens_total{sel})",
         ("hicache_direction", "hicache_pool"),
         {(d, p): n for d, t in truth.items() for p, n in t["tokens"].items()}),
        ("ops per direction (duration histogram count)",
         f"sum by (hicache_direction) (hicache_transfer_duration_seconds_count{sel})",
         ("hicache_direction",), {(d,): t["ops"] for d, t in truth.items()}),
    ]
    started = time.monotonic()
    state: dict[str, dict[tuple[str, ...], float]] = {}

    def matches(name: str, expr: str, labels: tuple[str, ...], want: dict[tuple[str, ...], int]) -> bool:
        got = prom.by_labels(expr, labels)
        state[name] = got
        keys = set(want) | set(got)
        # a direction with no ops has no histogram series; a missing series counts as 0
        return bool(got) and all(got.get(k, 0.0) == want.get(k, 0) for k in keys)

    def all_match() -> bool:
        return all([matches(*c) for c in checks])

    wait_until(all_match, WAIT_S, 0.5)
    waited = time.monotonic() - started
    device = prom.by_labels(f'sum(hicache_transfer_duration_seconds_count{{service_name="{service}",'
                            f'hicache_timing_source="device_event"}})', ())
    res.device_timed = any(v > 0 for v in device.values())
    print(f"   (device-timed ops in this run: {'yes' if res.device_timed else 'no, host clock only'})")
    for name, expr, labels, want in checks:
        got = state.get(name, {})
        keys = sorted(set(want) | set(got))
        ok = bool(got) and all(got.get(k, 0.0) == want.get(k, 0) for k in keys)
        shown = ", ".join(f"{'/'.join(k)}={got.get(k, 0):.0f}" + ("" if got.get(k, 0) == want.get(k, 0)
                                                                   else f" (want {want.get(k, 0)})")
                          for k in keys)
        res.check(f"{name} == truth", ok, f"{shown or 'no data'}; `{expr}`")
    print(f"   (polled {waited:.1f} s for the final values)")
    # a rate needs two exports of the run: the link throughput must be a number, not just a series
    expr = (f"max_over_time((sum by (hicache_direction) (rate(hicache_transfer_bytes_total{sel}[1m]))"
            f" / sum by (hicache_direction) (rate(hicache_transfer_busy_time_seconds_total{sel}[1m])))[2m:1s])")
    got = prom.by_labels(expr, ("hicache_direction",))
    ok = set(got) == {(d,) for d, t in truth.items() if t["ops"]} and all(
        math.isfinite(v) and v > 0 for v in got.values())
    res.check("link throughput (rate bytes / rate busy time) is a positive number per direction", ok,
              ", ".join(f"{k[0]}={v / 1e9:.2f} GB/s" for k, v in sorted(got.items())) + f"; `{expr}`")


# --------------------------------------------------------------------------------------
# PromQL helpers: top-level operators, Grafana variables
# --------------------------------------------------------------------------------------
_COMPARISONS = ("==", "!=", ">=", "<=", ">", "<")
_SET_OPS = ("and", "or", "unless")


def _top_level_tokens(expr: str) -> Iterable[tuple[int, str]]:
    """(position, operator) of comparison and set operators outside (), [], {} and strings."""
    depth = 0
    i, n = 0, len(expr)
    while i < n:
        c = expr[i]
        if c in "\"'`":
            j = i + 1
            while j < n and expr[j] != c:
                j += 2 if expr[j] == "\\" and c != "`" else 1
            i = j + 1
            continue
        if c == "#":  # comment to end of line
            while i < n and expr[i] != "\n":
                i += 1
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0:
            two = expr[i:i + 2]
            if two in _COMPARISONS:
                yield i, two
                i += 2
                continue
            if c in "<>":
                yield i, c
            elif c.isalpha() and (i == 0 or not (expr[i - 1].isalnum() or expr[i - 1] in "_:")):
                m = re.match(r"[A-Za-z_][A-Za-z0-9_:]*", expr[i:])
                word = m.group(0)
                if word in _SET_OPS:
                    yield i, word
                i += len(word)
                continue
        i += 1


def compared_sides(expr: str) -> list[str]:
    """For an alert condition, the expressions being compared: split on top-level and/or/
    unless, then take what lies left of the last top-level comparison of each operand
    (operands with no comparison are left out)."""
    tokens = list(_top_level_tokens(expr))
    bounds = [0] + [p for p, op in tokens if op in _SET_OPS] + [len(expr)]
    sides = []
    for a, b in zip(bounds, bounds[1:]):
        part_start = a
        if a:
            m = re.match(r"[A-Za-z]+\s*(?:(?:on|ignoring)\s*\([^)]*\))?", expr[a:])
            part_start = a + m.end()
        comps = [p for p, op in tokens if op in _COMPARISONS and part_start <= p < b]
        if comps:
            sides.append(expr[part_start:comps[-1]].strip())
    return sides


_VAR = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\$(\w+)|\[\[(\w+)(?::[^\]]*)?\]\]")
_MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')


def grafana_to_promql(expr: str) -> str:
    """Substitute Grafana's variables: the interval ones by fixed windows, dashboard
    variables in label matchers by `.*` (a regex matcher matching everything)."""
    def builtin(m: re.Match) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        return GRAFANA_BUILTINS.get(name, m.group(0))

    expr = _VAR.sub(builtin, expr)

    def matcher(m: re.Match) -> str:
        label, op, value = m.groups()
        if not _VAR.search(value):
            return m.group(0)
        if op in ("=", "=~"):
            return f'{label}=~"{_VAR.sub(".*", value)}"'
        return f'{label}!~"{_VAR.sub("__e2e_no_such_value__", value)}"'  # excludes nothing

    return _MATCHER.sub(matcher, expr)


# --------------------------------------------------------------------------------------
# (b) rules and dashboards
# --------------------------------------------------------------------------------------
def rule_files(repo: str) -> list[str]:
    return sorted(glob.glob(os.path.join(repo, "deploy/prometheus/rules/*.yml"))
                  + glob.glob(os.path.join(repo, "deploy/prometheus/rules/*.yaml")))


def dashboard_files(repo: str) -> list[str]:
    return sorted(glob.glob(os.path.join(repo, "deploy/grafana/dashboards/**/*.json"), recursive=True))


def _duration_s(text: Any) -> float:
    total = 0.0
    for num, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)", str(text or "")):
        total += float(num) * {"ms": 1e-3, "s": 1, "m": 60, "h": 3600, "d": 86400}[unit]
    return total


def check_rules(res: Results, prom: Prometheus, repo: str) -> None:
    res.section("(b) PromQL of the shipped Prometheus rules")
    files = rule_files(repo)
    if not files:
        print("   no rule files under deploy/prometheus/rules/: nothing to check")
        return
    if yaml is None:
        res.check("rule files parse", False, "PyYAML is not installed in this interpreter")
        return
    records = []  # (name, selector, group interval)
    for path in files:
        rel = os.path.relpath(path, repo)
        try:
            with open(path, encoding="utf-8") as f:
                doc = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError) as exc:
            res.check(f"{rel} parses", False, str(exc))
            continue
        for group in doc.get("groups") or []:
            interval = _duration_s(group.get("interval")) or 1.0
            for rule in group.get("rules") or []:
                expr = str(rule.get("expr", "")).strip()
                one_line = " ".join(expr.split())
                if "record" in rule:
                    ok, result, err = prom.query(expr)
                    res.check_data(f"record {rule['record']}: expr returns data", one_line, ok, result, err)
                    labels = rule.get("labels") or {}
                    sel = rule["record"] + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
                                            if labels else "")
                    records.append((rule["record"], sel, interval))
                elif "alert" in rule:
                    ok, result, err = prom.query(expr)
                    res.check(f"alert {rule['alert']}: expr parses and evaluates", ok,
                              err or f"condition {'true' if result else 'false'} now")
                    for side in compared_sides(expr):
                        s_ok, s_result, s_err = prom.query(side)
                        side = " ".join(side.split())
                        res.check_data(f"alert {rule['alert']}: compared side returns data", side,
                                       s_ok, s_result, s_err, side)
    # recorded series: the group interval (15 s in the shipped file, 1 s by default here)
    # passes before the first evaluation that sees the workload's data
    if records:
        timeout = max(WAIT_S, 2 * max(r[2] for r in records) + 5)
        started = time.monotonic()
        found: dict[str, list] = {}

        def all_recorded() -> bool:
            for name, sel, _ in records:
                if not found.get(name):
                    ok, result, _ = prom.query(sel)
                    found[name] = result if ok else []
            return all(found.values())

        wait_until(all_recorded, timeout, 1.0)
        waited = time.monotonic() - started
        for name, sel, _ in records:
            res.check_data(f"recorded series {sel} exists", sel, True, found.get(name) or [], "")
        print(f"   (recorded series checked after {waited:.1f} s)")


def _panels(panels: Iterable[dict]) -> Iterable[dict]:
    for panel in panels or []:
        yield panel
        yield from _panels(panel.get("panels") or [])


def check_dashboards(res: Results, prom: Prometheus, repo: str) -> None:
    res.section("(b) PromQL of the shipped Grafana dashboards")
    files = dashboard_files(repo)
    if not files:
        print("   no dashboards under deploy/grafana/dashboards/: nothing to check")
        return
    for path in files:
        rel = os.path.relpath(path, repo)
        try:
            with open(path, encoding="utf-8") as f:
                dash = json.load(f)
        except (OSError, ValueError) as exc:
            res.check(f"{rel} parses", False, str(exc))
            continue
        dash = dash.get("dashboard", dash)  # API export format
        panels = list(_panels(dash.get("panels") or []))
        for row in dash.get("rows") or []:  # old schema
            panels.extend(_panels(row.get("panels") or []))
        for panel in panels:
            for target in panel.get("targets") or []:
                if "expr" not in target:
                    continue
                ds = target.get("datasource") or panel.get("datasource") or {}
                if isinstance(ds, dict) and ds.get("type") not in (None, "prometheus", "datasource"):
                    continue  # another datasource's query language
                raw = str(target["expr"])
                expr = grafana_to_promql(raw)
                ok, result, err = prom.query(expr)
                what = f"panel \"{panel.get('title', '?')}\" {target.get('refId', '')}".rstrip()
                res.check_data(f"{what} returns data", expr, ok, result, err, expr)
        for var in (dash.get("templating") or {}).get("list") or []:
            query = var.get("query")
            query = query.get("query") if isinstance(query, dict) else query
            m = re.fullmatch(r"\s*label_values\((.+),\s*(\w+)\s*\)\s*", str(query or ""))
            if var.get("type") == "query" and m:
                expr = f"count by ({m.group(2)}) ({grafana_to_promql(m.group(1))})"
                ok, result, err = prom.query(expr)
                values = sorted(s["metric"].get(m.group(2), "") for s in result)
                res.check_data(f"variable ${var.get('name')} has values", expr, ok, result, err,
                               f"{', '.join(values)}: {query}")


# --------------------------------------------------------------------------------------
# (c) traces in Phoenix
# --------------------------------------------------------------------------------------
def _flatten(attrs: Any, prefix: str = "") -> dict[str, Any]:
    """Phoenix may return attributes nested by their dotted names; flatten them back."""
    out: dict[str, Any] = {}
    if isinstance(attrs, list):  # OTLP-style [{key, value}]
        for item in attrs:
            if isinstance(item, dict) and "key" in item:
                value = item.get("value")
                if isinstance(value, dict) and len(value) == 1:
                    value = next(iter(value.values()))
                out[prefix + item["key"]] = value
        return out
    for key, value in (attrs or {}).items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def fetch_spans(base: str, project: str = "default") -> tuple[list[dict[str, Any]], str]:
    spans: list[dict[str, Any]] = []
    cursor = None
    for _ in range(1000):
        params: dict[str, Any] = {"limit": 1000}
        if cursor:
            params["cursor"] = cursor
        status, body = get_json(f"{base}/v1/projects/{project}/spans", params, timeout=30)
        if status != 200 or not isinstance(body, dict):
            return spans, f"HTTP {status}: {str(body)[:200]}"
        spans.extend(body.get("data") or [])
        cursor = body.get("next_cursor")
        if not cursor:
            break
    return spans, ""


def check_traces(res: Results, base: str, truth: dict[str, Any]) -> None:
    res.section("(c) spans in the trace store (Phoenix)")
    want_ops = {d: truth[d]["ops"] for d in DIRECTIONS if d in truth}
    total_ops = sum(want_ops.values())
    started = time.monotonic()
    state: dict[str, Any] = {"spans": [], "error": ""}

    def complete() -> bool:
        spans, error = fetch_spans(base)
        state["spans"], state["error"] = spans, error
        names = [s.get("name") for s in spans]
        return (not error and all(names.count(SPAN_NAMES[d]) >= n for d, n in want_ops.items())
                and names.count(STEP_SPAN) >= total_ops)

    # Phoenix stores spans one by one (SQLite): on 2 busy cores it can lag the export by tens of
    # seconds, so wait longer for the store than for Prometheus
    wait_until(complete, TRACE_WAIT_S, 2.0)
    waited = time.monotonic() - started
    spans = state["spans"]
    if not res.check("spans readable over Phoenix's REST API", not state["error"] and bool(spans),
                     state["error"] or f"{len(spans)} spans after {waited:.1f} s"):
        return
    by_name: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        by_name.setdefault(span.get("name"), []).append(span)
    for d, n in want_ops.items():
        got = len(by_name.get(SPAN_NAMES[d], []))
        res.check(f"{SPAN_NAMES[d]} spans == truth ops", got == n, f"{got} (want {n})")
    steps = by_name.get(STEP_SPAN, [])
    res.check(f"{STEP_SPAN} spans == ops", len(steps) == total_ops, f"{len(steps)} (want {total_ops})")

    transfers = [(d, s) for d in DIRECTIONS for s in by_name.get(SPAN_NAMES[d], [])]
    required = ("hicache.direction", "hicache.tokens", "hicache.bytes", "hicache.blocks",
                "hicache.page_size", "hicache.timing_source", "tp_rank")
    missing, inconsistent = [], []
    sums = {d: {"bytes": 0, "blocks": 0, "tokens": 0} for d in DIRECTIONS}
    sources: dict[str, int] = {}
    for d, span in transfers:
        attrs = _flatten(span.get("attributes"))
        absent = [k for k in required if k not in attrs]
        if absent:
            missing.append(f"{span.get('context', {}).get('span_id')}: {', '.join(absent)}")
            continue
        tokens, blocks, page = int(attrs["hicache.tokens"]), int(attrs["hicache.blocks"]), int(attrs["hicache.page_size"])
        problems = []
        if attrs["hicache.direction"] != d:
            problems.append(f"direction {attrs['hicache.direction']}")
        if page <= 0 or blocks != -(-tokens // page):
            problems.append(f"blocks {blocks} != ceil({tokens}/{page})")
        if attrs["hicache.timing_source"] not in ("device_event", "host_clock"):
            problems.append(f"timing_source {attrs['hicache.timing_source']}")
        if str(attrs["tp_rank"]) != "0":
            problems.append(f"tp_rank {attrs['tp_rank']}")
        if int(attrs["hicache.bytes"]) <= 0:
            problems.append(f"bytes {attrs['hicache.bytes']}")
        if problems:
            inconsistent.append(f"{span.get('context', {}).get('span_id')}: {'; '.join(problems)}")
        sums[d]["bytes"] += int(attrs["hicache.bytes"])
        sums[d]["blocks"] += blocks
        sums[d]["tokens"] += tokens
        sources[attrs["hicache.timing_source"]] = sources.get(attrs["hicache.timing_source"], 0) + 1
    res.check("every transfer span has " + ", ".join(required), not missing and bool(transfers),
              f"{len(missing)} without: {missing[:3]}" if missing else f"{len(transfers)} spans")
    res.check("attributes consistent (direction, blocks == ceil(tokens/page_size), timing_source, tp_rank)",
              not inconsistent and bool(transfers),
              f"{len(inconsistent)} inconsistent: {inconsistent[:3]}" if inconsistent
              else "timing_source " + ", ".join(f"{k}={v}" for k, v in sorted(sources.items())))
    for d in want_ops:
        want = {"bytes": truth[d]["bytes"], "blocks": truth[d]["blocks"], "tokens": truth[d]["tokens"].get("kv", 0)}
        res.check(f"{d} span attributes sum to truth (bytes, blocks, kv tokens)", sums[d] == want,
                  f"{sums[d]}" + ("" if sums[d] == want else f" (want {want})"))

    step_ids = {(s.get("context", {}).get("trace_id"), s.get("context", {}).get("span_id")) for s in steps}
    orphans = [s.get("context", {}).get("span_id") for _, s in transfers
               if (s.get("context", {}).get("trace_id"), s.get("parent_id")) not in step_ids]
    res.check(f"every transfer span's parent is a stored {STEP_SPAN} span (same trace)",
              not orphans and bool(transfers),
              f"{len(orphans)} without: {orphans[:3]}" if orphans else f"{len(transfers)} linked")


# --------------------------------------------------------------------------------------
# (d) promtool
# --------------------------------------------------------------------------------------
def run_promtool(res: Results, name: str, args: list[str], cwd: str) -> None:
    try:
        proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120)
        out = (proc.stdout + proc.stderr).strip()
        ok = proc.returncode == 0
    except (OSError, subprocess.TimeoutExpired) as exc:
        out, ok = str(exc), False
    lines = out.splitlines()
    res.check(name, ok, (lines[-1] if ok and lines else "\n     " + "\n     ".join(lines[-15:])))


def check_promtool(res: Results, promtool: str, prom_config: str, repo: str) -> None:
    res.section("(d) promtool")
    if not promtool:
        res.check("promtool available", False, "pass --promtool")
        return
    run_promtool(res, "promtool check config (test configuration, rule files included)",
                 [promtool, "check", "config", prom_config], repo)
    rules = [os.path.relpath(p, repo) for p in rule_files(repo)]
    if rules:
        run_promtool(res, "promtool check rules " + " ".join(rules), [promtool, "check", "rules", *rules], repo)
    tests = sorted(glob.glob(os.path.join(repo, "deploy/prometheus/tests/*.yml"))
                   + glob.glob(os.path.join(repo, "deploy/prometheus/tests/*.yaml")))
    if tests:
        rel = [os.path.relpath(p, repo) for p in tests]
        run_promtool(res, "promtool test rules " + " ".join(rel), [promtool, "test", "rules", *rel], repo)


# --------------------------------------------------------------------------------------
# (e) Docker deployment structure
# --------------------------------------------------------------------------------------
_DEFAULT_PORTS = {  # listeners whose endpoint may be left out, by component type
    ("receivers", "otlp/grpc"): 4317, ("receivers", "otlp/http"): 4318,
    ("extensions", "health_check"): 13133, ("extensions", "zpages"): 55679, ("extensions", "pprof"): 1777,
}
_ENV = re.compile(r"\$\{(?:env:)?(\w+)(?::?-([^}]*))?\}")


def _expand(value: Any) -> str:
    """${VAR:-default} / ${env:VAR:-default}: the environment, else the default."""
    return _ENV.sub(lambda m: os.environ.get(m.group(1), m.group(2) or ""), str(value))


def _port(endpoint: Any) -> int | None:
    m = re.search(r":(\d+)\s*$", _expand(endpoint))
    return int(m.group(1)) if m else None


def collector_listen_ports(cfg: dict[str, Any]) -> dict[int, str]:
    """Port -> what listens on it, for the components the pipelines and service use."""
    ports: dict[int, str] = {}
    service = cfg.get("service") or {}
    used = {kind: set() for kind in ("receivers", "exporters")}
    for pipeline in (service.get("pipelines") or {}).values():
        for kind in used:
            used[kind].update((pipeline or {}).get(kind) or [])
    for name in used["receivers"]:
        conf = (cfg.get("receivers") or {}).get(name) or {}
        if name.split("/")[0] == "otlp":
            for proto, pconf in (conf.get("protocols") or {}).items():
                port = _port((pconf or {}).get("endpoint", "")) or _DEFAULT_PORTS.get(("receivers", f"otlp/{proto}"))
                if port:
                    ports[port] = f"receiver {name} {proto}"
        elif isinstance(conf, dict) and conf.get("endpoint"):
            ports[_port(conf["endpoint"]) or 0] = f"receiver {name}"
    for name in used["exporters"]:  # exporters that serve (pull) rather than send
        conf = (cfg.get("exporters") or {}).get(name) or {}
        if name.split("/")[0] == "prometheus" and conf.get("endpoint"):
            ports[_port(conf["endpoint"]) or 0] = f"exporter {name}"
    for name in service.get("extensions") or []:
        conf = (cfg.get("extensions") or {}).get(name) or {}
        port = _port(conf.get("endpoint", "")) or _DEFAULT_PORTS.get(("extensions", name.split("/")[0]))
        if port:
            ports[port] = f"extension {name}"
    metrics = (service.get("telemetry") or {}).get("metrics") or {}
    if metrics.get("level") != "none":
        for reader in metrics.get("readers") or []:
            exp = (((reader or {}).get("pull") or {}).get("exporter") or {}).get("prometheus") or {}
            if exp.get("port"):
                ports[int(_expand(exp["port"]))] = "service telemetry (own metrics)"
        if metrics.get("address"):
            ports[_port(metrics["address"]) or 0] = "service telemetry (own metrics)"
    return ports


def _published(ports: Any) -> list[tuple[str, int | None, str]]:
    """compose `ports:` -> [(host ip, container port, as written)]."""
    out = []
    for item in ports or []:
        if isinstance(item, dict):
            out.append((str(item.get("host_ip", "")), int(_expand(item.get("target"))), json.dumps(item)))
            continue
        text = _expand(item).split("/")[0]
        m = re.fullmatch(r"(?:(\[[^\]]+\]|[\d.]+):)?(?:(\d+(?:-\d+)?):)?(\d+(?:-\d+)?)", text)
        if not m:
            out.append(("", None, str(item)))
            continue
        host_ip = m.group(1) or ""
        target = m.group(3).split("-")[0]
        out.append((host_ip, int(target), str(item)))
    return out


def _scrape_targets(path: str) -> set[str]:
    """host:port targets of every static scrape config in a Prometheus config file."""
    try:
        with open(path, encoding="utf-8") as f:
            cfg = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError):
        return set()
    return {t for job in cfg.get("scrape_configs") or [] for sc in job.get("static_configs") or []
            for t in sc.get("targets") or []}


def check_docker(res: Results, repo: str) -> None:
    res.section("(e) Docker deployment (structure only)")
    composes = [p for p in (os.path.join(repo, n) for n in ("docker-compose.yml", "docker-compose.yaml",
                                                            "compose.yml", "compose.yaml")) if os.path.exists(p)]
    col_configs = sorted(glob.glob(os.path.join(repo, "deploy/otel-collector/*.yaml"))
                         + glob.glob(os.path.join(repo, "deploy/otel-collector/*.yml")))
    if not composes and not col_configs:
        print("   no docker-compose.yml or deploy/otel-collector/ config: nothing to check")
        return
    if yaml is None:
        res.check("deployment YAML parses", False, "PyYAML is not installed in this interpreter")
        return
    docs: dict[str, Any] = {}
    for path in composes + col_configs:
        rel = os.path.relpath(path, repo)
        try:
            with open(path, encoding="utf-8") as f:
                docs[path] = yaml.safe_load(f)
            res.check(f"{rel} parses as YAML", isinstance(docs[path], dict))
        except (OSError, yaml.YAMLError) as exc:
            res.check(f"{rel} parses as YAML", False, str(exc).splitlines()[0])

    listen: dict[int, str] = {}
    for path in col_configs:
        cfg = docs.get(path)
        if not isinstance(cfg, dict):
            continue
        rel = os.path.relpath(path, repo)
        service = cfg.get("service") or {}
        connectors = set((cfg.get("connectors") or {}).keys())
        problems = []
        pipelines = service.get("pipelines") or {}
        as_exporter, as_receiver = set(), set()
        for pname, pipeline in pipelines.items():
            pipeline = pipeline or {}
            for kind, extra in (("receivers", connectors), ("processors", set()), ("exporters", connectors)):
                defined = set((cfg.get(kind) or {}).keys()) | extra
                for comp in pipeline.get(kind) or []:
                    if comp not in defined:
                        problems.append(f"pipeline {pname}: {kind[:-1]} {comp} is not defined")
            if not pipeline.get("receivers") or not pipeline.get("exporters"):
                problems.append(f"pipeline {pname}: needs receivers and exporters")
            as_receiver.update(c for c in pipeline.get("receivers") or [] if c in connectors)
            as_exporter.update(c for c in pipeline.get("exporters") or [] if c in connectors)
        for conn in connectors:
            if conn not in as_receiver or conn not in as_exporter:
                problems.append(f"connector {conn} must be an exporter and a receiver of pipelines")
        for ext in service.get("extensions") or []:
            if ext not in (cfg.get("extensions") or {}):
                problems.append(f"extension {ext} is not defined")
        res.check(f"{rel}: every pipeline component is defined", bool(pipelines) and not problems,
                  "; ".join(problems) or ", ".join(f"{k}: {'/'.join(v.get('receivers') or [])} -> "
                                                   f"{'/'.join(v.get('exporters') or [])}"
                                                   for k, v in pipelines.items()))
        listen.update(collector_listen_ports(cfg))

    for path in composes:
        compose = docs.get(path)
        if not isinstance(compose, dict):
            continue
        rel = os.path.relpath(path, repo)
        services = compose.get("services") or {}
        exposed = []
        for sname, svc in services.items():
            for host_ip, target, written in _published((svc or {}).get("ports")):
                exposed.append((sname, host_ip, target, written))
        bad = [f"{s}: {w}" for s, ip, _, w in exposed if ip != "127.0.0.1"]
        res.check(f"{rel}: every published port binds 127.0.0.1", not bad,
                  f"not on 127.0.0.1: {bad}" if bad else f"{len(exposed)} published ports")
        if listen:
            collector = [s for s, svc in services.items()
                         if "collector" in str((svc or {}).get("image", "")) or "collector" in s]
            targets = {t for s, _, t, _ in exposed if s in collector}
            # the Collector's own telemetry stays inside the compose network: Prometheus scrapes it there
            internal = {p: w for p, w in listen.items() if w.startswith("service telemetry")}
            external = {p: w for p, w in listen.items() if p not in internal}
            missing = {p: what for p, what in external.items() if p not in targets}
            res.check(f"{rel}: every port the Collector serves to the host is published "
                      f"({', '.join(f'{p} {w}' for p, w in sorted(external.items()))})",
                      bool(collector) and not missing,
                      ("no collector service found" if not collector else
                       f"service {'/'.join(collector)} does not publish: "
                       + ", ".join(f"{p} ({w})" for p, w in sorted(missing.items())) if missing
                       else f"service {'/'.join(collector)}: {sorted(targets)}"))
            scraped = _scrape_targets(os.path.join(repo, "deploy/prometheus/prometheus.yml"))
            unscraped = [p for p in internal if not any(f"{s}:{p}" in scraped for s in collector)]
            if internal:
                res.check(f"{rel}: the Collector's own telemetry ({', '.join(map(str, sorted(internal)))}) is "
                          "scraped inside the compose network", bool(collector) and not unscraped,
                          f"not a scrape target in deploy/prometheus/prometheus.yml: {unscraped}" if unscraped
                          else f"targets {sorted(t for t in scraped if any(t.startswith(c) for c in collector))}")


# --------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parser.add_argument("--truth", required=True, help="ground truth written by hicache_workload.py --truth-json")
    parser.add_argument("--prometheus", default="http://127.0.0.1:19090")
    parser.add_argument("--phoenix", default="http://127.0.0.1:16006")
    parser.add_argument("--promtool", default="")
    parser.add_argument("--prometheus-config", default="", help="the test Prometheus configuration")
    parser.add_argument("--service", default="hicache-e2e", help="OTEL_SERVICE_NAME of the workload")
    args = parser.parse_args(argv)
    with open(args.truth, encoding="utf-8") as f:
        truth = json.load(f)
    res = Results()
    started = time.monotonic()
    prom = Prometheus(args.prometheus)
    check_counters(res, prom, truth, args.service)
    check_rules(res, prom, args.repo)
    check_dashboards(res, prom, args.repo)
    check_traces(res, args.phoenix.rstrip("/"), truth)
    check_promtool(res, args.promtool, args.prometheus_config, args.repo)
    check_docker(res, args.repo)
    if res.no_data:
        print("-- expressions that returned no data:")
        for item in res.no_data:
            print(f"   {item}")
    print(f"{res.passed} passed, {len(res.failed)} failed, {res.skipped} skipped "
          f"({time.monotonic() - started:.1f} s)")
    return 1 if res.failed else 0


if __name__ == "__main__":
    sys.exit(main())
