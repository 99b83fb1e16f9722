"""Fused element-wise operations of a Qwen3 decoder layer (one launch each instead of 5-8).

At decode batch sizes a layer's matrix products are short, and the launches of the small
element-wise kernels between them (RMSNorm in float32, q/k norm, RoPE, SiLU, residual adds: ~35
launches per layer) cost more than the products' memory traffic. Each function here is one Triton
launch and follows the torch path's roundings (every torch bf16 element-wise op computes in
float32 and rounds), so results match it up to the reduction order of the norm:

- :func:`add_rms_norm`: ``h = x + residual`` (optional), ``weight * (h * rsqrt(mean(h^2)+eps))``;
  :func:`embed_rms_norm`: the same of embedding rows gathered by token id (a decoder's input);
  :func:`embed_rows`: the rows alone.
- :func:`head_norm_rope`: per-head RMSNorm then rotate-half RoPE of ``[T, heads, head_dim]``.
- :func:`silu_mul`: ``silu(gate) * up``; :func:`silu_mul_merged`: the same of a merged
  ``[T, 2 * inter]`` gate/up product (gate columns first).
- :func:`rope_cos_sin_rows`: the step's RoPE ``cos``/``sin`` rows from its positions (the
  torch ops took 7 launches, 12 when the inverse frequencies were built each time).
- :func:`qkv_norm_rope`: of a merged ``[T, (Hq + 2 Hkv) * D]`` q/k/v product, q- and k-norm +
  RoPE of every head and (optionally) the K/V write into the pool's slots, one launch for what
  took three (q, k, :func:`~kvstrata.kernels.kv_write.write_kv`).

The ``*_ref`` functions are the torch references (the CPU path): exactly the ops of
:mod:`kvstrata.nn.layers`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..nn.layers import apply_rotary, rms_norm
from ..nn.layers import rope_cos_sin_rows as rope_cos_sin_rows_ref
from ._device import gdc_launch_dependents, gdc_wait, pdl_launch, use_triton  # noqa: F401
from .kv_write import check_kv_write, write_kv_ref

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None

#: Heads per program of the q/k norm + RoPE kernels. Measured on the H200 (docs/benchmarks.md,
#: sixth runner session; qkv_norm_rope with the K/V write, Qwen3-8B heads, us per launch at 1 /
#: 16 / 256 / 1024 rows): one head and one warp per program (the first version) 1.40 / 1.59 /
#: 12.98 / 49.97; 8 heads with 8 warps 1.34 / 1.47 / 3.71 / 11.56, with 4 warps 1.50 / 1.65 /
#: 3.62 / 8.17, with 2 warps 2.02 / 2.15 / 3.36 / 8.53.
ROPE_HEADS = 8


def rope_warps(rows: int) -> int:
    """Warps per program of the q/k norm + RoPE kernels for ``rows`` tokens (chosen by rows
    only, so :func:`qkv_norm_rope` and :func:`head_norm_rope` of the same rows share a tile
    and round alike)."""
    return 8 if rows <= 64 else 4


def add_rms_norm_ref(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
                     ) -> tuple[Tensor, Tensor]:
    h = x if residual is None else residual + x
    return rms_norm(h, weight, eps), h


def head_norm_rope_ref(x: Tensor, weight: Tensor, eps: float, cos: Tensor, sin: Tensor
                       ) -> Tensor:
    return apply_rotary(rms_norm(x, weight, eps), cos, sin)


def silu_mul_ref(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


def _split_qkv(qkv: Tensor, hq: int, hkv: int, d: int) -> tuple[Tensor, Tensor, Tensor]:
    T = qkv.shape[0]
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], -1)
    return q.view(T, hq, d), k.view(T, hkv, d), v.view(T, hkv, d)


def qkv_norm_rope_ref(qkv: Tensor, q_weight: Tensor | None, k_weight: Tensor, eps: float,
                      cos: Tensor, sin: Tensor, num_q_heads: int, num_kv_heads: int,
                      kv_cache: Tensor | None = None, layer: int = 0,
                      slot_mapping: Tensor | None = None
                      ) -> tuple[Tensor | None, Tensor | None, Tensor]:
    d = k_weight.shape[0]
    q, k, v = _split_qkv(qkv, num_q_heads, num_kv_heads, d)
    qo = head_norm_rope_ref(q, q_weight, eps, cos, sin) if num_q_heads else None
    ko = head_norm_rope_ref(k, k_weight, eps, cos, sin)
    if kv_cache is None:
        return qo, ko, v
    write_kv_ref(kv_cache, layer, ko, v, slot_mapping)
    return qo, None, v


if triton is not None:
    @triton.jit
    def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, h_ptr, dim, eps, s_x, s_r, s_o, s_h,
                             ids_ptr, V, HAS_RES: tl.constexpr, GATHER: tl.constexpr,
                             BLOCK: tl.constexpr, PDL: tl.constexpr, NORM: tl.constexpr = True):
        # GATHER: x's row is the embedding row x[ids[row]] (zeros for an id outside [0, V)),
        # also stored as h; without NORM nothing else (the rows alone)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        ok = c < dim
        if GATHER:
            tok = tl.load(ids_ptr + row).to(tl.int64)
            valid = (tok >= 0) & (tok < V)
            x = tl.load(x_ptr + tl.where(valid, tok, 0) * s_x + c, mask=ok, other=0.0)
            x = tl.where(valid, x, tl.zeros_like(x))
            tl.store(h_ptr + row * s_h + c, x, mask=ok)
            if not NORM:
                return
        else:
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
    def _norm_rope_heads(xa, w1, w2, cos_ptr, sin_ptr, t, eps, s_c, s_s, ok,
                         HEAD_DIM: tl.constexpr, HALF: tl.constexpr):
        """RMSNorm then rotate-half RoPE of a tile of heads of token ``t``: ``xa`` ``[HEADS, 1]``
        pointers to each head's first element (rows not ``ok`` read as zeros), ``w1``/``w2``
        the norm weight's halves (float32, ``[HEADS or 1, HALF]``). Each product is rounded as
        torch rounds it in the activation dtype (``xa``'s); returns both halves in that
        dtype."""
        dt = xa.dtype.element_ty
        i = tl.arange(0, HALF)[None, :]
        x1 = tl.load(xa + i, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(xa + HALF + i, mask=ok, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_DIM + eps)[:, None]
        n1 = (w1 * (x1 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        n2 = (w2 * (x2 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        c1 = tl.load(cos_ptr + t * s_c + i).to(dt).to(tl.float32)
        c2 = tl.load(cos_ptr + t * s_c + HALF + i).to(dt).to(tl.float32)
        s1 = tl.load(sin_ptr + t * s_s + i).to(dt).to(tl.float32)
        s2 = tl.load(sin_ptr + t * s_s + HALF + i).to(dt).to(tl.float32)
        # rotate-half: [x1, x2] -> [x1 c1 - x2 s1, x2 c2 + x1 s2]
        o1 = ((n1 * c1).to(dt).to(tl.float32) + (-n2 * s1).to(dt).to(tl.float32)).to(dt)
        o2 = ((n2 * c2).to(dt).to(tl.float32) + (n1 * s2).to(dt).to(tl.float32)).to(dt)
        return o1, o2

    @triton.jit
    def _head_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, eps, H, s_xt, s_xh,
                               s_ot, s_oh, s_c, s_s, HEAD_DIM: tl.constexpr,
                               HALF: tl.constexpr, HEADS: tl.constexpr):
        # Grid (T, cdiv(H, HEADS)): HEADS heads of one token per program.
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
        ok = (h < H)[:, None]
        h = h.to(tl.int64)[:, None]
        i = tl.arange(0, HALF)
        w1 = tl.load(w_ptr + i).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + i).to(tl.float32)[None, :]
        o1, o2 = _norm_rope_heads(x_ptr + t * s_xt + h * s_xh, w1, w2, cos_ptr, sin_ptr, t, eps,
                                  s_c, s_s, ok, HEAD_DIM, HALF)
        ob = out_ptr + t * s_ot + h * s_oh + i[None, :]
        tl.store(ob, o1, mask=ok)
        tl.store(ob + HALF, o2, mask=ok)

    @triton.jit
    def _qkv_norm_rope_kernel(x_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, kv_ptr,
                              slot_ptr, eps, layer_off, s_xt, s_qt, s_kt, s_c, s_s,
                              s_page, s_kv, s_head, s_tok, NQ: tl.constexpr,
                              NKV: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                              HEADS: tl.constexpr, PAGE_SIZE: tl.constexpr, WRITE: tl.constexpr,
                              PDL: tl.constexpr):
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        # Grid (T, cdiv(NQ + NKV, HEADS)): HEADS heads of one token per program; head h < NQ
        # is q head h, the others k head j = h - NQ and, writing, v head j too (v is copied as
        # it is). q and k heads sit at h * HEAD_DIM in the row either way.
        t = tl.program_id(0).to(tl.int64)
        hv = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
        is_q = (hv < NQ)[:, None]
        is_k = ((hv >= NQ) & (hv < NQ + NKV))[:, None]
        h = hv.to(tl.int64)[:, None]
        j = h - NQ
        i = tl.arange(0, HALF)
        row = x_ptr + t * s_xt
        kw1 = tl.load(kw_ptr + i).to(tl.float32)[None, :]
        kw2 = tl.load(kw_ptr + HALF + i).to(tl.float32)[None, :]
        if NQ > 0:
            w1 = tl.where(is_q, tl.load(qw_ptr + i).to(tl.float32)[None, :], kw1)
            w2 = tl.where(is_q, tl.load(qw_ptr + HALF + i).to(tl.float32)[None, :], kw2)
        else:
            w1 = kw1
            w2 = kw2
        o1, o2 = _norm_rope_heads(row + h * HEAD_DIM, w1, w2, cos_ptr, sin_ptr, t, eps, s_c,
                                  s_s, is_q | is_k, HEAD_DIM, HALF)
        ii = i[None, :]
        if NQ > 0:
            qb = q_ptr + t * s_qt + h * HEAD_DIM + ii
            tl.store(qb, o1, mask=is_q)
            tl.store(qb + HALF, o2, mask=is_q)
        if WRITE:
            slot = tl.load(slot_ptr + t).to(tl.int64)
            kv_ok = is_k & (h * 0 + slot >= 0)   # a negative slot: a padding token, skipped
            base = (kv_ptr + layer_off + (slot // PAGE_SIZE) * s_page + j * s_head
                    + (slot % PAGE_SIZE) * s_tok)
            tl.store(base + ii, o1, mask=kv_ok)
            tl.store(base + HALF + ii, o2, mask=kv_ok)
            d = tl.arange(0, HEAD_DIM)[None, :]
            vv = tl.load(row + (NQ + NKV + j) * HEAD_DIM + d, mask=kv_ok, other=0.0)
            tl.store(base + s_kv + d, vv, mask=kv_ok)
        else:
            kb = k_ptr + t * s_kt + j * HEAD_DIM + ii
            tl.store(kb, o1, mask=is_k)
            tl.store(kb + HALF, o2, mask=is_k)

    @triton.jit
    def silu_mul_rounded(g, u, dt: tl.constexpr):
        """``silu(g) * u`` in float32 from float32 ``g``, ``u``, with ``silu(g)`` rounded to
        ``dt`` first: the rounding of torch's ``F.silu(g) * u`` in ``dt``, shared by the SiLU
        kernels here and the gated product's epilogue (kernels/gemv.py), which must agree bit
        for bit."""
        return (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u

    @triton.jit
    def _silu_mul_merged_kernel(x_ptr, out_ptr, n, s_x, s_o, BLOCK: tl.constexpr,
                                PDL: tl.constexpr):
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        t = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = c < n
        g = tl.load(x_ptr + t * s_x + c, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + t * s_x + n + c, mask=ok, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        tl.store(out_ptr + t * s_o + c, silu_mul_rounded(g, u, dt).to(dt), mask=ok)

    @triton.jit
    def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        tl.store(out_ptr + offs, silu_mul_rounded(g, u, dt).to(dt), mask=ok)

    @triton.jit
    def _rope_cos_sin_kernel(pos_ptr, inv_ptr, cos_ptr, sin_ptr, T, scaling, HALF: tl.constexpr,
                             BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                             SCALE: tl.constexpr, LIBDEVICE: tl.constexpr):
        # Rotate-half layout: columns j and j + HALF hold frequency j. cos/sin are libdevice's
        # (what torch's CUDA kernels call), not the approximate instructions of tl.cos/tl.sin;
        # the CPU interpreter has no libdevice (its tl.cos/tl.sin are numpy's).
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        j = tl.arange(0, BLOCK_D)
        ok = (t < T)[:, None] & (j < 2 * HALF)[None, :]
        p = tl.load(pos_ptr + t, mask=t < T, other=0).to(tl.float32)
        # (a model cast to bf16 casts this buffer too: its values, upcast, as torch's product)
        inv = tl.load(inv_ptr + j % HALF, mask=j < 2 * HALF, other=0.0).to(tl.float32)
        f = p[:, None] * inv[None, :]
        if LIBDEVICE:
            c = libdevice.cos(f)
            s = libdevice.sin(f)
        else:
            c = tl.cos(f)
            s = tl.sin(f)
        if SCALE:
            c = c * scaling
            s = s * scaling
        at = t[:, None].to(tl.int64) * (2 * HALF) + j[None, :]
        tl.store(cos_ptr + at, c.to(cos_ptr.dtype.element_ty), mask=ok)
        tl.store(sin_ptr + at, s.to(sin_ptr.dtype.element_ty), mask=ok)


def rope_cos_sin_rows(positions: Tensor, inv_freq: Tensor, scaling: float = 1.0,
                      dtype: torch.dtype = torch.float32, impl: str = "auto"
                      ) -> tuple[Tensor, Tensor]:
    """RoPE ``cos, sin`` ``[T, 2 * len(inv_freq)]`` (rotate-half layout) of ``positions [T]``
    int64: ``cos(p * inv_freq)`` twice over, times ``scaling``, in float32 (``inv_freq`` of
    any float dtype, upcast) and then ``dtype``.
    One launch on CUDA, the torch ops elsewhere (:func:`rope_cos_sin_rows_ref`, which is
    :func:`kvstrata.nn.layers.rope_cos_sin_rows`)."""
    t, half = positions.shape[0], inv_freq.shape[0]
    if not use_triton(positions, impl) or t == 0:
        return rope_cos_sin_rows_ref(positions, inv_freq, scaling, dtype)
    if not inv_freq.is_floating_point() or inv_freq.device != positions.device:
        raise ValueError(f"rope_cos_sin_rows: inv_freq must be floating point on "
                         f"{positions.device}, got {inv_freq.dtype} on {inv_freq.device}")
    cos = torch.empty((t, 2 * half), dtype=dtype, device=positions.device)
    sin = torch.empty_like(cos)
    # one position per program up to 512 rows: libdevice's cos/sin of large arguments take
    # their slow path, so 16 rows in one program cost a verify step 4 us per launch
    block_t = 1 if t <= 512 else 16
    _rope_cos_sin_kernel[(triton.cdiv(t, block_t),)](
        positions, inv_freq.contiguous(), cos, sin, t, float(scaling), HALF=half,
        BLOCK_T=block_t, BLOCK_D=triton.next_power_of_2(2 * half), SCALE=scaling != 1.0,
        LIBDEVICE=positions.device.type == "cuda", num_warps=4)
    return cos, sin


def add_rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None,
                 impl: str = "auto") -> tuple[Tensor, Tensor]:
    """``(rms_norm(residual + x), residual + x)``; x, residual: ``[T, dim]`` (rows contiguous),
    weight ``[dim]`` of x's dtype. Without ``residual`` the second result is ``x``."""
    if not use_triton(x, impl) or weight.dtype != x.dtype or x.stride(-1) != 1 or (
            residual is not None and residual.stride(-1) != 1):
        return add_rms_norm_ref(x, weight, eps, residual)
    T, dim = x.shape
    out = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else x
    r = residual if residual is not None else x
    if T:
        _rms_norm_launch(T, x, r, weight, out, h, eps, None, residual is not None)
    return out, h


def _rms_norm_launch(T: int, x: Tensor, r: Tensor, weight: Tensor, out: Tensor, h: Tensor,
                     eps: float, ids: Tensor | None, has_res: bool, norm: bool = True) -> None:
    dim = h.shape[1]
    _add_rms_norm_kernel[(T,)](x, r, weight, out, h, dim, eps, x.stride(0), r.stride(0),
                               out.stride(0), h.stride(0), ids if ids is not None else x,
                               x.shape[0], HAS_RES=has_res, GATHER=ids is not None,
                               BLOCK=triton.next_power_of_2(dim),
                               num_warps=8 if dim >= 2048 else 4, NORM=norm,
                               **pdl_launch(x.device, "norm"))


def embed_rows(ids: Tensor, embedding: Tensor, impl: str = "auto") -> Tensor:
    """``F.embedding(ids, embedding)`` (``ids [T]`` int64): one launch on CUDA (torch's gather
    took 7 us for 16 rows of a Qwen3 table on the H200); ids outside ``[0, V)`` give zero
    rows there."""
    if not use_triton(embedding, impl) or embedding.stride(-1) != 1 or ids.dim() != 1:
        return F.embedding(ids, embedding)
    h = torch.empty((ids.shape[0], embedding.shape[1]), dtype=embedding.dtype,
                    device=embedding.device)
    if ids.shape[0]:
        _rms_norm_launch(ids.shape[0], embedding, embedding, embedding, h, h, 0.0, ids, False,
                         norm=False)
    return h


def embed_rms_norm(ids: Tensor, embedding: Tensor, weight: Tensor, eps: float,
                   impl: str = "auto") -> tuple[Tensor, Tensor]:
    """``(rms_norm(e, weight), e)`` of the embedding rows ``e = embedding[ids]`` (``ids [T]``
    int64, ``embedding [V, dim]``): a decoder's input and its first norm in one launch (the
    torch ops elsewhere; :func:`add_rms_norm` of ``F.embedding`` bit for bit). Ids outside
    ``[0, V)`` give zero rows on the kernel (the engine checks prompts at its boundary)."""
    if not use_triton(embedding, impl) or weight.dtype != embedding.dtype or (
            embedding.stride(-1) != 1) or ids.dim() != 1:
        return add_rms_norm_ref(F.embedding(ids, embedding), weight, eps)
    T, dim = ids.shape[0], embedding.shape[1]
    out = torch.empty((T, dim), dtype=embedding.dtype, device=embedding.device)
    h = torch.empty_like(out)
    if T:
        _rms_norm_launch(T, embedding, embedding, weight, out, h, eps, ids, False)
    return out, h


def head_norm_rope(x: Tensor, weight: Tensor, eps: float, cos: Tensor, sin: Tensor,
                   impl: str = "auto") -> Tensor:
    """Per-head RMSNorm then RoPE: x ``[T, heads, head_dim]`` (head_dim contiguous), weight
    ``[head_dim]``, cos/sin ``[T, head_dim]`` (float32). Returns a new ``[T, heads, head_dim]``."""
    T, H, D = x.shape
    if not use_triton(x, impl) or weight.dtype != x.dtype or x.stride(2) != 1 or D % 2 or (
            D & (D - 1)) or cos.stride(1) != 1 or sin.stride(1) != 1:
        return head_norm_rope_ref(x, weight, eps, cos, sin)
    out = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if T:
        _head_norm_rope_kernel[(T, triton.cdiv(H, ROPE_HEADS))](
            x, weight, cos, sin, out, eps, H, x.stride(0), x.stride(1), out.stride(0),
            out.stride(1), cos.stride(0), sin.stride(0), HEAD_DIM=D, HALF=D // 2,
            HEADS=ROPE_HEADS, num_warps=rope_warps(T))
    return out


def silu_mul(gate: Tensor, up: Tensor, impl: str = "auto") -> Tensor:
    """``silu(gate) * up`` of two contiguous tensors of one shape and dtype."""
    if not use_triton(gate, impl) or not (gate.is_contiguous() and up.is_contiguous()) or (
            gate.shape != up.shape or gate.dtype != up.dtype):
        return silu_mul_ref(gate, up)
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _silu_mul_kernel[(triton.cdiv(n, 1024),)](gate, up, out, n, BLOCK=1024, num_warps=4)
    return out


def silu_mul_merged(gate_up: Tensor, impl: str = "auto") -> Tensor:
    """``silu(gate) * up`` of a merged ``[T, 2 * n]`` product (gate columns first, rows
    contiguous) -> ``[T, n]``: the values of :func:`silu_mul` of the two halves."""
    T, n2 = gate_up.shape
    n = n2 // 2
    if not use_triton(gate_up, impl) or gate_up.stride(-1) != 1 or n2 % 2:
        return silu_mul_ref(gate_up[:, :n], gate_up[:, n:])
    out = torch.empty((T, n), dtype=gate_up.dtype, device=gate_up.device)
    if T and n:
        _silu_mul_merged_kernel[(T, triton.cdiv(n, 1024))](gate_up, out, n, gate_up.stride(0),
                                                           out.stride(0), BLOCK=1024,
                                                           num_warps=4,
                                                           **pdl_launch(gate_up.device, "silu"))
    return out


def qkv_norm_rope(qkv: Tensor, q_weight: Tensor | None, k_weight: Tensor, eps: float,
                  cos: Tensor, sin: Tensor, num_q_heads: int, num_kv_heads: int, *,
                  kv_cache: Tensor | None = None, layer: int = 0,
                  slot_mapping: Tensor | None = None, impl: str = "auto"
                  ) -> tuple[Tensor | None, Tensor | None, Tensor]:
    """q-norm + RoPE and k-norm + RoPE of a merged projection, and the K/V write, in one launch.

    Args:
        qkv: ``[T, (num_q_heads + 2 * num_kv_heads) * head_dim]`` (q heads, k heads, v heads;
            rows contiguous), e.g. :meth:`~kvstrata.nn.layers.AttentionProjections.qkv`.
            ``num_q_heads`` may be 0 (k and v only: a drafter's context K/V).
        q_weight, k_weight: the ``[head_dim]`` norm weights (``q_weight`` unused without q heads).
        cos, sin: ``[T, head_dim]`` float32.
        kv_cache, layer, slot_mapping: when given, K (normed, rotated) and V go into the pool as
            :func:`~kvstrata.kernels.kv_write.write_kv` writes them (negative slots skipped)
            and no k tensor is returned.

    Returns:
        ``(q [T, Hq, D] or None, k [T, Hkv, D] or None when written, v [T, Hkv, D])``; v is a
        view of ``qkv``. Values equal :func:`head_norm_rope` of each part bit for bit.
    """
    T = qkv.shape[0]
    d = k_weight.shape[0]
    hq, hkv = num_q_heads, num_kv_heads
    if qkv.dim() != 2 or qkv.shape[1] != (hq + 2 * hkv) * d:
        raise ValueError(f"qkv must be [T, ({hq} + 2 * {hkv}) * {d}], got {tuple(qkv.shape)}")
    write = kv_cache is not None
    if write:
        if slot_mapping is None:
            raise ValueError("a K/V write needs slot_mapping")
        check_kv_write(kv_cache, layer, (T, hkv, d), qkv.dtype, slot_mapping)
    if not use_triton(qkv, impl) or k_weight.dtype != qkv.dtype or (
            hq and q_weight.dtype != qkv.dtype) or qkv.stride(1) != 1 or d & (d - 1) or (
            cos.stride(1) != 1 or sin.stride(1) != 1) or (write and kv_cache.stride(5) != 1):
        return qkv_norm_rope_ref(qkv, q_weight, k_weight, eps, cos, sin, hq, hkv, kv_cache,
                                 layer, slot_mapping)
    v = qkv[:, (hq + hkv) * d:].view(T, hkv, d)
    q = torch.empty((T, hq, d), dtype=qkv.dtype, device=qkv.device) if hq else None
    k = None if write else torch.empty((T, hkv, d), dtype=qkv.dtype, device=qkv.device)
    if T:
        qa = q if q is not None else v
        ka = k if k is not None else v
        kv = kv_cache if write else v
        st = kv_cache.stride() if write else (0,) * 6
        _qkv_norm_rope_kernel[(T, triton.cdiv(hq + hkv, ROPE_HEADS))](
            qkv, q_weight if hq else k_weight, k_weight, cos, sin, qa, ka, kv,
            slot_mapping if write else cos, eps, layer * st[1], qkv.stride(0), qa.stride(0),
            ka.stride(0), cos.stride(0), sin.stride(0), st[0], st[2], st[3], st[4],
            NQ=hq, NKV=hkv, HEAD_DIM=d, HALF=d // 2, HEADS=ROPE_HEADS,
            PAGE_SIZE=kv_cache.shape[4] if write else 1, WRITE=write, num_warps=rope_warps(T),
            **pdl_launch(qkv.device, "rope"))
    return q, k, v


__all__ = ["add_rms_norm", "add_rms_norm_ref", "embed_rms_norm", "embed_rows", "head_norm_rope",
           "head_norm_rope_ref", "qkv_norm_rope", "qkv_norm_rope_ref", "rope_cos_sin_rows",
           "rope_cos_sin_rows_ref", "silu_mul", "silu_mul_merged", "silu_mul_ref"]
