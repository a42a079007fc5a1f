"""benchmarks/stalled_collector.py, briefly: the serving process's memory while its collector
stalls stays within the bound measured part by part, and does not grow with time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "stalled_collector.py"
SECONDS = 24  # two export deadlines and more: the sawtooth of the stuck exports is in the first two thirds
RATE = 400
# What the last third of the run may exceed the first two thirds' peak by: RSS samples move
# by a few pages as the allocator hands memory back and takes it again; a leak of 2 KB per
# op at this rate adds more than that over the last third (8 s, 3,200 ops: 6.25 MiB).
GROWTH_MARGIN = 4 * 2**20


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_memory_under_a_stalled_collector_stays_within_its_bound(protocol, tmp_path):
    out = tmp_path / "figures.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--protocol", protocol, "--seconds", str(SECONDS),
                          "--rate", str(RATE), "--no-breakdown", "--json", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-4000:]
    figures = json.loads(out.read_text(encoding="utf-8"))
    rss, bound = figures["rss"], figures["bound"]
    print(run.stdout)
    spans = figures["delivery"]["spans"]
    assert spans["exported"] == 0 and spans["queue_full"] > 0, spans  # the collector did stall
    assert figures["span_queue_max"] <= figures["measured"]["queue_cap"]
    assert rss["peak"] <= bound["total"], (rss["peak"], bound)
    assert rss["peak_last_third"] <= rss["peak_first_two_thirds"] + GROWTH_MARGIN, rss["series"]
