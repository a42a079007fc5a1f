"""The shipped rules and dashboard on real data: promtool, rules loaded healthy, every query evaluates."""
import re
import subprocess

import pytest
from helpers import GPU_ONLY, ROOT, binary, settle, shipped_queries

pytestmark = pytest.mark.stack
QUERIES = shipped_queries()


@pytest.mark.parametrize("args", [["check", "config", "deploy/prometheus/prometheus.yml"],
                                  ["test", "rules", "deploy/prometheus/tests/otel-hicache.rules.test.yml"]],
                         ids=" ".join)
def test_promtool(args):
    run = subprocess.run([binary("promtool"), *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


def test_every_rule_loaded_and_healthy(prom, truth):
    """Once a group interval has evaluated them all (15 s)."""
    def rules():
        return {r["name"]: r["health"] for g in prom.api("/api/v1/rules")["groups"] for r in g["rules"]}

    got = settle(rules, lambda g: set(g.values()) == {"ok"}, 40)
    assert got == {name: "ok" for kind, name, _ in QUERIES if kind != "panel"}


def test_every_query_evaluates_on_series_that_exist(prom, truth):
    """Without error, on series that exist (a typo gives no error, only nothing), GPU-only ones aside."""
    absent = tuple(name for name in GPU_ONLY if not prom.query(f'count({{__name__=~"{name}.*"}})'))
    names = set(prom.api("/api/v1/label/__name__/values"))
    for kind, name, expr in QUERIES:
        prom.query(expr)  # an error fails here, naming the query
        # the series it reads: its names, once label lists, matchers and strings are left out
        bare = re.sub(r'\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)|\{[^}]*\}|"[^"]*"', " ", expr)
        read = set(re.findall(r"(?<![\w:])((?:otel_)?hicache_\w+|otel_sdk_\w+|sglang:\w+)", bare))
        # (SGLang's own series are on its /metrics, which the shipped stack does not scrape)
        assert read and {n for n in read - names if not n.startswith((*absent, "sglang:"))} == set(), (kind, name)


def test_panels_and_recorded_series_have_data(prom, truth):
    """Every panel, recording rule and recorded series has data once the rules ran (not GPU-only)."""
    absent = [name for name in GPU_ONLY if not prom.query(f'count({{__name__=~"{name}.*"}})')]
    wanted = [(name, expr) for kind, name, expr in QUERIES if kind != "alert" and not any(a in expr for a in absent)]
    wanted += [(name, name) for kind, name, expr in QUERIES if kind == "record" and not any(a in expr for a in absent)]
    empty = settle(lambda: [name for name, expr in wanted if not prom.query(expr)], lambda e: not e, 40, every=2)
    assert len(wanted) > 40 and empty == []
