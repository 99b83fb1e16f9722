"""benchmarks/decode_switches_bench.py imports and parses on the CPU (the bench itself needs an
sm_90 GPU: it says so in one line, and a bad variant gets a one-line error)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_switches_bench.py"


def _run(*args):
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True,
                          timeout=300, cwd=BENCH.parent)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's answer")
def test_it_needs_a_gpu():
    r = _run("--contexts", "1024")
    assert r.returncode == 1
    assert r.stderr.strip() == "decode_switches_bench: needs a CUDA device (an sm_90 GPU)"


@pytest.mark.parametrize("bad", ["1:3", "1:1:1:10", "2:1", "1"])
def test_a_bad_variant_is_one_line(bad):
    r = _run("--variants", bad)
    assert r.returncode == 1
    assert r.stderr.strip() == (f"--variants '{bad}': pages:unroll[:hwait[:warps]], pages and "
                                "hwait 0 or 1, unroll 0-2, warps 8, 12 or 16, e.g. 1:2:1:12")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's answer")
def test_the_warps_and_page_loop_variants_parse():
    """``unroll`` 2 and a fourth number, the warps per block, are taken (then the CPU run
    stops where it needs the GPU)."""
    r = _run("--variants", "1:2:1:12", "0:2:1:16", "1:1")
    assert r.returncode == 1
    assert r.stderr.strip() == "decode_switches_bench: needs a CUDA device (an sm_90 GPU)"
