"""The few-rows matrix product (kernels/gemv.py) against F.linear: the interpreter on the CPU
(fp16; bf16 through its float32 upcast), and on CUDA bf16 against cuBLAS, deterministic, PDL on
== off; the PDL switch's parsing."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

from kvstrata.kernels import _device
from kvstrata.kernels.gemv import GemvLaunch, _gemv, gemv, gemv_launch, gemv_ok

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
    _close(_gemv(x, w, b, SMALL, impl="triton"), want, dtype)
    # Split over K: the last program of each row block sums the partials in split order.
    from kvstrata.kernels.attention_triton import split_counters
    for split in (2, 4):
        lt = dataclasses.replace(SMALL, split_k=split)
        got = _gemv(x, w, b, lt, impl="triton")
        _close(got, want, dtype)
        assert torch.equal(got, _gemv(x, w, b, lt, impl="triton"))          # deterministic
        assert not split_counters(x.device, 8).any()                        # reset to zero


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
    with pytest.raises(ValueError, match="split_k"):
        GemvLaunch(split_k=0)
    with pytest.raises(ValueError, match="multiple of 16"):
        GemvLaunch(prefetch=100)
    from kvstrata.kernels.gemv import _launch
    w = torch.empty(8, 192)
    assert _launch(w, 192, GemvLaunch(32, 128, 2, 4, split_k=2)) == GemvLaunch(32, 32, 2, 4, 2)
    assert _launch(w, 192, GemvLaunch(32, 64, 2, 4, split_k=4)) == GemvLaunch(32, 16, 2, 4, 4)
    assert _launch(w, 192, GemvLaunch(32, 64, 2, 4, split_k=5)) == GemvLaunch(32, 64, 2, 4, 1)
    assert _launch(w, 100, None) is None
    assert gemv_launch(6144, 4096) == GemvLaunch(64, 128, 5, 4)
    assert gemv_launch(24576, 4096) == GemvLaunch(64, 128, 3, 4)
    assert gemv_launch(4096, 12288) == GemvLaunch(32, 256, 5, 4)


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
    for split in (2, 4):                         # split over K (not yet a default tile)
        lt = GemvLaunch(32, 128, 3, 4, split_k=split)
        got = _gemv(x, w, b, lt)
        _close(got, F.linear(x, w, b), torch.bfloat16)
        assert torch.equal(got, _gemv(x, w, b, lt))
    # The L2 prefetch before the PDL wait (whole rows, or more bytes than a row has) changes
    # no value.
    for pf in (1024, 1 << 20):
        lt = dataclasses.replace(gemv_launch(n, k), prefetch=pf)
        assert torch.equal(_gemv(x, w, b, lt), gemv(x, w, b))


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
