"""Fused decoder-layer element-wise kernels (Triton, interpreted on the CPU) against the torch ops
of kvstrata.nn.layers."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvstrata.kernels.kv_write import write_kv_ref
from kvstrata.kernels.layer_ops import (add_rms_norm, add_rms_norm_ref, embed_rms_norm, embed_rows,
                                        head_norm_rope,
                                        head_norm_rope_ref, qkv_norm_rope, qkv_norm_rope_ref,
                                        rope_cos_sin_rows, rope_cos_sin_rows_ref, silu_mul,
                                        silu_mul_merged, silu_mul_ref)
from kvstrata.nn.layers import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16]


def _close(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    # fp32: only the reduction order differs. bf16: a few ulps (the interpreter truncates casts).
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=7e-2, rtol=3e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
def test_add_rms_norm(dtype, residual):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 96, generator=g) * 3).to(dtype)
    r = torch.randn(5, 96, generator=g).to(dtype) if residual else None
    w = (torch.rand(96, generator=g) + 0.5).to(dtype)
    out, h = add_rms_norm(x, w, 1e-6, residual=r, impl="triton")
    want, hw = add_rms_norm_ref(x, w, 1e-6, r)
    _close(out, want, dtype)
    if dtype == torch.float32:   # exact; the interpreter's bf16 casts do not round to nearest
        assert torch.equal(h, hw)
    else:
        _close(h, hw, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_embed_rms_norm_is_add_rms_norm_of_the_rows(dtype):
    g = torch.Generator().manual_seed(1)
    emb = (torch.randn(50, 96, generator=g) * 2).to(dtype)
    w = (torch.rand(96, generator=g) + 0.5).to(dtype)
    ids = torch.tensor([3, 49, 0, 3, 17])
    out, h = embed_rms_norm(ids, emb, w, 1e-6, impl="triton")
    want, hw = add_rms_norm(emb[ids], w, 1e-6, impl="triton")
    assert torch.equal(h, emb[ids]) and torch.equal(out, want)
    assert torch.equal(embed_rows(ids, emb, impl="triton"), emb[ids])
    ref = embed_rms_norm(ids, emb, w, 1e-6, impl="torch")
    assert torch.equal(ref[1], hw)
    _close(out, ref[0], dtype)
    # an id outside the vocabulary reads as a zero row (the engine rejects such prompts)
    out, h = embed_rms_norm(torch.tensor([50, -1, 2]), emb, w, 1e-6, impl="triton")
    assert h[:2].abs().sum() == 0 and torch.equal(h[2], emb[2])


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_norm_rope(dtype):
    g = torch.Generator().manual_seed(1)
    T, H, D = 4, 3, 32
    lin = (torch.randn(T, H * D, generator=g) * 2).to(dtype)
    x = lin.view(T, H, D)
    w = (torch.rand(D, generator=g) + 0.5).to(dtype)
    cos, sin = RotaryEmbedding(D, 10000.0).cos_sin(torch.tensor([0, 5, 17, 300]))
    _close(head_norm_rope(x, w, 1e-6, cos, sin, impl="triton"),
           head_norm_rope_ref(x, w, 1e-6, cos, sin), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    g = torch.Generator().manual_seed(2)
    a, b = (torch.randn(3, 1500, generator=g) * 4).to(dtype), torch.randn(3, 1500, generator=g).to(dtype)
    _close(silu_mul(a, b, impl="triton"), silu_mul_ref(a, b), dtype)


def test_cpu_auto_is_the_torch_path():
    x = torch.randn(2, 16)
    w = torch.ones(16)
    out, h = add_rms_norm(x, w, 1e-6)
    assert torch.equal(out, add_rms_norm_ref(x, w, 1e-6)[0]) and h is x
    with pytest.raises(ValueError, match="impl"):
        silu_mul(x, x, impl="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernels_round_like_torch():
    """Compiled, with round-to-nearest casts: the residual add is exact and the rest within one
    bf16 ulp of the torch ops (only the norm's reduction order differs)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.bfloat16
    x = torch.randn(33, 4096, generator=g, device="cuda").to(dt)
    r = torch.randn(33, 4096, generator=g, device="cuda").to(dt)
    w = (torch.rand(4096, generator=g, device="cuda") + 0.5).to(dt)
    out, h = add_rms_norm(x, w, 1e-6, residual=r)
    want, hw = add_rms_norm_ref(x, w, 1e-6, r)
    assert torch.equal(h, hw)
    ids = torch.randint(0, 33, (17,), generator=g, device="cuda")
    eo, eh = embed_rms_norm(ids, x, w, 1e-6)
    assert torch.equal(eh, x[ids]) and torch.equal(eo, add_rms_norm(x[ids], w, 1e-6)[0])
    assert torch.equal(embed_rows(ids, x), x[ids])
    torch.testing.assert_close(out, want, atol=0, rtol=1.6e-2)
    q = torch.randn(33, 32 * 128, generator=g, device="cuda").to(dt).view(33, 32, 128)
    wq = (torch.rand(128, generator=g, device="cuda") + 0.5).to(dt)
    cos, sin = RotaryEmbedding(128, 1e6).to("cuda").cos_sin(torch.arange(33, device="cuda") * 97)
    torch.testing.assert_close(head_norm_rope(q, wq, 1e-6, cos, sin),
                               head_norm_rope_ref(q, wq, 1e-6, cos, sin), atol=1e-2, rtol=8e-3)
    a = torch.randn(33, 12288, generator=g, device="cuda").to(dt)
    torch.testing.assert_close(silu_mul(a, x.repeat(1, 3)), silu_mul_ref(a, x.repeat(1, 3)),
                               atol=1e-2, rtol=8e-3)


def _qkv_case(dtype, T=4, hq=4, hkv=2, D=32, seed=3):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(T, (hq + 2 * hkv) * D, generator=g) * 2).to(dtype)
    qw = (torch.rand(D, generator=g) + 0.5).to(dtype)
    kw = (torch.rand(D, generator=g) + 0.5).to(dtype)
    cos, sin = RotaryEmbedding(D, 10000.0).cos_sin(torch.tensor([0, 5, 17, 300])[:T])
    return qkv, qw, kw, cos, sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", [(4, 2), (12, 4)])
def test_qkv_norm_rope_equals_the_separate_kernels(dtype, hq, hkv):
    """One launch for q and k of a merged projection: bit for bit the head_norm_rope kernel of
    each part (same rounding steps), v a view of the input. 12 + 4 heads: a program's tile of
    ROPE_HEADS holds q and k heads both."""
    T, D = 4, 32
    qkv, qw, kw, cos, sin = _qkv_case(dtype, hq=hq, hkv=hkv)
    q, k, v = qkv_norm_rope(qkv, qw, kw, 1e-6, cos, sin, hq, hkv, impl="triton")
    parts = qkv.split([hq * D, hkv * D, hkv * D], -1)
    assert torch.equal(q, head_norm_rope(parts[0].reshape(T, hq, D), qw, 1e-6, cos, sin,
                                         impl="triton"))
    assert torch.equal(k, head_norm_rope(parts[1].reshape(T, hkv, D), kw, 1e-6, cos, sin,
                                         impl="triton"))
    assert torch.equal(v, parts[2].reshape(T, hkv, D)) and v.data_ptr() == parts[2].data_ptr()
    rq, rk, rv = qkv_norm_rope_ref(qkv, qw, kw, 1e-6, cos, sin, hq, hkv)
    _close(q, rq, dtype)
    _close(k, rk, dtype)
    # k and v only (a drafter's context K/V): the k part of the same kernel
    _, k2, v2 = qkv_norm_rope(qkv[:, hq * D:], None, kw, 1e-6, cos, sin, 0, hkv,
                              impl="triton")
    assert torch.equal(k2, k) and torch.equal(v2, v)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_qkv_norm_rope_writes_kv_like_write_kv(impl):
    """With a pool: K (normed, rotated) and V land where write_kv puts them, negative slots
    are skipped, nothing else changes; q is unchanged by the write."""
    hq, hkv, D, P = 4, 2, 32, 4
    qkv, qw, kw, cos, sin = _qkv_case(torch.float32)
    pool = torch.randn(6, 3, 2, hkv, P, D)
    want = pool.clone()
    slots = torch.tensor([5, -1, 22, 8])
    q, k, v = qkv_norm_rope(qkv, qw, kw, 1e-6, cos, sin, hq, hkv, kv_cache=pool, layer=1,
                            slot_mapping=slots, impl=impl)
    q0, k0, v0 = qkv_norm_rope(qkv, qw, kw, 1e-6, cos, sin, hq, hkv, impl=impl)
    assert k is None and torch.equal(q, q0) and torch.equal(v, v0)
    write_kv_ref(want, 1, k0, v0, slots)
    assert torch.equal(pool, want)
    with pytest.raises(ValueError, match="slot_mapping"):
        qkv_norm_rope(qkv, qw, kw, 1e-6, cos, sin, hq, hkv, kv_cache=pool, layer=1,
                      slot_mapping=slots[:2], impl=impl)
    with pytest.raises(ValueError, match="qkv must be"):
        qkv_norm_rope(qkv[:, 1:], qw, kw, 1e-6, cos, sin, hq, hkv, impl=impl)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_merged_equals_silu_mul(dtype):
    g = torch.Generator().manual_seed(4)
    gu = (torch.randn(3, 2 * 1100, generator=g) * 4).to(dtype)
    got = silu_mul_merged(gu, impl="triton")
    assert torch.equal(got, silu_mul(gu[:, :1100].contiguous(), gu[:, 1100:].contiguous(),
                                     impl="triton"))
    _close(got, silu_mul_ref(gu[:, :1100], gu[:, 1100:]), dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_qkv_norm_rope_is_the_separate_kernels_bit_for_bit():
    """Compiled: q and k equal the head_norm_rope kernel's, and the pool holds exactly what
    write_kv writes of them (the launch it replaces)."""
    from kvstrata.kernels.kv_write import write_kv
    g = torch.Generator(device="cuda").manual_seed(5)
    dt, T, hq, hkv, D = torch.bfloat16, 21, 32, 8, 128
    qkv = torch.randn(T, (hq + 2 * hkv) * D, generator=g, device="cuda").to(dt)
    qw = (torch.rand(D, generator=g, device="cuda") + 0.5).to(dt)
    kw = (torch.rand(D, generator=g, device="cuda") + 0.5).to(dt)
    cos, sin = RotaryEmbedding(D, 1e6).to("cuda").cos_sin(torch.arange(T, device="cuda") * 37)
    pool = torch.zeros(8, 2, 2, hkv, 16, D, dtype=dt, device="cuda")
    want = pool.clone()
    slots = torch.randperm(128, device="cuda")[:T]
    slots[3] = -1
    q, _, v = qkv_norm_rope(qkv, qw, kw, 1e-6, cos, sin, hq, hkv, kv_cache=pool, layer=1,
                            slot_mapping=slots)
    qs, ks, vs = qkv.split([hq * D, hkv * D, hkv * D], -1)
    assert torch.equal(q, head_norm_rope(qs.reshape(T, hq, D), qw, 1e-6, cos, sin))
    k = head_norm_rope(ks.reshape(T, hkv, D), kw, 1e-6, cos, sin)
    write_kv(want, 1, k, vs.reshape(T, hkv, D).contiguous(), slots)
    assert torch.equal(pool, want)


@pytest.mark.parametrize("scaling", [1.0, 0.7])
@pytest.mark.parametrize("half", [64, 40])
def test_rope_cos_sin_rows_are_rotary_embedding_values(scaling, half):
    """The one-launch cos/sin against the torch ops (RotaryEmbedding.cos_sin's, and the
    functional rope_cos_sin's cast): every position, both dtypes, a head_dim that is not a power
    of two (80). Under the interpreter (numpy's cos/sin) to a float32 ulp or so; the torch path
    (impl="torch") exactly."""
    pos = torch.cat([torch.arange(0, 300), torch.randint(0, 40960, (37,))])
    rot = RotaryEmbedding(2 * half, 1e6)
    want = rot.cos_sin(pos)
    if scaling != 1.0:
        want = tuple(t / rot.attention_scaling * scaling for t in want)
    for dtype in (torch.float32, torch.bfloat16):
        ref = rope_cos_sin_rows_ref(pos, rot.inv_freq, scaling, dtype)
        # a bf16 buffer (a model cast to bf16) is upcast, as torch's product upcasts it
        inv16 = rot.inv_freq.bfloat16()
        torch.testing.assert_close(
            rope_cos_sin_rows(pos, inv16, scaling, dtype, impl="triton")[0].float(),
            rope_cos_sin_rows_ref(pos, inv16, scaling, dtype)[0].float(), rtol=0,
            atol=1e-6 if dtype == torch.float32 else 8e-3)
        for r, w in zip(ref, want):
            torch.testing.assert_close(r, w.to(dtype), rtol=0, atol=0)
        assert all(torch.equal(a, b) for a, b in zip(
            rope_cos_sin_rows(pos, rot.inv_freq, scaling, dtype, impl="torch"), ref))
        got = rope_cos_sin_rows(pos, rot.inv_freq, scaling, dtype, impl="triton")
        for g, r in zip(got, ref):
            assert g.dtype == dtype and g.shape == (pos.shape[0], 2 * half)
            torch.testing.assert_close(g.float(), r.float(), rtol=0,
                                       atol=1e-6 if dtype == torch.float32 else 8e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rope_cos_sin_rows_are_the_torch_ops_bit_for_bit():
    """On CUDA the kernel calls libdevice's cos/sin, as torch's kernels do: the same bits as
    the torch ops for positions 0 .. 131071 (Qwen3's theta and head_dim, and the drafter's
    bf16 cast)."""
    pos = torch.arange(0, 131072, device="cuda")
    inv = RotaryEmbedding(128, 1e6).inv_freq.cuda()
    # a model cast to bf16 casts the rotary buffer too
    for inv_dtype, dtype in itertools.product((torch.float32, torch.bfloat16), repeat=2):
        got = rope_cos_sin_rows(pos, inv.to(inv_dtype), 1.0, dtype)
        ref = rope_cos_sin_rows_ref(pos, inv.to(inv_dtype), 1.0, dtype)
        for g, r in zip(got, ref):
            assert torch.equal(g, r), (inv_dtype, dtype, (g != r).sum().item())
