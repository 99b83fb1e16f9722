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
from .layer_ops import silu_mul_merged

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None

#: the most rows :func:`gemv` runs on its kernel; more rows take ``F.linear``.
GEMV_MAX_ROWS = 16


@dataclass(frozen=True)
class GemvLaunch:
    """Tile of one :func:`gemv` launch: ``block_n`` weight rows per program (twice that when
    ``gated``: the gate and the up rows), ``block_k`` columns per loop step, ``stages`` loads
    in flight, ``warps`` per program."""

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
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, s_xm, s_wn, s_om,
                     HAS_BIAS: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                     PDL: tl.constexpr, UPCAST: tl.constexpr):
        # K is a multiple of BLOCK_K (the wrapper checks); rows past M and columns past N are
        # masked. Program i reads weight rows i * BLOCK_N ... (and, GATED, the up rows N + ...)
        # whole, in column order. The loop holds only loads and products: element-wise work
        # on the input tiles inside it (an RMSNorm's scale and squares) stalls the load
        # pipeline (measured: docs/benchmarks.md, runner section).
        pid = tl.program_id(0)
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        kk = tl.arange(0, BLOCK_K)
        n_ok = n < N
        m_ok = m < M
        x_rows = x_ptr + m[:, None].to(tl.int64) * s_xm
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
        x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None], other=0.0)
        acc = _dot_t(x, w, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), UPCAST)
        acc_u = acc
        if GATED:
            acc_u = _dot_t(x, wu, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), UPCAST)
        for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
            k = k0 + kk
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None], other=0.0)
            if GATED:
                wu = tl.load(u_rows + k[None, :], mask=n_ok[:, None], other=0.0)
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None], other=0.0)
            acc = _dot_t(x, w, acc, UPCAST)
            if GATED:
                acc_u = _dot_t(x, wu, acc_u, UPCAST)
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_u += tl.load(b_ptr + N + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        dt = out_ptr.dtype.element_ty
        if GATED:
            # silu(gate) * up, each rounded as the separate product and silu_mul_merged round
            gate = acc.to(dt).to(tl.float32)
            silu = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
            acc = silu * acc_u.to(dt).to(tl.float32)
        tl.store(out_ptr + m[:, None].to(tl.int64) * s_om + n[None, :], acc.to(dt),
                 mask=m_ok[:, None] & n_ok[None, :])

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


def gemv(x: Tensor, weight: Tensor, bias: Tensor | None = None, impl: str = "auto", *,
         gated: bool = False) -> Tensor:
    """``F.linear(x, weight, bias)`` for ``x [M, K]``, ``weight [N, K]`` (``[M, N]`` out);
    ``gated``: ``weight`` is ``[2 n, K]`` (gate rows, then up rows) and the result
    ``silu(gate) * up`` ``[M, n]``, what :func:`~.layer_ops.silu_mul_merged` of the product
    computes, in the product's epilogue.

    On CUDA with ``M <= GEMV_MAX_ROWS`` bf16/fp16 rows-contiguous operands one Triton launch
    with the measured tile (:func:`gemv_launch`), else the torch ops. Values differ from
    cuBLAS's only by the summation order (float32 sums).
    """
    return _gemv(x, weight, bias, None, impl, gated)


def _gemv(x: Tensor, weight: Tensor, bias: Tensor | None, launch: GemvLaunch | None,
          impl: str = "auto", gated: bool = False) -> Tensor:
    """:func:`gemv` with a given tile (``None``: the default); benchmarks and tests."""
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"gemv: bias {tuple(bias.shape)} does not match weight "
                         f"{tuple(weight.shape)}")
    if gated and weight.shape[0] % 2:
        raise ValueError(f"gemv(gated=True): weight rows {weight.shape[0]} are not gate rows "
                         "then as many up rows")
    lt = _launch(weight, x.shape[-1], launch, gated) if gemv_ok(x, weight, impl) else None
    if lt is None:
        y = F.linear(x, weight, bias)
        return silu_mul_merged(y, impl=impl) if gated else y
    M, K = x.shape
    N = weight.shape[0] // (2 if gated else 1)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, lt.block_n),)](
        x, weight, bias if bias is not None else weight, out, M, N, K, x.stride(0),
        weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, GATED=gated,
        BLOCK_M=GEMV_MAX_ROWS, BLOCK_N=lt.block_n, BLOCK_K=lt.block_k, STAGES=lt.stages,
        UPCAST=x.dtype == torch.bfloat16 and x.device.type != "cuda", num_warps=lt.warps,
        **pdl_launch(x.device, "gemv"))
    return out


__all__ = ["GEMV_MAX_ROWS", "GemvLaunch", "gemv", "gemv_launch", "gemv_ok"]
