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
serves; ``KVSTRATA_STREAM_GEMV=0`` keeps every product on Triton.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch
from torch import Tensor

from ._cuda import PRELUDE, Kernel, compiles, tensor_map_2d, variant
from ._device import num_sms, pdl_ok
from .stream_gemv import _BLOCK, _SMEM_MAX, _run, operands_ok

#: the switches of :func:`stream_rows` (2-16 rows): consumer warps; ring KB per block; the
#: columns of a stage (a multiple of 64); and, as :data:`~.stream_gemv.VARIANT`'s last two,
#: the products that launch the next kernel early and the products served (masks of 1 plain,
#: 2 gated, 4 add-norm).
ROWS_VARIANT = (8, 192, 64, 4, 5)
#: for benchmarks: colon-separated switches replacing :data:`ROWS_VARIANT`'s first ones
ROWS_VARIANT_ENV = "KVSTRATA_STREAM_ROWS_VARIANT"


_ROWS_SOURCE = r"""
#define K_IN %(k)d
#define RMS_IN %(rms_in)d
#define ADD_NORM %(add_norm)d
#define GATED %(gated)d
#define NW %(nw)d
#define NS %(ns)d
#define KC %(kc)d
#define MTG %(mt)d
#define MT (MTG * (1 + GATED))
#define MAXR %(maxr)d
#define PDL %(pdl)d
#define TRIGGER %(trigger)d
#define STAMPS 0
#define NC (K_IN / KC)
#define NB (KC / 64)
#define WBOX (MT * 2048)
#define XOFF (NB * WBOX)
#define STAGEB (NB * (WBOX + 2048))
#define RED (MT * 16 * 17)
#define EPI ((16 * MAXR + NW * 32 - 1) / (NW * 32))
%(prelude)s
%(block)s
// chunk i (KC columns, 64-column boxes) of this block's weight rows (GATED: its gate rows,
// then from m-tile MTG on its up rows, N further) into stage i %% NS, and after the wait
// (issue_x) of the 16 input rows (rows past m read as zeros), on full[i %% NS]: 128-byte
// swizzled rows, 16-byte chunk c of row r at c ^ (r %% 8)
__device__ __forceinline__ void issue_w(const TMap* wm, int N, int r0, int nr,
                                        unsigned char* ring, u64* full, int i) {
    const int s = i %% NS;
    mbar_expect(&full[s], NB * (nr * (1 + GATED) + 16) * 128);
#pragma unroll
    for (int j = 0; j < NB; ++j)
#pragma unroll
        for (int part = 0; part <= GATED; ++part)
            tensor_copy(sa(ring + s * STAGEB + j * WBOX + part * MTG * 2048), wm,
                        i * KC + j * 64, r0 + part * N, &full[s]);
}
__device__ __forceinline__ void issue_x(const TMap* xm, unsigned char* ring, u64* full, int i) {
    const int s = i %% NS;
#pragma unroll
    for (int j = 0; j < NB; ++j)
        tensor_copy(sa(ring + s * STAGEB + XOFF + j * 2048), xm, i * KC + j * 64, 0, &full[s]);
}

extern "C" __global__ void __launch_bounds__(NW * 32, 1)
stream_rows(const __grid_constant__ TMap wlo, const __grid_constant__ TMap whi,
            const __grid_constant__ TMap xm, int m, bf16_t* __restrict__ out, int N,
            const float* __restrict__ ss_in, int parts_in, float eps,
            const bf16_t* __restrict__ res, const bf16_t* __restrict__ gam,
            bf16_t* __restrict__ hout, float* __restrict__ ss_out) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    u64* full = (u64*)smem_raw;                                   // NS mbarriers
    unsigned char* ring = smem_raw + 1024 + ((1024u - (sa(smem_raw) & 1023u)) & 1023u);
    float* rs = (float*)(ring + NS * STAGEB);                     // [16] the rows' scales
    BLOCK_ROWS;
    // the weight map whose boxes are this block's rows (two row counts: N over G blocks)
    const TMap* wm = nr == (int)((long long)N / G) ? &wlo : &whi;
    if (lane == 0) {
        init_stages(full, warp);
        // the weights depend on no kernel: issued before the wait
        for (int i = warp; i < NS && i < NC; i += NW) issue_w(wm, N, r0, nr, ring, full, i);
    }
#if PDL && TRIGGER
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    GDC_WAIT();
    if (lane == 0)
        for (int i = warp; i < NS && i < NC; i += NW) issue_x(&xm, ring, full, i);
#if RMS_IN
    for (int t = warp; t < m; t += NW) {
        float a = 0.f;
        for (int p = lane; p < parts_in; p += 32) a += ss_in[t * parts_in + p];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) a += __shfl_xor_sync(FULL, a, off);
        if (lane == 0) rs[t] = rsqrtf(a / K_IN + eps);
    }
#endif
#if ADD_NORM
    // the epilogue's residual and norm weight, loaded now: they arrive while the loop runs
    float pres[EPI], pgam[EPI];
#pragma unroll
    for (int j = 0; j < EPI; ++j) {
        const int e = tid + j * NW * 32, tok = e / nr, n = r0 + e - tok * nr;
        pres[j] = e < m * nr ? bf(res[(size_t)tok * N + n]) : 0.f;
        pgam[j] = e < m * nr ? bf(gam[n]) : 0.f;
    }
#endif
    __syncwarp();
    // ldmatrix rows: weight rows lane %% 16 of an m-tile (chunk lane / 16 of a k-step), input
    // rows lane %% 8 + 8 * (lane / 16) (chunk lane / 8 %% 2): two n-tiles of 8 in one x4 load;
    // both swizzled by the row's r %% 8 == lane %% 8
    const u32 a_row = (lane & 15) * 128, b_row = ((lane & 7) + ((lane >> 4) << 3)) * 128;
    const u32 a_sw = (lane >> 4) ^ (lane & 7), b_sw = ((lane >> 3) & 1) ^ (lane & 7);
    float acc[MT][2][4];
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[t][j >> 2][j & 3] = 0.f;
    for (int i = warp; i < NC; i += NW) {
        const int s = i %% NS;
        mbar_wait(&full[s], (i / NS) & 1);
        const u32 st = sa(ring + s * STAGEB);
#pragma unroll
        for (int ks = 0; ks < KC / 16; ++ks) {
            const u32 box = (ks >> 2), c = (ks & 3) * 2;
            u32 b0, b1, b2, b3;
            ldsm4(st + XOFF + box * 2048 + b_row + ((c ^ b_sw) << 4), b0, b1, b2, b3);
#pragma unroll
            for (int t = 0; t < MT; ++t) {
                u32 a0, a1, a2, a3;
                ldsm4(st + box * WBOX + t * 2048 + a_row + ((c ^ a_sw) << 4), a0, a1, a2, a3);
                mma_bf16(acc[t][0], a0, a1, a2, a3, b0, b1);
                mma_bf16(acc[t][1], a0, a1, a2, a3, b2, b3);
            }
        }
        __syncwarp();
        // every lane's reads of the stage are done (the products above need them): refill it
        if (lane == 0 && i + NS < NC) {
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            issue_w(wm, N, r0, nr, ring, full, i + NS);
            issue_x(&xm, ring, full, i + NS);
        }
    }
    // the warps' partial sums in a fixed order: red[warp][row][token] (17 floats a row)
    __syncthreads();
    float* red = (float*)ring;
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int row = t * 16 + (lane >> 2) + ((j & 2) ? 8 : 0);
            const int tok = (j >> 2) * 8 + (lane & 3) * 2 + (j & 1);
            red[warp * RED + row * 17 + tok] = acc[t][j >> 2][j & 3];
        }
    __syncthreads();
#if ADD_NORM
    float* sq = red + NW * RED;                                   // [16][MAXR] h squared
#endif
#pragma unroll
    for (int j = 0; j < EPI; ++j) {
        const int e = tid + j * NW * 32, tok = e / nr, row = e - tok * nr, n = r0 + row;
        if (e >= m * nr) break;
        float a = 0.f, au = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w) {
            a += red[w * RED + row * 17 + tok];
            if (GATED) au += red[w * RED + (MTG * 16 + row) * 17 + tok];
        }
#if RMS_IN
        a *= rs[tok];
        au *= rs[tok];
#endif
#if GATED
        // silu(gate) rounded, times up: as silu_mul_merged rounds the separate product
        const float g = bf(to_bf(a)), u = bf(to_bf(au));
        out[(size_t)tok * N + n] = to_bf(bf(to_bf(g / (1.f + expf(-g)))) * u);
#elif ADD_NORM
        // h = residual + product, g * h: as gemv_add_norm rounds them
        const bf16_t hn = to_bf(pres[j] + bf(to_bf(a)));
        hout[(size_t)tok * N + n] = hn;
        const float hf = bf(hn);
        sq[tok * MAXR + row] = hf * hf;
        out[(size_t)tok * N + n] = to_bf(pgam[j] * hf);
#else
        out[(size_t)tok * N + n] = to_bf(a);
#endif
    }
#if ADD_NORM
    __syncthreads();
    for (int tok = warp; tok < m; tok += NW) {
        float a = 0.f;
        for (int row = lane; row < nr; row += 32) a += sq[tok * MAXR + row];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) a += __shfl_xor_sync(FULL, a, off);
        if (lane == 0) ss_out[tok * G + b] = a;
    }
#endif
}
"""


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
    src = _ROWS_SOURCE % {"prelude": PRELUDE, "block": _BLOCK, "k": k, "rms_in": int(rms_in),
                          "gated": int(gated), "add_norm": int(add_norm), "nw": nw, "ns": ns,
                          "kc": kc, "mt": mt, "maxr": -(-n // blocks), "pdl": int(pdl),
                          "trigger": int(trigger)}
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
