"""benchmarks/host_bench.py runs on the CPU and prints one row per mode and batch (a smoke test:
the figures themselves are in docs/benchmarks.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "host_bench.py"


def test_host_bench_rows():
    out = subprocess.run([sys.executable, str(BENCH), "--batches", "1", "3", "--steps", "20",
                          "--reps", "1"], capture_output=True, text=True, timeout=600,
                         cwd=BENCH.parent, check=True).stdout
    rows = [line for line in out.splitlines() if re.match(r"\| (plain|spec) \|", line)]
    assert [r.split("|")[1:3] for r in rows] == [[" plain ", " 1 "], [" plain ", " 3 "],
                                                 [" spec ", " 1 "], [" spec ", " 3 "]]
    for r in rows:
        runner, engine, overlapped = (float(x) for x in r.split("|")[3:6])
        # the runner's step is timed directly; the engine's are differences of two runs, which
        # a loaded machine can make small or negative over so few steps
        assert 0 < runner < 1e5, r
        assert abs(engine) < 1e5 and abs(overlapped) < 1e5, r
