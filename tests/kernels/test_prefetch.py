"""kernels/prefetch.py: the L2 prefetch never changes a value, runs only where it can (a no-op
on the CPU, off with KVSTRATA_L2_PREFETCH=0), and on an H200 issues its bulk prefetches inside a
CUDA graph, before a product that then reads the same bytes."""

from __future__ import annotations

import pytest
import torch

from kvstrata.kernels.gemv import gemv
from kvstrata.kernels.prefetch import PREFETCH_ENV, l2_prefetch, l2_prefetch_ok


def test_cpu_and_odd_tensors_are_left_alone(monkeypatch):
    w = torch.randn(64, 32)
    before = w.clone()
    assert not l2_prefetch_ok(w)
    l2_prefetch(w)                                  # a no-op: nothing launched, nothing written
    assert torch.equal(w, before)
    l2_prefetch(torch.empty(0))


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.gpu
def test_cuda_prefetch_in_a_graph_changes_nothing(monkeypatch):
    hopper = torch.cuda.get_device_capability()[0] >= 9
    w = torch.randn(4096, 4096, device="cuda").to(torch.bfloat16)
    x = torch.randn(2, 4096, device="cuda").to(torch.bfloat16)
    assert l2_prefetch_ok(w) == hopper
    assert not l2_prefetch_ok(w.t())                                # not contiguous
    assert not l2_prefetch_ok(torch.empty(3, device="cuda", dtype=torch.bfloat16))  # 6 bytes
    tail = torch.randn(1000 * 4096 + 8, device="cuda").to(torch.bfloat16)  # a partial chunk
    snapshot = tail.clone()
    ref = gemv(x, w)

    def step():
        l2_prefetch(tail)
        l2_prefetch(w)
        return gemv(x, w)

    got = step()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, ref) and torch.equal(out, ref)
    assert torch.equal(tail, snapshot)
    monkeypatch.setenv(PREFETCH_ENV, "0")
    assert not l2_prefetch_ok(w)
