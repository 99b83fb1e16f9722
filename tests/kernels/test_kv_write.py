"""write_kv: Triton (interpreter) and torch reference against a direct per-token oracle."""

from __future__ import annotations

import pytest
import torch

from kvstrata.kernels.kv_write import write_kv, write_kv_ref


def _case(dtype, seed=0, n=13, hkv=2, d=32, P=4, pages=9, layers=3):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(pages, layers, 2, hkv, P, d, generator=g).to(dtype)
    slots = torch.randperm(pages * P, generator=g)[:n].long()
    k = torch.randn(n, hkv, d, generator=g).to(dtype)
    v = torch.randn(n, hkv, d, generator=g).to(dtype)
    return kv, k, v, slots


def _oracle(kv, layer, k, v, slots):
    out = kv.clone()
    P = kv.shape[4]
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            out[s // P, layer, 0, :, s % P] = k[t]
            out[s // P, layer, 1, :, s % P] = v[t]
    return out


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv_matches_oracle(impl, dtype):
    kv, k, v, slots = _case(dtype)
    slots[4] = -1  # padding token: skipped
    want = _oracle(kv, 2, k, v, slots)
    write_kv(kv, 2, k, v, slots, impl=impl)
    assert torch.equal(kv, want)


def test_write_kv_ref_direct_and_errors():
    kv, k, v, slots = _case(torch.float32, seed=1)
    want = _oracle(kv, 0, k, v, slots)
    write_kv_ref(kv, 0, k, v, slots)
    assert torch.equal(kv, want)
    with pytest.raises(ValueError, match="layer"):
        write_kv(kv, 3, k, v, slots)
    with pytest.raises(ValueError, match="dtype"):
        write_kv(kv, 0, k.half(), v.half(), slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(kv, 0, k, v, slots[:-1])
    with pytest.raises(ValueError, match="num_tokens"):
        write_kv(kv, 0, k[:, :1], v[:, :1], slots)
