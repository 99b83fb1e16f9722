"""The greedy language-model head alone (issue 13, H200): ``F.linear`` (cuBLAS) + ``argmax``
against :func:`kvstrata.kernels.gemv.gemv_argmax` over a few tiles, at 1 and 16 rows of a
Qwen3 head (151936 x 4096 bf16), each as a CUDA graph over two weight copies (more bytes than
L2 holds), median of replays; floor = weight bytes / copy rate. Also the step's small
launches this session changed: the embedding gather + first norm, RoPE rows of 16 positions.

    python benchmarks/lm_head_bench.py
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from runner_bench import _graph_us, copy_rate  # noqa: E402

from kvstrata.kernels.gemv import GemvLaunch, gemv_argmax  # noqa: E402
from kvstrata.kernels.layer_ops import add_rms_norm, embed_rms_norm, rope_cos_sin_rows  # noqa: E402

TILES = [(32, 256, 3, 4), (64, 256, 3, 4), (64, 128, 3, 4), (32, 128, 4, 4), (64, 128, 4, 4),
         (128, 128, 3, 8)]


def main() -> None:
    bw = copy_rate()
    print(f"copy rate {bw / 1e12:.3f} TB/s", flush=True)
    n, k = 151936, 4096
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(2)]
    floor = n * k * 2 / bw * 1e6
    print("| rows | floor us | cuBLAS + argmax us | " + " | ".join(
        "/".join(map(str, t)) for t in TILES) + " |")
    for m in (1, 16):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = _graph_us(lambda: [F.linear(x, w).argmax(-1) for w in ws], 2, reps=30)
        row = [f"{m}", f"{floor:.1f}", f"{ref:.1f}"]
        for t in TILES:
            lt = GemvLaunch(*t)
            t_us = _graph_us(lambda: [gemv_argmax(x, w, launch=lt) for w in ws], 2, reps=30)
            row.append(f"{t_us:.1f}")
        default = _graph_us(lambda: [gemv_argmax(x, w) for w in ws], 2, reps=30)
        print("| " + " | ".join(row) + f" | (default {default:.1f}) |", flush=True)
    emb, g = ws[0], torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
    for m in (1, 16):
        ids = torch.randint(0, n, (m,), device="cuda")
        sep = _graph_us(lambda: [add_rms_norm(F.embedding(ids, emb), g, 1e-6)
                                 for _ in range(36)], 36)
        one = _graph_us(lambda: [embed_rms_norm(ids, emb, g, 1e-6) for _ in range(36)], 36)
        print(f"embedding + norm, {m} rows: separate {sep:.2f} us, one launch {one:.2f} us",
              flush=True)
    inv = 1.0 / (1e6 ** (torch.arange(0, 128, 2, device="cuda").float() / 128))
    for m in (1, 16):
        pos = torch.arange(m, device="cuda") + 8000
        t = _graph_us(lambda: [rope_cos_sin_rows(pos, inv) for _ in range(36)], 36)
        print(f"rope cos/sin, {m} rows at 8k: {t:.2f} us per launch", flush=True)


if __name__ == "__main__":
    main()
