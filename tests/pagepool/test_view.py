"""PoolView: both layouts read and write the canonical page shape; bad tensors are refused."""

import pytest
import torch

from kvstrata.pagepool import (LAYER_KV_FIRST, PAGE_MAJOR, GroupView, KVGroupSpec, PagePool,
                               PoolView)

SPEC = KVGroupSpec("target", num_layers=3, num_kv_heads=2, head_dim=16, dtype=torch.float32)
P, N = 4, 6


def _layer_view(kv_page_major: torch.Tensor) -> PoolView:
    # the same content in vLLM's flash layout: per layer [2, N, P, H, D]
    layers = tuple(kv_page_major[:, l].permute(1, 0, 3, 2, 4).contiguous() for l in range(3))
    return PoolView((GroupView(SPEC, LAYER_KV_FIRST, layers),), N, P)


def test_layouts_agree_on_read_and_write():
    pool = PagePool([SPEC], N, P)
    pool.kv["target"].copy_(torch.randn_like(pool.kv["target"]))
    pv, lv = PoolView.of(pool), _layer_view(pool.kv["target"])
    ids = torch.tensor([4, 1, 3])
    assert torch.equal(pv.read(0, ids), pool.kv["target"][ids])
    assert torch.equal(lv.read(0, ids), pool.kv["target"][ids])
    assert pv.page_major(0) is pool.kv["target"] and lv.page_major(0) is None
    new = torch.randn(3, *SPEC.page_shape(P))
    lv.write(0, ids, new)
    pv.write(0, ids, new)
    assert torch.equal(lv.read(0, ids), new) and torch.equal(pool.kv["target"][ids], new)
    assert torch.equal(lv.read(0, torch.tensor([0, 2, 5])), pool.kv["target"][[0, 2, 5]])


def test_of_pool_carries_lookup_and_specs():
    pool = PagePool([SPEC], N, P)
    v = PoolView.of(pool)
    assert v.specs == [SPEC] and v.num_pages == N and v.page_size == P
    assert v.lookup(b"\0" * 16) is None


def test_bad_tensors_are_refused():
    t = torch.empty(N, *SPEC.page_shape(P))
    with pytest.raises(ValueError, match="expected"):
        PoolView((GroupView(SPEC, PAGE_MAJOR, (t[:, :2],)),), N, P)
    with pytest.raises(ValueError, match="dtype"):
        PoolView((GroupView(SPEC, PAGE_MAJOR, (t.half(),)),), N, P)
    with pytest.raises(ValueError, match="layout"):
        PoolView((GroupView(SPEC, "rows", (t,)),), N, P)
