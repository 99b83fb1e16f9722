"""Fused decoder-layer element-wise kernels (Triton, interpreted on the CPU) against the torch ops
of kvstrata.nn.layers."""

from __future__ import annotations

import pytest
import torch

from kvstrata.kernels.layer_ops import (add_rms_norm, add_rms_norm_ref, head_norm_rope,
                                        head_norm_rope_ref, silu_mul, silu_mul_ref)
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
    torch.testing.assert_close(out, want, atol=0, rtol=1.6e-2)
    q = torch.randn(33, 32 * 128, generator=g, device="cuda").to(dt).view(33, 32, 128)
    wq = (torch.rand(128, generator=g, device="cuda") + 0.5).to(dt)
    cos, sin = RotaryEmbedding(128, 1e6).to("cuda").cos_sin(torch.arange(33, device="cuda") * 97)
    torch.testing.assert_close(head_norm_rope(q, wq, 1e-6, cos, sin),
                               head_norm_rope_ref(q, wq, 1e-6, cos, sin), atol=1e-2, rtol=8e-3)
    a = torch.randn(33, 12288, generator=g, device="cuda").to(dt)
    torch.testing.assert_close(silu_mul(a, x.repeat(1, 3)), silu_mul_ref(a, x.repeat(1, 3)),
                               atol=1e-2, rtol=8e-3)
