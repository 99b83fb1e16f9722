"""Matrix products of a few rows against a large weight (decode and verify steps).

At batch 1-16 a decoder's linear layers read every weight byte once and do almost no math, so
their time is the weight's bytes over the memory bandwidth plus the launch's ramp and tail.
:func:`gemv` is ``F.linear`` for ``[M <= 16, K] x [N, K]^T``: one Triton launch, every program
streams ``BLOCK_N`` whole weight rows (no split over K, so the sum order is fixed: results are
deterministic, graph replay equals eager), float32 accumulation, one rounding to the output
dtype. On CPU, for more rows, or for shapes the kernel does not take it is ``F.linear``.

Tiles are chosen per weight shape by :func:`gemv_launch` (measured on the H200,
``benchmarks/runner_profile.py``); :class:`GemvLaunch` lets benchmarks and tests set them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ._device import gdc_launch_dependents, gdc_wait, pdl_ok  # noqa: F401 - used in kernels
from .layer_ops import add_rms_norm_ref, silu_mul_ref

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
    columns per loop step, ``stages`` loads in flight, ``warps`` per program."""

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


def gemv_launch(n: int, k: int) -> GemvLaunch:
    """The default tile for an ``[n, k]`` weight. Measured on the H200 (docs/benchmarks.md,
    runner section: every tile of a grid, 1 and 16 rows): the Qwen3-8B shapes' best tiles
    were 64 x 128 for wide outputs (q/k/v 6144, gate/up 24576; 5 stages up to 8k rows, 3
    beyond) and 32 x 256 with 5 stages for 4096-wide ones (o_proj, down)."""
    if n >= 6144:
        return GemvLaunch(64, 128, 5 if n <= 8192 else 3, 4)
    return GemvLaunch(32, 256, 5, 4)


#: input transforms a :func:`gemv` launch applies to its rows before the product
_PRO_NONE, _PRO_NORM, _PRO_ADD_NORM, _PRO_SILU = 0, 1, 2, 3

if triton is not None:
    @triton.jit
    def _gemv_input(x_rows, r_rows, nw_ptr, k, m_ok, rstd, K, PRO: tl.constexpr):
        """The product's input tile ``[BLOCK_M, BLOCK_K]`` at columns ``k``, rounded as the
        separate torch ops round it (every bf16 op computes in float32 and rounds)."""
        dt = nw_ptr.dtype.element_ty
        if PRO == 3:   # silu(gate) * up of a merged [M, 2K] product
            g = tl.load(x_rows + k[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
            u = tl.load(x_rows + K + k[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
            s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
            return (s * u).to(dt)
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None], other=0.0)
        if PRO == 2:
            x = (tl.load(r_rows + k[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
                 + x.to(tl.float32)).to(dt)
        if PRO >= 1:
            y = (x.to(tl.float32) * rstd[:, None]).to(dt).to(tl.float32)
            w = tl.load(nw_ptr + k).to(tl.float32)
            x = (w[None, :] * y).to(dt)
        return x

    @triton.jit
    def _dot_t(x, w, acc, UPCAST: tl.constexpr):
        """``acc + x @ w^T``; ``UPCAST``: in float32 (the CPU interpreter's bf16 dot is wrong)."""
        if UPCAST:
            return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc,
                          input_precision="ieee")
        return tl.dot(x, tl.trans(w), acc)

    @triton.jit
    def _gemv_kernel(x_ptr, r_ptr, nw_ptr, h_ptr, w_ptr, b_ptr, out_ptr, M, N, K, eps,
                     s_xm, s_rm, s_hm, s_wn, s_om, PRO: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     STAGES: tl.constexpr, PDL: tl.constexpr, UPCAST: tl.constexpr):
        # K is a multiple of BLOCK_K (the wrapper checks); rows past M and columns past N are
        # masked. Every program reads its BLOCK_N weight rows whole, in K order.
        pid = tl.program_id(0)
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        kk = tl.arange(0, BLOCK_K)
        n_ok = n < N
        m_ok = m < M
        x_rows = x_ptr + m[:, None].to(tl.int64) * s_xm
        r_rows = r_ptr + m[:, None].to(tl.int64) * s_rm
        w_rows = w_ptr + n[:, None].to(tl.int64) * s_wn
        # The first weight tile is read before waiting on the previous kernel: weights are
        # never written by a step, so under PDL this load overlaps that kernel's tail.
        w0 = tl.load(w_rows + kk[None, :], mask=n_ok[:, None], other=0.0)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
        if PRO == 1 or PRO == 2:
            ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
                k = k0 + kk
                h = tl.load(x_rows + k[None, :], mask=m_ok[:, None], other=0.0)
                if PRO == 2:
                    h = (tl.load(r_rows + k[None, :], mask=m_ok[:, None], other=0.0)
                         .to(tl.float32) + h.to(tl.float32)).to(h.dtype)
                    if pid == 0:   # the new residual stream, written once
                        tl.store(h_ptr + m[:, None].to(tl.int64) * s_hm + k[None, :], h,
                                 mask=m_ok[:, None])
                hf = h.to(tl.float32)
                ss += tl.sum(hf * hf, 1)
            rstd = tl.math.rsqrt(ss / K + eps)
        acc = _dot_t(_gemv_input(x_rows, r_rows, nw_ptr, kk, m_ok, rstd, K, PRO), w0,
                     tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), UPCAST)
        for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
            k = k0 + kk
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None], other=0.0)
            acc = _dot_t(_gemv_input(x_rows, r_rows, nw_ptr, k, m_ok, rstd, K, PRO), w, acc,
                         UPCAST)
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + m[:, None].to(tl.int64) * s_om + n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def gemv_ok(x: Tensor, weight: Tensor, impl: str = "auto") -> bool:
    """Whether the :func:`gemv` family runs its kernel for these operands (else the torch ops):
    ``impl="auto"`` on CUDA, ``"triton"`` anywhere Triton runs (the interpreter on CPU),
    ``"torch"`` never."""
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    return (triton is not None and impl != "torch"
            and (x.device.type == "cuda" or impl == "triton") and x.dim() == 2
            and 0 < x.shape[0] <= GEMV_MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and x.stride(1) == 1 and weight.stride(1) == 1
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def _launch(x: Tensor, weight: Tensor, k: int, launch: GemvLaunch | None) -> GemvLaunch | None:
    lt = launch or gemv_launch(weight.shape[0], k)
    bk = lt.block_k
    while bk > 16 and k % bk:
        bk //= 2
    if k % bk or weight.shape[1] != k:
        return None
    return lt if bk == lt.block_k else GemvLaunch(lt.block_n, bk, lt.stages, lt.warps)


def _run(pro: int, x: Tensor, weight: Tensor, lt: GemvLaunch, k: int, *, residual=None,
         norm_weight=None, eps=0.0, bias=None) -> tuple[Tensor, Tensor | None]:
    M, N = x.shape[0], weight.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    h = torch.empty_like(x) if pro == _PRO_ADD_NORM else None
    r = residual if residual is not None else x
    pdl = pdl_ok(x.device)
    _gemv_kernel[(triton.cdiv(N, lt.block_n),)](
        x, r, norm_weight if norm_weight is not None else x, h if h is not None else x, weight,
        bias if bias is not None else weight, out, M, N, k, eps, x.stride(0), r.stride(0),
        (h if h is not None else x).stride(0), weight.stride(0), out.stride(0), PRO=pro,
        HAS_BIAS=bias is not None, BLOCK_M=16, BLOCK_N=lt.block_n, BLOCK_K=lt.block_k,
        STAGES=lt.stages, PDL=pdl, UPCAST=x.dtype == torch.bfloat16 and x.device.type != "cuda",
        num_warps=lt.warps, **({"launch_pdl": True} if pdl else {}))
    return out, h


def gemv(x: Tensor, weight: Tensor, bias: Tensor | None = None,
         launch: GemvLaunch | None = None, impl: str = "auto") -> Tensor:
    """``F.linear(x, weight, bias)`` for ``x [M, K]``, ``weight [N, K]`` (``[M, N]`` out).

    On CUDA with ``M <= GEMV_MAX_ROWS`` bf16/fp16 rows-contiguous operands one Triton launch,
    else ``F.linear``. Values differ from cuBLAS's only by the summation order (float32 sums).
    """
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"gemv: bias {tuple(bias.shape)} does not match weight "
                         f"{tuple(weight.shape)}")
    lt = _launch(x, weight, x.shape[-1], launch) if gemv_ok(x, weight, impl) else None
    if lt is None:
        return F.linear(x, weight, bias)
    return _run(_PRO_NONE, x, weight, lt, x.shape[1], bias=bias)[0]


def norm_gemv(x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor,
              residual: Tensor | None = None, bias: Tensor | None = None,
              launch: GemvLaunch | None = None, impl: str = "auto") -> tuple[Tensor, Tensor]:
    """``(F.linear(rms_norm(h), weight, bias), h)`` with ``h = residual + x`` (or ``x``): the
    decoder's residual add and RMSNorm read as the product's input, one launch (the values of
    :func:`~kvstrata.kernels.layer_ops.add_rms_norm` then ``F.linear``, up to the order of
    the norm's sum). ``x``, ``residual``: ``[M, K]``; ``norm_weight``: ``[K]``."""
    lt = None
    if gemv_ok(x, weight, impl) and norm_weight.dtype == x.dtype and (
            residual is None or (residual.shape == x.shape and residual.stride(1) == 1)):
        lt = _launch(x, weight, x.shape[1], launch)
    if lt is None:
        xn, h = add_rms_norm_ref(x, norm_weight, eps, residual)
        return F.linear(xn, weight, bias), h
    out, h = _run(_PRO_ADD_NORM if residual is not None else _PRO_NORM, x, weight, lt,
                  x.shape[1], residual=residual, norm_weight=norm_weight, eps=eps, bias=bias)
    return out, (h if h is not None else x)


def silu_gemv(gate_up: Tensor, weight: Tensor, launch: GemvLaunch | None = None,
              impl: str = "auto") -> Tensor:
    """``F.linear(silu(gate) * up, weight)`` of a merged ``[M, 2K]`` gate/up product (gate
    columns first), one launch: the values of
    :func:`~kvstrata.kernels.layer_ops.silu_mul_merged` then ``F.linear``."""
    k = gate_up.shape[-1] // 2
    lt = None
    if gemv_ok(gate_up, weight, impl) and gate_up.shape[1] == 2 * k:
        lt = _launch(gate_up, weight, k, launch)
    if lt is None:
        return F.linear(silu_mul_ref(gate_up[:, :k], gate_up[:, k:]), weight)
    return _run(_PRO_SILU, gate_up, weight, lt, k)[0]


__all__ = ["GEMV_MAX_ROWS", "GemvLaunch", "gemv", "gemv_launch", "gemv_ok", "norm_gemv",
           "silu_gemv"]
