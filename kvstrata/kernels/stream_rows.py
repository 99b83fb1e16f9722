"""Products of 2-16 rows streamed through shared memory by tensor-map copies (Hopper, CUDA C++).

The same stream as :func:`~.stream_gemv.stream_gemv` for 2-16 rows (the verify and draft
steps at batch 1, where 16 rows of float32 FMAs would be bound by compute): a stage is 64-column
boxes of a tensor map (``cp.async.bulk.tensor``, 128-byte swizzle; one box per 64 columns of
all the block's rows, so a stage is a few copies where per-row copies of a column range were
bound by the copies' issue: 0.9-2.4 ms slower per verify step) issued before the wait, then
the 16 input rows' boxes after it (rows past ``M`` land as zeros). Warp ``w`` takes the stages
``w, w + NW, ...`` whole: ``ldmatrix`` of the weight rows (16-row m-tiles) and of the input
rows, two ``mma.m16n8k16`` per m-tile and 16 columns, float32 accumulators; the warps' parts
are summed in warp order through shared memory, then the same epilogues (the add-norm one's
residual and norm weight loaded before the loop).

Shipped for q/k/v and down (:data:`ROWS_VARIANT`): the batch-1 verify-16 step 0.10-0.11 ms
faster at 1k and 8k on the H200. The gated build (gate and up rows of a block's outputs per
stage, SiLU in the epilogue) is correct and measured slower (the verify-16 step 0.24 ms: its
stages of 24 KB leave one per warp, and 187 registers per thread), so gate/up stays on Triton
(docs/benchmarks.md, twenty-seventh runner session). :func:`stream_rows_ok` says where it
serves; ``KVSTRATA_STREAM_GEMV=0`` keeps every product on Triton. The kernel's CUDA C++:
``cuda/stream_rows.cu`` (built by :func:`~._cuda.cuda_source`).
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch
from torch import Tensor

from ._cuda import Kernel, compiles, cuda_source, tensor_map_2d, variant
from ._device import num_sms, pdl_ok
from .stream_gemv import _SMEM_MAX, _run, operands_ok

#: the switches of :func:`stream_rows` (2-16 rows): consumer warps; ring KB per block; the
#: columns of a stage (a multiple of 64); and, as :data:`~.stream_gemv.VARIANT`'s last two,
#: the products that launch the next kernel early and the products served (masks of 1 plain,
#: 2 gated, 4 add-norm).
ROWS_VARIANT = (8, 192, 64, 4, 5)
#: for benchmarks: colon-separated switches replacing :data:`ROWS_VARIANT`'s first ones
ROWS_VARIANT_ENV = "KVSTRATA_STREAM_ROWS_VARIANT"


def _rows_variant() -> tuple[int, ...]:
    return variant(os.environ.get(ROWS_VARIANT_ENV, ""), ROWS_VARIANT, ROWS_VARIANT_ENV)


def rows_layout(k: int, n: int, blocks: int, nw: int, ring_kb: int, kc: int, add_norm: bool,
                gated: bool = False) -> tuple[int, int, int] | None:
    """``(stages, m-tiles, dynamic shared memory)`` of a :func:`stream_rows` build: a stage is
    ``kc`` columns (64-column boxes of a tensor map) of the block's rows (at most 255, in
    16-row m-tiles per part: ``gated``, its gate and its up rows) and of the 16 input rows;
    the ring the most multiples of ``nw`` stages in ``ring_kb`` (at least ``nw``) that also
    hold the warps' partial sums, after 1 KB of mbarriers and 1 KB of alignment slack.
    ``None`` where it does not fit."""
    maxr = -(-n // blocks)
    if kc < 64 or kc % 64 or k % kc or n < blocks or maxr > 255:
        return None
    mt = -(-maxr // 16)
    parts = 2 if gated else 1
    stage = (kc // 64) * (mt * parts * 16 + 16) * 128
    ns = max(nw, (ring_kb * 1024 // stage) // nw * nw)
    red = nw * mt * parts * 16 * 17 * 4 + (16 * maxr * 4 if add_norm else 0)
    while ns > nw and 2048 + ns * stage + 64 > _SMEM_MAX:
        ns -= nw
    smem = 2048 + ns * stage + 64
    if smem > _SMEM_MAX or ns * stage < red:
        return None
    return ns, mt, smem


def build_rows(k: int, n: int, blocks: int, rms_in: bool, add_norm: bool, nw: int,
               ring_kb: int, kc: int, trigger: int, pdl: int, gated: bool = False
               ) -> tuple[str, int]:
    """The source of one :func:`stream_rows` shape and epilogue (``n`` outputs; ``gated``:
    ``2 n`` weight rows), and its shared memory."""
    lay = rows_layout(k, n, blocks, nw, ring_kb, kc, add_norm, gated)
    if lay is None:
        raise ValueError(f"stream_rows: [{n}, {k}] with {nw} warps, a {ring_kb} KB ring and "
                         f"{kc}-column stages does not fit a block's shared memory")
    ns, mt, smem = lay
    src = cuda_source("stream_rows.cu", {
        "K_IN": k, "RMS_IN": rms_in, "ADD_NORM": add_norm, "GATED": gated, "NW": nw, "NS": ns,
        "KC": kc, "MTG": mt, "MAXR": -(-n // blocks), "PDL": pdl, "TRIGGER": trigger})
    return src, smem


@functools.lru_cache(maxsize=None)
def _rows_kernel(device: torch.device, k: int, n: int, gated: bool, rms_in: bool,
                 add_norm: bool, nw: int, ring_kb: int, kc: int, trigger: int, pdl: int
                 ) -> Kernel:
    blocks = num_sms(device, 132)
    trigger = int(bool(trigger & (2 if gated else 4 if add_norm else 1)))
    src, smem = build_rows(k, n, blocks, rms_in, add_norm, nw, ring_kb, kc, trigger, pdl,
                           gated)
    with torch.cuda.device(device):
        return Kernel(src, "stream_rows", smem, nw * 32, blocks=blocks, cooperative=False)


def stream_rows_ok(x: Tensor, weight: Tensor, bias: Tensor | None, gated: bool,
                   impl: str = "auto", add_norm: bool = False) -> bool:
    """Whether :func:`stream_rows` serves ``F.linear(x, weight)``: 2-16 rows (16-byte aligned)
    whose operands are :func:`~.stream_gemv.operands_ok`, a product served by the switches,
    a layout that fits (:func:`rows_layout`), and the shape compiles."""
    if (not operands_ok(x, weight, bias, impl) or not 2 <= x.shape[0] <= 16
            or x.stride(0) % 8):
        return False
    n, k = weight.shape
    n //= 2 if gated else 1
    nw, ring_kb, kc, _, kinds = _rows_variant()
    if (not kinds & (2 if gated else 4 if add_norm else 1)
            # every epilogue of the shape is compiled at once: a plain one fits the add-norm's
            # layout too
            or rows_layout(k, n, num_sms(x.device, 132), nw, ring_kb, kc, not gated,
                           gated) is None):
        return False
    return _rows_compiled(x.device, k, n, gated)


@functools.lru_cache(maxsize=None)
def _rows_compiled(device: torch.device, k: int, n: int, gated: bool) -> bool:
    v = _rows_variant()
    return compiles(
        lambda: [_rows_kernel(device, k, n, gated, r, a, *v[:4], int(pdl_ok(device, "gemv")))
                 for r in (False, True) for a in ((False,) if gated else (False, True))
                 if not (r and a)],
        f"kernels.stream_rows: not compiled for [{n}, {k}]"
        f"{' gated' if gated else ''} on {device}",
        "products of 2-16 rows keep the Triton kernel")


def stream_rows(x: Tensor, weight: Tensor, *, gated: bool = False, rms=None,
                add_norm: tuple[Tensor, Tensor, float] | None = None):
    """:func:`~.gemv.gemv` / :func:`~.gemv.gemv_add_norm` of 2-16 rows where
    :func:`stream_rows_ok` holds: ``out [M, N]``, or ``(out, h, parts [M, blocks])``."""
    m, k = x.shape
    n = weight.shape[0] // (2 if gated else 1)
    dev = x.device
    pdl = pdl_ok(dev, "gemv")
    kern = _rows_kernel(dev, k, n, gated, rms is not None, add_norm is not None,
                        *_rows_variant()[:4], int(pdl))
    lo = n // kern.blocks
    return _run(kern, lambda out: [tensor_map_2d(weight, lo, 64),
                                   tensor_map_2d(weight, lo + 1, 64), tensor_map_2d(x, 16, 64),
                                   ctypes.c_int32(m), out, ctypes.c_int32(n)],
                x, m, n, rms, add_norm, pdl)


__all__ = ["ROWS_VARIANT", "ROWS_VARIANT_ENV", "stream_rows", "stream_rows_ok"]
