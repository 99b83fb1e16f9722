"""The few-rows matrix product (kernels/gemv.py) against F.linear: the interpreter on the CPU
(fp16; bf16 through its float32 upcast), and on CUDA bf16 against cuBLAS, deterministic, PDL on
== off; the PDL switch's parsing."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kvstrata.kernels import _device
from kvstrata.kernels.gemv import (ARGMAX_LAUNCH, GemvLaunch, RowRms, _gemv, gemv, gemv_add_norm,
                                  gemv_argmax, gemv_launch, gemv_ok)
from kvstrata.kernels.layer_ops import add_rms_norm, silu_mul_merged

SMALL = GemvLaunch(block_n=32, block_k=64, stages=2, warps=4)
SHAPES = [(1, 64, 256), (5, 70, 192), (16, 32, 128)]      # rows, out, in (70: a partial tile)


def _close(got, want, dtype):
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(got.float(), want.float(), atol=tol * want.abs().max().item(),
                               rtol=0)


def _operands(m, n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype)
    return x, w


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_interpreter_matches_the_torch_ops(m, n, k, dtype):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU interpreter case (TRITON_INTERPRET=1)")
    x, w = _operands(m, n, k, dtype)
    b = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    want = F.linear(x.float(), w.float(), b.float())
    got = _gemv(x, w, b, SMALL, impl="triton")
    _close(got, want, dtype)
    assert torch.equal(got, _gemv(x, w, b, SMALL, impl="triton"))          # deterministic


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_interpreter_gated(m, n, k, dtype):
    """``gated``: SiLU-and-multiply of the gate and up halves in the product's epilogue, against
    the separate torch ops; bit for bit the product then silu_mul_merged's kernel (fp16, where
    the interpreter's float conversions round as torch's)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU interpreter case (TRITON_INTERPRET=1)")
    x, w = _operands(m, 2 * n, k, dtype, seed=n + k)
    b = torch.randn(2 * n, generator=torch.Generator().manual_seed(n)).to(dtype)
    y = F.linear(x.float(), w.float(), b.float())
    got = _gemv(x, w, b, SMALL, impl="triton", gated=True)
    assert got.shape == (m, n) and got.dtype == dtype
    _close(got, F.silu(y[:, :n]) * y[:, n:], dtype)
    assert torch.equal(got, _gemv(x, w, b, SMALL, impl="triton", gated=True))
    if dtype == torch.float16:
        sep = silu_mul_merged(_gemv(x, w, b, SMALL, impl="triton"), impl="triton")
        assert torch.equal(got, sep)


def _norm_chain(m, n, k, dtype, impl, launch=None, seed=0):
    """o -> (o_proj + residual add + next norm's weight, in the epilogue) -> gate/up gated with
    the row scale, and the same with the separate add_rms_norm (torch ops)."""
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(m, k, generator=g).to(dtype)
    wo = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype)
    res = torch.randn(m, n, generator=g).to(dtype)
    gamma = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    wgu = (torch.randn(64, n, generator=g) * n ** -0.5).to(dtype)
    kw = dict(impl=impl)
    xg, h, rms = (_gemv(o, wo, None, launch, impl, add_norm=(res, gamma, 1e-6)) if launch
                  else gemv_add_norm(o, wo, None, res, gamma, 1e-6, **kw))
    y = (_gemv(xg, wgu, None, launch, impl, gated=True, rms=rms) if launch
         else gemv(xg, wgu, gated=True, rms=rms, **kw))
    x_ref, h_ref = add_rms_norm(F.linear(o, wo), gamma, 1e-6, residual=res, impl="torch")
    y_ref = gemv(x_ref, wgu, gated=True, impl="torch")
    return (xg, h, rms, y), (x_ref, h_ref, y_ref, gamma)


@pytest.mark.parametrize("m,n,k", [(1, 64, 128), (5, 70, 64), (16, 96, 128)])
def test_interpreter_deferred_norm_chain(m, n, k):
    """gemv_add_norm's epilogue (residual add, g * h, per-block sums of squares) and the
    consumer's row scale give the separate add_rms_norm chain's values (fp16; the norm's
    rounding moves, so within rounding), and the torch fallback's chain too."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU interpreter case (TRITON_INTERPRET=1)")
    (xg, h, rms, y), (x_ref, h_ref, y_ref, gamma) = _norm_chain(m, n, k, torch.float16,
                                                                "triton", SMALL, seed=m)
    assert rms.parts.shape == (m, -(-n // SMALL.block_n)) and rms.dim == n
    _close(h, h_ref, torch.float16)
    torch.testing.assert_close(rms.parts.sum(1), h.float().square().sum(1), rtol=1e-5,
                               atol=1e-5)
    torch.testing.assert_close(xg.float(), gamma.float() * h.float(), rtol=1e-3, atol=1e-3)
    _close(y, y_ref, torch.float16)
    (xt, ht, rt, yt), _ = _norm_chain(m, n, k, torch.float16, "torch", seed=m)
    _close(yt, y, torch.float16)


def test_deferred_norm_checks_and_fallback():
    (xg, h, rms, y), (x_ref, h_ref, y_ref, gamma) = _norm_chain(3, 32, 64, torch.float32,
                                                                "torch")
    assert torch.equal(h, h_ref) and rms.parts.shape == (3, 1)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    bad = RowRms(torch.zeros(2, 1), 32, 1e-6)
    with pytest.raises(ValueError, match="rms parts"):
        gemv(xg, torch.zeros(8, 32), rms=bad)
    with pytest.raises(ValueError, match="residual"):
        gemv_add_norm(xg, torch.zeros(32, 32), None, h[:2], gamma, 1e-6)


def test_gated_checks_and_fallback():
    x, w = _operands(3, 8, 64, torch.float32)
    with pytest.raises(ValueError, match="gate rows"):
        gemv(x, w[:7], gated=True)
    y = F.linear(x, w)                                         # CPU: the torch ops
    assert torch.equal(gemv(x, w, gated=True), F.silu(y[:, :4]) * y[:, 4:])


def test_fallbacks_are_the_torch_ops():
    x, w = _operands(17, 32, 64, torch.float32)
    assert not gemv_ok(x, w, "triton")                     # 17 rows, float32: F.linear
    assert torch.equal(gemv(x, w, impl="triton"), F.linear(x, w))
    xb = x[:4].to(torch.bfloat16)
    assert not gemv_ok(xb, w[:, :64].to(torch.bfloat16))   # CPU, impl auto: torch
    with pytest.raises(ValueError, match="impl must be"):
        gemv_ok(xb, w, "cuda")
    with pytest.raises(ValueError, match="bias"):
        gemv(xb, w.to(torch.bfloat16), torch.zeros(3, dtype=torch.bfloat16))


def test_launch_validation_and_defaults():
    with pytest.raises(ValueError, match="power of two"):
        GemvLaunch(block_n=24)
    with pytest.raises(ValueError, match="stages"):
        GemvLaunch(stages=0)
    from kvstrata.kernels.gemv import _launch
    w = torch.empty(8, 192)
    assert _launch(w, 192, GemvLaunch(32, 256, 2, 4)) == GemvLaunch(32, 64, 2, 4)
    assert _launch(w, 100, None) is None
    assert _launch(torch.empty(8, 100), 100, None) is None      # no tile divides 100
    assert gemv_launch(6144, 4096) == GemvLaunch(64, 128, 5, 4)
    assert gemv_launch(24576, 4096) == GemvLaunch(64, 128, 3, 4)
    assert gemv_launch(4096, 12288) == GemvLaunch(32, 256, 5, 4)
    assert gemv_launch(4096, 4096) == GemvLaunch(32, 256, 5, 4, late_trigger=True)
    assert gemv_launch(12288, 4096, gated=True) == GemvLaunch(32, 128, 3, 4)


def _argmax_ref(x, w):
    """argmax of the product rounded to the activation dtype (what the kernel's keys order)."""
    return F.linear(x.float(), w.float()).to(x.dtype).float().argmax(-1)


@pytest.mark.parametrize("m,n,k", [(1, 1000, 256), (3, 777, 128), (16, 300, 64)])
@pytest.mark.parametrize("tile", [(16, 16, 1, 1), (32, 64, 2, 4), (64, 128, 2, 4)])
def test_interpreter_argmax_is_the_product_s(m, n, k, tile):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU interpreter case (TRITON_INTERPRET=1)")
    x, w = _operands(m, n, k, torch.float16, seed=m + n)
    got = gemv_argmax(x, w, impl="triton", launch=GemvLaunch(*tile))
    assert got.dtype == torch.int64 and torch.equal(got, _argmax_ref(x, w))


def test_interpreter_argmax_ties_nan_and_signed_zero():
    """The first column among equal maxima (within and across programs), NaN as +inf, every
    value negative, -0.0 equal to 0.0: torch's argmax."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU interpreter case (TRITON_INTERPRET=1)")
    lt = GemvLaunch(16, 16, 1, 1)
    x = torch.ones(2, 16, dtype=torch.float16)
    w = torch.zeros(100, 16, dtype=torch.float16)
    w[[40, 7, 90]] = 1
    assert gemv_argmax(x, w, impl="triton", launch=lt).tolist() == [7, 7]
    w.fill_(-1)
    w[55] = -0.5
    w[70] = -0.5
    assert gemv_argmax(x, w, impl="triton", launch=lt).tolist() == [55, 55]
    w.fill_(-1)
    w[33, 0] = float("nan")
    assert gemv_argmax(x, w, impl="triton", launch=lt).tolist() == [33, 33]
    x = torch.tensor([[-1.0] + [0.0] * 15], dtype=torch.float16)
    w = torch.zeros(40, 16, dtype=torch.float16)
    w[5:, 0] = 1          # columns 5.. read -1; columns 0..4 read 0 (1: -0.0)
    w[1, 1] = -0.0
    assert gemv_argmax(x, w, impl="triton", launch=lt).tolist() == [0]


def test_argmax_fallback_and_tiles():
    x, w = _operands(20, 64, 32, torch.float32)
    assert torch.equal(gemv_argmax(x, w), F.linear(x, w).argmax(-1))      # CPU: the torch ops
    assert torch.equal(gemv_argmax(x[:3], w, impl="torch"), F.linear(x[:3], w).argmax(-1))
    assert ARGMAX_LAUNCH == (GemvLaunch(64, 128, 4, 4), GemvLaunch(64, 256, 3, 4))


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5, 16])
def test_cuda_argmax_lm_head(m):
    """A Qwen3-sized head: the token of the kernel's own product (gemv), deterministic, and
    cuBLAS's wherever cuBLAS's best column is not within rounding of another."""
    x, w = (t.cuda() for t in _operands(m, 151936, 4096, torch.bfloat16, seed=m))
    got = gemv_argmax(x, w)
    assert torch.equal(got, gemv_argmax(x, w))
    assert torch.equal(got, gemv(x, w).float().argmax(-1))
    ref = F.linear(x, w).float()
    top2 = ref.topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.02 * top2[:, 0].abs()
    assert torch.equal(got[clear], ref.argmax(-1)[clear])


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 12288), (1000, 512)])
def test_cuda_bf16_against_cublas_and_the_separate_kernels(m, n, k):
    x, w = (t.cuda() for t in _operands(m, n, k, torch.bfloat16, seed=m + n))
    ref = F.linear(x, w)
    _close(gemv(x, w), ref, torch.bfloat16)
    assert torch.equal(gemv(x, w), gemv(x, w))                      # deterministic
    b = torch.randn(n, device="cuda").to(torch.bfloat16)
    _close(gemv(x, w, b), F.linear(x, w, b), torch.bfloat16)
    # gated: bit for bit the product then silu_mul_merged's kernel
    assert torch.equal(gemv(x, w, b, gated=True), silu_mul_merged(gemv(x, w, b)))


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16])
def test_cuda_deferred_norm_chain(m):
    """o_proj-shaped producer (residual add, next norm's weight, sums of squares in its
    epilogue) then the gated gate/up consumer scaled by the row rsqrt, against add_rms_norm's
    kernel and the plain products (bf16, within rounding); h bit for bit add_rms_norm's;
    deterministic."""
    g = torch.Generator(device="cuda").manual_seed(m)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    o = torch.randn(m, 4096, generator=g, **bf)
    wo = torch.randn(4096, 4096, generator=g, **bf) * 4096 ** -0.5
    res = torch.randn(m, 4096, generator=g, **bf)
    gamma = 1 + 0.1 * torch.randn(4096, generator=g, **bf)
    wgu = torch.randn(2 * 12288, 4096, generator=g, **bf) * 4096 ** -0.5
    xg, h, rms = gemv_add_norm(o, wo, None, res, gamma, 1e-6)
    y = gemv(xg, wgu, gated=True, rms=rms)
    x_ref, h_ref = add_rms_norm(gemv(o, wo), gamma, 1e-6, residual=res)
    assert torch.equal(h, h_ref)
    torch.testing.assert_close(rms.rstd(), h.float().square().mean(1).add(1e-6).rsqrt(),
                               rtol=1e-5, atol=0)
    _close(y, gemv(x_ref, wgu, gated=True), torch.bfloat16)
    xg2, h2, rms2 = gemv_add_norm(o, wo, None, res, gamma, 1e-6)
    assert torch.equal(xg, xg2) and torch.equal(rms.parts, rms2.parts)
    assert torch.equal(y, gemv(xg2, wgu, gated=True, rms=rms2))


@cuda
@pytest.mark.gpu
def test_cuda_pdl_on_equals_off(monkeypatch):
    x, w = (t.cuda() for t in _operands(4, 4096, 4096, torch.bfloat16))
    assert _device.pdl_ok(x.device, "gemv") == (torch.cuda.get_device_capability()[0] >= 9)
    on = gemv(x, w)
    monkeypatch.setenv(_device.PDL_ENV, "0")
    assert not _device.pdl_ok(x.device, "gemv")
    assert torch.equal(on, gemv(x, w))


def test_pdl_switch(monkeypatch):
    cpu = torch.device("cpu")
    assert not _device.pdl_ok(cpu, "gemv")                          # never off CUDA
    assert _device.pdl_launch(cpu, "gemv") == {"PDL": False}       # no launch_pdl either
    with pytest.raises(ValueError, match="unknown PDL kernel family"):
        _device.pdl_ok(cpu, "matmul")
    assert _device._pdl_families("1") == frozenset(_device.PDL_DEFAULT)
    assert _device._pdl_families("0") == frozenset()
    assert _device._pdl_families("gemv, attn") == {"gemv", "attn"}
    with pytest.raises(ValueError, match="unknown families"):
        _device._pdl_families("gemv,fast")
