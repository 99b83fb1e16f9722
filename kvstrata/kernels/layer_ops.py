"""Fused element-wise operations of a Qwen3 decoder layer (one launch each instead of 5-8).

At decode batch sizes a layer's matrix products are short, and the launches of the small
element-wise kernels between them (RMSNorm in float32, q/k norm, RoPE, SiLU, residual adds: ~35
launches per layer) cost more than the products' memory traffic. Each function here is one Triton
launch and follows the torch path's roundings (every torch bf16 element-wise op computes in
float32 and rounds), so results match it up to the reduction order of the norm:

- :func:`add_rms_norm`: ``h = x + residual`` (optional), ``weight * (h * rsqrt(mean(h^2)+eps))``.
- :func:`head_norm_rope`: per-head RMSNorm then rotate-half RoPE of ``[T, heads, head_dim]``.
- :func:`silu_mul`: ``silu(gate) * up``.

The ``*_ref`` functions are the torch references (the CPU path): exactly the ops of
:mod:`kvstrata.nn.layers`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..nn.layers import apply_rotary, rms_norm

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None


def add_rms_norm_ref(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
                     ) -> tuple[Tensor, Tensor]:
    h = x if residual is None else residual + x
    return rms_norm(h, weight, eps), h


def head_norm_rope_ref(x: Tensor, weight: Tensor, eps: float, cos: Tensor, sin: Tensor
                       ) -> Tensor:
    return apply_rotary(rms_norm(x, weight, eps), cos, sin)


def silu_mul_ref(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


if triton is not None:
    @triton.jit
    def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, h_ptr, dim, eps, s_x, s_r, s_o, s_h,
                             HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        ok = c < dim
        x = tl.load(x_ptr + row * s_x + c, mask=ok, other=0.0)
        if HAS_RES:
            x = (tl.load(r_ptr + row * s_r + c, mask=ok, other=0.0).to(tl.float32)
                 + x.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(h_ptr + row * s_h + c, x, mask=ok)
        xf = x.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(xf * xf, 0) / dim + eps)
        y = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * s_o + c, (w * y).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _head_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, eps, s_xt, s_xh, s_ot,
                               s_oh, s_c, s_s, HEAD_DIM: tl.constexpr, HALF: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        i = tl.arange(0, HALF)
        base = x_ptr + t * s_xt + h * s_xh
        x1 = tl.load(base + i).to(tl.float32)
        x2 = tl.load(base + HALF + i).to(tl.float32)
        rstd = tl.math.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / HEAD_DIM + eps)
        dt = out_ptr.dtype.element_ty
        w1 = tl.load(w_ptr + i).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + i).to(tl.float32)
        n1 = (w1 * (x1 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        n2 = (w2 * (x2 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        c1 = tl.load(cos_ptr + t * s_c + i).to(dt).to(tl.float32)
        c2 = tl.load(cos_ptr + t * s_c + HALF + i).to(dt).to(tl.float32)
        s1 = tl.load(sin_ptr + t * s_s + i).to(dt).to(tl.float32)
        s2 = tl.load(sin_ptr + t * s_s + HALF + i).to(dt).to(tl.float32)
        # rotate-half: [x1, x2] -> [x1 c1 - x2 s1, x2 c2 + x1 s2], each product rounded as torch
        o1 = ((n1 * c1).to(dt).to(tl.float32) + (-n2 * s1).to(dt).to(tl.float32)).to(dt)
        o2 = ((n2 * c2).to(dt).to(tl.float32) + (n1 * s2).to(dt).to(tl.float32)).to(dt)
        ob = out_ptr + t * s_ot + h * s_oh
        tl.store(ob + i, o1)
        tl.store(ob + HALF + i, o2)

    @triton.jit
    def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(out_ptr + offs, (s * u).to(dt), mask=ok)


def _use_triton(x: Tensor, impl: str) -> bool:
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    if torch.is_grad_enabled() and x.requires_grad:
        return False     # the kernels have no backward: autograd takes the torch ops
    return triton is not None and (impl == "triton" or (impl == "auto"
                                                        and x.device.type == "cuda"))


def add_rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None,
                 impl: str = "auto") -> tuple[Tensor, Tensor]:
    """``(rms_norm(residual + x), residual + x)``; x, residual: ``[T, dim]`` (rows contiguous),
    weight ``[dim]`` of x's dtype. Without ``residual`` the second result is ``x``."""
    if not _use_triton(x, impl) or weight.dtype != x.dtype or x.stride(-1) != 1 or (
            residual is not None and residual.stride(-1) != 1):
        return add_rms_norm_ref(x, weight, eps, residual)
    T, dim = x.shape
    out = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else x
    r = residual if residual is not None else x
    if T:
        _add_rms_norm_kernel[(T,)](x, r, weight, out, h, dim, eps, x.stride(0), r.stride(0),
                                   out.stride(0), h.stride(0), HAS_RES=residual is not None,
                                   BLOCK=triton.next_power_of_2(dim),
                                   num_warps=8 if dim >= 2048 else 4)
    return out, h


def head_norm_rope(x: Tensor, weight: Tensor, eps: float, cos: Tensor, sin: Tensor,
                   impl: str = "auto") -> Tensor:
    """Per-head RMSNorm then RoPE: x ``[T, heads, head_dim]`` (head_dim contiguous), weight
    ``[head_dim]``, cos/sin ``[T, head_dim]`` (float32). Returns a new ``[T, heads, head_dim]``."""
    T, H, D = x.shape
    if not _use_triton(x, impl) or weight.dtype != x.dtype or x.stride(2) != 1 or D % 2 or (
            D & (D - 1)) or cos.stride(1) != 1 or sin.stride(1) != 1:
        return head_norm_rope_ref(x, weight, eps, cos, sin)
    out = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if T:
        _head_norm_rope_kernel[(T, H)](x, weight, cos, sin, out, eps, x.stride(0), x.stride(1),
                                       out.stride(0), out.stride(1), cos.stride(0),
                                       sin.stride(0), HEAD_DIM=D, HALF=D // 2, num_warps=1)
    return out


def silu_mul(gate: Tensor, up: Tensor, impl: str = "auto") -> Tensor:
    """``silu(gate) * up`` of two contiguous tensors of one shape and dtype."""
    if not _use_triton(gate, impl) or not (gate.is_contiguous() and up.is_contiguous()) or (
            gate.shape != up.shape or gate.dtype != up.dtype):
        return silu_mul_ref(gate, up)
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _silu_mul_kernel[(triton.cdiv(n, 1024),)](gate, up, out, n, BLOCK=1024, num_warps=4)
    return out


__all__ = ["add_rms_norm", "add_rms_norm_ref", "head_norm_rope", "head_norm_rope_ref",
           "silu_mul", "silu_mul_ref"]
