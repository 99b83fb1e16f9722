"""Matrix products of a few rows against a large weight (decode and verify steps).

At batch 1-16 a decoder's linear layers read every weight byte once and do almost no math, so
their time is the weight's bytes over the memory bandwidth plus the launch's ramp and tail.
:func:`gemv` is ``F.linear`` for ``[M <= 16, K] x [N, K]^T``: one Triton launch, every program
streams ``BLOCK_N`` whole weight rows (no split over K, so the sum order is fixed: results are
deterministic, graph replay equals eager), float32 accumulation, one rounding to the output
dtype. On CPU, for more rows, or for shapes the kernel does not take it is ``F.linear``.

Tiles are chosen per weight shape by :func:`gemv_launch` (measured on the H200,
``benchmarks/runner_profile.py``); benchmarks and tests try others through the private
``_gemv(..., launch)``. Under programmatic dependent launch (:func:`~._device.pdl_ok`) a
program reads its first weight tile before it waits for the previous kernel.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ._device import gdc_launch_dependents, gdc_wait, pdl_launch  # noqa: F401 - in kernels

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None

#: the most rows :func:`gemv` runs on its kernel; more rows take ``F.linear``.
GEMV_MAX_ROWS = 16


@dataclass(frozen=True)
class GemvLaunch:
    """Tile of one :func:`gemv` launch: ``block_n`` weight rows per program (twice that with
    :func:`norm_gemv`'s ``gated``: the gate and the up rows), ``block_k`` columns per loop
    step, ``stages`` loads in flight, ``warps`` per program."""

    block_n: int = 32
    block_k: int = 256
    stages: int = 4
    warps: int = 4

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"GemvLaunch.{name}={v}: a power of two >= 16")
        if not 1 <= self.stages <= 8 or self.warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"GemvLaunch: stages={self.stages} (1-8), warps={self.warps} "
                             "(1, 2, 4, 8 or 16)")


def gemv_launch(n: int, k: int, gated: bool = False) -> GemvLaunch:
    """The default tile for an ``[n, k]`` weight. Measured on the H200 (docs/benchmarks.md,
    runner section: every tile of a grid, 1 and 16 rows): the Qwen3-8B shapes' best tiles
    were 64 x 128 for wide outputs (q/k/v 6144, gate/up 24576; 5 stages up to 8k rows, 3
    beyond) and 32 x 256 with 5 stages for 4096-wide ones (o_proj, down); a split over K (2 or
    4 ranges, summed in one launch) and bulk L2 prefetches before the PDL wait lost
    everywhere. ``gated`` (gate and up rows per program): 32 x 128, 3 stages (the same 64
    weight rows per program as the plain gate/up tile)."""
    if gated:
        return GemvLaunch(32, 128, 3, 4)
    if n >= 6144:
        return GemvLaunch(64, 128, 5 if n <= 8192 else 3, 4)
    return GemvLaunch(32, 256, 5, 4)


if triton is not None:
    @triton.jit
    def _gemv_kernel(x_ptr, r_ptr, h_ptr, g_ptr, w_ptr, b_ptr, out_ptr, M, N, K, eps,
                     s_xm, s_rm, s_hm, s_wn, s_om,
                     HAS_BIAS: tl.constexpr, RES: tl.constexpr, NORM: tl.constexpr,
                     GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr,
                     UPCAST: tl.constexpr):
        # K is a multiple of BLOCK_K (the wrapper checks); rows past M and columns past N are
        # masked. Program i reads weight rows i * BLOCK_N ... (and, GATED, the up rows N + ...)
        # whole, in column order.
        pid = tl.program_id(0)
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        kk = tl.arange(0, BLOCK_K)
        n_ok = n < N
        m_ok = m < M
        rows = m[:, None].to(tl.int64)
        w_rows = w_ptr + n[:, None].to(tl.int64) * s_wn
        u_rows = w_rows + N * s_wn
        # The first weight tile is read before waiting on the previous kernel: a step never
        # writes weights, so under PDL this load overlaps that kernel's tail.
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None], other=0.0)
        wu = w
        if GATED:
            wu = tl.load(u_rows + kk[None, :], mask=n_ok[:, None], other=0.0)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
        z, ss = _input_tile(x_ptr + rows * s_xm, r_ptr + rows * s_rm, h_ptr + rows * s_hm,
                            g_ptr, kk, m, M, ss, pid == 0, RES, NORM)
        acc = _dot_t(z, w, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), UPCAST)
        acc_u = acc
        if GATED:
            acc_u = _dot_t(z, wu, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), UPCAST)
        for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
            k = k0 + kk
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None], other=0.0)
            if GATED:
                wu = tl.load(u_rows + k[None, :], mask=n_ok[:, None], other=0.0)
            # the residual stream's tile k0 is stored by one program (spread over the grid)
            own = (k0 // BLOCK_K) % tl.num_programs(0) == pid
            z, ss = _input_tile(x_ptr + rows * s_xm, r_ptr + rows * s_rm, h_ptr + rows * s_hm,
                                g_ptr, k, m, M, ss, own, RES, NORM)
            acc = _dot_t(z, w, acc, UPCAST)
            if GATED:
                acc_u = _dot_t(z, wu, acc_u, UPCAST)
        if NORM:
            # rms_norm(h) @ W^T = rstd * ((h * gamma) @ W^T): the row's scale comes last
            rstd = tl.math.rsqrt(ss / K + eps)[:, None]
            acc = acc * rstd
            if GATED:
                acc_u = acc_u * rstd
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_u += tl.load(b_ptr + N + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        dt = out_ptr.dtype.element_ty
        if GATED:
            # silu(gate) * up, each rounded as the separate products and silu_mul_merged round
            gate = acc.to(dt).to(tl.float32)
            silu = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
            acc = silu * acc_u.to(dt).to(tl.float32)
        tl.store(out_ptr + rows * s_om + n[None, :], acc.to(dt),
                 mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _input_tile(x_rows, r_rows, h_rows, g_ptr, k, m, M, ss, own, RES: tl.constexpr,
                    NORM: tl.constexpr):
        """Columns ``k`` of rows ``m < M`` of the product's input: x, or (``RES``) h = x + r
        rounded as torch's add (and stored where ``own``), then (``NORM``) h * gamma, adding
        h's squares to ``ss``."""
        m_ok = m[:, None] < M
        x = tl.load(x_rows + k[None, :], mask=m_ok, other=0.0)
        if RES:
            r = tl.load(r_rows + k[None, :], mask=m_ok, other=0.0)
            x = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
            # (a row bound, not `m_ok & own`: the interpreter mistypes a bool & scalar mask)
            tl.store(h_rows + k[None, :], x, mask=m[:, None] < tl.where(own, M, 0))
        if NORM:
            xf = x.to(tl.float32)
            ss += tl.sum(xf * xf, 1)
            x = (xf * tl.load(g_ptr + k).to(tl.float32)[None, :]).to(x.dtype)
        return x, ss

    @triton.jit
    def _dot_t(x, w, acc, UPCAST: tl.constexpr):
        """``acc + x @ w^T``; ``UPCAST``: in float32 (the CPU interpreter's bf16 dot is wrong)."""
        if UPCAST:
            return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc,
                          input_precision="ieee")
        return tl.dot(x, tl.trans(w), acc)


def gemv_ok(x: Tensor, weight: Tensor, impl: str = "auto") -> bool:
    """Whether :func:`gemv` runs its kernel for these operands (else the torch ops):
    ``impl="auto"`` on CUDA, ``"triton"`` anywhere Triton runs (the interpreter on CPU),
    ``"torch"`` never."""
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    return (triton is not None and impl != "torch"
            and (x.device.type == "cuda" or impl == "triton") and x.dim() == 2
            and 0 < x.shape[0] <= GEMV_MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and x.stride(1) == 1 and weight.stride(1) == 1
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def _launch(weight: Tensor, k: int, launch: GemvLaunch | None, gated: bool = False
            ) -> GemvLaunch | None:
    """``launch`` (or the default) fitted to ``k`` columns: ``block_k`` halved until it
    divides ``k``; ``None`` when no tile fits."""
    lt = launch or gemv_launch(weight.shape[0] // (2 if gated else 1), k, gated)
    if weight.shape[1] != k:
        return None
    bk = lt.block_k
    while bk > 16 and k % bk:
        bk //= 2
    return dataclasses.replace(lt, block_k=bk) if k % bk == 0 else None


def gemv(x: Tensor, weight: Tensor, bias: Tensor | None = None, impl: str = "auto") -> Tensor:
    """``F.linear(x, weight, bias)`` for ``x [M, K]``, ``weight [N, K]`` (``[M, N]`` out).

    On CUDA with ``M <= GEMV_MAX_ROWS`` bf16/fp16 rows-contiguous operands one Triton launch
    with the measured tile (:func:`gemv_launch`), else ``F.linear``. Values differ from
    cuBLAS's only by the summation order (float32 sums).
    """
    return _gemv(x, weight, bias, None, impl)


def _check_bias(weight: Tensor, bias: Tensor | None) -> None:
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"gemv: bias {tuple(bias.shape)} does not match weight "
                         f"{tuple(weight.shape)}")


def _gemv(x: Tensor, weight: Tensor, bias: Tensor | None, launch: GemvLaunch | None,
          impl: str = "auto") -> Tensor:
    """:func:`gemv` with a given tile (``None``: the default); benchmarks and tests."""
    _check_bias(weight, bias)
    lt = _launch(weight, x.shape[-1], launch) if gemv_ok(x, weight, impl) else None
    if lt is None:
        return F.linear(x, weight, bias)
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    _run(x, None, None, None, 0.0, weight, bias, out, lt, False)
    return out


def norm_gemv(x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor,
              bias: Tensor | None = None, *, residual: Tensor | None = None,
              gated: bool = False, impl: str = "auto") -> tuple[Tensor, Tensor]:
    """A decoder's pre-norm product in one launch: ``h = x + residual`` (``x`` without one),
    ``y = F.linear(rms_norm(h, norm_weight, eps), weight, bias)``; ``gated``: ``weight`` is
    ``[2 n, K]`` (gate rows, then up rows) and ``y = silu(gate) * up`` ``[M, n]``. Returns
    ``(y, h)``.

    Where :func:`gemv` runs its kernel on bf16 operands, every program adds the residual and
    sums h's squares over the columns it streams anyway, multiplies by ``norm_weight`` before
    the product and by the row's ``rsqrt(mean(h^2) + eps)`` after it; ``h`` is stored once
    (each column tile by one program). So the roundings differ from the separate kernels'
    (which round ``h * rsqrt`` before the weight multiply) by about one bf16 step; everywhere
    else (CPU, more rows, fp16, whose ``h * norm_weight`` could overflow) it is exactly
    :func:`~.layer_ops.add_rms_norm`, :func:`gemv` and :func:`~.layer_ops.silu_mul_merged`.
    """
    return _norm_gemv(x, norm_weight, eps, weight, bias, residual, gated, None, impl)


def _norm_gemv(x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor,
               bias: Tensor | None, residual: Tensor | None, gated: bool,
               launch: GemvLaunch | None, impl: str = "auto") -> tuple[Tensor, Tensor]:
    """:func:`norm_gemv` with a given tile (``None``: the default); benchmarks and tests."""
    from .layer_ops import add_rms_norm, silu_mul_merged
    _check_bias(weight, bias)
    if gated and weight.shape[0] % 2:
        raise ValueError(f"norm_gemv(gated=True): weight rows {weight.shape[0]} are not "
                         "gate rows then as many up rows")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"norm_gemv: residual {tuple(residual.shape)} != x "
                         f"{tuple(x.shape)}")
    fused = (gemv_ok(x, weight, impl) and x.dtype == torch.bfloat16
             and norm_weight.dtype == x.dtype and norm_weight.is_contiguous()
             and (residual is None or (residual.dtype == x.dtype and residual.stride(1) == 1)))
    lt = _launch(weight, x.shape[-1], launch, gated) if fused else None
    if lt is None:
        xn, h = add_rms_norm(x, norm_weight, eps, residual, impl=impl)
        y = _gemv(xn, weight, bias, launch, impl)
        return (silu_mul_merged(y, impl=impl) if gated else y), h
    n_out = weight.shape[0] // (2 if gated else 1)
    out = torch.empty((x.shape[0], n_out), dtype=x.dtype, device=x.device)
    h = torch.empty_like(x) if residual is not None else x
    _run(x, residual, h, norm_weight, eps, weight, bias, out, lt, gated)
    return out, h


def _run(x: Tensor, residual: Tensor | None, h: Tensor | None, norm_weight: Tensor | None,
         eps: float, weight: Tensor, bias: Tensor | None, out: Tensor, lt: GemvLaunch,
         gated: bool) -> None:
    M, K = x.shape
    N = out.shape[1]
    r = residual if residual is not None else x
    hh = h if residual is not None else x
    _gemv_kernel[(triton.cdiv(N, lt.block_n),)](
        x, r, hh, norm_weight if norm_weight is not None else x, weight,
        bias if bias is not None else weight, out, M, N, K, eps, x.stride(0), r.stride(0),
        hh.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
        RES=residual is not None, NORM=norm_weight is not None, GATED=gated,
        BLOCK_M=GEMV_MAX_ROWS, BLOCK_N=lt.block_n, BLOCK_K=lt.block_k, STAGES=lt.stages,
        UPCAST=x.dtype == torch.bfloat16 and x.device.type != "cuda", num_warps=lt.warps,
        **pdl_launch(x.device, "gemv"))


__all__ = ["GEMV_MAX_ROWS", "GemvLaunch", "gemv", "gemv_launch", "gemv_ok", "norm_gemv"]
