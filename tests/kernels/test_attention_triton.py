"""Triton paged attention (under TRITON_INTERPRET=1 on the CPU) against the torch reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from kvstrata.kernels.attention import (choose_num_splits, paged_attention, paged_attention_ref,
                                        plan_attention)
from kvstrata.kernels.kv_write import write_kv
from test_attention_helpers import make_case, tol


def _check(case, sm_scale=0.3, window=None):
    got = paged_attention(case.q, case.kv_cache, case.layer, case.meta, sm_scale=sm_scale,
                          sliding_window=window, block_kv=case.block_kv, impl="triton")
    want = paged_attention_ref(case.q, case.kv_cache, case.layer, case.meta, sm_scale=sm_scale,
                               sliding_window=window, block_kv=case.block_kv)
    assert got.dtype == case.q.dtype and got.shape == case.q.shape
    torch.testing.assert_close(got.float(), want.float(), **tol(case.q.dtype))
    return got


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("window", [None, 7])
def test_causal_decode_prefill_verify_mix(group, window):
    # decode (1), verify (16), prefill chunk spanning pages (5), a full prompt (37), no query (0)
    case = make_case([37, 1, 50, 16, 21], [37, 1, 1, 16, 0], group=group, seed=group)
    _check(case, window=window)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes_head_dim_128(dtype):
    case = make_case([45, 3, 70], [1, 3, 9], hkv=2, group=4, head_dim=128, dtype=dtype, seed=7)
    _check(case, sm_scale=128 ** -0.5)


def test_non_power_of_two_group_and_head_dim():
    case = make_case([29, 40], [6, 1], hkv=1, group=3, head_dim=80, page_size=8, seed=11)
    _check(case)


@pytest.mark.parametrize("window", [None, 100])
def test_split_kv_matches_unsplit(window):
    case = make_case([300, 70, 129], [1, 3, 2], group=4, num_splits=3, seed=2)
    assert case.meta.num_splits == 3 and case.meta.tokens_per_split == 128
    split = _check(case, window=window)
    one = make_case([300, 70, 129], [1, 3, 2], group=4, num_splits=1, seed=2)
    unsplit = paged_attention(one.q, one.kv_cache, one.layer, one.meta, sm_scale=0.3,
                              sliding_window=window, impl="triton")
    torch.testing.assert_close(split, unsplit, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("splits", [1, 2])
def test_block_mode(window, splits):
    case = make_case([0, 233, 17], [4, 4, 3], group=4, block=True, num_splits=splits, seed=3)
    _check(case, sm_scale=0.125, window=window)


def test_split_choice_is_host_only_and_sane():
    assert choose_num_splits(1, 32768, num_kv_heads=8, num_sms=132) == 64   # ~4 waves, capped
    assert choose_num_splits(1, 1024, num_kv_heads=8, num_sms=132) == 2
    assert choose_num_splits(128, 32768, num_kv_heads=8, num_sms=132) == 1
    assert choose_num_splits(32, 8192, num_kv_heads=8, num_sms=132) == 3    # 256 programs: 2 uneven waves
    bt = torch.zeros(1, 2048, dtype=torch.int32)
    meta = plan_attention(bt, [32768], [1], page_size=16, num_sms=132, num_kv_heads=8)
    assert meta.num_splits == 64 and meta.tokens_per_split % 64 == 0
    assert meta.num_splits * meta.tokens_per_split >= 32768
    meta = plan_attention(bt, torch.tensor([100], dtype=torch.int32), [1], page_size=16)
    assert meta.max_seq_len == 100 and meta.seq_lens_host == [100] and meta.num_splits == 1


def test_int64_addressing_past_2_31_elements():
    """A real pool of > 2**31 elements (bf16, ~4.3 GB virtual; only touched pages are resident):
    pages at the top of the pool sit past the int32 range of element offsets."""
    P, D = 16, 16
    num_pages = 2 ** 31 // (2 * P * D) + 64
    kv = torch.empty(num_pages, 1, 2, 1, P, D, dtype=torch.bfloat16)
    assert kv.numel() > 2 ** 31 and (num_pages - 1) * kv.stride(0) > 2 ** 31
    pages = [num_pages - 1, num_pages - 7, 5, num_pages - 3]
    g = torch.Generator().manual_seed(0)
    kv[:8] = torch.randn(8, 1, 2, 1, P, D, generator=g).bfloat16()  # decoys a wrap would hit
    seq_len = 4 * P - 3
    slots = torch.tensor([pages[i // P] * P + i % P for i in range(seq_len)], dtype=torch.int64)
    k = torch.randn(seq_len, 1, D, generator=g).bfloat16()
    v = torch.randn(seq_len, 1, D, generator=g).bfloat16()
    write_kv(kv, 0, k, v, slots, impl="triton")
    assert torch.equal(kv[num_pages - 3, 0, 1, 0, :seq_len - 3 * P], v[3 * P:, 0])
    q = torch.randn(3, 4, D, generator=g).bfloat16()
    meta = plan_attention(torch.tensor([pages], dtype=torch.int32), [seq_len], [3], page_size=P)
    got = paged_attention(q, kv, 0, meta, sm_scale=0.25, impl="triton")
    # Oracle from the dense K/V (independent of any pool indexing).
    pos = torch.arange(seq_len - 3, seq_len)
    mask = torch.arange(seq_len)[None] <= pos[:, None]
    s = torch.einsum("qhd,kd->hqk", q.float(), k[:, 0].float()) * 0.25
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
    want = torch.einsum("hqk,kd->qhd", p, v[:, 0].float())
    torch.testing.assert_close(got.float(), want, **tol(torch.bfloat16))


@given(lens=st.lists(st.tuples(st.integers(0, 70), st.integers(0, 9)), min_size=1, max_size=4),
       group=st.sampled_from([1, 2, 4, 8]), window=st.one_of(st.none(), st.integers(1, 40)),
       block=st.booleans(), splits=st.integers(1, 3), seed=st.integers(0, 2 ** 16))
def test_property_triton_equals_reference(lens, group, window, block, splits, seed):
    seq_lens = [s if block else max(s, q) for s, q in lens]
    q_lens = [q for _, q in lens]
    if sum(q_lens) == 0:
        q_lens[0] = 1
        seq_lens[0] = max(seq_lens[0], 1)
    case = make_case(seq_lens, q_lens, hkv=2, group=group, head_dim=32, page_size=8,
                     block=block, num_splits=splits, seed=seed)
    _check(case, window=window)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block", [False, True])
def test_cuda_compiled_kernel_matches_reference(dtype, block):
    """The compiled kernel on a GPU (run by benchmarks/gpu_run.sh), split and unsplit."""
    for splits in (1, 4):
        c = make_case([300, 1, 77], [1, 1, 16] if not block else [4, 4, 16], hkv=8, group=4,
                      head_dim=128, dtype=dtype, block=block, num_splits=splits, seed=splits)
        q, kv = c.q.cuda(), c.kv_cache.cuda()
        sl, ql = c.meta.host_lens()
        meta = plan_attention(c.meta.block_tables, sl, ql, page_size=16, causal=not block,
                              num_splits=splits, device="cuda")
        bkv = None if c.block_kv is None else (c.block_kv[0].cuda(), c.block_kv[1].cuda())
        for window in (None, 50):
            got = paged_attention(q, kv, c.layer, meta, sm_scale=0.1, sliding_window=window,
                                  block_kv=bkv, impl="triton")
            want = paged_attention_ref(c.q, c.kv_cache, c.layer, c.meta, sm_scale=0.1,
                                       sliding_window=window, block_kv=c.block_kv)
            torch.testing.assert_close(got.cpu().float(), want.float(),
                                       **(tol(dtype) if dtype != torch.float32
                                          else dict(atol=1e-4, rtol=1e-4)))
