"""benchmarks/wait_cost.py runs and prints a CPU and a wall figure per wait primitive, and the control's CPU
after each sleep; no time is asserted."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "wait_cost.py"


def test_wait_cost_prints_every_primitive():
    run = subprocess.run([sys.executable, str(SCRIPT), "--waits", "20", "--poll-ms", "0.2", "--cold-calls", "20"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [line for line in run.stdout.splitlines() if re.search(r"\)\s+\d+\.\d\s+\d+$", line)]
    assert [row.split("(")[0].strip() for row in rows] == ["lock.acquire", "time.sleep", "select.select",
                                                          "time.sleep"]
    for row in rows:  # a timed wait lasts at least its timeout; a yield does not
        wall = int(row.split()[-1])
        assert wall >= (0 if "sleep(0)" in row else 200), row
    # the control after each sleep: one row per sleep, a CPU figure per burst size, the ratio last
    cold = [line for line in run.stdout.splitlines() if re.match(r"(none \(back to back\)|[\d.]+ ms)\s+\d", line)]
    assert [row.split("  ")[0].strip() for row in cold] == ["none (back to back)", "0.2 ms", "1 ms", "4 ms", "16 ms"]
    for row in cold:
        cells = row.split()[-4:]
        assert all(float(c) > 0 for c in cells[:3]) and cells[3].endswith("x"), row
    assert cold[0].endswith("1.00x")
