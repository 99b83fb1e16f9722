"""Batch-1 decode: attention and the o_proj product in one persistent launch (Hopper, CUDA C++).

(:func:`decode_attention` is phases 2-3 alone: batch-1 decode attention in one launch, what
:func:`~.attention.paged_attention` runs for it on such a GPU, built with the pages dealt round
robin, the page loop unrolled and each query head merged once its own KV head's splits are in
instead of after a grid barrier, :data:`ATTENTION_VARIANT`.)

At batch 1 a decoder layer's attention reads ~1 MB of K/V per 1k tokens and takes ~12 us in a
step, nearly all latency, and o_proj (``gemv_add_norm``) cannot start streaming its weights until
attention is done: Triton cannot keep weights in shared memory across a PDL wait, and attention's
programs fill every SM (docs/benchmarks.md, runner sessions 4-14). :func:`decode_segment` runs
both as one launch of 128 blocks, one per SM, all resident (a cooperative launch):

1. each block starts Hopper bulk copies of its first ``RS`` o_proj weight rows into shared memory
   (they depend on nothing) once its warp 0 has issued the loads of its last K/V page (issued
   among the pages they slowed the pages at 8k: docs/benchmarks.md, twentieth runner session);
2. each block computes one (KV head, split) of split-KV attention (``128 / num_kv_heads`` splits
   per head; 8 warps over the split's pages, the next page's K/V loaded while one is computed,
   each page's two products on tensor cores (``mma`` m16n8k16: K q^T with the tokens as rows
   and the query heads as columns, then V^T P^T, P rounded to bf16 as the Triton kernel rounds
   it), online softmax in float32) and stores the split's normalised partial and its
   log-sum-exp (base 2);
3. a grid barrier; blocks 0 .. num_q_heads-1 merge one query head each into the bf16 attention
   output; a second grid barrier;
4. each block multiplies its ``N / 128`` o_proj rows (``RS`` from shared memory, the rest from
   memory) by the output held in registers, and writes what :func:`~.gemv.gemv_add_norm` writes:
   ``h = residual + product`` (bf16), ``norm_weight * h`` and each block's sum of squares of
   ``h`` (the next product's :class:`~.gemv.RowRms`).

The grid barriers count on one int32 per (device, stream) that only grows (128 arrivals per
barrier, and 2**32 is a multiple of 128), so CUDA-graph replays need no reset. Sums run in a
fixed order and no float atomics are used: a launch is deterministic, so graph replay equals
eager bit for bit.
The values differ from the Triton attention + ``gemv_add_norm`` path only by summation order
(the CUDA tests bound it).

The source is compiled once per shape with NVRTC through ``torch.cuda._compile_kernel`` (torch's
bundled NVRTC; no other dependency) and launched as a cooperative launch; where
:func:`~._device.pdl_ok` allows (family ``segment``) also as a programmatic dependent launch:
each warp's first page (unless it holds the step's new token, which the kernel before writes)
and the weight rows are issued before ``griddepcontrol.wait``, q and the residual after it
(plain decode b1 0.03 ms faster, docs/benchmarks.md, twenty-fourth runner session).
:func:`decode_segment_ok` says where it applies (sm_90, >= 128 SMs, one query of one sequence, a
bf16 page-major pool of 16-token pages and 128-dim heads, no sliding window or o_proj bias, shapes
below); ``KVSTRATA_DECODE_SEGMENT=0`` turns it off. Measured: docs/benchmarks.md, fifteenth runner
session.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os

import torch
from torch import Tensor

from ._cuda import BLOCKS, PRELUDE, Kernel, compiles, enabled, grid_counter, variant
from ._device import pdl_ok
from .attention_plan import AttentionMetadata
from .gemv import RowRms

#: ``KVSTRATA_DECODE_SEGMENT=0`` keeps batch-1 decode on the Triton attention + ``gemv_add_norm``
#: launches (``1``: this kernel where it applies).
SEGMENT_ENV = "KVSTRATA_DECODE_SEGMENT"
WARPS = 8
#: o_proj rows per block kept in shared memory (measured: 16 of 32 rows beat 0 and 24 at 1k
#: and 8k, docs/benchmarks.md fifteenth runner session)
SMEM_ROWS = 16
#: :func:`source`'s switches as shipped: ``rs, rreg, rlate, pdl, pages, unroll, hwait`` (pages
#: and unroll as :data:`ATTENTION_VARIANT` made the plain decode step no faster:
#: docs/benchmarks.md, thirty-fourth runner session)
VARIANT = (SMEM_ROWS, 0, 2, 1, 0, 0, 0)
#: :func:`decode_attention`'s ``pages, unroll, hwait``: the pages dealt round robin and the page
#: loop two pages per trip (batch-1 decode attention 9.9 -> 9.4 us at 1k, 19.6 -> 19.3 at 8k,
#: 47.9 -> 46.8 at 32k, 78.5 -> 77.6 at 64k; docs/benchmarks.md, thirty-fourth runner session),
#: each query head merged once its KV head's splits are in (9.5 -> 9.4, 19.3 -> 19.2, 46.9 ->
#: 46.8; the segment's step no faster with it: thirty-fifth runner session)
ATTENTION_VARIANT = (1, 1, 1)
#: for benchmarks of the step (``benchmarks/gpu_runner.sh``): colon-separated switches that
#: replace :data:`VARIANT`'s first ones, e.g. ``16:0:1``
VARIANT_ENV = "KVSTRATA_DECODE_SEGMENT_VARIANT"
_LOG2E = math.log2(math.e)
#: :func:`decode_attention` serves contexts up to this many tokens; longer ones keep the Triton
#: kernel (32 splits per KV head where this kernel has 16). H200, one layer, cold L2, graph
#: replay, us, this kernel / Triton: 1k 9.4 / 13.3, 8k 19.3 / 22.2, 32k 46.8 / 51.5, 64k 77.6 /
#: 84.5; 128k 137.2 / 152.0 (``attention_bench.py``); docs/benchmarks.md, thirty-fourth runner
#: session. Longer contexts were not measured.
ATTENTION_MAX_CONTEXT = 131072

_SOURCE = r"""
#define NKV %(nkv)d
#define GROUP %(group)d
#define SPLITS %(splits)d
#define K_IN %(k_in)d
#define RPW %(rpw)d
#define RS %(rs)d
#define RREG %(rreg)d
#define RLATE %(rlate)d
#define PDL %(pdl)d
#define STAMPS %(stamps)d
#define ATTN_ONLY %(attn_only)d
#define PAGES %(pages)d
#define UNROLL %(unroll)d
#define HWAIT %(hwait)d
#define NW 8
#define ROWS (RPW * NW)
static_assert(!HWAIT || GROUP <= SPLITS, "hwait: a head's query heads merged by its splits");
%(prelude)s
// This block's first RS o_proj rows into shared memory: bulk copies of <= 16 KB, one mbarrier.
__device__ __forceinline__ void start_rows(const bf16_t* src_rows, unsigned char* smem, u64* bar) {
    if (RS == 0) return;
    const unsigned char* src = (const unsigned char*)src_rows;
    mbar_init(bar, 1);
    mbar_fence_init();
    mbar_expect(bar, RS * K_IN * 2);
    for (int off = 0; off < RS * K_IN * 2; off += 16384)
        bulk_copy(sa(smem + off), src + off, min(RS * K_IN * 2 - off, 16384), bar);
}

#define VW(v, w) ((w) == 0 ? (v).x : (w) == 1 ? (v).y : (w) == 2 ? (v).z : (v).w)
// One 16-token page of K and V as the warp's tensor-core products take it (lane = 4 r + t):
// K rows r and r + 8, dims 32 i + 8 t .. + 7 (i = 0..3: the products' k order, which q's
// registers share); V rows 2t, 2t + 1, 2t + 8, 2t + 9 (j = 0..3), dims 64 hh + 8 r .. + 7.
__device__ __forceinline__ void load_page(const bf16_t* kp, long long s_kv, int r, int t,
                                          v4* kr, v4* vr) {
    const bf16_t* vp = kp + s_kv;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        kr[i] = *(const v4*)(kp + r * 128 + 32 * i + 8 * t);
        kr[4 + i] = *(const v4*)(kp + (r + 8) * 128 + 32 * i + 8 * t);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
            vr[2 * j + hh] = *(const v4*)(vp + (2 * t + (j & 1) + 8 * (j >> 1)) * 128
                                          + 64 * hh + 8 * r);
}

// The online-softmax update of one page on tensor cores: S^T = K q^T (rows: tokens r, r + 8;
// columns: query heads 2t, 2t + 1, those past GROUP zero), the column maxima across the lanes
// of equal t, P^T rearranged by shuffles into the second product's operand, O^T += V^T P^T
// (rows: dims 64 hh + 8 r + 2 w and + 1 of acc[4 hh + w]). Tokens >= hi are masked and their
// V rows zeroed (a page's tokens past the sequence may hold anything, NaN too).
__device__ __forceinline__ void attend_page(const v4* kr, v4* vr, int p, int hi, int r, int t,
                                            const v4* qv, float qk_scale, float* m, float* l,
                                            float (&acc)[8][4]) {
    const unsigned FULL = 0xffffffffu;
    float sa[4] = {0.f, 0.f, 0.f, 0.f}, sb[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        mma_bf16(sa, kr[i].x, kr[4 + i].x, kr[i].y, kr[4 + i].y, qv[i].x, qv[i].y);
        mma_bf16(sb, kr[i].z, kr[4 + i].z, kr[i].w, kr[4 + i].w, qv[i].z, qv[i].w);
    }
    const bool ok0 = p * 16 + r < hi, ok1 = p * 16 + r + 8 < hi;
    float sv[4];
#pragma unroll
    for (int e = 0; e < 4; ++e)
        sv[e] = (e < 2 ? ok0 : ok1) ? (sa[e] + sb[e]) * qk_scale : NEG_INF;
    if (p * 16 + 16 > hi) {
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (p * 16 + 2 * t + (j & 1) + 8 * (j >> 1) >= hi) {
                vr[2 * j] = v4{0u, 0u, 0u, 0u};
                vr[2 * j + 1] = v4{0u, 0u, 0u, 0u};
            }
    }
    float pr[4], alpha[2];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        float mx = fmaxf(sv[c], sv[2 + c]);
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, off));
        const float mn = fmaxf(m[c], mx), ms = mn == NEG_INF ? 0.f : mn;
        alpha[c] = exp2f(m[c] - ms);
        pr[c] = exp2f(sv[c] - ms);
        pr[2 + c] = exp2f(sv[2 + c] - ms);
        l[c] = l[c] * alpha[c] + pr[c] + pr[2 + c];
        m[c] = mn;
    }
    // P^T's operand: this lane's column r (query head), rows (tokens) 2t, 2t + 1 and + 8
    const u32 plo = pack_bf(pr[0], pr[1]), phi = pack_bf(pr[2], pr[3]);
    const int src = 8 * t + (r >> 1);
    const u32 sel = (r & 1) ? 0x7632u : 0x5410u;
    const u32 b0 = __byte_perm(__shfl_sync(FULL, plo, src), __shfl_sync(FULL, plo, src + 4), sel);
    const u32 b1 = __byte_perm(__shfl_sync(FULL, phi, src), __shfl_sync(FULL, phi, src + 4), sel);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            float* d = acc[4 * hh + w];
            d[0] *= alpha[0]; d[1] *= alpha[1]; d[2] *= alpha[0]; d[3] *= alpha[1];
            const u32 ta = VW(vr[hh], w), tb = VW(vr[2 + hh], w);
            const u32 tc = VW(vr[4 + hh], w), td = VW(vr[6 + hh], w);
            mma_bf16(d, __byte_perm(ta, tb, 0x5410u), __byte_perm(ta, tb, 0x7632u),
                     __byte_perm(tc, td, 0x5410u), __byte_perm(tc, td, 0x7632u), b0, b1);
        }
}

// The merged attention output of query head qh, dim d: the SPLITS partials' weighted mean.
__device__ __forceinline__ float merge_one(const float* part_o, const float* part_lse, int qh,
                                           int d) {
    float lse[SPLITS], o[SPLITS], M = NEG_INF;
#pragma unroll
    for (int s = 0; s < SPLITS; ++s) {
        lse[s] = ld_cg_f(part_lse + s * NKV * GROUP + qh);
        o[s] = ld_cg_f(part_o + (size_t)(s * NKV * GROUP + qh) * 128 + d);
    }
#pragma unroll
    for (int s = 0; s < SPLITS; ++s) M = fmaxf(M, lse[s]);
    if (M == NEG_INF) return 0.f;
    float sum = 0.f, val = 0.f;
#pragma unroll
    for (int s = 0; s < SPLITS; ++s) {
        const float e = exp2f(lse[s] - M);
        sum += e;
        val += e * o[s];
    }
    return val / sum;
}

extern "C" __global__ void __launch_bounds__(NW * 32, 1)
decode_segment(const bf16_t* __restrict__ q, const bf16_t* __restrict__ kv, long long layer_off,
               long long s_page, long long s_kv, long long s_head,
               const int* __restrict__ bt, const int* __restrict__ seq_len_p,
               const bf16_t* __restrict__ W, const bf16_t* __restrict__ res,
               const bf16_t* __restrict__ gam, bf16_t* __restrict__ out,
               bf16_t* __restrict__ hout, float* __restrict__ ss_out, float* part_o,
               float* part_lse, bf16_t* xbuf, u32* ctr, float qk_scale, u64* stamps,
               int bt_w) {
    extern __shared__ __align__(128) unsigned char smem[];
    bf16_t* wsm = (bf16_t*)smem;                                        // RS rows of W
    float* red = (float*)(smem + RS * K_IN * 2);                       // [NW][GROUP][128]
    float* red_m = red + NW * GROUP * 128;
    float* red_l = red_m + NW * GROUP;
    float* ssw = red_l + NW * GROUP;                                    // [NW]
    u64* bar = (u64*)(ssw + NW);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int c = blockIdx.x;
    const unsigned FULL = 0xffffffffu;
    STAMP(0)
    // the epilogue's inputs for this warp's rows (read now; under PDL after the wait)
    float rres[RPW], rgam[RPW];
#define LOAD_RES() _Pragma("unroll") for (int rr = 0; rr < RPW; ++rr) { \
        rres[rr] = bf(res[c * ROWS + warp + rr * NW]); \
        rgam[rr] = bf(gam[c * ROWS + warp + rr * NW]); }
#if ATTN_ONLY
#undef LOAD_RES
#define LOAD_RES()
#endif
#if !PDL
    LOAD_RES()
#endif

    // 1-2. one (KV head, split) of attention; the weight copies start as RLATE says
    const int h = c / SPLITS, sidx = c %% SPLITS;
#if PAGES
    // pages dealt round robin: this warp takes pages sidx + SPLITS * (warp + NW * k); their
    // first 32 ids do not depend on the length, so they are read beside it, one per lane
    const int p0 = sidx + SPLITS * warp, pstep = SPLITS * NW;
    int btl = p0 + lane * pstep < bt_w ? bt[p0 + lane * pstep] : 0;
    const int L = *seq_len_p, hi = L, pend = (L + 15) / 16;
    const int npw = pend > p0 ? (pend - p0 + pstep - 1) / pstep : 0;
#else
    // split sidx: a contiguous run of T tokens
    const int L = *seq_len_p;
    int T = (L + SPLITS - 1) / SPLITS;
    T = (T + 15) & ~15;
    const int lo = sidx * T, hi = min(lo + T, L);
#endif
    const int r4 = lane >> 2, t4 = lane & 3;
    v4 qv[4];
    float m[2], l[2], acc[8][4];
#define LOAD_Q() _Pragma("unroll") for (int i = 0; i < 4; ++i) \
        qv[i] = r4 < GROUP ? *(const v4*)(q + (size_t)(GROUP * h + r4) * 128 + 32 * i + 8 * t4) \
                           : v4{0u, 0u, 0u, 0u}; \
    _Pragma("unroll") for (int i = 0; i < 8; ++i) \
        _Pragma("unroll") for (int e = 0; e < 4; ++e) acc[i][e] = 0.f; \
    m[0] = m[1] = NEG_INF; l[0] = l[1] = 0.f;
#define LOAD_PAGE(ptr, K, V) load_page(ptr, s_kv, r4, t4, K, V)
#if !PDL
    LOAD_Q()
#endif
    const bf16_t* kbase = kv + layer_off + (long long)h * s_head;
    // this warp's pages p0, p0 + pstep, ...; their ids 32 at a time, one per lane
#if !PAGES
    const int p0 = lo / 16 + warp, pstep = NW, pend = (hi + 15) / 16;
    const int npw = hi > lo && pend > p0 ? (pend - p0 + NW - 1) / NW : 0;
    int btl = lane < npw ? bt[p0 + lane * pstep] : 0;
#endif
    v4 kr[8], vr[8];
    // under PDL the first page before the wait unless it holds this step's token (the
    // previous kernel's K/V write); q and the residual after it
    const bool early = !PDL || p0 != (L - 1) / 16;
#define LOAD_PAGE0() \
    LOAD_PAGE(kbase + (long long)__shfl_sync(FULL, btl, 0) * s_page, kr, vr)
    if (npw > 0 && early) LOAD_PAGE0();
    GDC_WAIT();
#if PDL
    LOAD_RES()
    LOAD_Q()
#endif
    if (npw > 0 && !early) LOAD_PAGE0();
    // RLATE 0: the weight rows after warp 0's first page loads; 2: after its last page's
    // loads are issued (the same with <= 1 page); 1: after its products (below)
    if (tid == 0 && (RLATE == 0 || (RLATE == 2 && npw <= 1)))
        start_rows(W + (size_t)c * ROWS * K_IN, smem, bar);
    v4 kn[8], vn[8];
    // one page: the next page's loads into (NK, NV), then page k's products from (CK, CV)
#define PAGE_STEP(k, CK, CV, NK, NV) { \
        const int k1 = (k) + 1; \
        if (k1 < npw) { \
            if ((k1 & 31) == 0) btl = k1 + lane < npw ? bt[p0 + (k1 + lane) * pstep] : 0; \
            LOAD_PAGE(kbase + (long long)__shfl_sync(FULL, btl, k1 & 31) * s_page, NK, NV); \
            if (RLATE == 2 && tid == 0 && k1 == npw - 1) \
                start_rows(W + (size_t)c * ROWS * K_IN, smem, bar); \
        } \
        attend_page(CK, CV, p0 + (k) * pstep, hi, r4, t4, qv, qk_scale, m, l, acc); }
#if UNROLL
    // two pages per trip, the buffers' roles swapped: no register copy waits for the next
    // page's loads, so a warp waits on page k + 1 with page k + 2's loads already issued
    for (int k = 0; k < npw; k += 2) {
        PAGE_STEP(k, kr, vr, kn, vn)
        if (k + 1 < npw) PAGE_STEP(k + 1, kn, vn, kr, vr)
    }
#else
    for (int k = 0; k < npw; ++k) {
        PAGE_STEP(k, kr, vr, kn, vn)
#pragma unroll
        for (int i = 0; i < 8; ++i) { kr[i] = kn[i]; vr[i] = vn[i]; }
    }
#endif
    if (tid == 0 && RLATE == 1) start_rows(W + (size_t)c * ROWS * K_IN, smem, bar);
    // each lane's column sums cover its own tokens: summed across the lanes of equal t; the
    // warp's state into shared memory
#pragma unroll
    for (int c = 0; c < 2; ++c) {
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) l[c] += __shfl_xor_sync(FULL, l[c], off);
        const int g = 2 * t4 + c;
        if (g < GROUP) {
            float* dst = red + (warp * GROUP + g) * 128 + 8 * r4;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                dst[64 * (i >> 2) + 2 * (i & 3)] = acc[i][c];
                dst[64 * (i >> 2) + 2 * (i & 3) + 1] = acc[i][2 + c];
            }
            if (r4 == 0) { red_m[warp * GROUP + g] = m[c]; red_l[warp * GROUP + g] = l[c]; }
        }
    }
    __syncthreads();
    for (int o = tid; o < GROUP * 128; o += NW * 32) {
        const int g = o >> 7, d = o & 127;
        float M = NEG_INF;
        for (int w = 0; w < NW; ++w) M = fmaxf(M, red_m[w * GROUP + g]);
        float sum = 0.f, val = 0.f;
        if (M != NEG_INF) {
            for (int w = 0; w < NW; ++w) {
                const float e = exp2f(red_m[w * GROUP + g] - M);
                sum += red_l[w * GROUP + g] * e;
                val += red[(w * GROUP + g) * 128 + d] * e;
            }
        }
        const int row = sidx * NKV * GROUP + GROUP * h + g;
        part_o[(size_t)row * 128 + d] = sum > 0.f ? val / sum : 0.f;
        if (d == 0) part_lse[row] = sum > 0.f ? M + log2f(sum) : NEG_INF;
    }
    STAMP(1)

#if HWAIT
    // 3. the head's partials stored: its first GROUP blocks merge one of its query heads each,
    // waiting for the head's SPLITS arrivals alone (its counter only grows by SPLITS per
    // launch); the others go on at once
    __syncthreads();
    if (tid == 0) arrive(split_counter(ctr, SPLITS, h), SPLITS, sidx < GROUP);
    __syncthreads();
#else
    // 3. every partial stored: blocks 0 .. NKV * GROUP - 1 merge one query head each
    grid_barrier(ctr);
#endif
#if RREG
    // this warp's rows past RS into registers: after the grid barrier (every block's attention
    // is done), or under HWAIT once this block has merged (at once where it merges nothing)
    v4 wg[RPW - RS / NW][K_IN / 256];
#define LOAD_ROWS() _Pragma("unroll") for (int rr = RS / NW; rr < RPW; ++rr) \
        _Pragma("unroll") for (int it = 0; it < K_IN / 256; ++it) \
            wg[rr - RS / NW][it] = *(const v4*)(W + (size_t)(c * ROWS + warp + rr * NW) * K_IN \
                                                + it * 256 + lane * 8);
#if !HWAIT
    LOAD_ROWS()
#endif
#endif
    STAMP(2)
#if HWAIT
    // query head GROUP h + sidx, by block c = SPLITS h + sidx
    const int mq = c %% SPLITS < GROUP ? GROUP * (c / SPLITS) + c %% SPLITS : -1;
    for (int o = tid; o < 128 && mq >= 0; o += NW * 32)
        xbuf[mq * 128 + o] = to_bf(merge_one(part_o, part_lse, mq, o));
#else
    for (int o = tid; o < 128 && c < NKV * GROUP; o += NW * 32)
        xbuf[c * 128 + o] = to_bf(merge_one(part_o, part_lse, c, o));
#endif
#if RREG && HWAIT
    LOAD_ROWS()
#endif
    STAMP(3)
#if ATTN_ONLY
    return;   // xbuf is the attention output [NKV * GROUP, 128]
#endif
    grid_barrier(ctr);
    STAMP(4)

    // 4. this block's o_proj rows: this lane's K_IN / 32 inputs in registers (bf16), the
    // warp's RPW rows (warp, warp + NW, ...) at once; rows below RS from shared memory
    v4 xp[K_IN / 256];
#pragma unroll
    for (int it = 0; it < K_IN / 256; ++it) xp[it] = ld_cg(xbuf + it * 256 + lane * 8);
    if (RS > 0 && tid < 32) mbar_wait(bar, 0);
    __syncthreads();
    STAMP(5)
    float a[RPW];
    const bf16_t* wr[RPW];
#pragma unroll
    for (int rr = 0; rr < RPW; ++rr) {
        a[rr] = 0.f;
        const int r = warp + rr * NW;
        wr[rr] = (rr < RS / NW ? wsm + (size_t)r * K_IN : W + (size_t)(c * ROWS + r) * K_IN)
                 + lane * 8;
    }
#pragma unroll
    for (int it = 0; it < K_IN / 256; ++it) {
        float xf[8];
        unpack8(xp[it], xf);
#pragma unroll
        for (int rr = 0; rr < RPW; ++rr) {
            float wf[8];
#if RREG
            if (rr >= RS / NW) unpack8(wg[rr - RS / NW][it], wf);
            else
#endif
            unpack8(*(const v4*)(wr[rr] + it * 256), wf);
#pragma unroll
            for (int j = 0; j < 8; ++j) a[rr] = fmaf(wf[j], xf[j], a[rr]);
        }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
#pragma unroll
        for (int rr = 0; rr < RPW; ++rr) a[rr] += __shfl_xor_sync(FULL, a[rr], off);
    float ssum = 0.f;
    if (lane == 0) {
#pragma unroll
        for (int rr = 0; rr < RPW; ++rr) {
            // rounded as gemv_add_norm rounds: the product, h = residual + product, g * h
            const int row = c * ROWS + warp + rr * NW;
            const bf16_t hn = to_bf(rres[rr] + bf(to_bf(a[rr])));
            hout[row] = hn;
            const float hf = bf(hn);
            out[row] = to_bf(rgam[rr] * hf);
            ssum += hf * hf;
        }
        ssw[warp] = ssum;
    }
    __syncthreads();
    if (tid == 0) {
        float t = 0.f;
        for (int w = 0; w < NW; ++w) t += ssw[w];
        ss_out[c] = t;
    }
    STAMP(6)
}
"""


def _env_variant() -> tuple[int, ...]:
    return variant(os.environ.get(VARIANT_ENV, ""), VARIANT, VARIANT_ENV)


def _switches(given: tuple[int, ...] | None) -> tuple[int, ...]:
    """A launch's switches: ``given`` (those left out as :data:`VARIANT`), else the
    environment's."""
    return tuple(given) + VARIANT[len(given):] if given else _env_variant()


def source(nkv: int, group: int, k_in: int, n_out: int, rs: int = SMEM_ROWS, rreg: int = 0,
           rlate: int = 2, pdl: int = 0, pages: int = 0, unroll: int = 0, hwait: int = 0,
           stamps: bool = False, attn_only: bool = False) -> str:
    """The kernel's CUDA source for one shape (``rs`` rows per block in shared memory, a
    multiple of 8; ``rreg``: the other rows loaded into registers after the first barrier
    (with ``hwait``: once the block has merged, at once where it merges nothing);
    ``rlate``: the rows' copies started after warp 0's first page's loads (0), once it has
    read its pages (1), or once its last page's loads are issued (2); ``pdl``: a programmatic
    dependent launch, the first page's loads issued before the wait; ``pages``: each split a
    contiguous run of pages (0) or the pages dealt to the splits' warps round robin, their
    first ids read beside the length instead of after it (1); ``unroll``: the page loop one
    page per trip, the next page's buffers copied to the current ones (0: the copy waits for
    the next page's loads), or two pages per trip with the buffers' roles swapped (1: the
    same products in the same order); ``hwait``: the
    splits' merge after a grid barrier of all blocks (0), or each query head merged by one of
    its KV head's blocks once that head's splits have arrived on its own counter, the other
    blocks going on at once (1: the same sums);
    ``stamps``: per-block phase timestamps, ``benchmarks/segment_proto.py``;
    ``attn_only``: phases 2-3 alone, the merged attention written to ``xbuf``,
    :func:`decode_attention`)."""
    rows = n_out // BLOCKS
    return _SOURCE % {"prelude": PRELUDE, "nkv": nkv, "group": group, "splits": BLOCKS // nkv,
                      "k_in": k_in, "rpw": rows // WARPS, "rs": min(rs, rows),
                      "rreg": int(rreg), "rlate": int(rlate), "pdl": int(pdl),
                      "pages": int(pages), "unroll": int(unroll), "hwait": int(hwait),
                      "stamps": int(stamps),
                      "attn_only": int(attn_only)}


def smem_bytes(group: int, k_in: int, rs: int) -> int:
    """Dynamic shared memory: the ``rs`` weight rows, the warps' partial states and the
    mbarrier."""
    return rs * k_in * 2 + (WARPS * group * 128 + 2 * WARPS * group + WARPS) * 4 + 16


def build(nkv: int, group: int, k_in: int, n_out: int, rs: int, rreg: int, rlate: int,
          pdl: int, pages: int, unroll: int, hwait: int, stamps: bool,
          attn_only: bool = False) -> tuple[str, int]:
    """The source a launch compiles (for the device's own ``sm_90``) and the shared-memory rows
    it keeps (``rs``, at most the block's rows)."""
    rs = min(rs, n_out // BLOCKS)
    return source(nkv, group, k_in, n_out, rs, rreg, rlate, pdl, pages, unroll, hwait,
                  stamps, attn_only), rs


@functools.lru_cache(maxsize=None)
def _kernel(device: torch.device, nkv: int, group: int, k_in: int, n_out: int,
            v: tuple[int, ...], stamps: bool, attn_only: bool = False) -> Kernel:
    src, rs = build(nkv, group, k_in, n_out, *v, stamps, attn_only)
    with torch.cuda.device(device):
        return Kernel(src, "decode_segment", smem_bytes(group, k_in, rs), WARPS * 32)


def decode_segment_ok(q: Tensor, kv_cache: Tensor, meta: AttentionMetadata, weight: Tensor,
                      bias: Tensor | None, sliding_window: int | None, impl: str = "auto"
                      ) -> bool:
    """Whether :func:`decode_segment` serves this layer: ``impl="auto"`` on an sm_90 GPU with
    >= 128 SMs (and ``KVSTRATA_DECODE_SEGMENT`` not ``0``) for the shapes
    :func:`segment_shapes_ok` takes."""
    if not (enabled(impl, q.device, SEGMENT_ENV, "1")
            and segment_shapes_ok(q, kv_cache, meta, weight, bias, sliding_window)):
        return False
    hkv = kv_cache.shape[3]
    return _compiled(q.device, hkv, q.shape[1] // hkv, weight.shape[1], weight.shape[0])


@functools.lru_cache(maxsize=None)
def _compiled(device: torch.device, nkv: int, group: int, k_in: int, n_out: int) -> bool:
    """Compiles the shape's kernel (once, before any graph capture needs it); a failure warns
    once and leaves the layer on the Triton path."""
    return compiles(lambda: _kernel(device, nkv, group, k_in, n_out, _env_variant(), False),
                    f"kernels.decode_segment: not compiled for {nkv} KV heads x {group}, o_proj "
                    f"[{n_out}, {k_in}] on {device}",
                    "batch-1 decode keeps the Triton attention + o_proj launches")


def attention_shapes_ok(q: Tensor, kv_cache: Tensor, meta: AttentionMetadata,
                        sliding_window: int | None) -> bool:
    """The attention the kernel takes (any device): one causal query of one sequence, bf16 ``q
    [1, Hq, 128]`` (heads 128 apart) over a contiguous pool ``[pages, layers, 2, Hkv, 16,
    128]``, Hkv dividing 128 with at most 8 query heads each and ``Hq * 128 <= 4096`` a
    multiple of 256, no sliding window, a block-table row of consecutive ids."""
    if (meta.num_seqs != 1 or meta.max_query_len != 1 or not meta.causal
            or sliding_window is not None or meta.block_tables.stride(1) != 1):
        return False
    if (q.dim() != 3 or q.shape[0] != 1 or q.shape[2] != 128 or q.dtype != torch.bfloat16
            or q.stride(2) != 1 or q.stride(1) != 128):
        return False
    hq = q.shape[1]
    if (kv_cache.dim() != 6 or kv_cache.dtype != torch.bfloat16 or not kv_cache.is_contiguous()
            or kv_cache.shape[2] != 2 or kv_cache.shape[4] != 16 or kv_cache.shape[5] != 128):
        return False
    hkv = kv_cache.shape[3]
    return (BLOCKS % hkv == 0 and hq % hkv == 0 and hq // hkv <= 8 and hq * 128 % 256 == 0
            and hq * 128 <= 4096)


def segment_shapes_ok(q: Tensor, kv_cache: Tensor, meta: AttentionMetadata, weight: Tensor,
                      bias: Tensor | None, sliding_window: int | None) -> bool:
    """The shapes the kernel takes (any device): one causal query of one sequence, bf16 ``q [1,
    Hq, 128]`` (heads 128 apart) and a contiguous pool ``[pages, layers, 2, Hkv, 16, 128]``,
    Hkv dividing 128 with at most 8 query heads each, a contiguous o_proj weight ``[N, Hq *
    128]`` with ``Hq * 128 <= 4096`` a multiple of 256 and ``N`` a multiple of 1024 up to 4096,
    no bias, no sliding window."""
    if bias is not None or not attention_shapes_ok(q, kv_cache, meta, sliding_window):
        return False
    n, k = weight.shape if weight.dim() == 2 else (0, 0)
    return (k == q.shape[1] * 128 and n % 1024 == 0 and 0 < n <= 4096
            and weight.dtype == torch.bfloat16 and weight.is_contiguous())


def decode_segment(q: Tensor, kv_cache: Tensor, layer: int, meta: AttentionMetadata, *,
                   sm_scale: float, weight: Tensor, residual: Tensor, norm_weight: Tensor,
                   eps: float, _variant: tuple[int, ...] | None = None,
                   _stamps: Tensor | None = None) -> tuple[Tensor, Tensor, RowRms]:
    """``gemv_add_norm(paged_attention(q, ...).reshape(1, -1), weight, None, residual,
    norm_weight, eps)`` in one launch, where :func:`decode_segment_ok` holds: returns
    ``(norm_weight * h, h, RowRms)`` with ``h = residual + o_proj(attention)``.

    ``_variant`` (:func:`source`'s ``rs, rreg, rlate, pdl, pages, unroll, hwait``, those left
    out as shipped; ``None``: :data:`VARIANT` or what ``KVSTRATA_DECODE_SEGMENT_VARIANT``
    says) and ``_stamps`` (int64, ``BLOCKS * 16``: per-block phase timestamps) are for
    ``benchmarks/segment_proto.py``."""
    n, k_in = weight.shape
    hq, hkv = q.shape[1], kv_cache.shape[3]
    if residual.shape != (1, n) or norm_weight.shape != (n,):
        raise ValueError(f"decode_segment: residual {tuple(residual.shape)} and norm weight "
                         f"{tuple(norm_weight.shape)} must be [1, {n}] and [{n}]")
    dev = q.device
    v = _switches(_variant)
    kern = _kernel(dev, hkv, hq // hkv, k_in, n, v, _stamps is not None)
    splits = BLOCKS // hkv
    part_o = torch.empty(splits * hq * 128, dtype=torch.float32, device=dev)
    part_lse = torch.empty(splits * hq, dtype=torch.float32, device=dev)
    xbuf = torch.empty(k_in, dtype=torch.bfloat16, device=dev)
    out = torch.empty((1, n), dtype=torch.bfloat16, device=dev)
    h = torch.empty((1, n), dtype=torch.bfloat16, device=dev)
    ss = torch.empty((1, BLOCKS), dtype=torch.float32, device=dev)
    s = kv_cache.stride()
    kern([q, kv_cache, ctypes.c_int64(layer * s[1]), ctypes.c_int64(s[0]), ctypes.c_int64(s[2]),
          ctypes.c_int64(s[3]), meta.block_tables, meta.seq_lens, weight, residual.contiguous(),
          norm_weight.contiguous(), out, h, ss, part_o, part_lse, xbuf, grid_counter(dev),
          ctypes.c_float(sm_scale * _LOG2E),
          _stamps if _stamps is not None else ctypes.c_void_p(0),
          ctypes.c_int32(meta.block_tables.shape[1])],
         pdl=bool(v[3]) and pdl_ok(dev, "segment"))
    return out, h, RowRms(ss, n, eps)


def decode_attention_ok(q: Tensor, kv_cache: Tensor, meta: AttentionMetadata,
                        sliding_window: int | None, impl: str = "auto") -> bool:
    """Whether :func:`decode_attention` serves this call: ``impl="auto"`` on an sm_90 GPU with
    >= 128 SMs (``KVSTRATA_DECODE_SEGMENT`` not ``0``), a plan of at most
    :data:`ATTENTION_MAX_CONTEXT` tokens, for the shapes :func:`attention_shapes_ok` takes."""
    if not (enabled(impl, q.device, SEGMENT_ENV, "1") and meta.max_seq_len
            <= ATTENTION_MAX_CONTEXT and attention_shapes_ok(q, kv_cache, meta, sliding_window)):
        return False
    hkv = kv_cache.shape[3]
    return _attn_compiled(q.device, hkv, q.shape[1] // hkv, *ATTENTION_VARIANT)


def _attn_kernel(device: torch.device, nkv: int, group: int, pages: int, unroll: int,
                 hwait: int) -> Kernel:
    """The attention-only build: no o_proj rows (``n_out`` only sizes the unused phase 4);
    ``pages``, ``unroll`` and ``hwait`` as :func:`source` says."""
    return _kernel(device, nkv, group, nkv * group * 128, BLOCKS * WARPS,
                   (0, 0, 2, 0, pages, unroll, hwait), stamps=False, attn_only=True)


@functools.lru_cache(maxsize=None)
def _attn_compiled(device: torch.device, nkv: int, group: int, pages: int, unroll: int,
                   hwait: int) -> bool:
    return compiles(lambda: _attn_kernel(device, nkv, group, pages, unroll, hwait),
                    f"kernels.decode_segment: attention not compiled for {nkv} KV heads x "
                    f"{group} on {device}", "batch-1 decode attention keeps the Triton kernel")


def decode_attention(q: Tensor, kv_cache: Tensor, layer: int, meta: AttentionMetadata, *,
                     sm_scale: float, _variant: tuple[int, ...] | None = None) -> Tensor:
    """Batch-1 decode attention in one launch, where :func:`decode_attention_ok` holds: the
    segment's attention and merge (phases 2-3 above) without o_proj: 128 blocks, one (KV
    head, split) each, then one block per query head merges the splits once its KV head's
    splits are in.
    Returns ``[1, Hq, 128]`` bf16, what :func:`~.attention.paged_attention` returns up to
    summation order. ``_variant``: ``pages, unroll, hwait`` (:func:`source`; those left out as
    shipped) for tests and benchmarks; ``None``: :data:`ATTENTION_VARIANT`."""
    v = tuple(_variant or ()) + ATTENTION_VARIANT[len(_variant or ()):]
    hq, hkv = q.shape[1], kv_cache.shape[3]
    dev = q.device
    kern = _attn_kernel(dev, hkv, hq // hkv, *v)
    splits = BLOCKS // hkv
    part_o = torch.empty(splits * hq * 128, dtype=torch.float32, device=dev)
    part_lse = torch.empty(splits * hq, dtype=torch.float32, device=dev)
    out = torch.empty((1, hq, 128), dtype=torch.bfloat16, device=dev)
    s = kv_cache.stride()
    null = ctypes.c_void_p(0)   # o_proj's operands: never read or written in this mode
    kern([q, kv_cache, ctypes.c_int64(layer * s[1]), ctypes.c_int64(s[0]), ctypes.c_int64(s[2]),
          ctypes.c_int64(s[3]), meta.block_tables, meta.seq_lens, null, null, null, null, null,
          null, part_o, part_lse, out, grid_counter(dev), ctypes.c_float(sm_scale * _LOG2E),
          null, ctypes.c_int32(meta.block_tables.shape[1])])
    return out


__all__ = ["ATTENTION_VARIANT", "SEGMENT_ENV", "attention_shapes_ok", "decode_attention", "decode_attention_ok",
           "decode_segment", "decode_segment_ok", "segment_shapes_ok"]
