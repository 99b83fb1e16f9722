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
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ._device import gdc_launch_dependents, gdc_wait, pdl_launch, prefetch_l2  # noqa: F401

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None

#: the most rows :func:`gemv` runs on its kernel; more rows take ``F.linear``.
GEMV_MAX_ROWS = 16


@dataclass(frozen=True)
class GemvLaunch:
    """Tile of one :func:`gemv` launch: ``block_n`` weight rows per program, ``block_k``
    columns per loop step, ``stages`` loads in flight, ``warps`` per program; ``split_k`` > 1
    cuts the columns into that many equal ranges, one program each, whose float32 partials the
    last program of each row block sums in split order (deterministic, one launch);
    ``prefetch`` > 0 (under PDL only): each program first asks L2 for that many bytes of each
    of its rows (from its column range's start) while the previous kernel still runs."""

    block_n: int = 32
    block_k: int = 256
    stages: int = 4
    warps: int = 4
    split_k: int = 1
    prefetch: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.split_k, int) or not 1 <= self.split_k <= 16:
            raise ValueError(f"GemvLaunch.split_k={self.split_k!r}: 1 to 16")
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"GemvLaunch.{name}={v}: a power of two >= 16")
        if self.prefetch < 0 or self.prefetch % 16:
            raise ValueError(f"GemvLaunch.prefetch={self.prefetch}: a multiple of 16 bytes")
        if not 1 <= self.stages <= 8 or self.warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"GemvLaunch: stages={self.stages} (1-8), warps={self.warps} "
                             "(1, 2, 4, 8 or 16)")


def gemv_launch(n: int, k: int) -> GemvLaunch:
    """The default tile for an ``[n, k]`` weight. Measured on the H200 (docs/benchmarks.md,
    runner section: every tile of a grid, 1 and 16 rows): the Qwen3-8B shapes' best tiles
    were 64 x 128 for wide outputs (q/k/v 6144, gate/up 24576; 5 stages up to 8k rows, 3
    beyond) and 32 x 256 with 5 stages for 4096-wide ones (o_proj, down)."""
    pf = int(os.environ.get("KVSTRATA_GEMV_PREFETCH", "0"))   # bytes per row; being measured
    if n >= 6144:
        return GemvLaunch(64, 128, 5 if n <= 8192 else 3, 4, prefetch=min(pf, k * 2))
    return GemvLaunch(32, 256, 5, 4, prefetch=min(pf, k * 2))


if triton is not None:
    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, cnt_ptr, M, N, K, s_xm, s_wn, s_om,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, STAGES: tl.constexpr, SPLIT_K: tl.constexpr,
                     PDL: tl.constexpr, UPCAST: tl.constexpr, PREFETCH: tl.constexpr):
        # K is a multiple of SPLIT_K * BLOCK_K (the wrapper checks); rows past M and columns
        # past N are masked. Program (i, s) reads weight rows i * BLOCK_N ... whole over the
        # s-th of SPLIT_K equal column ranges, in column order.
        pid = tl.program_id(0)
        k_len = K // SPLIT_K
        k_lo = tl.program_id(1) * k_len
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        kk = tl.arange(0, BLOCK_K)
        n_ok = n < N
        m_ok = m < M
        x_rows = x_ptr + m[:, None].to(tl.int64) * s_xm + k_lo
        w_rows = w_ptr + n[:, None].to(tl.int64) * s_wn + k_lo
        # The first weight tile is read before waiting on the previous kernel: a step never
        # writes weights, so under PDL this load overlaps that kernel's tail.
        if PREFETCH > 0:
            # Under PDL: the first PREFETCH bytes of every row of this block into L2 while the
            # previous kernel still runs (its tail leaves HBM idle).
            prefetch_l2(w_ptr + n.to(tl.int64) * s_wn + k_lo, n_ok, PREFETCH)
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None], other=0.0)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None], other=0.0)
        acc = _dot_t(x, w, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), UPCAST)
        for k0 in tl.range(BLOCK_K, k_len, BLOCK_K, num_stages=STAGES):
            k = k0 + kk
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None], other=0.0)
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None], other=0.0)
            acc = _dot_t(x, w, acc, UPCAST)
        out_mask = m_ok[:, None] & n_ok[None, :]
        if SPLIT_K > 1:
            # Deterministic split-K in one launch: every program stores its float32 partial;
            # the last of a column block's SPLIT_K programs to arrive sums them in split order
            # and resets the block's counter (zero again for the next launch or graph replay).
            # The barrier orders all threads' partial stores before the gpu-scope acq_rel
            # increment; the partials are read back through L2 (.cg), never a stale L1 line.
            part = part_ptr + m[:, None].to(tl.int64) * N + n[None, :]
            tl.store(part + tl.program_id(1).to(tl.int64) * BLOCK_M * N, acc, mask=out_mask)
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                tl.debug_barrier()
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in tl.static_range(SPLIT_K):
                    acc += tl.load(part + s * BLOCK_M * N, mask=out_mask, other=0.0,
                                   cache_modifier=".cg")
                if HAS_BIAS:
                    acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
                tl.store(out_ptr + m[:, None].to(tl.int64) * s_om + n[None, :],
                         acc.to(out_ptr.dtype.element_ty), mask=out_mask)
                tl.store(cnt_ptr + pid, 0)
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + m[:, None].to(tl.int64) * s_om + n[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=out_mask)

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


def _launch(weight: Tensor, k: int, launch: GemvLaunch | None) -> GemvLaunch | None:
    """``launch`` (or the default) fitted to ``k`` columns: ``block_k`` halved until
    ``split_k * block_k`` divides ``k``, else no split; ``None`` when no tile fits."""
    lt = launch or gemv_launch(weight.shape[0], k)
    if weight.shape[1] != k:
        return None
    for split in dict.fromkeys((lt.split_k, 1)):
        bk = lt.block_k
        while bk > 16 and k % (split * bk):
            bk //= 2
        if k % (split * bk) == 0:
            return dataclasses.replace(lt, block_k=bk, split_k=split)
    return None


def gemv(x: Tensor, weight: Tensor, bias: Tensor | None = None, impl: str = "auto") -> Tensor:
    """``F.linear(x, weight, bias)`` for ``x [M, K]``, ``weight [N, K]`` (``[M, N]`` out).

    On CUDA with ``M <= GEMV_MAX_ROWS`` bf16/fp16 rows-contiguous operands one Triton launch
    with the measured tile (:func:`gemv_launch`), else ``F.linear``. Values differ from
    cuBLAS's only by the summation order (float32 sums).
    """
    return _gemv(x, weight, bias, None, impl)


def _gemv(x: Tensor, weight: Tensor, bias: Tensor | None, launch: GemvLaunch | None,
          impl: str = "auto") -> Tensor:
    """:func:`gemv` with a given tile (``None``: the default); benchmarks and tests."""
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"gemv: bias {tuple(bias.shape)} does not match weight "
                         f"{tuple(weight.shape)}")
    lt = _launch(weight, x.shape[-1], launch) if gemv_ok(x, weight, impl) else None
    if lt is None:
        return F.linear(x, weight, bias)
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    blocks = triton.cdiv(N, lt.block_n)
    if lt.split_k > 1:
        from .attention_triton import split_counters   # zeroed between launches
        part = torch.empty((lt.split_k, GEMV_MAX_ROWS, N), dtype=torch.float32,
                           device=x.device)
        cnt = split_counters(x.device, blocks)
    else:
        part = cnt = out                                # unused
    pdl = pdl_launch(x.device, "gemv")
    row_bytes = weight.stride(0) * weight.element_size()
    pf = lt.prefetch if pdl["PDL"] and row_bytes % 16 == 0 and weight.data_ptr() % 16 == 0 else 0
    pf = min(pf, (K // lt.split_k) * weight.element_size())
    _gemv_kernel[(blocks, lt.split_k)](
        x, weight, bias if bias is not None else weight, out, part, cnt, M, N, K, x.stride(0),
        weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=GEMV_MAX_ROWS,
        BLOCK_N=lt.block_n, BLOCK_K=lt.block_k, STAGES=lt.stages, SPLIT_K=lt.split_k,
        UPCAST=x.dtype == torch.bfloat16 and x.device.type != "cuda", num_warps=lt.warps,
        PREFETCH=pf, **pdl)
    return out


__all__ = ["GEMV_MAX_ROWS", "GemvLaunch", "gemv", "gemv_launch", "gemv_ok"]
