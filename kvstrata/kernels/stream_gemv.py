"""One-row products streamed through shared memory by bulk copies (Hopper, CUDA C++).

At batch 1 a product reads each weight byte once, and what separates a chain of them from the
copy rate is each launch's ramp and tail: the Triton :func:`~.gemv.gemv` can read only its
first weight tile before it waits for the previous kernel (``griddepcontrol.wait``), so every
product starts with its loads' latency exposed (docs/benchmarks.md, runner sessions 5-11:
the Triton chain 1.10-1.13x the read floor, a bulk-copy stream alone 0.99x).

:func:`stream_gemv` is one launch of one block per SM (each block owns a contiguous range of
weight rows, the ranges balanced to within one row). Every warp's lane 0 starts bulk copies
(``cp.async.bulk``) of its first rows into a ring of shared-memory stages (one row, or a gate
and an up row, per stage, about 192 KB per block) *before* the wait, so a product streams up
to 25 MB of its weights while the previous kernel finishes. A block holds most of its SM's
shared memory, so the next kernel's blocks can only start where a block of this one has left;
where the next kernel is itself a stream product (after down) the blocks let it launch at once,
elsewhere (after q/k/v: its q/k norm + RoPE, then the decode segment, whose attention ran
slower for an early start) only when they complete. After the wait the input row goes to shared
memory and each warp takes the stages ``warp, warp + NW, ...`` (a stage's phases in order, by
one warp): 8 inputs per lane and step, float32 sums, the warp's sum by shuffles, then the stage
is refilled with the warp's row ``NS`` further on.

Epilogues as :func:`~.gemv.gemv`'s: ``RMS_IN`` (the row scaled by the previous norm's
``rsqrt``, :class:`~.gemv.RowRms`), ``GATED`` (``silu(gate) * up``, each rounded as the separate
ops round), ``ADD_NORM`` (``h = residual + product``, ``norm_weight * h`` and the block's sum of
squares of ``h``: one part per block). Sums run in a fixed order: deterministic, graph replay
equals eager bit for bit; values differ from the Triton kernel's by the summation order only.

Shipped for q/k/v and down (:data:`VARIANT`): the batch-1 plain decode step 0.05-0.06 ms faster
at 1k and 8k on the H200; the gated gate/up product stays on Triton, whose 384 programs read
its 201 MB at the copy rate (docs/benchmarks.md, twenty-sixth runner session).
:func:`stream_gemv_ok` says where it serves (sm_90, one bf16 row, no bias, ``K`` a multiple of
256 and a ring that fits); ``KVSTRATA_STREAM_GEMV=0`` keeps every product on Triton.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch
from torch import Tensor

from ._cuda import PRELUDE, Kernel, compiles, tensor_map_2d, variant
from ._device import num_sms, pdl_ok

#: ``KVSTRATA_STREAM_GEMV=0``: one-row products stay on the Triton kernel.
STREAM_ENV = "KVSTRATA_STREAM_GEMV"
#: the switches as shipped: consumer warps; ring KB per block; the products that let the next
#: kernel launch once every block has issued its first copies (the others: when they
#: complete); the products served. The last two are masks of 1 (plain, e.g. q/k/v), 2 (gated:
#: gate/up) and 4 (the add-norm epilogue: down). Measured on the H200 (docs/benchmarks.md,
#: twenty-sixth runner session): the gated product lost to Triton's (52 against 48.5 us per
#: layer); an early launch of the kernel after q/k/v (its norm + RoPE, then the segment) made
#: the decode segment slower, after down (q/k/v) it pays.
VARIANT = (8, 192, 4, 5)
#: for benchmarks: colon-separated switches replacing :data:`VARIANT`'s first ones
VARIANT_ENV = "KVSTRATA_STREAM_GEMV_VARIANT"
#: the switches of :func:`stream_rows` (2-16 rows): consumer warps; ring KB per block; the
#: columns of a stage (a multiple of 64); and, as :data:`VARIANT`'s last two, the products that
#: launch the next kernel early and the products served (masks of 1 plain, 2 gated, 4
#: add-norm).
ROWS_VARIANT = (8, 192, 64, 4, 5)
#: for benchmarks: colon-separated switches replacing :data:`ROWS_VARIANT`'s first ones
ROWS_VARIANT_ENV = "KVSTRATA_STREAM_ROWS_VARIANT"
#: the most dynamic shared memory a block of an H100/H200 may take
_SMEM_MAX = 227 * 1024

#: what both sources share after the prelude: this block's rows and its stages' mbarriers
_BLOCK = r"""
// this block's weight rows [r0, r0 + nr): N over the grid, balanced to within one row
#define BLOCK_ROWS const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31; \
    const int b = blockIdx.x, G = gridDim.x; \
    const int r0 = (int)((long long)N * b / G), nr = (int)((long long)N * (b + 1) / G) - r0; \
    const unsigned FULL = 0xffffffffu
// a warp's stages are warp, warp + NW, ... (NS is a multiple of NW): only it uses them
__device__ __forceinline__ void init_stages(u64* full, int warp) {
    for (int s = warp; s < NS; s += NW) mbar_init(&full[s], 1);
    mbar_fence_init();
}
"""

_SOURCE = r"""
#define K_IN %(k)d
#define GATED %(gated)d
#define RMS_IN %(rms_in)d
#define ADD_NORM %(add_norm)d
#define NW %(nw)d
#define NS %(ns)d
#define MAXR %(maxr)d
#define PDL %(pdl)d
#define TRIGGER %(trigger)d
#define STAMPS 0
#define ROWB (K_IN * 2)
#define STAGEB (ROWB * (1 + GATED))
%(prelude)s
%(block)s
// row i of this block (and its up row) into stage i %% NS, completing on full[i %% NS]
__device__ __forceinline__ void issue(const bf16_t* W, int N, int r, unsigned char* ring,
                                      u64* full, int i) {
    const int s = i %% NS;
    mbar_expect(&full[s], STAGEB);
#pragma unroll
    for (int part = 0; part <= GATED; ++part) {
        const unsigned char* src = (const unsigned char*)(W + ((size_t)part * N + r) * K_IN);
        for (int off = 0; off < ROWB; off += 16384)
            bulk_copy(sa(ring + s * STAGEB + part * ROWB + off), src + off,
                      min(ROWB - off, 16384), &full[s]);
    }
}

extern "C" __global__ void __launch_bounds__(NW * 32, 1)
stream_gemv(const bf16_t* __restrict__ x, const bf16_t* __restrict__ W, bf16_t* __restrict__ out,
            int N, const float* __restrict__ ss_in, int parts_in, float eps,
            const bf16_t* __restrict__ res, const bf16_t* __restrict__ gam,
            bf16_t* __restrict__ hout, float* __restrict__ ss_out) {
    extern __shared__ __align__(128) unsigned char smem[];
    u64* full = (u64*)smem;                                       // NS mbarriers
    unsigned char* ring = smem + 1024;                            // NS stages
    bf16_t* xs = (bf16_t*)(ring + NS * STAGEB);                    // the input row
    float* ep = (float*)(xs + K_IN);                              // residual, norm weight
    float* ssw = ep + 2 * MAXR;                                   // [NW]
    float* rs = ssw + NW;                                         // the input's row scale
    BLOCK_ROWS;
    if (lane == 0) {
        init_stages(full, warp);
        // the weights depend on no kernel: issued before the wait
        for (int i = warp; i < NS && i < nr; i += NW) issue(W, N, r0 + i, ring, full, i);
    }
#if PDL && TRIGGER
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    GDC_WAIT();
    for (int o = tid * 8; o < K_IN; o += NW * 256) *(v4*)(xs + o) = *(const v4*)(x + o);
#if RMS_IN
    if (warp == 0) {
        float t = 0.f;
        for (int p = lane; p < parts_in; p += 32) t += ss_in[p];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) t += __shfl_xor_sync(FULL, t, off);
        if (lane == 0) rs[0] = rsqrtf(t / K_IN + eps);
    }
#endif
#if ADD_NORM
    for (int i = tid; i < nr; i += NW * 32) {
        ep[i] = bf(res[r0 + i]);
        ep[MAXR + i] = bf(gam[r0 + i]);
    }
#endif
    __syncthreads();
#if RMS_IN
    const float rstd = rs[0];
#endif
    float ssum = 0.f;
    for (int i = warp; i < nr; i += NW) {
        const int s = i %% NS;
        mbar_wait(&full[s], (i / NS) & 1);
        const unsigned char* st = ring + s * STAGEB;
        float a = 0.f, au = 0.f;
#pragma unroll 4
        for (int it = 0; it < K_IN / 256; ++it) {
            const int col = it * 256 + lane * 8;
            float xf[8], wf[8];
            unpack8(*(const v4*)(xs + col), xf);
            unpack8(*(const v4*)(st + col * 2), wf);
#pragma unroll
            for (int j = 0; j < 8; ++j) a = fmaf(wf[j], xf[j], a);
#if GATED
            unpack8(*(const v4*)(st + ROWB + col * 2), wf);
#pragma unroll
            for (int j = 0; j < 8; ++j) au = fmaf(wf[j], xf[j], au);
#endif
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            a += __shfl_xor_sync(FULL, a, off);
            if (GATED) au += __shfl_xor_sync(FULL, au, off);
        }
        // every lane's reads of the stage are done (the sums above need them): refill it
        if (lane == 0 && i + NS < nr) {
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            issue(W, N, r0 + i + NS, ring, full, i + NS);
        }
        if (lane == 0) {
            const int n = r0 + i;
#if RMS_IN
            a *= rstd;
            au *= rstd;
#endif
#if GATED
            // silu(gate) rounded, times up: as silu_mul_merged rounds the separate product
            const float g = bf(to_bf(a)), u = bf(to_bf(au));
            out[n] = to_bf(bf(to_bf(g / (1.f + expf(-g)))) * u);
#elif ADD_NORM
            // h = residual + product, g * h: as gemv_add_norm rounds them
            const bf16_t hn = to_bf(ep[i] + bf(to_bf(a)));
            hout[n] = hn;
            const float hf = bf(hn);
            ssum += hf * hf;
            out[n] = to_bf(ep[MAXR + i] * hf);
#else
            out[n] = to_bf(a);
#endif
        }
    }
#if ADD_NORM
    if (lane == 0) ssw[warp] = ssum;
    __syncthreads();
    if (tid == 0) {
        float t = 0.f;
        for (int w = 0; w < NW; ++w) t += ssw[w];
        ss_out[b] = t;
    }
#endif
}
"""


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

def _env_variant() -> tuple[int, ...]:
    return variant(os.environ.get(VARIANT_ENV, ""), VARIANT, VARIANT_ENV)


def stages(k: int, gated: bool, nw: int, ring_kb: int) -> int:
    """Ring stages: the most multiples of ``nw`` whose rows fit ``ring_kb`` (at least ``nw``)."""
    per = k * 2 * (2 if gated else 1)
    return min(128, max(nw, (ring_kb * 1024 // per) // nw * nw))


def smem_bytes(k: int, gated: bool, ns: int, nw: int, maxr: int) -> int:
    """Dynamic shared memory: the mbarriers (1 KB), the ring, the input row, the epilogue's
    rows and sums."""
    return 1024 + ns * k * 2 * (2 if gated else 1) + k * 2 + (2 * maxr + nw + 1) * 4


def build(k: int, n: int, blocks: int, gated: bool, rms_in: bool, add_norm: bool, nw: int,
          ring_kb: int, trigger: int, pdl: int) -> tuple[str, int]:
    """The source of one shape and epilogue, and its dynamic shared memory."""
    ns = stages(k, gated, nw, ring_kb)
    maxr = -(-n // blocks)
    while ns > nw and smem_bytes(k, gated, ns, nw, maxr) > _SMEM_MAX:
        ns -= nw
    src = _SOURCE % {"prelude": PRELUDE, "block": _BLOCK, "k": k, "gated": int(gated),
                     "rms_in": int(rms_in),
                     "add_norm": int(add_norm), "nw": nw, "ns": ns, "maxr": maxr,
                     "pdl": int(pdl), "trigger": int(trigger)}
    return src, smem_bytes(k, gated, ns, nw, maxr)


@functools.lru_cache(maxsize=None)
def _kernel(device: torch.device, k: int, n: int, gated: bool, rms_in: bool, add_norm: bool,
            nw: int, ring_kb: int, trigger: int, pdl: int) -> Kernel:
    blocks = num_sms(device, 132)
    trigger = int(bool(trigger & (2 if gated else 4 if add_norm else 1)))
    src, smem = build(k, n, blocks, gated, rms_in, add_norm, nw, ring_kb, trigger, pdl)
    with torch.cuda.device(device):
        return Kernel(src, "stream_gemv", smem, nw * 32, blocks=blocks, cooperative=False)


def stream_gemv_ok(x: Tensor, weight: Tensor, bias: Tensor | None, gated: bool,
                   impl: str = "auto", add_norm: bool = False) -> bool:
    """Whether :func:`stream_gemv` serves ``F.linear(x, weight)``: ``impl="auto"``, one
    contiguous bf16 row on an sm_90 GPU (``KVSTRATA_STREAM_GEMV`` not ``0``), a contiguous
    weight that :func:`fits`, no bias, 16-byte aligned operands, and the shape compiles."""
    if (impl != "auto" or x.device.type != "cuda" or os.environ.get(STREAM_ENV, "1") == "0"
            or bias is not None or x.dim() != 2 or x.shape[0] != 1
            or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16
            or not x.is_contiguous() or not weight.is_contiguous() or weight.dim() != 2
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            or torch.cuda.get_device_capability(x.device)[0] != 9):
        return False
    n, k = weight.shape
    n //= 2 if gated else 1
    blocks = num_sms(x.device, 132)
    if not _env_variant()[3] & (2 if gated else 4 if add_norm else 1):
        return False
    if (k != x.shape[1] or not fits(k, n, gated, blocks) or x.data_ptr() % 16
            or weight.data_ptr() % 16):
        return False
    return _compiled(x.device, k, n, gated)


def fits(k: int, n: int, gated: bool, blocks: int) -> bool:
    """``K`` a multiple of 256, at least a row per block, and the ring (at least one stage per
    warp) with the rest in a block's shared memory, with the switches in force."""
    nw, ring_kb = _env_variant()[:2]
    if k % 256 or n < blocks:
        return False
    maxr = -(-n // blocks)
    return smem_bytes(k, gated, stages(k, gated, nw, ring_kb), nw, maxr) <= _SMEM_MAX


@functools.lru_cache(maxsize=None)
def _compiled(device: torch.device, k: int, n: int, gated: bool) -> bool:
    v = _env_variant()
    return compiles(
        lambda: [_kernel(device, k, n, gated, r, a, *v[:3], int(pdl_ok(device, "gemv")))
                 for r in (False, True)
                 for a in ((False,) if gated else (False, True))],
        f"kernels.stream_gemv: not compiled for [{n}, {k}]{' gated' if gated else ''} on "
        f"{device}", "one-row products keep the Triton kernel")


def stream_gemv(x: Tensor, weight: Tensor, *, gated: bool = False, rms=None,
                add_norm: tuple[Tensor, Tensor, float] | None = None):
    """:func:`~.gemv.gemv` / :func:`~.gemv.gemv_add_norm` of one row where
    :func:`stream_gemv_ok` holds: ``out [1, N]``, or ``(out, h, parts [1, blocks])`` with
    ``add_norm`` (the caller wraps the parts in a :class:`~.gemv.RowRms`)."""
    k = x.shape[1]
    n = weight.shape[0] // (2 if gated else 1)
    dev = x.device
    pdl = pdl_ok(dev, "gemv")
    kern = _kernel(dev, k, n, gated, rms is not None, add_norm is not None,
                   *_env_variant()[:3], int(pdl))
    return _run(kern, lambda out: [x, weight, out, ctypes.c_int32(n)], x, 1, n, rms, add_norm,
                pdl)


def _run(kern: Kernel, head, x: Tensor, m: int, n: int, rms, add_norm, pdl: bool):
    """One launch of either build: ``head(out)`` its first arguments, then the input's row
    scale and the add-norm epilogue's operands; ``out [m, n]`` or ``(out, h, parts)``."""
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ss_in = rms.parts.contiguous() if rms is not None else out
    args = head(out) + [ss_in, ctypes.c_int32(ss_in.shape[1] if rms is not None else 0),
                        ctypes.c_float(rms.eps if rms is not None else 0.0)]
    if add_norm is None:
        kern(args + [out, out, out, out], pdl=pdl)
        return out
    residual, g, _ = add_norm
    h = torch.empty((m, n), dtype=x.dtype, device=x.device)
    parts = torch.empty((m, kern.blocks), dtype=torch.float32, device=x.device)
    kern(args + [residual.contiguous(), g.contiguous(), h, parts], pdl=pdl)
    return out, h, parts


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
                          "gated": int(gated),
                          "add_norm": int(add_norm), "nw": nw, "ns": ns, "kc": kc, "mt": mt,
                          "maxr": -(-n // blocks), "pdl": int(pdl), "trigger": int(trigger)}
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
    """Whether :func:`stream_rows` serves ``F.linear(x, weight)``: as :func:`stream_gemv_ok`
    but 2-16 bf16 rows (each 16-byte aligned, columns contiguous)."""
    if (impl != "auto" or x.device.type != "cuda"
            or os.environ.get(STREAM_ENV, "1") == "0" or bias is not None or x.dim() != 2
            or not 2 <= x.shape[0] <= 16 or x.dtype != torch.bfloat16
            or weight.dtype != torch.bfloat16 or x.stride(1) != 1 or x.stride(0) % 8
            or not weight.is_contiguous() or weight.dim() != 2
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            or torch.cuda.get_device_capability(x.device)[0] != 9):
        return False
    n, k = weight.shape
    n //= 2 if gated else 1
    nw, ring_kb, kc, _, kinds = _rows_variant()
    if (not kinds & (2 if gated else 4 if add_norm else 1) or k != x.shape[1]
            or x.data_ptr() % 16 or weight.data_ptr() % 16
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
        f"kernels.stream_gemv: the rows build not compiled for [{n}, {k}]"
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


__all__ = ["STREAM_ENV", "stream_gemv", "stream_gemv_ok", "stream_rows", "stream_rows_ok"]
