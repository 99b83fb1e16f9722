"""The torch reference of paged attention against dense scaled_dot_product_attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvstrata.kernels.attention import paged_attention, paged_attention_ref
from kvstrata.kernels.attention_plan import plan_attention
from attention_cases import make_case


def _dense(case, sm_scale, window=None):
    """Per-sequence dense SDPA with an explicit boolean mask (the independent oracle)."""
    meta = case.meta
    seq_lens, q_lens = meta.host_lens()
    outs, start = [], 0
    for s, (L, ql) in enumerate(zip(seq_lens, q_lens)):
        q = case.q[start:start + ql].float().transpose(0, 1)            # [Hq, ql, D]
        k, v = case.dense_k[s].float(), case.dense_v[s].float()        # [Hkv, L, D]
        pos = torch.arange(L - ql, L) if meta.causal else torch.arange(L, L + ql)
        j = torch.arange(L)
        mask = (j[None] <= pos[:, None]) if meta.causal else torch.ones(ql, L, dtype=torch.bool)
        if window is not None:
            mask &= j[None] > pos[:, None] - window
        if case.block_kv is not None:
            k = torch.cat([k, case.block_kv[0][start:start + ql].float().transpose(0, 1)], 1)
            v = torch.cat([v, case.block_kv[1][start:start + ql].float().transpose(0, 1)], 1)
            mask = torch.cat([mask, torch.ones(ql, ql, dtype=torch.bool)], 1)
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                           scale=sm_scale, enable_gqa=True)[0]
        outs.append(o.transpose(0, 1))
        start += ql
    return torch.cat(outs)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("window", [None, 7])
def test_ref_causal_matches_sdpa(group, window):
    case = make_case([37, 1, 50, 16], [5, 1, 1, 16], group=group, seed=group)
    out = paged_attention_ref(case.q, case.kv_cache, case.layer, case.meta, sm_scale=0.3,
                              sliding_window=window)
    torch.testing.assert_close(out.float(), _dense(case, 0.3, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 9])
def test_ref_block_mode_matches_sdpa(window):
    case = make_case([0, 33, 17], [4, 4, 3], group=4, block=True, seed=3)
    out = paged_attention_ref(case.q, case.kv_cache, case.layer, case.meta, sm_scale=0.125,
                              sliding_window=window, block_kv=case.block_kv)
    torch.testing.assert_close(out.float(), _dense(case, 0.125, window), atol=1e-5, rtol=1e-5)
    # The block is bidirectional: the first query must see the last block token.
    k2 = case.block_kv[0].clone()
    k2[3] += 5.0
    out2 = paged_attention_ref(case.q, case.kv_cache, case.layer, case.meta, sm_scale=0.125,
                               sliding_window=window, block_kv=(k2, case.block_kv[1]))
    assert not torch.allclose(out2[0], out[0])


def test_ref_auto_on_cpu_is_ref_and_bf16_output_dtype():
    case = make_case([20, 9], [3, 2], dtype=torch.bfloat16, seed=5)
    a = paged_attention(case.q, case.kv_cache, case.layer, case.meta, sm_scale=0.2)
    b = paged_attention_ref(case.q, case.kv_cache, case.layer, case.meta, sm_scale=0.2)
    assert a.dtype == torch.bfloat16 and torch.equal(a, b)


def test_plan_rejects_bad_input():
    bt = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="int32"):
        plan_attention(bt.long(), [1, 2], [1, 1], page_size=16)
    with pytest.raises(ValueError, match="power of two"):
        plan_attention(bt, [1, 2], [1, 1], page_size=12)
    with pytest.raises(ValueError, match="outside"):
        plan_attention(bt, [1, 49], [1, 1], page_size=16)
    with pytest.raises(ValueError, match="query tokens but only"):
        plan_attention(bt, [1, 2], [2, 1], page_size=16)
    with pytest.raises(ValueError, match="entries"):
        plan_attention(bt, [1], [1, 1], page_size=16)
    meta = plan_attention(bt, [4, 2], [1, 1], page_size=16)
    q = torch.randn(2, 4, 16)
    kv = torch.randn(4, 1, 2, 2, 16, 16)
    with pytest.raises(ValueError, match="layer"):
        paged_attention(q, kv, 1, meta, sm_scale=1.0)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(torch.randn(2, 3, 16), kv, 0, meta, sm_scale=1.0)
    with pytest.raises(ValueError, match="block_kv"):
        paged_attention(q, kv, 0, meta, sm_scale=1.0, block_kv=(q[:, :2], q[:, :2]))
    with pytest.raises(ValueError, match="impl"):
        paged_attention(q, kv, 0, meta, sm_scale=1.0, impl="cuda")
    with pytest.raises(ValueError, match="dtype|share"):
        paged_attention(q.half(), kv, 0, meta, sm_scale=1.0)
