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

:func:`gemv_add_norm` also adds the residual and applies the next RMSNorm's weight in the
epilogue and leaves the norm's row scale (:class:`RowRms`) to the next product's epilogue
(``gemv(..., rms=...)``): a decoder layer's two norms without launches of their own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ._device import gdc_launch_dependents, gdc_wait, pdl_launch  # noqa: F401 - in kernels
from .layer_ops import silu_mul_merged
from .stream_gemv import stream_gemv, stream_gemv_ok
from .stream_rows import stream_rows, stream_rows_ok

try:
    import triton
    import triton.language as tl
    from .layer_ops import silu_mul_rounded  # noqa: F401 - in the kernel
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None

#: the most rows :func:`gemv` runs on its kernel; more rows take ``F.linear``.
GEMV_MAX_ROWS = 16


@dataclass(frozen=True)
class GemvLaunch:
    """Tile of one :func:`gemv` launch: ``block_n`` weight rows per program (twice that when
    ``gated``: the gate and the up rows), ``block_k`` columns per loop step, ``stages`` loads
    in flight, ``warps`` per program; ``late_trigger`` (:func:`gemv_add_norm` launches only):
    under PDL the next kernel launches when every program has streamed its weight rows, not
    as soon as they start. Measured on the H200 (docs/benchmarks.md, fifth runner session):
    the target's o_proj, followed by the large gated gate/up, took 13.3 us per layer with the
    early trigger and 11.9 with the late one; the drafter's o_proj-sized products (followed by
    a norm or attention) lost with it (draft graph 1.01 / 1.07 ms against 0.96 / 1.01)."""

    block_n: int = 32
    block_k: int = 256
    stages: int = 4
    warps: int = 4
    late_trigger: bool = False

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
    return GemvLaunch(32, 256, 5, 4, late_trigger=n * k <= 4096 * 4096)


if triton is not None:
    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, s_xm, s_wn, s_om,
                     r_ptr, g_ptr, h_ptr, ss_out_ptr, ss_in_ptr, s_rm, s_hm, parts_in, eps,
                     HAS_BIAS: tl.constexpr, GATED: tl.constexpr, ADD_NORM: tl.constexpr,
                     RMS_IN: tl.constexpr, PARTS_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                     LATE_TRIGGER: tl.constexpr, PDL: tl.constexpr, UPCAST: tl.constexpr,
                     ARGMAX: tl.constexpr = False):
        # K is a multiple of BLOCK_K (the wrapper checks); rows past M and columns past N are
        # masked. Program i reads weight rows i * BLOCK_N ... (and, GATED, the up rows N + ...)
        # whole, in column order. The loop holds only loads and products: element-wise work
        # on the input tiles inside it (an RMSNorm's scale and squares) stalls the load
        # pipeline (measured: docs/benchmarks.md, runner section).
        # ADD_NORM (the producer of a residual stream, not GATED): the epilogue adds the
        # residual (r -> h), stores h, the sums of squares of its BLOCK_N columns per row
        # (ss_out [M, programs]) and g * h as the output: the next RMSNorm but its row scale.
        # RMS_IN (the consumer): x is g * h, and the accumulator is scaled by rsqrt(sum of the
        # parts_in sums / K + eps) per row, so the loop stays loads and products.
        # ARGMAX (plain products only): out is int64 [M, programs], each row's best column of
        # this program's BLOCK_N as an argmax key (_argmax_key); _argmax_keys_kernel reduces.
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
        if ADD_NORM:
            gam = tl.load(g_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
        if PDL:
            gdc_wait()
            if not LATE_TRIGGER:
                gdc_launch_dependents()
        x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None], other=0.0)
        # The epilogue's inputs are read here, before the loop: the tail then only computes
        # and stores (earlier kernels wrote them, all done once the wait above returns).
        if RMS_IN:
            p = tl.arange(0, PARTS_PAD)
            ss = tl.load(ss_in_ptr + m[:, None] * parts_in + p[None, :],
                         mask=m_ok[:, None] & (p < parts_in)[None, :], other=0.0)
        if ADD_NORM:
            mn = m_ok[:, None] & n_ok[None, :]
            m64 = m[:, None].to(tl.int64)
            res = tl.load(r_ptr + m64 * s_rm + n[None, :], mask=mn, other=0.0)
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
        if PDL and LATE_TRIGGER:
            # The next kernel starts (and reads its first weight tile) once every program here
            # has streamed its weight rows (see GemvLaunch.late_trigger).
            gdc_launch_dependents()
        if RMS_IN:
            rstd = tl.math.rsqrt(tl.sum(ss, 1) / K + eps)
            acc = acc * rstd[:, None]
            if GATED:
                acc_u = acc_u * rstd[:, None]
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_u += tl.load(b_ptr + N + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        dt = out_ptr.dtype.element_ty
        if GATED:
            # silu(gate) * up, each rounded as the separate product and silu_mul_merged round
            acc = silu_mul_rounded(acc.to(dt).to(tl.float32), acc_u.to(dt).to(tl.float32), dt)
        if ADD_NORM:
            # h = residual + product and g * h, rounded as add_rms_norm rounds them
            hn = (res.to(tl.float32) + acc.to(dt).to(tl.float32)).to(dt)
            tl.store(h_ptr + m64 * s_hm + n[None, :], hn, mask=mn)
            hf = hn.to(tl.float32)
            tl.store(ss_out_ptr + m * tl.num_programs(0) + pid, tl.sum(hf * hf, 1), mask=m_ok)
            acc = gam[None, :] * hf
        if ARGMAX:
            # the product rounded as F.linear rounds it, then this program's best column
            v = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
            key = tl.max(_argmax_key(v, n[None, :], n_ok[None, :]), 1)
            tl.store(out_ptr + m.to(tl.int64) * s_om + pid, key, mask=m_ok)
        else:
            tl.store(out_ptr + m[:, None].to(tl.int64) * s_om + n[None, :], acc.to(dt),
                     mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _argmax_key(v, col, ok):
        """int64 keys of float32 values ``v`` at columns ``col`` whose maximum is the argmax
        as torch takes it: the largest value, the first column among equal ones (NaN counts
        as +inf, -0.0 as 0.0; columns not ``ok`` never win): the value's bits made orderable
        as a signed int32 in the high word, ``2^31 - 1 - col`` in the low word."""
        v = tl.where(v != v, float("inf"), v + 0.0)
        v = tl.where(ok, v, float("-inf"))
        b = v.to(tl.int32, bitcast=True)
        b = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
        return (b.to(tl.int64) << 32) | (0x7FFFFFFF - col).to(tl.int64)

    @triton.jit
    def _argmax_keys_kernel(key_ptr, out_ptr, P, s_k, BLOCK: tl.constexpr, PDL: tl.constexpr):
        # one program per row: the largest of the row's P keys, decoded to its column
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        p = tl.arange(0, BLOCK)
        best = tl.load(key_ptr + row * s_k + p, mask=p < P, other=-(2 ** 63))
        for p0 in tl.range(BLOCK, P, BLOCK):
            k = tl.load(key_ptr + row * s_k + p0 + p, mask=p0 + p < P, other=-(2 ** 63))
            best = tl.maximum(best, k)
        top = tl.max(best, 0)
        tl.store(out_ptr + row, 0x7FFFFFFF - (top & 0x7FFFFFFF))

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


@dataclass(frozen=True)
class RowRms:
    """The row scale of an RMSNorm left to the next product: ``parts [M, P]`` float32 sums
    of squares of a residual stream's rows in ``P`` column blocks (:func:`gemv_add_norm`
    writes them) over ``dim`` columns; the scale is ``rsqrt(parts.sum(1) / dim + eps)``."""

    parts: Tensor
    dim: int
    eps: float

    def rstd(self) -> Tensor:
        return torch.rsqrt(self.parts.sum(1) / self.dim + self.eps)


def gemv(x: Tensor, weight: Tensor, bias: Tensor | None = None, impl: str = "auto", *,
         gated: bool = False, rms: RowRms | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` for ``x [M, K]``, ``weight [N, K]`` (``[M, N]`` out);
    ``gated``: ``weight`` is ``[2 n, K]`` (gate rows, then up rows) and the result
    ``silu(gate) * up`` ``[M, n]``, what :func:`~.layer_ops.silu_mul_merged` of the product
    computes, in the product's epilogue. ``rms``: ``x`` is ``g * h`` from
    :func:`gemv_add_norm`, and the product is that of ``rms_norm(h, g)``: ``x @ weight^T``
    scaled per row by ``rms.rstd()`` (in float32, before the bias and the rounding).

    On CUDA with ``M <= GEMV_MAX_ROWS`` bf16/fp16 rows-contiguous operands one Triton launch
    with the measured tile (:func:`gemv_launch`); one bf16 row on Hopper without a bias
    :func:`~.stream_gemv.stream_gemv` (bulk copies before the PDL wait), 2-16 such rows
    :func:`~.stream_rows.stream_rows` (q/k/v and down as shipped); else the torch ops.
    Values differ from cuBLAS's only by the summation order (float32 sums).
    """
    return _gemv(x, weight, bias, None, impl, gated, rms)


def gemv_add_norm(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor,
                  norm_weight: Tensor, eps: float, impl: str = "auto"
                  ) -> tuple[Tensor, Tensor, RowRms]:
    """The product, the residual add and the next RMSNorm but its row scale, in the product's
    epilogue: ``h = residual + F.linear(x, weight, bias)`` (rounded as
    :func:`~.layer_ops.add_rms_norm` rounds it) and returns ``(norm_weight * h, h, RowRms)``;
    ``gemv(norm_weight * h, w, rms=that RowRms)`` is then the product of ``rms_norm(h,
    norm_weight)``, one launch less per norm."""
    n = weight.shape[0]
    if residual.shape != (x.shape[0], n) or norm_weight.shape != (n,):
        raise ValueError(f"gemv_add_norm: residual {tuple(residual.shape)} and norm weight "
                         f"{tuple(norm_weight.shape)} must be [{x.shape[0]}, {n}] and [{n}]")
    return _gemv(x, weight, bias, None, impl, add_norm=(residual, norm_weight, eps))


#: Tiles of :func:`gemv_argmax` (1 row, 2-16 rows); measured on the H200 with the argmax
#: epilogue (docs/benchmarks.md, twenty-first runner session).
ARGMAX_LAUNCH = (GemvLaunch(64, 128, 4, 4), GemvLaunch(64, 256, 3, 4))


def gemv_argmax(x: Tensor, weight: Tensor, impl: str = "auto", *,
                launch: GemvLaunch | None = None) -> Tensor:
    """``F.linear(x, weight).argmax(-1)`` (``[M]`` int64) without the ``[M, N]`` product in
    memory: a language-model head and its greedy token. Each program of the :func:`gemv`
    kernel keeps its columns' best (the product rounded to ``x``'s dtype, as ``F.linear``
    rounds it; the first column among equal values, as ``argmax`` takes it; NaN counts as
    +inf) and a second launch reduces the programs' bests per row. Where :func:`gemv` would
    take the torch ops (CPU, more than ``GEMV_MAX_ROWS`` rows, ...) it is those ops. Values
    of the product differ from cuBLAS's only by the summation order, so on near-ties the
    token can differ from ``F.linear``'s in the last bit's way."""
    lt = None
    if gemv_ok(x, weight, impl):
        lt = _launch(weight, x.shape[-1], launch or ARGMAX_LAUNCH[x.shape[0] > 1])
    if lt is None or weight.shape[0] >= 2 ** 31 - 1:
        return F.linear(x, weight).argmax(-1)
    M, K = x.shape
    N = weight.shape[0]
    grid = triton.cdiv(N, lt.block_n)
    keys = torch.empty((M, grid), dtype=torch.int64, device=x.device)
    out = torch.empty(M, dtype=torch.int64, device=x.device)
    _gemv_kernel[(grid,)](
        x, weight, weight, keys, M, N, K, x.stride(0), weight.stride(0), keys.stride(0),
        *(weight,) * 5, 0, 0, 1, 0.0, HAS_BIAS=False, GATED=False, ADD_NORM=False,
        RMS_IN=False, PARTS_PAD=1, BLOCK_M=GEMV_MAX_ROWS, BLOCK_N=lt.block_n,
        BLOCK_K=lt.block_k, STAGES=lt.stages, LATE_TRIGGER=False,
        UPCAST=x.dtype == torch.bfloat16 and x.device.type != "cuda", ARGMAX=True,
        num_warps=lt.warps, **pdl_launch(x.device, "gemv"))
    _argmax_keys_kernel[(M,)](keys, out, grid, keys.stride(0), BLOCK=1024, num_warps=4,
                              **pdl_launch(x.device, "gemv"))
    return out


def _gemv(x: Tensor, weight: Tensor, bias: Tensor | None, launch: GemvLaunch | None,
          impl: str = "auto", gated: bool = False, rms: RowRms | None = None,
          add_norm: tuple[Tensor, Tensor, float] | None = None):
    """:func:`gemv` / :func:`gemv_add_norm` with a given tile (``None``: the default)."""
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"gemv: bias {tuple(bias.shape)} does not match weight "
                         f"{tuple(weight.shape)}")
    if gated and weight.shape[0] % 2:
        raise ValueError(f"gemv(gated=True): weight rows {weight.shape[0]} are not gate rows "
                         "then as many up rows")
    if rms is not None and (rms.parts.shape[0] != x.shape[0] or rms.dim != x.shape[1]
                            or rms.parts.dtype != torch.float32):
        raise ValueError(f"gemv: rms parts {tuple(rms.parts.shape)} {rms.parts.dtype} over "
                         f"{rms.dim} columns do not fit x {tuple(x.shape)} (float32 [M, P])")
    M, K = x.shape
    N = weight.shape[0] // (2 if gated else 1)
    stream, stream_ok = (stream_gemv, stream_gemv_ok) if M == 1 else (stream_rows,
                                                                        stream_rows_ok)
    if launch is None and stream_ok(x, weight, bias, gated, impl, add_norm is not None):
        y = stream(x, weight, gated=gated, rms=rms, add_norm=add_norm)
        if add_norm is None:
            return y
        out, h, parts = y
        return out, h, RowRms(parts, N, add_norm[2])
    lt = _launch(weight, x.shape[-1], launch, gated) if gemv_ok(x, weight, impl) else None
    if lt is None:
        y = F.linear(x, weight, None if rms is not None else bias)
        if rms is not None:
            y = (y.float() * rms.rstd()[:, None]).to(x.dtype)
            y = y if bias is None else y + bias
        y = silu_mul_merged(y, impl=impl) if gated else y
        if add_norm is None:
            return y
        residual, g, eps = add_norm
        h = (residual.float() + y.float()).to(x.dtype)
        parts = h.float().square().sum(1, keepdim=True)
        return (g.float() * h.float()).to(x.dtype), h, RowRms(parts, N, eps)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    grid = triton.cdiv(N, lt.block_n)
    if add_norm is not None:
        residual, g, eps = add_norm
        h = torch.empty((M, N), dtype=x.dtype, device=x.device)
        ss_out = torch.empty((M, grid), dtype=torch.float32, device=x.device)
        r_args = (residual, g, h, ss_out)
    else:
        eps = rms.eps if rms is not None else 0.0
        r_args = (weight,) * 4
    ss_in = rms.parts.contiguous() if rms is not None else weight
    parts_in = ss_in.shape[1] if rms is not None else 1
    _gemv_kernel[(grid,)](
        x, weight, bias if bias is not None else weight, out, M, N, K, x.stride(0),
        weight.stride(0), out.stride(0), *r_args, ss_in,
        residual.stride(0) if add_norm else 0, h.stride(0) if add_norm else 0, parts_in, eps,
        HAS_BIAS=bias is not None, GATED=gated, ADD_NORM=add_norm is not None,
        RMS_IN=rms is not None, PARTS_PAD=triton.next_power_of_2(parts_in),
        BLOCK_M=GEMV_MAX_ROWS, BLOCK_N=lt.block_n, BLOCK_K=lt.block_k, STAGES=lt.stages,
        LATE_TRIGGER=lt.late_trigger and add_norm is not None,
        UPCAST=x.dtype == torch.bfloat16 and x.device.type != "cuda", num_warps=lt.warps,
        **pdl_launch(x.device, "gemv"))
    if add_norm is not None:
        return out, h, RowRms(ss_out, N, eps)
    return out


__all__ = ["ARGMAX_LAUNCH", "GEMV_MAX_ROWS", "GemvLaunch", "RowRms", "gemv", "gemv_add_norm",
           "gemv_argmax", "gemv_launch", "gemv_ok"]
