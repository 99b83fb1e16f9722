"""Checks both persistent segments' CUDA tests share (kernels.decode_segment, .verify_segment)."""

from __future__ import annotations

import dataclasses

import torch


def graph_replay_equals_eager(run, meta) -> None:
    """``run(meta)`` (a segment launch; its first two outputs compared) is deterministic, a CUDA
    graph of it replays eager's bits, and the graph reads the length from device memory: a
    replay after ``seq_lens`` changes equals an eager launch at the new length."""
    meta = dataclasses.replace(meta, seq_lens=meta.seq_lens.clone())
    eager = [t.clone() for t in run(meta)[:2]]
    again = run(meta)[:2]
    assert all(torch.equal(a, b) for a, b in zip(eager, again))
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = run(meta)[:2]
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(outs, eager))
    meta.seq_lens.fill_(1234)
    g.replay()
    short = run(meta)[:2]
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(outs, short))
    assert not torch.equal(outs[1], eager[1])
