"""The few-rows matrix product (kernels/gemv.py) against F.linear: the interpreter on the CPU
(fp16; bf16 through its float32 upcast), and on CUDA bf16 against cuBLAS, deterministic, PDL on
== off; the PDL switch's parsing."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kvstrata.kernels import _device
from kvstrata.kernels.gemv import (GemvLaunch, _gemv, _norm_gemv, gemv, gemv_launch, gemv_ok,
                                   norm_gemv)
from kvstrata.kernels.layer_ops import add_rms_norm, add_rms_norm_ref, silu_mul_merged

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
    b = torch.randn(n).to(dtype)
    want = F.linear(x.float(), w.float(), b.float())
    got = _gemv(x, w, b, SMALL, impl="triton")
    _close(got, want, dtype)
    assert torch.equal(got, _gemv(x, w, b, SMALL, impl="triton"))          # deterministic


def _norm_reference(x, g, eps, w, b, r, gated):
    xn, h = add_rms_norm_ref(x, g, eps, r)
    y = F.linear(xn.float(), w.float(), None if b is None else b.float())
    if gated:
        n = y.shape[1] // 2
        y = F.silu(y[:, :n]) * y[:, n:]
    return y, h


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("res", [False, True])
def test_interpreter_norm_gemv(m, n, k, gated, res):
    """The pre-norm product in one launch (residual add, RMSNorm, product, SiLU gate) against
    the separate torch ops: h bit for bit, y to bf16 rounding; fp16 takes the separate ops."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU interpreter case (TRITON_INTERPRET=1)")
    dt = torch.bfloat16
    x, w = _operands(m, 2 * n if gated else n, k, dt, seed=n + k)
    g = torch.Generator().manual_seed(m)
    r = (torch.randn(m, k, generator=g) * 4).to(dt) if res else None
    gamma = (1 + 0.3 * torch.randn(k, generator=g)).to(dt)
    b = torch.randn(w.shape[0], generator=g).to(dt)
    want, want_h = _norm_reference(x, gamma, 1e-6, w, b, r, gated)
    got, h = _norm_gemv(x, gamma, 1e-6, w, b, r, gated, SMALL, impl="triton")
    assert got.shape == want.shape and got.dtype == dt
    # the residual stream, as the norm kernel rounds it (the interpreter's float32 -> bf16
    # conversion differs from torch's CPU add in the last bit)
    assert torch.equal(h, add_rms_norm(x, gamma, 1e-6, r, impl="triton")[1])
    _close(h, want_h, dt)
    _close(got, want, dt)
    assert torch.equal(got, _norm_gemv(x, gamma, 1e-6, w, b, r, gated, SMALL,
                                       impl="triton")[0])            # deterministic
    # fp16 (h * gamma could overflow before the scale): exactly the separate launches
    x16, w16, g16 = x.half(), w.half(), gamma.half()
    r16 = r.half() if res else None
    xn, h16 = add_rms_norm(x16, g16, 1e-6, r16, impl="triton")
    y16 = _gemv(xn, w16, None, SMALL, impl="triton")
    y16 = silu_mul_merged(y16, impl="triton") if gated else y16
    got16, hh = _norm_gemv(x16, g16, 1e-6, w16, None, r16, gated, SMALL, impl="triton")
    assert torch.equal(got16, y16) and torch.equal(hh, h16)


def test_norm_gemv_checks_and_fallback():
    x, w = _operands(3, 8, 64, torch.float32)
    gamma = torch.ones(64)
    with pytest.raises(ValueError, match="gate rows"):
        norm_gemv(x, gamma, 1e-6, w[:7], gated=True)
    with pytest.raises(ValueError, match="residual"):
        norm_gemv(x, gamma, 1e-6, w, residual=x[:2])
    y, h = norm_gemv(x, gamma, 1e-6, w, residual=x)            # CPU: the torch ops
    want_h = x + x
    assert torch.equal(h, want_h)
    assert torch.equal(y, F.linear(add_rms_norm_ref(want_h, gamma, 1e-6)[0], w))


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
    assert gemv_launch(12288, 4096, gated=True) == GemvLaunch(32, 128, 3, 4)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


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
    # the pre-norm product, gated and not, against the separate kernels
    g = torch.Generator().manual_seed(n)
    r = (torch.randn(m, k, generator=g) * 4).to(torch.bfloat16).cuda()
    gamma = (1 + 0.3 * torch.randn(k, generator=g)).to(torch.bfloat16).cuda()
    for gated in (False, True):
        want, want_h = _norm_reference(x, gamma, 1e-6, w, b, r, gated)
        got, h = norm_gemv(x, gamma, 1e-6, w, b, residual=r, gated=gated)
        assert torch.equal(h, want_h)
        _close(got, want, torch.bfloat16)
        assert torch.equal(got, norm_gemv(x, gamma, 1e-6, w, b, residual=r, gated=gated)[0])


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
