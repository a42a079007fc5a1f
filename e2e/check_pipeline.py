"""Checks for the real pipeline test (e2e/run.sh): the real OpenTelemetry Collector, Jaeger v2
and Prometheus 3 of deploy/local/stack.sh, started from the files docker-compose.yml mounts,
after the example workload and the SGLang CPU harness sent their spans and metrics to it.
Everything is read through the HTTP APIs the UIs use.

  (a) counters in Prometheus equal the ground truth exactly: the example workload's
      (--truth-json of examples/hicache_workload.py) and the SGLang harness' (merged ops,
      decode-retraction direct copies, and SGLang's own sglang:*_total counter deltas for
      the series docs/reference.md maps them to); rank labels on every SGLang series;
      nothing dropped or failed, and nothing undelivered by the SDK's self-metrics
      (otel_sdk_*);
  (b) every PromQL expression of the shipped rules (deploy/prometheus/rules/*.yml) and
      Grafana dashboards (deploy/grafana/dashboards/*.json) returns data; the rules are
      loaded and healthy, every recorded series exists (after the group interval);
  (c) every Prometheus series docs/reference.md documents exists with the documented
      labels (SKIP, with the reason, for those this run cannot produce), and every
      hicache_*/otel_hicache_* series Prometheus has is documented;
  (d) Jaeger (/api/services, /api/operations, /api/traces): one trace per example op, span
      counts and attribute sums equal the truth, documented attributes, the parent is the
      example.scheduler_step span, write-throughs and prefix hits link to their example.request
      span; the SGLang service's spans: merged ops + direct copies,
      with the rank attributes;
  (e) exemplars of hicache_transfer_duration_seconds_bucket open their trace in Jaeger, on
      the very span (span id) they name;
  (f) the Collector's own metrics (names from deploy/README.md, "The Collector's own
      metrics") exist under job="otel-collector-self" and agree with what was sent;
  (g) promtool: check config, check rules, test rules, on the shipped files;
  (h) the Docker deployment's structure: YAML parses, every pipeline component is defined,
      every port served to the host is published, only on 127.0.0.1, and the services
      reach each other on the ports the other side listens on.

Prints one PASS/FAIL/SKIP line per check and `N passed, N failed, N skipped`; exits 1 if any
check failed. Standard library, PyYAML and requests (both in the project's venv).
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
TIERS = {"offload": ("L1", "L2"), "onboard": ("L2", "L1")}  # (src, dst)
STEP_SPAN = "example.scheduler_step"
REQUEST_SPAN = "example.request"
RANK_LABELS = ("tp_rank", "pp_rank", "dp_rank")
WAIT_S = 30.0          # counters: the final export reaches Prometheus within a scrape or two
TRACE_WAIT_S = 90.0    # spans: Collector batch (1 s) + Jaeger batch, on 2 busy cores
COLLECTOR_WAIT_S = 30.0

# Series that only device-timed ops produce (docs/reference.md): on a CPU-only run (every op
# timed on the host clock) an expression over them has nothing to return, which is reported
# as SKIP rather than FAIL. Any other empty result fails.
DEVICE_ONLY = {
    "hicache_transfer_queue_wait_seconds":
        "hicache.transfer.queue_wait is recorded only for device_event ops with a wall-clock anchor",
}

# Series there only when a workload process had NVML (nvidia-ml-py) and a GPU: on a run where
# no process reported its link capacity, an expression over them is SKIP rather than FAIL.
NVML_ONLY = {
    "hicache_link_nominal_bandwidth_bytes_per_second":
        "hicache.link.nominal_bandwidth needs NVML (otel-hicache[nvml]) and a GPU",
    "hicache:link_efficiency:ratio_rate1m":
        "it divides by hicache.link.nominal_bandwidth, which needs NVML (otel-hicache[nvml]) and a GPU",
}

# The span attributes every transfer span carries, used when docs/reference.md's span
# attribute table cannot be read (it is read first: its rows "When present: always").
REQUIRED_SPAN_ATTRIBUTES = ("hicache.direction", "hicache.tokens", "hicache.bytes", "hicache.blocks",
                            "hicache.page_size", "hicache.timing_source")

# The Collector's own metrics to look for when deploy/README.md has no section
# "The Collector's own metrics" listing them (the list there wins when it exists).
COLLECTOR_METRICS_DEFAULT = (
    "otelcol_receiver_accepted_spans", "otelcol_receiver_accepted_metric_points",
    "otelcol_receiver_refused_spans", "otelcol_exporter_sent_spans",
    "otelcol_exporter_sent_metric_points", "otelcol_exporter_queue_size", "otelcol_process_uptime",
)
COLLECTOR_JOB = "otel-collector-self"

# SGLang's own counters (the keys of the SGLang truth's "sglang" dict) -> the otel-hicache
# series docs/reference.md maps each one to: (series, fixed labels, SGLang label -> label).
SGLANG_SERIES: dict[str, tuple[str, dict[str, str], dict[str, str]]] = {
    "sglang:hicache_backup_tokens_total": ("hicache_transfer_tokens_total",
                                           {"hicache_direction": "offload", "hicache_origin": "merged_op"},
                                           {"pool": "hicache_pool"}),
    "sglang:load_back_tokens_total": ("hicache_transfer_tokens_total",
                                      {"hicache_direction": "onboard", "hicache_origin": "merged_op"},
                                      {"pool": "hicache_pool"}),
    "sglang:hicache_backup_bytes_total": ("hicache_transfer_bytes_total",
                                          {"hicache_direction": "offload", "hicache_origin": "merged_op"}, {}),
    "sglang:load_back_bytes_total": ("hicache_transfer_bytes_total",
                                     {"hicache_direction": "onboard", "hicache_origin": "merged_op"}, {}),
    "sglang:evicted_tokens_total": ("hicache_evicted_tokens_total", {"hicache_tier": "device"}, {}),
    "sglang:hicache_dropped_tokens_total": ("hicache_dropped_tokens_total", {},
                                            {"reason": "reason", "pool": "hicache_pool"}),
    "sglang:cached_tokens_total": ("hicache_prefix_tokens_total", {}, {"cache_source": "hicache_tier"}),
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
        self.nvml = True  # any link capacity reported (NVML_ONLY); set in check_counters

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
        if ok and not result and not self.nvml:
            why = [why for metric, why in NVML_ONLY.items() if metric in expr]
            if why:
                self.no_data.append(f"{name} (expected without NVML: {why[0]}): {' '.join(expr.split())}")
                self.skip(name, f"no data, expected: no process reported its link capacity and {why[0]}; "
                                f"`{shown or expr}`")
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
def get_json(url: str, params: dict[str, Any] | None = None, timeout: float = 15.0) -> tuple[int, Any]:
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


def get_text(url: str, timeout: float = 15.0) -> tuple[int, str]:
    if requests is not None:
        try:
            r = requests.get(url, timeout=timeout)
            return r.status_code, r.text
        except requests.RequestException as exc:
            return 0, str(exc)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as exc:
        return 0, str(exc)


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

    def api(self, path: str, params: dict[str, Any] | None = None) -> tuple[bool, Any, str]:
        status, body = get_json(self.base + path, params)
        if isinstance(body, dict) and body.get("status") == "success":
            return True, body.get("data"), ""
        if isinstance(body, dict):
            return False, None, f"HTTP {status}: {body.get('errorType')}: {body.get('error')}"
        return False, None, f"HTTP {status}: {str(body)[:200]}"

    def query(self, expr: str) -> tuple[bool, list[dict[str, Any]], str]:
        """Instant query now -> (ok, result vector, error)."""
        ok, data, err = self.api("/api/v1/query", {"query": expr})
        if not ok:
            return False, [], err
        result = data["result"]
        if data.get("resultType") == "scalar":
            result = [{"metric": {}, "value": result}]
        return True, result, ""

    def by_labels(self, expr: str, labels: Iterable[str]) -> dict[tuple[str, ...], float]:
        ok, result, _ = self.query(expr)
        labels = tuple(labels)
        return {tuple(s["metric"].get(k, "") for k in labels): float(s["value"][1]) for s in result} if ok else {}

    def names(self) -> list[str]:
        ok, data, _ = self.api("/api/v1/label/__name__/values")
        return list(data or []) if ok else []


def describe(result: list[dict[str, Any]]) -> str:
    values = [float(s["value"][1]) for s in result]
    nan = sum(1 for v in values if math.isnan(v))
    return f"{len(result)} series" + (f" ({nan} NaN)" if nan else "")


def _fmt(v: float) -> str:
    return f"{v:.0f}" if float(v).is_integer() else f"{v:g}"


# --------------------------------------------------------------------------------------
# markdown helpers (docs/reference.md, deploy/README.md)
# --------------------------------------------------------------------------------------
def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return ""


def _section(doc: str, heading: str) -> str:
    """The text under the heading line `heading` up to the next heading of its level or above
    ('' when there is no such heading)."""
    lines = doc.splitlines()
    if heading not in lines:
        return ""
    start = lines.index(heading) + 1
    level = len(heading) - len(heading.lstrip("#"))
    end, fenced = len(lines), False
    for i in range(start, len(lines)):
        if lines[i].lstrip().startswith("```"):
            fenced = not fenced  # a `# comment` in a code block is no heading
        elif not fenced and re.match(r"#{1,%d} " % level, lines[i]):
            end = i
            break
    return "\n".join(lines[start:end])


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _row(section: str, field: str) -> str:
    for line in section.splitlines():
        cells = _cells(line)
        if line.lstrip().startswith("|") and len(cells) >= 2 and cells[0] == field:
            return cells[1]
    return ""


def _ticked(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


def documented_series(reference: str) -> dict[str, dict[str, Any]]:
    """Prometheus series name -> {metric, labels} from the metric sections of
    docs/reference.md (`### \\`otel.name\\`` with "Prometheus" and "Labels" rows). Labels are
    those the row names before "plus the static ones" (static ones are the service's own)."""
    out: dict[str, dict[str, Any]] = {}
    metrics_part = _section(reference, "## 2. Metrics") or reference
    for heading in re.findall(r"^### `[^`]+`$", metrics_part, flags=re.M):
        section = _section(metrics_part, heading)
        prom = _row(section, "Prometheus")
        if not prom:
            continue
        labels_cell = _row(section, "Labels")
        own = re.split(r"plus the static|the static ones", labels_cell)[0]
        labels = set(_ticked(own))
        for name in _ticked(prom):
            if re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", name):
                out[name] = {"metric": heading[5:-1], "labels": labels}
    return out


def always_span_attributes(reference: str) -> list[str]:
    """The span attributes docs/reference.md's span attribute table marks "always"."""
    table = _section(reference, "### Span attributes")
    found = []
    for line in table.splitlines():
        cells = _cells(line)
        if line.lstrip().startswith("|") and len(cells) >= 3 and cells[2].startswith("always"):
            names = _ticked(cells[0])
            if names and not cells[0].startswith("*"):
                found.append(names[0])
    return found


def collector_metric_names(readme: str) -> tuple[list[str], list[str], str]:
    """(listed names, names the section mentions outside its list, where from) from the section
    "The Collector's own metrics" of deploy/README.md; the built-in default without it."""
    heading = next((line for line in readme.splitlines()
                    if re.match(r"#+ +The Collector(?:'|\u2019)s own metrics\s*$", line)), None)
    if heading is None:
        return list(COLLECTOR_METRICS_DEFAULT), [], "built-in list (deploy/README.md has no section " \
                                                    "\"The Collector's own metrics\")"
    listed, prose = [], []
    for line in _section(readme, heading).splitlines():
        names = [n for n in _ticked(line) if re.fullmatch(r"otelcol_\w+", n)]
        is_list = re.match(r"\s*(\||[-*+] |\d+\. )", line) is not None
        for n in names:
            target = listed if is_list else prose
            if n not in target:
                target.append(n)
    return listed, [n for n in prose if n not in listed], f"deploy/README.md, section \"{heading.lstrip('# ')}\""


# --------------------------------------------------------------------------------------
# (a) counters vs ground truth
# --------------------------------------------------------------------------------------
Want = dict[tuple[str, ...], float]


def compare_counters(res: Results, prom: Prometheus, checks: list[tuple[str, str, tuple[str, ...], Want]],
                     timeout: float = WAIT_S) -> float:
    """Poll until every expression returns exactly what its check wants (bounded), then report
    one line per check. A key missing on one side counts as 0. Returns the seconds polled."""
    state: dict[str, dict[tuple[str, ...], float]] = {}

    def matches(name: str, expr: str, labels: tuple[str, ...], want: Want) -> bool:
        got = prom.by_labels(expr, labels)
        state[name] = got
        return bool(got) and all(got.get(k, 0.0) == want.get(k, 0) for k in set(want) | set(got))

    started = time.monotonic()
    wait_until(lambda: all([matches(*c) for c in checks]), timeout, 0.5)
    for name, expr, labels, want in checks:
        got = state.get(name, {})
        keys = sorted(set(want) | set(got))
        ok = bool(got) and all(got.get(k, 0.0) == want.get(k, 0) for k in keys)
        shown = ", ".join(f"{'/'.join(k) or 'total'}={_fmt(got.get(k, 0))}"
                          + ("" if got.get(k, 0) == want.get(k, 0) else f" (want {_fmt(want.get(k, 0))})")
                          for k in keys)
        res.check(f"{name} == truth", ok, f"{shown or 'no data'}; `{expr}`")
    return time.monotonic() - started


def check_counters(res: Results, prom: Prometheus, truth: dict[str, Any], service: str) -> None:
    res.section(f"(a) counters in Prometheus vs the example workload's ground truth (service {service})")
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
        ("bytes per direction and cause",
         f"sum by (hicache_direction, hicache_cause) (hicache_transfer_bytes_total{sel})",
         ("hicache_direction", "hicache_cause"),
         {(d, c): n for d, t in truth.items() for c, n in t.get("bytes_by_cause", {}).items()}),
    ]
    if all("host_bytes" in t for t in truth.values()):  # host residence (the example turns it on)
        checks += [
            ("host bytes reloaded by load-backs", f"sum(hicache_host_reloaded_bytes_total{sel})", (),
             {(): truth["onboard"]["host_bytes"]}),
            ("host bytes wasted (overwritten before any load-back)", f"sum(hicache_host_wasted_bytes_total{sel})",
             (), {(): truth["offload"]["host_bytes"]}),
            ("host residence values (load-back x writing offload)",
             f"sum(hicache_host_residence_time_seconds_count{sel})", (), {(): truth["onboard"]["residence_count"]}),
        ]
    waited = compare_counters(res, prom, checks)
    print(f"   (polled {waited:.1f} s for the final values)")
    device = prom.by_labels(f'sum(hicache_transfer_duration_seconds_count{{service_name="{service}",'
                            f'hicache_timing_source="device_event"}})', ())
    res.device_timed = any(v > 0 for v in device.values())
    res.nvml = bool(prom.by_labels("count(hicache_link_nominal_bandwidth_bytes_per_second)", ()))
    print(f"   (link capacity from NVML in this run: {'yes' if res.nvml else 'no'})")
    print(f"   (device-timed ops in this run: {'yes' if res.device_timed else 'no, host clock only'})")
    # a rate needs two exports of the run: the link throughput must be a number, not just a series
    expr = (f"max_over_time((sum by (hicache_direction) (rate(hicache_transfer_bytes_total{sel}[1m]))"
            f" / sum by (hicache_direction) (rate(hicache_transfer_busy_time_seconds_total{sel}[1m])))[3m:1s])")
    got = prom.by_labels(expr, ("hicache_direction",))
    ok = set(got) == {(d,) for d, t in truth.items() if t["ops"]} and all(
        math.isfinite(v) and v > 0 for v in got.values())
    res.check("link throughput (rate bytes / rate busy time) is a positive number per direction", ok,
              ", ".join(f"{k[0]}={v / 1e9:.2f} GB/s" for k, v in sorted(got.items())) + f"; `{expr}`")
    check_no_loss(res, prom, service)


# The SDK's own self-metrics (OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED=true, set by e2e/run.sh):
# what the exporters delivered, and what was lost on the way out. A series with an error_type
# appears only with the first loss, so "lost" is absent or 0; "delivered" must be there.
SDK_DELIVERED = {
    "spans exported": 'otel_sdk_exporter_span_exported_total{{{sel}, error_type=""}}',
    "metric data points exported": 'otel_sdk_exporter_metric_data_point_exported_total{{{sel}, error_type=""}}',
}
SDK_LOST = {
    "spans lost in failed exports": 'otel_sdk_exporter_span_exported_total{{{sel}, error_type!=""}}',
    "spans the span processor dropped (queue_full, already_shutdown)":
        'otel_sdk_processor_span_processed_total{{{sel}, error_type!=""}}',
    "metric data points lost in failed exports":
        'otel_sdk_exporter_metric_data_point_exported_total{{{sel}, error_type!=""}}',
}


def check_no_loss(res: Results, prom: Prometheus, service: str) -> None:
    """otel-hicache's own loss counters are all zero (and exist: zero series from start-up), and
    the SDK's self-metrics show spans and metric points delivered and none lost."""
    names = ("otel_hicache_records_dropped_total", "otel_hicache_records_failed_total")
    expr = f'sum by (__name__) ({{__name__=~"{"|".join(names)}", service_name="{service}"}})'
    got = {k[0]: v for k, v in prom.by_labels(expr, ("__name__",)).items()}
    ok = set(got) == set(names) and all(v == 0 for v in got.values())
    res.check(f"nothing dropped or failed ({service})", ok,
              ", ".join(f"{n}={_fmt(got[n])}" if n in got else f"{n} missing" for n in names))
    sel = f'service_name="{service}"'
    delivered = {what: prom.by_labels(f"sum({q.format(sel=sel)})", ()).get((), 0.0)
                 for what, q in SDK_DELIVERED.items()}
    lost = {what: prom.by_labels(f"sum({q.format(sel=sel)})", ()).get((), 0.0) for what, q in SDK_LOST.items()}
    ok = all(v > 0 for v in delivered.values()) and all(v == 0 for v in lost.values())
    res.check(f"nothing undelivered, by the SDK's self-metrics ({service})", ok,
              ", ".join(f"{what} {_fmt(v)}" for what, v in {**delivered, **lost}.items())
              + ("" if all(delivered.values()) else
                 " (no otel_sdk_* series: OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED=true for the workload?)"))


def _direct_want(st: dict[str, Any], key: str) -> tuple[tuple[str, ...], Want]:
    """Direct copies of the SGLang truth, per direction when it has them, else in total."""
    direct = st.get("direct") or {}
    if all(isinstance(direct.get(d), dict) for d in DIRECTIONS):
        return ("hicache_direction",), {(d,): direct[d][key] for d in DIRECTIONS}
    return (), {(): direct.get(key, 0)}


def _parse_sglang_key(key: str) -> tuple[str, dict[str, str]]:
    """'sglang:x_total{"pool": "kv"}' -> ('sglang:x_total', {'pool': 'kv'})."""
    i = key.find("{")
    if i < 0:
        return key, {}
    try:
        return key[:i], {str(k): str(v) for k, v in json.loads(key[i:]).items()}
    except ValueError:
        return key[:i], {}


def sglang_mapping_rows(reference: str) -> list[tuple[str, str]]:
    """(otel-hicache cell, SGLang cell) of the mapping table in docs/reference.md."""
    rows = []
    for line in reference.splitlines():
        cells = _cells(line)
        if line.lstrip().startswith("|") and len(cells) == 3 and "sglang:" in cells[2]:
            rows.append((cells[0], cells[2]))
    return rows


def check_sglang_counters(res: Results, prom: Prometheus, st: dict[str, Any], service: str,
                          reference: str) -> None:
    res.section(f"(a) counters in Prometheus vs the SGLang harness' ground truth (service {service})")
    sel = f'service_name="{service}"'
    merged = f'{sel}, hicache_origin="merged_op"'
    direct = f'{sel}, hicache_origin="direct"'
    by_dir = ("hicache_direction",)
    d_labels, d_ops = _direct_want(st, "ops")
    _, d_tokens = _direct_want(st, "tokens")
    d_by = f"sum by ({', '.join(d_labels)})" if d_labels else "sum"
    checks = [
        ("merged-op bytes per direction",
         f"sum by (hicache_direction) (hicache_transfer_bytes_total{{{merged}}})",
         by_dir, {(d,): st[d]["bytes"] for d in DIRECTIONS}),
        ("merged-op kv tokens per direction",
         f'sum by (hicache_direction) (hicache_transfer_tokens_total{{{merged}, hicache_pool="kv"}})',
         by_dir, {(d,): st[d]["tokens"] for d in DIRECTIONS}),
        ("merged ops per direction (duration histogram count)",
         f"sum by (hicache_direction) (hicache_transfer_duration_seconds_count{{{merged}}})",
         by_dir, {(d,): st[d]["ops"] for d in DIRECTIONS}),
        ("direct copies (decode retraction, duration histogram count)",
         f"{d_by} (hicache_transfer_duration_seconds_count{{{direct}}})", d_labels, d_ops),
        ("direct-copy kv tokens",
         f'{d_by} (hicache_transfer_tokens_total{{{direct}, hicache_pool="kv"}})', d_labels, d_tokens),
    ]
    compare_counters(res, prom, checks)

    # SGLang's own counters: the otel-hicache series docs/reference.md maps each one to
    rows = sglang_mapping_rows(reference)
    own = st.get("sglang") or {}
    if not own:
        res.skip("otel-hicache counters == SGLang's own counters", "the SGLang truth has no sglang:* deltas")
    mapped: list[tuple[str, str, tuple[str, ...], Want]] = []
    for key, value in sorted(own.items()):
        name, labels = _parse_sglang_key(key)
        documented = [(o, s) for o, s in rows if any(t.split("{")[0] == name for t in _ticked(s))]
        if name not in SGLANG_SERIES:
            if documented:
                res.check(f"{key}: mapped to an otel-hicache series", False,
                          f"docs/reference.md maps it ({documented[0][0]}) but this checker does not know how")
            else:
                res.skip(f"{key} == otel-hicache", f"SGLang counter ({_fmt(value)}) with no otel-hicache "
                                                   "counterpart in docs/reference.md's mapping table")
            continue
        series, fixed, renames = SGLANG_SERIES[name]
        doc_ok = any(series in o and all(f'"{v}"' in o for v in fixed.values()) for o, _ in documented)
        if not res.check(f"{key}: docs/reference.md maps it to {series}"
                         f"{{{', '.join(f'{k}={v!r}' for k, v in fixed.items())}}}", doc_ok,
                         "; ".join(f"{o} <- {s}" for o, s in documented) or "no row names it"):
            continue
        matchers = [sel] + [f'{k}="{v}"' for k, v in fixed.items()]
        unknown = [k for k in labels if k not in renames]
        matchers += [f'{renames[k]}="{v}"' for k, v in labels.items() if k in renames]
        if unknown:
            res.check(f"{key}: labels translate", False, f"no otel-hicache label for {unknown}")
            continue
        mapped.append((f"{series}{{{', '.join(matchers[1:])}}} == SGLang's {key}",
                       f"sum({series}{{{', '.join(matchers)}}})", (), {(): value}))
    if mapped:
        compare_counters(res, prom, mapped)

    # rank labels on every series of the SGLang service
    ok, result, err = prom.query(f'{{__name__=~"hicache_.+|otel_hicache_.+", {sel}}}')
    lacking = sorted({s["metric"].get("__name__", "?") for s in result
                      if any(s["metric"].get(r, "") == "" for r in RANK_LABELS)})
    res.check(f"every series of {service} carries {', '.join(RANK_LABELS)}", ok and bool(result) and not lacking,
              err or (f"without: {lacking}" if lacking else f"{len(result)} series"))
    check_no_loss(res, prom, service)


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
    for num, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w|y)", str(text or "")):
        total += float(num) * {"ms": 1e-3, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800,
                               "y": 31536000}[unit]
    return total


def _global_evaluation_interval(repo: str) -> float:
    """The shipped prometheus.yml's global evaluation_interval (Prometheus' default: 1m)."""
    try:
        with open(os.path.join(repo, "deploy/prometheus/prometheus.yml"), encoding="utf-8") as f:
            cfg = yaml.safe_load(f) or {}
        return _duration_s((cfg.get("global") or {}).get("evaluation_interval")) or 60.0
    except (OSError, yaml.YAMLError, AttributeError):
        return 60.0


def check_rules(res: Results, prom: Prometheus, repo: str) -> None:
    res.section("(b) PromQL of the shipped Prometheus rules")
    files = rule_files(repo)
    if not files:
        print("   no rule files under deploy/prometheus/rules/: nothing to check")
        return
    if yaml is None:
        res.check("rule files parse", False, "PyYAML is not installed in this interpreter")
        return
    default_interval = _global_evaluation_interval(repo)
    records = []  # (name, selector, group interval)
    names_in_files: list[tuple[str, str]] = []  # (group, rule name)
    for path in files:
        rel = os.path.relpath(path, repo)
        try:
            with open(path, encoding="utf-8") as f:
                doc = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError) as exc:
            res.check(f"{rel} parses", False, str(exc))
            continue
        for group in doc.get("groups") or []:
            interval = _duration_s(group.get("interval")) or default_interval
            for rule in group.get("rules") or []:
                expr = str(rule.get("expr", "")).strip()
                one_line = " ".join(expr.split())
                names_in_files.append((group.get("name", "?"), rule.get("record") or rule.get("alert") or "?"))
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

    # the running Prometheus loaded exactly these rules, and evaluates them without error
    max_interval = max([r[2] for r in records] + [default_interval])

    def loaded() -> tuple[bool, Any, str]:
        ok, data, err = prom.api("/api/v1/rules")
        return ok, data, err

    def all_evaluated() -> bool:
        ok, data, _ = loaded()
        rules = [r for g in (data or {}).get("groups") or [] for r in g.get("rules") or []]
        return ok and bool(rules) and all(r.get("health") == "ok" for r in rules)

    wait_until(all_evaluated, max_interval + 10, 1.0)
    ok, data, err = loaded()
    got = [(g.get("name"), r.get("name"), r.get("health"), r.get("lastError", ""))
           for g in (data or {}).get("groups") or [] for r in g.get("rules") or []]
    res.check("Prometheus loaded every rule of the shipped files (/api/v1/rules)",
              ok and sorted((g, n) for g, n, _, _ in got) == sorted(names_in_files),
              err or (f"{len(got)} rules in {len({g for g, *_ in got})} groups" if sorted(
                  (g, n) for g, n, _, _ in got) == sorted(names_in_files) else
                  f"loaded {sorted((g, n) for g, n, _, _ in got)}, files {sorted(names_in_files)}"))
    unhealthy = [f"{n}: {h} {e}".strip() for _, n, h, e in got if h != "ok"]
    res.check("every loaded rule evaluates with health ok", ok and bool(got) and not unhealthy,
              err or (f"{unhealthy}" if unhealthy else f"{len(got)} ok"))

    # recorded series: the group interval (15 s in the shipped file) passes before the
    # first evaluation that sees the workloads' data
    if records:
        timeout = max(WAIT_S, 2 * max_interval + 10)
        started = time.monotonic()
        found: dict[str, list] = {}

        def all_recorded() -> bool:
            for name, sel, _ in records:
                if not found.get(name):
                    q_ok, result, _ = prom.query(sel)
                    found[name] = result if q_ok else []
            # without NVML the link efficiency is never recorded: not waited for
            return all(found[name] for name, _, _ in records if res.nvml or name not in NVML_ONLY)

        wait_until(all_recorded, timeout, 1.0)
        waited = time.monotonic() - started
        for name, sel, _ in records:
            res.check_data(f"recorded series {sel} exists", sel, True, found.get(name) or [], "")
        print(f"   (recorded series checked after {waited:.1f} s, group interval {max_interval:.0f} s)")


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
# (c) documented series exist as documented
# --------------------------------------------------------------------------------------
def _promql_regex_escape(text: str) -> str:
    """A literal for a PromQL regex matcher in a double-quoted string (RE2: no escaped '-')."""
    return re.sub(r"([.^$*+?{}\[\]\\|()])", r"\\\\\1", text)


def check_documented_series(res: Results, prom: Prometheus, repo: str, services: list[str]) -> None:
    res.section("(c) the series docs/reference.md documents exist in Prometheus, with their labels")
    reference = _read(os.path.join(repo, "docs/reference.md"))
    documented = documented_series(reference)
    if not res.check("docs/reference.md lists Prometheus series with labels", bool(documented),
                     f"{len(documented)} series of {len({v['metric'] for v in documented.values()})} metrics"
                     if documented else "no metric section with a 'Prometheus' row found"):
        return
    sel = f'service_name=~"{"|".join(_promql_regex_escape(s) for s in services)}"'
    # static attributes of each service: the labels every otel-hicache series of it carries
    ok, everything, err = prom.query(f'{{__name__=~"hicache_.+|otel_hicache_.+", {sel}}}')
    if not res.check("otel-hicache series of the workloads readable", ok and bool(everything),
                     err or f"{len(everything)} series"):
        return
    common: dict[str, set[str]] = {}
    for s in everything:
        svc = s["metric"].get("service_name", "")
        keys = set(s["metric"]) - {"__name__"}
        common[svc] = common[svc] & keys if svc in common else keys
    print("   (labels on every series, i.e. resource and static attributes: "
          + "; ".join(f"{svc}: {', '.join(sorted(k))}" for svc, k in sorted(common.items())) + ")")
    by_name: dict[str, list[dict[str, str]]] = {}
    for s in everything:
        by_name.setdefault(s["metric"]["__name__"], []).append(s["metric"])

    for name, spec in sorted(documented.items()):
        series = by_name.get(name, [])
        want = set(spec["labels"]) | ({"le"} if name.endswith("_bucket") else set())
        if not series:
            why = next((why for base, why in DEVICE_ONLY.items() if name.startswith(base)), None)
            nvml_why = NVML_ONLY.get(name)
            if why and not res.device_timed:
                res.skip(f"{name} exists", f"expected absent: no device-timed op in this run and {why}")
            elif nvml_why and not res.nvml:
                res.skip(f"{name} exists", f"expected absent: no process reported its link capacity and {nvml_why}")
            else:
                res.check(f"{name} exists", False, f"documented for `{spec['metric']}`, no series of "
                                                   f"{', '.join(services)} in Prometheus (`{name}{{{sel}}}`)")
            continue
        missing, extra = set(), set()
        for labels in series:
            keys = set(labels) - {"__name__"}
            missing |= want - keys
            extra |= keys - want - common.get(labels.get("service_name", ""), set())
        svcs = sorted({s.get("service_name", "") for s in series})
        res.check(f"{name} exists with labels {', '.join(sorted(want)) or '(static ones only)'}",
                  not missing and not extra,
                  (f"missing {sorted(missing)} " if missing else "")
                  + (f"undocumented {sorted(extra)} " if extra else "")
                  + f"({len(series)} series of {', '.join(svcs)})")

    # the reverse: everything Prometheus has under these prefixes is documented
    names = [n for n in prom.names() if re.match(r"(hicache|otel_hicache)_", n)]
    undocumented = sorted(set(names) - set(documented))
    res.check("every hicache_*/otel_hicache_* series name in Prometheus is documented",
              bool(names) and not undocumented,
              f"undocumented: {undocumented}" if undocumented else f"{len(names)} names, all in docs/reference.md")


# --------------------------------------------------------------------------------------
# (d) Jaeger
# --------------------------------------------------------------------------------------
class Jaeger:
    def __init__(self, base: str, start_us: int) -> None:
        self.base = base.rstrip("/")
        self.start_us = start_us

    def api(self, path: str, params: dict[str, Any] | None = None) -> tuple[Any, str]:
        status, body = get_json(self.base + path, params, timeout=60)
        if status == 200 and isinstance(body, dict) and not body.get("errors"):
            return body.get("data"), ""
        return None, f"HTTP {status}: {str(body)[:300]}"

    def traces(self, service: str, operation: str | None, limit: int) -> tuple[list[dict[str, Any]], str]:
        """The search the UI runs: traces of a service (holding an operation), newest first."""
        params = {"service": service, "limit": limit, "start": self.start_us,
                  "end": int((time.time() + 60) * 1e6)}
        if operation:
            params["operation"] = operation
        data, err = self.api("/api/traces", params)
        return (data or []), err

    def trace(self, trace_id: str) -> tuple[dict[str, Any] | None, str]:
        data, err = self.api(f"/api/traces/{trace_id}")
        return (data[0] if data else None), err or ("" if data else "no trace")


def _tags(span: dict[str, Any]) -> dict[str, Any]:
    return {t.get("key"): t.get("value") for t in span.get("tags") or []}


def _spans(traces: list[dict[str, Any]], operation: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(trace, span) of every span named `operation`, once each."""
    seen, out = set(), []
    for tr in traces:
        for span in tr.get("spans") or []:
            key = (span.get("traceID"), span.get("spanID"))
            if span.get("operationName") == operation and key not in seen:
                seen.add(key)
                out.append((tr, span))
    return out


def _service_of(trace: dict[str, Any], span: dict[str, Any]) -> str:
    return ((trace.get("processes") or {}).get(span.get("processID")) or {}).get("serviceName", "")


def fetch_transfer_spans(jaeger: Jaeger, service: str, want: dict[str, int]
                         ) -> tuple[dict[str, list[tuple[dict, dict]]], dict[str, str], float]:
    """Poll Jaeger (bounded) until each direction has at least `want` spans; the limit is
    well above the expected count, so a surplus shows too."""
    state: dict[str, Any] = {"spans": {}, "errors": {}}

    def complete() -> bool:
        for d in DIRECTIONS:
            limit = 2 * want.get(d, 0) + 100
            traces, err = jaeger.traces(service, SPAN_NAMES[d], limit)
            state["spans"][d] = _spans(traces, SPAN_NAMES[d])
            state["errors"][d] = err or (f"search limit {limit} reached" if len(traces) >= limit else "")
        return all(len(state["spans"][d]) >= want.get(d, 0) and not state["errors"][d] for d in DIRECTIONS)

    started = time.monotonic()
    wait_until(complete, TRACE_WAIT_S, 2.0)
    return state["spans"], state["errors"], time.monotonic() - started


def check_jaeger(res: Results, jaeger: Jaeger, truth: dict[str, Any], st: dict[str, Any] | None,
                 service: str, sglang_service: str, repo: str) -> None:
    res.section("(d) traces in Jaeger, through the API its UI uses")
    services = [service] + ([sglang_service] if st is not None else [])
    data = wait_until(lambda: set(services) <= set(jaeger.api("/api/services")[0] or []), TRACE_WAIT_S, 2.0)
    listed, err = jaeger.api("/api/services")
    res.check(f"/api/services lists {', '.join(services)}", bool(data), err or f"{sorted(listed or [])}")
    for svc, ops in ((service, (SPAN_NAMES["offload"], SPAN_NAMES["onboard"], STEP_SPAN)),
                     (sglang_service, (SPAN_NAMES["offload"], SPAN_NAMES["onboard"]))):
        if svc not in services:
            continue
        got, err = jaeger.api("/api/operations", {"service": svc})
        kinds = {o.get("name"): o.get("spanKind") for o in got or []}
        missing = [o for o in ops if o not in kinds]
        wrong_kind = [f"{o}: {kinds[o]}" for o in ops if o in kinds and o.startswith("hicache.")
                      and kinds[o] != "internal"]
        res.check(f"/api/operations?service={svc} has {', '.join(ops)} (hicache.* of kind internal)",
                  not err and not missing and not wrong_kind,
                  err or (f"missing {missing}" if missing else "") + (f" kind {wrong_kind}" if wrong_kind else "")
                  or ", ".join(f"{k} ({v})" for k, v in sorted(kinds.items())))

    reference = _read(os.path.join(repo, "docs/reference.md"))
    required = always_span_attributes(reference) or list(REQUIRED_SPAN_ATTRIBUTES)
    print(f"   (attributes every transfer span must carry: {', '.join(required)} and tp_rank)")
    check_example_traces(res, jaeger, truth, service, required + ["tp_rank"])
    if st is not None:
        check_sglang_traces(res, jaeger, st, sglang_service, required + list(RANK_LABELS))
        check_request_links(res, jaeger, st, sglang_service)


def check_request_links(res: Results, jaeger: Jaeger, st: dict[str, Any], service: str) -> None:
    """docs/sglang.md "Links to requests", both ways, as a user does it in the Jaeger UI: the
    tag search for a request's trace id finds its transfer, and the transfer's reference
    opens the request's trace (SGLang's own root span, exported by SGLang's provider)."""
    requests = st.get("requests")
    if not requests:
        res.skip("transfers linked to SGLang's traced requests", "the SGLang truth has no traced requests")
        return
    problems: list[str] = []
    for want in requests:
        tid = want["trace_id"]
        state: dict[str, Any] = {}

        def search() -> bool:
            params = {"service": service, "tags": json.dumps({"hicache.request.trace_id": tid}), "limit": 20,
                      "start": jaeger.start_us, "end": int((time.time() + 60) * 1e6)}
            data, state["err"] = jaeger.api("/api/traces", params)
            state["spans"] = [s for tr in data or [] for s in tr.get("spans") or []
                              if s.get("operationName", "").startswith("hicache.")]
            return bool(state["spans"])

        wait_until(search, TRACE_WAIT_S, 2.0)
        spans = state.get("spans") or []
        causes = [_tags(s).get("hicache.cause") for s in spans]
        if causes != [want["cause"]]:
            problems.append(f"hicache.request.trace_id={tid}: found causes {causes} (want [{want['cause']!r}])"
                            + (f"; {state.get('err')}" if state.get("err") else ""))
            continue
        refs = [(r.get("traceID"), r.get("spanID")) for r in spans[0].get("references") or []]
        if (tid, want["span_id"]) not in refs:
            problems.append(f"{want['cause']} span of request {tid}: references {refs} lack the request's root span")
            continue
        tr, err = jaeger.trace(tid)
        processes = (tr or {}).get("processes") or {}
        root = next((s for s in (tr or {}).get("spans") or [] if s.get("spanID") == want["span_id"]), None)
        service_of_root = (processes.get(root.get("processID")) or {}).get("serviceName") if root else None
        if service_of_root != want["service"]:
            problems.append(f"request trace {tid}: root span {want['span_id']} "
                            f"{'from ' + str(service_of_root) if root else 'not found'} ({err or 'ok'})")
    res.check(f"{service}: each traced request's tag search finds its transfer, whose link opens the request's "
              f"trace ({requests[0]['service']})", not problems,
              "; ".join(problems[:3]) or f"{len(requests)} requests: "
              + ", ".join(sorted({r['cause'] for r in requests})))


def _span_problems(d: str, tags: dict[str, Any]) -> list[str]:
    problems = []
    try:
        tokens, blocks, page = int(tags["hicache.tokens"]), int(tags["hicache.blocks"]), int(tags["hicache.page_size"])
    except (KeyError, TypeError, ValueError):
        return ["tokens/blocks/page_size not integers"]
    if tags.get("hicache.direction") != d:
        problems.append(f"direction {tags.get('hicache.direction')}")
    if page <= 0 or blocks != -(-tokens // page):
        problems.append(f"blocks {blocks} != ceil({tokens}/{page})")
    if tags.get("hicache.timing_source") not in ("device_event", "host_clock"):
        problems.append(f"timing_source {tags.get('hicache.timing_source')}")
    if "hicache.src_tier" in tags and (tags.get("hicache.src_tier"), tags.get("hicache.dst_tier")) != TIERS[d]:
        problems.append(f"tiers {tags.get('hicache.src_tier')}->{tags.get('hicache.dst_tier')}")
    if tags.get("hicache.origin", "merged_op") not in ("merged_op", "direct"):
        problems.append(f"origin {tags.get('hicache.origin')}")
    if str(tags.get("tp_rank")) != "0":
        problems.append(f"tp_rank {tags.get('tp_rank')}")
    if int(tags.get("hicache.bytes", 0)) <= 0:
        problems.append(f"bytes {tags.get('hicache.bytes')}")
    if tags.get("span.kind", "internal") != "internal":
        problems.append(f"kind {tags.get('span.kind')}")
    if "hicache.pool.tokens" in tags:  # the anchor pool is the first one
        try:
            pools = json.loads(tags["hicache.pool.tokens"]) if isinstance(tags["hicache.pool.tokens"], str) \
                else tags["hicache.pool.tokens"]
            if pools and int(pools[0]) != tokens:
                problems.append(f"tokens {tokens} != anchor pool {pools[0]}")
        except (ValueError, TypeError, IndexError):
            problems.append(f"pool.tokens {tags['hicache.pool.tokens']!r}")
    return problems


def _attribute_checks(res: Results, spans: list[tuple[str, dict, dict]], required: list[str], what: str) -> None:
    missing, inconsistent, sources = [], [], {}
    for d, _, span in spans:
        tags = _tags(span)
        absent = [k for k in required if k not in tags]
        if absent:
            missing.append(f"{span.get('spanID')}: {', '.join(absent)}")
            continue
        problems = _span_problems(d, tags)
        if problems:
            inconsistent.append(f"{span.get('spanID')}: {'; '.join(problems)}")
        sources[tags["hicache.timing_source"]] = sources.get(tags["hicache.timing_source"], 0) + 1
    res.check(f"{what}: every transfer span has the documented attributes", not missing and bool(spans),
              f"{len(missing)} without: {missing[:3]}" if missing else f"{len(spans)} spans")
    res.check(f"{what}: attributes consistent (direction, tiers, blocks == ceil(tokens/page_size), "
              "anchor-pool tokens, timing_source, tp_rank, kind)", not inconsistent and bool(spans),
              f"{len(inconsistent)} inconsistent: {inconsistent[:3]}" if inconsistent
              else "timing_source " + ", ".join(f"{k}={v}" for k, v in sorted(sources.items())))


def check_residence_links(res: Results, found: dict[str, list], residence_count: int, service: str,
                          requests_linked: bool) -> None:
    """A load-back's links (Jaeger references FOLLOWS_FROM) go to the offload spans that wrote
    its pages: one per load-back x writing offload (at most 12 writers per op here, under the
    16 linked), each an exported hicache.offload span of the run. Jaeger's references carry
    no link attributes: with ``requests_linked``, a link to anything else is a link to a
    request (checked by :func:`check_example_request_links`), else it is dangling."""
    offloads = {(s.get("traceID"), s.get("spanID")) for _, s in found.get("offload", [])}
    refs = [(r.get("traceID"), r.get("spanID")) for _, s in found.get("onboard", [])
            for r in s.get("references") or [] if r.get("refType") == "FOLLOWS_FROM"]
    to_offloads = [r for r in refs if r in offloads]
    dangling = 0 if requests_linked else len(refs) - len(to_offloads)
    res.check(f"{service}: load-backs link to the offload spans that wrote their pages (one per residence value)",
              len(to_offloads) == residence_count and not dangling,
              f"{len(to_offloads)} links to exported offload spans (want {residence_count})"
              + (f", {dangling} to no exported offload span" if dangling else ""))


def check_example_request_links(res: Results, jaeger: Jaeger, found: dict[str, list], truth: dict[str, Any],
                                service: str) -> None:
    """Each write-through and prefix hit of the example links (FOLLOWS_FROM) to the
    ``example.request`` span it served, the root of a trace of its own; a load-back's other
    links go to the run's offload spans. Counted per direction against the truth, and every
    link opened in Jaeger: its span must be an ``example.request`` root."""
    offloads = {(s.get("traceID"), s.get("spanID")) for _, s in found.get("offload", [])}
    got, targets = {}, []
    for d in DIRECTIONS:
        linked = 0
        for _, s in found.get(d, []):
            to = [(r.get("traceID"), r.get("spanID")) for r in s.get("references") or []
                  if r.get("refType") == "FOLLOWS_FROM" and (r.get("traceID"), r.get("spanID")) not in offloads]
            linked += bool(to)
            targets += to
        got[d] = linked
    want = {d: truth[d].get("request_links", 0) for d in DIRECTIONS if d in truth}
    wrong = []
    for trace_id, span_id in targets:
        tr, err = jaeger.trace(trace_id)
        span = next((x for x in (tr or {}).get("spans") or [] if x.get("spanID") == span_id), None)
        if span is None or span.get("operationName") != REQUEST_SPAN or span.get("references"):
            wrong.append(f"{trace_id}/{span_id}: {span.get('operationName') if span else err or 'not found'}")
    res.check(f"{service}: write-throughs and prefix hits link to the {REQUEST_SPAN} span each served (a root)",
              got == want and bool(targets) and not wrong,
              f"{got} spans with a link to a request (want {want}); {len(targets) - len(wrong)} of {len(targets)} "
              f"links open an {REQUEST_SPAN} root" + (f"; {wrong[:3]}" if wrong else ""))


def check_example_traces(res: Results, jaeger: Jaeger, truth: dict[str, Any], service: str,
                         required: list[str]) -> None:
    want = {d: truth[d]["ops"] for d in DIRECTIONS if d in truth}
    found, errors, waited = fetch_transfer_spans(jaeger, service, want)
    print(f"   ({service}: searched for {waited:.1f} s)")
    for d, n in want.items():
        got = len(found.get(d, []))
        res.check(f"{service}: {SPAN_NAMES[d]} spans == truth ops", got == n and not errors.get(d),
                  f"{got} (want {n})" + (f"; {errors[d]}" if errors.get(d) else ""))
    spans = [(d, tr, s) for d in DIRECTIONS for tr, s in found.get(d, [])]
    if not spans:
        return
    # one trace per op: each trace holds one transfer span and its example.scheduler_step parent
    per_trace: dict[str, list] = {}
    for d, tr, s in spans:
        per_trace.setdefault(s.get("traceID"), []).append(s)
    shared = {t: len(v) for t, v in per_trace.items() if len(v) != 1}
    res.check(f"{service}: every op is one trace", not shared and len(per_trace) == sum(want.values()),
              f"{len(shared)} traces with several transfer spans: {list(shared.items())[:3]}" if shared
              else f"{len(per_trace)} traces (want {sum(want.values())})")
    orphans, foreign = [], []
    for d, tr, s in spans:
        by_id = {x.get("spanID"): x for x in tr.get("spans") or []}
        parents = [r for r in s.get("references") or [] if r.get("refType") == "CHILD_OF"]
        parent = by_id.get(parents[0].get("spanID")) if len(parents) == 1 else None
        if parent is None or parent.get("operationName") != STEP_SPAN \
                or parents[0].get("traceID") != s.get("traceID"):
            orphans.append(f"{s.get('spanID')} refs {[(r.get('refType'), r.get('spanID')) for r in s.get('references') or []]}")
        if _service_of(tr, s) != service:
            foreign.append(f"{s.get('spanID')}: {_service_of(tr, s)}")
    res.check(f"{service}: every transfer span's parent (CHILD_OF) is an {STEP_SPAN} span of its trace",
              not orphans, f"{len(orphans)} without: {orphans[:3]}" if orphans else f"{len(spans)} linked")
    res.check(f"{service}: the spans' process is the service", not foreign,
              f"{foreign[:3]}" if foreign else f"serviceName {service}")
    _attribute_checks(res, spans, required, service)
    requests_linked = "request_links" in truth.get("onboard", {})
    if "residence_count" in truth.get("onboard", {}):
        check_residence_links(res, found, truth["onboard"]["residence_count"], service, requests_linked)
    if requests_linked:
        check_example_request_links(res, jaeger, found, truth, service)
    sums = {d: {"bytes": 0, "blocks": 0, "tokens": 0} for d in DIRECTIONS}
    for d, _, s in spans:
        tags = _tags(s)
        try:
            sums[d]["bytes"] += int(tags["hicache.bytes"])
            sums[d]["blocks"] += int(tags["hicache.blocks"])
            sums[d]["tokens"] += int(tags["hicache.tokens"])
        except (KeyError, TypeError, ValueError):
            pass
    for d in want:
        w = {"bytes": truth[d]["bytes"], "blocks": truth[d]["blocks"], "tokens": truth[d]["tokens"].get("kv", 0)}
        res.check(f"{service}: {d} span attributes sum to truth (bytes, blocks, kv tokens)", sums[d] == w,
                  f"{sums[d]}" + ("" if sums[d] == w else f" (want {w})"))


def check_sglang_traces(res: Results, jaeger: Jaeger, st: dict[str, Any], service: str,
                        required: list[str]) -> None:
    direct = st.get("direct") or {}
    per_dir = all(isinstance(direct.get(d), dict) for d in DIRECTIONS)
    want_direct = {d: direct[d]["ops"] for d in DIRECTIONS} if per_dir else None
    want = {d: st[d]["ops"] + (want_direct[d] if per_dir else 0) for d in DIRECTIONS}
    found, errors, waited = fetch_transfer_spans(
        jaeger, service, want if per_dir else {d: st[d]["ops"] for d in DIRECTIONS})
    print(f"   ({service}: searched for {waited:.1f} s)")
    if per_dir:
        for d in DIRECTIONS:
            got = len(found.get(d, []))
            res.check(f"{service}: {SPAN_NAMES[d]} spans == merged ops + direct copies",
                      got == want[d] and not errors.get(d),
                      f"{got} (want {st[d]['ops']} + {want_direct[d]})" + (f"; {errors[d]}" if errors.get(d) else ""))
    else:
        got = sum(len(found.get(d, [])) for d in DIRECTIONS)
        total = sum(st[d]["ops"] for d in DIRECTIONS) + direct.get("ops", 0)
        res.check(f"{service}: hicache.* spans == merged ops + direct copies", got == total,
                  f"{got} (want {total})")
    spans = [(d, tr, s) for d in DIRECTIONS for tr, s in found.get(d, [])]
    if not spans:
        return
    origins: dict[tuple[str, str], int] = {}
    sums = {d: {"bytes": 0, "tokens": 0} for d in DIRECTIONS}
    for d, _, s in spans:
        tags = _tags(s)
        origin = str(tags.get("hicache.origin"))
        origins[(d, origin)] = origins.get((d, origin), 0) + 1
        if origin == "merged_op":
            sums[d]["bytes"] += int(tags.get("hicache.bytes", 0))
            sums[d]["tokens"] += int(tags.get("hicache.tokens", 0))
    want_origins = {(d, "merged_op"): st[d]["ops"] for d in DIRECTIONS}
    if per_dir:
        want_origins.update({(d, "direct"): want_direct[d] for d in DIRECTIONS})
    ok = all(origins.get(k, 0) == v for k, v in want_origins.items()) and set(origins) <= set(want_origins)
    res.check(f"{service}: spans by hicache.origin == truth (merged ops, direct copies)", ok,
              ", ".join(f"{d}/{o}={n}" + ("" if want_origins.get((d, o)) == n else f" (want {want_origins.get((d, o), 0)})")
                        for (d, o), n in sorted(origins.items())))
    lacking = [s.get("spanID") for _, _, s in spans if any(r not in _tags(s) for r in RANK_LABELS)]
    res.check(f"{service}: every transfer span carries {', '.join(RANK_LABELS)}", not lacking,
              f"{len(lacking)} without: {lacking[:3]}" if lacking else f"{len(spans)} spans")
    _attribute_checks(res, spans, required, service)
    for d in DIRECTIONS:
        w = {"bytes": st[d]["bytes"], "tokens": st[d]["tokens"]}
        res.check(f"{service}: merged-op {d} span attributes sum to truth (bytes, tokens)", sums[d] == w,
                  f"{sums[d]}" + ("" if sums[d] == w else f" (want {w})"))


# --------------------------------------------------------------------------------------
# (e) exemplars -> Jaeger
# --------------------------------------------------------------------------------------
def check_exemplars(res: Results, prom: Prometheus, jaeger: Jaeger, service: str, start_s: float) -> None:
    res.section("(e) exemplars of the duration histogram open their trace in Jaeger")
    expr = f'hicache_transfer_duration_seconds_bucket{{service_name="{service}"}}'
    state: dict[str, Any] = {"ex": [], "err": ""}

    def fetch() -> bool:
        ok, data, err = prom.api("/api/v1/query_exemplars",
                                 {"query": expr, "start": f"{start_s:.3f}", "end": f"{time.time() + 60:.3f}"})
        state["err"] = err
        state["ex"] = [(s.get("seriesLabels") or {}, e) for s in (data or []) for e in s.get("exemplars") or []]
        return bool(state["ex"])

    wait_until(fetch, WAIT_S, 1.0)
    exemplars = state["ex"]
    with_ids = [(lbl, e) for lbl, e in exemplars
                if re.fullmatch(r"[0-9a-f]{32}", (e.get("labels") or {}).get("trace_id", ""))
                and re.fullmatch(r"[0-9a-f]{16}", (e.get("labels") or {}).get("span_id", ""))]
    if not res.check("/api/v1/query_exemplars returns exemplars with trace_id and span_id",
                     bool(with_ids) and len(with_ids) == len(exemplars),
                     state["err"] or f"{len(exemplars)} exemplars ({len(with_ids)} with both ids) "
                                     f"on {len({json.dumps(l, sort_keys=True) for l, _ in exemplars})} series; `{expr}`"):
        return
    picked, seen = [], set()
    step = max(1, len(with_ids) // 5)  # spread over the buckets/series rather than the first five
    for lbl, e in with_ids[::step] + with_ids:
        tid = e["labels"]["trace_id"]
        if tid not in seen:
            seen.add(tid)
            picked.append((lbl, e))
        if len(picked) == 5:
            break
    for lbl, e in picked:
        tid, sid = e["labels"]["trace_id"], e["labels"]["span_id"]
        tr, err = jaeger.trace(tid)
        span = next((s for s in (tr or {}).get("spans") or [] if s.get("spanID") == sid), None)
        problems = []
        if span is None:
            problems.append(err or f"no span {sid} in the trace")
        else:
            if not str(span.get("operationName", "")).startswith("hicache."):
                problems.append(f"span {sid} is {span.get('operationName')}")
            if _service_of(tr, span) != service:
                problems.append(f"service {_service_of(tr, span)}")
            direction = lbl.get("hicache_direction")
            if direction and span.get("operationName") != SPAN_NAMES.get(direction):
                problems.append(f"series direction {direction}, span {span.get('operationName')}")
            # the exemplar's value is the op's duration (s); Jaeger keeps the span's in microseconds
            if abs(float(e.get("value", 0)) * 1e6 - float(span.get("duration", -1))) > 2:
                problems.append(f"exemplar value {e.get('value')} s vs span duration {span.get('duration')} us")
            if float(e.get("value", 0)) > float(lbl.get("le", "inf")):
                problems.append(f"value {e.get('value')} above its bucket le={lbl.get('le')}")
        res.check(f"exemplar trace {tid} opens in Jaeger with span {sid}", not problems,
                  "; ".join(problems) if problems else
                  f"{span.get('operationName')}, {span.get('duration')} us, le={lbl.get('le')}")


# --------------------------------------------------------------------------------------
# (f) the Collector's own metrics
# --------------------------------------------------------------------------------------
def check_collector(res: Results, prom: Prometheus, repo: str, collector_metrics: str,
                    exported_spans: int) -> None:
    res.section(f"(f) the Collector's own metrics in Prometheus (job=\"{COLLECTOR_JOB}\")")
    listed, conditional, source = collector_metric_names(_read(os.path.join(repo, "deploy/README.md")))
    print(f"   (names from {source}: {', '.join(listed) or 'none'})")
    if not res.check("the list of the Collector's own metrics is not empty", bool(listed), source):
        return
    job = f'job="{COLLECTOR_JOB}"'

    def sum_of(name: str) -> float | None:
        got = prom.by_labels(f"sum({name}{{{job}}})", ())
        return next(iter(got.values()), None)

    # the final spans of the workloads reach the Collector at their exit; wait for a scrape
    wait_until(lambda: (sum_of("otelcol_receiver_accepted_spans") or 0) >= exported_spans
               and (sum_of("otelcol_exporter_sent_spans") or 0) >= exported_spans, COLLECTOR_WAIT_S, 1.0)
    present = {k[0]: v for k, v in prom.by_labels(f'count by (__name__) ({{{job}, __name__=~"otelcol_.+"}})',
                                                  ("__name__",)).items()}
    for name in listed:
        res.check(f"{name} exists", name in present,
                  f"{_fmt(present[name])} series" if name in present else f"no `{name}{{{job}}}` in Prometheus")
    for name in conditional:
        if name in present:
            value = sum_of(name)
            res.check(f"{name} == 0 (no failure in this run)", value == 0, f"{_fmt(value or 0)}")
        else:
            res.skip(f"{name} exists", "deploy/README.md says it appears once a failure happened; none did")

    value_checks = [
        ("otelcol_receiver_accepted_spans", lambda v: v >= exported_spans, f">= {exported_spans} spans the workloads exported"),
        ("otelcol_exporter_sent_spans", lambda v: v >= exported_spans, f">= {exported_spans} spans the workloads exported"),
        ("otelcol_receiver_refused_spans", lambda v: v == 0, "== 0"),
        ("otelcol_receiver_refused_metric_points", lambda v: v == 0, "== 0"),
        ("otelcol_receiver_accepted_metric_points", lambda v: v > 0, "> 0"),
        ("otelcol_exporter_sent_metric_points", lambda v: v > 0, "> 0"),
        ("otelcol_exporter_queue_size", lambda v: v == 0, "== 0 (everything sent)"),
        ("otelcol_process_uptime", lambda v: v > 0, "> 0"),
    ]
    for name, ok_fn, what in value_checks:
        if name not in listed and name not in present:
            continue
        value = sum_of(name)
        res.check(f"sum({name}) {what}", value is not None and ok_fn(value),
                  f"{_fmt(value)}" if value is not None else "no data")

    all_names = [n for n in prom.names() if n.startswith("otelcol_")]
    bad = [n for n in all_names if "__" in n or "{" in n or "}" in n]
    res.check("no otelcol_* name in Prometheus contains `__` or `{`", bool(all_names) and not bad,
              f"{bad[:5]}" if bad else f"{len(all_names)} names")
    if collector_metrics:
        status, text = get_text(collector_metrics)
        raw = sorted({m.group(1) for m in (re.match(r"([^\s{#][^\s{]*)", line) for line in text.splitlines())
                      if m} if status == 200 else set())
        bad = [n for n in raw if "__" in n or not re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", n)]
        quoted = [line for line in text.splitlines() if line.startswith("{")] if status == 200 else []
        res.check(f"{collector_metrics}: every name is a plain Prometheus name without `__` or braces",
                  status == 200 and bool(raw) and not bad and not quoted,
                  f"HTTP {status}" if status != 200 else
                  (f"{bad[:5]} {quoted[:2]}" if bad or quoted else f"{len(raw)} names"))


# --------------------------------------------------------------------------------------
# (g) promtool
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


def check_promtool(res: Results, promtool: str, repo: str) -> None:
    res.section("(g) promtool on the shipped files")
    if not promtool:
        res.check("promtool available", False, "pass --promtool")
        return
    config = "deploy/prometheus/prometheus.yml"
    run_promtool(res, f"promtool check config {config} (rule files included)",
                 [promtool, "check", "config", config], repo)
    rules = [os.path.relpath(p, repo) for p in rule_files(repo)]
    if rules:
        run_promtool(res, "promtool check rules " + " ".join(rules), [promtool, "check", "rules", *rules], repo)
    tests = sorted(glob.glob(os.path.join(repo, "deploy/prometheus/tests/*.yml"))
                   + glob.glob(os.path.join(repo, "deploy/prometheus/tests/*.yaml")))
    if tests:
        rel = [os.path.relpath(p, repo) for p in tests]
        run_promtool(res, "promtool test rules " + " ".join(rel), [promtool, "test", "rules", *rel], repo)
    else:
        res.check("promtool rule tests exist (deploy/prometheus/tests/*.yml)", False, "none found")


# --------------------------------------------------------------------------------------
# (h) Docker deployment structure
# --------------------------------------------------------------------------------------
_DEFAULT_PORTS = {  # listeners whose endpoint may be left out, by component type
    ("receivers", "otlp/grpc"): 4317, ("receivers", "otlp/http"): 4318,
    ("extensions", "health_check"): 13133, ("extensions", "zpages"): 55679, ("extensions", "pprof"): 1777,
}
_ENV = re.compile(r"\$\{(?:env:)?(\w+)(?::?-([^}]*))?\}")


def _expand(value: Any, env: dict[str, str] | None = None) -> str:
    """${VAR:-default} / ${env:VAR:-default}: from env (the process environment when None),
    else the default."""
    env = os.environ if env is None else env
    return _ENV.sub(lambda m: env.get(m.group(1), m.group(2) or ""), str(value))


def _port(endpoint: Any, env: dict[str, str] | None = None) -> int | None:
    m = re.search(r":(\d+)\s*$", _expand(endpoint, env))
    return int(m.group(1)) if m else None


def collector_listen_ports(cfg: dict[str, Any], env: dict[str, str] | None = None) -> dict[int, str]:
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
                port = _port((pconf or {}).get("endpoint", ""), env) or _DEFAULT_PORTS.get(("receivers", f"otlp/{proto}"))
                if port:
                    ports[port] = f"receiver {name} {proto}"
        elif isinstance(conf, dict) and conf.get("endpoint"):
            ports[_port(conf["endpoint"], env) or 0] = f"receiver {name}"
    for name in used["exporters"]:  # exporters that serve (pull) rather than send
        conf = (cfg.get("exporters") or {}).get(name) or {}
        if name.split("/")[0] == "prometheus" and conf.get("endpoint"):
            ports[_port(conf["endpoint"], env) or 0] = f"exporter {name}"
    for name in service.get("extensions") or []:
        conf = (cfg.get("extensions") or {}).get(name) or {}
        endpoints = [conf.get("endpoint", "")] + [((conf.get(p) or {}).get("endpoint", "")) for p in ("http", "grpc")
                                                  if isinstance(conf.get(p), dict)]
        found = [p for p in (_port(e, env) for e in endpoints if e) if p]
        for port in found or [_DEFAULT_PORTS.get(("extensions", name.split("/")[0]))]:
            if port:
                ports[port] = f"extension {name}"
    metrics = (service.get("telemetry") or {}).get("metrics") or {}
    if metrics.get("level") != "none":
        for reader in metrics.get("readers") or []:
            exp = (((reader or {}).get("pull") or {}).get("exporter") or {}).get("prometheus") or {}
            if exp.get("port"):
                ports[int(_expand(exp["port"], env))] = "service telemetry (own metrics)"
        if metrics.get("address"):
            ports[_port(metrics["address"], env) or 0] = "service telemetry (own metrics)"
    return ports


def _published(ports: Any) -> list[tuple[str, int | None, str]]:
    """compose `ports:` -> [(host ip, container port, as written)]."""
    out = []
    for item in ports or []:
        if isinstance(item, dict):
            out.append((str(item.get("host_ip", "")), int(_expand(item.get("target"), {})), json.dumps(item)))
            continue
        text = _expand(item, {}).split("/")[0]
        m = re.fullmatch(r"(?:(\[[^\]]+\]|[\d.]+):)?(?:(\d+(?:-\d+)?):)?(\d+(?:-\d+)?)", text)
        if not m:
            out.append(("", None, str(item)))
            continue
        host_ip = m.group(1) or ""
        target = m.group(3).split("-")[0]
        out.append((host_ip, int(target), str(item)))
    return out


def _scrape_targets(path: str) -> dict[str, set[str]]:
    """job -> host:port targets of its static scrape configs, in a Prometheus config file."""
    try:
        with open(path, encoding="utf-8") as f:
            cfg = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError):
        return {}
    return {job.get("job_name", "?"): {t for sc in job.get("static_configs") or [] for t in sc.get("targets") or []}
            for job in cfg.get("scrape_configs") or []}


def _service_env(svc: dict[str, Any]) -> dict[str, str]:
    """A compose service's `environment:` (mapping or list), the variables its config sees."""
    env = (svc or {}).get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): str(v) for k, v in env.items()}


def _mounted(svc: dict[str, Any], repo: str, under: str) -> list[str]:
    """Repo files under `under` a compose service mounts (short volume syntax)."""
    out = []
    for vol in (svc or {}).get("volumes") or []:
        src = vol.get("source", "") if isinstance(vol, dict) else str(vol).split(":")[0]
        path = os.path.normpath(os.path.join(repo, src))
        if path.startswith(os.path.join(repo, under)) and os.path.isfile(path):
            out.append(path)
    return out


def _check_pipelines(res: Results, cfg: dict[str, Any], rel: str) -> None:
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


def check_docker(res: Results, repo: str) -> None:
    res.section("(h) Docker deployment (structure only)")
    composes = [p for p in (os.path.join(repo, n) for n in ("docker-compose.yml", "docker-compose.yaml",
                                                            "compose.yml", "compose.yaml")) if os.path.exists(p)]
    otel_configs = sorted(glob.glob(os.path.join(repo, "deploy/otel-collector/*.yaml"))
                          + glob.glob(os.path.join(repo, "deploy/otel-collector/*.yml"))
                          + glob.glob(os.path.join(repo, "deploy/jaeger/*.yaml"))
                          + glob.glob(os.path.join(repo, "deploy/jaeger/*.yml")))
    if not composes:
        res.check("docker-compose.yml exists", False, "no compose file at the repository root")
        return
    if yaml is None:
        res.check("deployment YAML parses", False, "PyYAML is not installed in this interpreter")
        return
    docs: dict[str, Any] = {}
    for path in composes + otel_configs:
        rel = os.path.relpath(path, repo)
        try:
            with open(path, encoding="utf-8") as f:
                docs[path] = yaml.safe_load(f)
            res.check(f"{rel} parses as YAML", isinstance(docs[path], dict))
        except (OSError, yaml.YAMLError) as exc:
            res.check(f"{rel} parses as YAML", False, str(exc).splitlines()[0])
    for path in otel_configs:  # the Collector's and Jaeger v2's (a Collector too)
        if isinstance(docs.get(path), dict):
            _check_pipelines(res, docs[path], os.path.relpath(path, repo))

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
        scraped = _scrape_targets(os.path.join(repo, "deploy/prometheus/prometheus.yml"))
        check_compose_collector(res, rel, repo, services, exposed, docs, scraped)
        check_compose_jaeger(res, rel, repo, services, exposed, docs)


def check_compose_collector(res: Results, rel: str, repo: str, services: dict[str, Any],
                            exposed: list, docs: dict[str, Any], scraped: dict[str, set[str]]) -> None:
    collector = [s for s, svc in services.items()
                 if "opentelemetry-collector" in str((svc or {}).get("image", "")) or s == "otel-collector"]
    if not res.check(f"{rel}: a Collector service mounts a config of deploy/otel-collector/",
                     len(collector) == 1 and bool(_mounted(services[collector[0]], repo, "deploy/otel-collector")),
                     f"services {collector}" + (f", mounts {[os.path.relpath(p, repo) for p in _mounted(services[collector[0]], repo, 'deploy/otel-collector')]}"
                                                if collector else "")):
        return
    name = collector[0]
    env = _service_env(services[name])
    listen: dict[int, str] = {}
    for path in _mounted(services[name], repo, "deploy/otel-collector"):
        if isinstance(docs.get(path), dict):
            listen.update(collector_listen_ports(docs[path], env))
    targets = {t for s, _, t, _ in exposed if s == name}
    # the Collector's own telemetry stays inside the compose network: Prometheus scrapes it there
    internal = {p: w for p, w in listen.items() if w.startswith("service telemetry")}
    external = {p: w for p, w in listen.items() if p not in internal}
    missing = {p: what for p, what in external.items() if p not in targets}
    res.check(f"{rel}: every port the Collector serves to the host is published "
              f"({', '.join(f'{p} {w}' for p, w in sorted(external.items()))})",
              bool(external) and not missing,
              (f"service {name} does not publish: " + ", ".join(f"{p} ({w})" for p, w in sorted(missing.items())))
              if missing else f"service {name}: {sorted(targets)}")
    all_targets = {t for ts in scraped.values() for t in ts}
    for port, what in sorted(listen.items()):
        if what.startswith("service telemetry") or what.startswith("exporter prometheus"):
            res.check(f"{rel}: Prometheus scrapes the Collector's {what} as {name}:{port}",
                      f"{name}:{port}" in all_targets,
                      ", ".join(f"{j}: {sorted(t)}" for j, t in sorted(scraped.items())))


def check_compose_jaeger(res: Results, rel: str, repo: str, services: dict[str, Any],
                         exposed: list, docs: dict[str, Any]) -> None:
    jaeger = [s for s, svc in services.items() if "jaegertracing/" in str((svc or {}).get("image", ""))]
    mounted = _mounted(services[jaeger[0]], repo, "deploy/jaeger") if len(jaeger) == 1 else []
    if not res.check(f"{rel}: a Jaeger service mounts deploy/jaeger/config.yaml",
                     len(jaeger) == 1 and os.path.join(repo, "deploy/jaeger/config.yaml") in mounted,
                     f"services {jaeger}, mounts {[os.path.relpath(p, repo) for p in mounted]}"):
        return
    name = jaeger[0]
    cfg = docs.get(os.path.join(repo, "deploy/jaeger/config.yaml"))
    if not isinstance(cfg, dict):
        return
    env = _service_env(services[name])
    ext = cfg.get("extensions") or {}
    query_port = _port(((ext.get("jaeger_query") or {}).get("http") or {}).get("endpoint", ""), env)
    targets = {t for s, _, t, _ in exposed if s == name}
    res.check(f"{rel}: Jaeger's query service (UI and API, port {query_port}) is published",
              query_port is not None and query_port in targets, f"service {name}: {sorted(targets)}")
    # the Collector's exporter to Jaeger reaches Jaeger's OTLP receiver by service name and port
    otlp = ((cfg.get("receivers") or {}).get("otlp") or {}).get("protocols") or {}
    jaeger_ports = {_port((p or {}).get("endpoint", ""), env) or _DEFAULT_PORTS.get(("receivers", f"otlp/{k}"))
                    for k, p in otlp.items()}
    col_name = next((s for s, svc in services.items() if "opentelemetry-collector" in str((svc or {}).get("image", ""))), "")
    col_env = _service_env(services.get(col_name) or {})
    endpoints = []
    for path in _mounted(services.get(col_name) or {}, repo, "deploy/otel-collector"):
        for exp_name, conf in ((docs.get(path) or {}).get("exporters") or {}).items():
            if exp_name.split("/")[0] in ("otlp", "otlp_grpc") and isinstance(conf, dict):
                endpoints.append(_expand(conf.get("endpoint", ""), col_env))
    ok = bool(endpoints) and all(re.sub(r"^\w+://", "", e).split(":")[0] == name and _port(e) in jaeger_ports
                                 for e in endpoints)
    res.check(f"{rel}: the Collector's OTLP exporter reaches Jaeger's OTLP receiver "
              f"({name}:{'/'.join(str(p) for p in sorted(p for p in jaeger_ports if p))})", ok,
              f"exporter endpoints {endpoints}")
    health = ((ext.get("healthcheckv2") or {}).get("http") or {}).get("endpoint", "")
    health_port = _port(health, env)
    test = " ".join(map(str, ((services[name] or {}).get("healthcheck") or {}).get("test") or []))
    res.check(f"{rel}: Jaeger's compose healthcheck probes its healthcheckv2 port ({health_port})",
              health_port is not None and f":{health_port}/" in test, f"test: {test or 'none'}")


# --------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parser.add_argument("--truth", required=True, help="ground truth written by hicache_workload.py --truth-json")
    parser.add_argument("--sglang-truth", default="", help="ground truth written by e2e/sglang_workload.py")
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090")
    parser.add_argument("--jaeger", default="http://127.0.0.1:16686")
    parser.add_argument("--collector-metrics", default="http://127.0.0.1:8888/metrics",
                        help="the Collector's own metrics endpoint")
    parser.add_argument("--promtool", default="")
    parser.add_argument("--service", default="hicache-e2e", help="OTEL_SERVICE_NAME of the example workload")
    parser.add_argument("--sglang-service", default="hicache-e2e-sglang",
                        help="OTEL_SERVICE_NAME of the SGLang harness")
    parser.add_argument("--lookback-s", type=float, default=3 * 3600,
                        help="how far back to search for traces and exemplars (default 3 h)")
    args = parser.parse_args(argv)
    args.repo = os.path.abspath(args.repo)
    with open(args.truth, encoding="utf-8") as f:
        truth = json.load(f)
    truth = {d: t for d, t in truth.items() if d in DIRECTIONS}
    st = None
    if args.sglang_truth:
        with open(args.sglang_truth, encoding="utf-8") as f:
            st = json.load(f)
    res = Results()
    started = time.monotonic()
    since_s = time.time() - args.lookback_s
    prom = Prometheus(args.prometheus)
    jaeger = Jaeger(args.jaeger, int(since_s * 1e6))
    reference = _read(os.path.join(args.repo, "docs/reference.md"))
    services = [args.service] + ([args.sglang_service] if st is not None else [])

    check_counters(res, prom, truth, args.service)
    if st is not None:
        check_sglang_counters(res, prom, st, args.sglang_service, reference)
    else:
        res.skip("SGLang harness counters", "no --sglang-truth")
    check_rules(res, prom, args.repo)
    check_dashboards(res, prom, args.repo)
    check_documented_series(res, prom, args.repo, services)
    check_jaeger(res, jaeger, truth, st, args.service, args.sglang_service, args.repo)
    check_exemplars(res, prom, jaeger, args.service, since_s)
    exported = 2 * sum(t["ops"] for t in truth.values())  # each op: a transfer span and its step span
    if st is not None:
        exported += sum(st[d]["ops"] for d in DIRECTIONS) + (st.get("direct") or {}).get("ops", 0)
    check_collector(res, prom, args.repo, args.collector_metrics, exported)
    check_promtool(res, args.promtool, args.repo)
    check_docker(res, args.repo)
    if res.no_data:
        print("-- expressions that returned no data:")
        for item in res.no_data:
            print(f"   {item}")
    if res.failed:
        print("-- failed: " + "; ".join(res.failed))
    print(f"{res.passed} passed, {len(res.failed)} failed, {res.skipped} skipped "
          f"({time.monotonic() - started:.1f} s)")
    return 1 if res.failed else 0


if __name__ == "__main__":
    sys.exit(main())
