"""Batch-1 verify: attention of 2-16 query tokens and the o_proj product in one persistent launch
(Hopper, CUDA C++ with tensor-core products).

A batch-1 verify-16 step (the target's forward over the last token and the drafts) spends ~27
us per layer at 1k in attention, the merge of its splits and o_proj, three launches that each
wait for the previous one (H200, docs/benchmarks.md, sixteenth runner session).
:func:`verify_segment` runs them as one launch of 128 blocks, one per SM, all resident (a
cooperative launch), the batch-1 decode segment's plan (:mod:`.decode_segment`) with matrix
products:

1. a producer warp per block brings the pages of one (KV head, split) into a ring of
   shared-memory stages with Hopper tensor copies (128-byte swizzle) and the block's first 16
   o_proj weight rows with bulk copies, one after every second page and the rest after the
   last (all after the pages left ~3 us of weight traffic in flight when the split's partial
   is stored, which delayed it; twenty-eighth runner session);
2. eight warps compute the split's attention, a warp per query head's 16 (token) rows, two
   warps per head over every other page, online softmax in float32 (the running maxima move
   only when one grows by more than 2^8, so most pages skip the rescale of the output state;
   pages wholly before every query skip the masks; two pages per iteration with one vote
   were 0.06 ms slower per step at 8k, twenty-ninth runner session), causal and length
   masks, V rows past the sequence zeroed. With 4 query heads per KV head the four warps of
   a head group are a warpgroup and multiply a page straight from the ring (``wgmma``, sm_90a):
   ``QK^T`` as eight m64n16k16, ``PV`` as one m64n128k16; other groupings use per-warp
   ``mma.m16n8k16`` with ``ldmatrix``. A head's first warp merges the other warps' states
   (through shared memory) in its registers and stores the split's normalised partial and
   log-sum-exp (base 2);
3. a grid barrier; each block merges ``16 * Hq / 128`` (token, head) rows of the splits into
   the bf16 attention output; a second grid barrier;
4. each block multiplies its ``N / 128`` o_proj rows by the 16 output rows (``mma``, the eight
   warps split K, a fixed-order sum): with 32 rows, 0-15 from shared memory, 16-23 from the
   ring (bulk copies issued once attention is done, landing over the merge and the barriers)
   and 24-31 from registers (loaded after the merge, in flight through barrier 2); it
   writes what :func:`~.gemv.gemv_add_norm` writes: ``h = residual + product`` (bf16),
   ``norm_weight * h`` and each block's per-row sums of squares of ``h``.

Both grid barriers' arrivals come from the producer warp's first lane, which has no memory
operations in flight (thread 0 arrives with the partial's stores, then the weight loads, in
flight: each barrier took ~1 us longer in a layer, docs/benchmarks.md, twenty-third runner
session).

Where :func:`~._device.pdl_ok` allows (family ``segment``) it is also a programmatic dependent
launch: the producer issues the pages without any of the last 16 positions (the kernel before
writes this step's K/V) and the first 16 weight rows before ``griddepcontrol.wait``; q, the
residual and the newest pages come after it (verify-16 0.04-0.05 ms faster at 1k and 8k,
twenty-fourth runner session).

No float atomics, fixed summation orders: graph replay equals eager bit for bit. The values
differ from the Triton attention + ``gemv_add_norm`` path only by summation order (the CUDA
tests bound it). :func:`verify_segment_ok` says where it applies (sm_90, >= 128 SMs, one
sequence, 2-16 causal queries, a bf16 page-major pool of 16-token pages and 128-dim heads, no
sliding window or o_proj bias, shapes below) for the query counts of :data:`DEFAULT_QUERIES`
(4 query heads per KV head) or :data:`DEFAULT_QUERIES_MMA` (``KVSTRATA_VERIFY_SEGMENT=1``:
every count from 2 to 16; ``0``: none). Measured in the step (docs/benchmarks.md, nineteenth
and twentieth runner sessions, Qwen3-8B shape): verify-16 graph 4.62-4.63 ms against the Triton
path's 4.77 at 1k, 5.01-5.02 against 5.01 at 8k; the speculative step at width 8 5.91 against
6.03 ms at 8k, at widths 2 and 4 0.07-0.12 ms faster than on the Triton path at 1k and 8k (the
``mma`` build lost there from 4k).
"""

from __future__ import annotations

import ctypes
import functools
import math
import os

import torch
from torch import Tensor

from ._cuda import (BLOCKS, PRELUDE, WGMMA, Kernel, compiles, enabled, grid_counter,
                    tensor_map_2d, variant)
from ._device import pdl_ok
from .attention_plan import AttentionMetadata
from .gemv import RowRms

#: ``KVSTRATA_VERIFY_SEGMENT=1`` puts every batch-1 verify on this kernel where it applies, ``0``
#: none (the Triton attention + merge + ``gemv_add_norm`` launches); unset: the query counts of
#: :data:`DEFAULT_QUERIES`.
SEGMENT_ENV = "KVSTRATA_VERIFY_SEGMENT"
#: query rows of a launch (an mma tile)
MAX_QUERIES = 16
#: query tokens per launch the warpgroup build (4 query heads per KV head) serves unless
#: ``KVSTRATA_VERIFY_SEGMENT`` says otherwise: every count (see the module: verify widths 2, 4,
#: 8 and 16 measured)
DEFAULT_QUERIES = frozenset(range(2, MAX_QUERIES + 1))
#: the same for the ``mma`` build (other groupings; measured in the eighteenth session)
DEFAULT_QUERIES_MMA = frozenset({8})
WARPS = 8           # compute warps; one more warp issues the copies
THREADS = (WARPS + 1) * 32
#: ring stages of one page (K and V, 8 KB) each
STAGES = 8
#: :func:`source`'s switches as shipped: ``stages, pref, wg, pdl, lazy, spread``
VARIANT = (STAGES, 0, 1, 1, 1, 1)
#: for benchmarks of the step (``benchmarks/gpu_runner.sh``): colon-separated switches that
#: replace :data:`VARIANT`'s first ones, e.g. ``10:1``
VARIANT_ENV = "KVSTRATA_VERIFY_SEGMENT_VARIANT"
_LOG2E = math.log2(math.e)

_SOURCE = r"""
#define NKV %(nkv)d
#define GROUP %(group)d
#define SPLITS %(splits)d
#define K_IN %(k_in)d
#define MT %(mt)d
#define NST %(nst)d
#define PREF %(pref)d
#define STAMPS %(stamps)d
#define BLOCKS %(blocks)d
#define NW 8
#define NT (NW * 32 + 32)
#define WPM (NW / GROUP)
#define HQ (NKV * GROUP)
#define WP (K_IN * 2 + 16)
#define RING (NST * 8192)
#define NCH (K_IN / 512)
#define WG %(wg)d
#define PDL %(pdl)d
#define LAZY %(lazy)d
#define SPREAD %(spread)d
#define RESCALE 8.f
// exp2 without denormal results (their flush to zero is below every use here)
__device__ __forceinline__ float ex2(float x) {
    float y; asm("ex2.approx.ftz.f32 %%0, %%1;" : "=f"(y) : "f"(x)); return y; }
%(prelude)s
static_assert(NST >= NW, "the ring holds the compute warps' states after attention");
static_assert(MT <= 2 && 8 * WP <= RING + 128, "o_proj rows 16-23 fit the ring (+ its slack)");
#if WG
static_assert(GROUP == 4 && NW == 8, "a warpgroup is one KV head's 4 query heads x 16 tokens");
%(wgmma)s
#endif

// n o_proj rows from src into shared memory at dst, pitch WP (one bulk copy per row), on bar
__device__ __forceinline__ void copy_rows(u32 dst, const bf16_t* src, int n, u64* bar) {
    for (int r = 0; r < n; ++r) bulk_copy(dst + r * WP, src + (size_t)r * K_IN, K_IN * 2, bar);
}

extern "C" __global__ void __launch_bounds__(NT, 1)
verify_segment(const __grid_constant__ TMap kvmap, const bf16_t* __restrict__ q,
               long long s_qt, int layer, int nlayers, int T, const int* __restrict__ bt,
               const int* __restrict__ seq_len_p, const int* __restrict__ qlen_p,
               const bf16_t* __restrict__ W, const bf16_t* __restrict__ res,
               const bf16_t* __restrict__ gam, bf16_t* __restrict__ out,
               bf16_t* __restrict__ hout, float* __restrict__ ss_out, float* part_o,
               float* part_lse, bf16_t* xbuf, u32* ctr, float qk_scale, u64* stamps) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    // the ring's boxes must start on 1024-byte boundaries (the 128-byte swizzle's period)
    unsigned char* ring = smem_raw + ((1024u - (sa(smem_raw) & 1023u)) & 1023u);
    // o_proj rows 0-15, pitch WP (after the ring's 128 bytes of slack: rows 16-23 go into the
    // ring at pitch WP once attention is done)
    unsigned char* wsm = ring + RING + 128;
    u64* full = (u64*)(wsm + 16 * WP);
    u64* empty = full + NST;
    u64* wbar = empty + NST;                                 // rows 0-15
    u64* rbar = wbar + 1;                                    // rows 16-23
    float* red_m = (float*)(rbar + 1);                       // [NW][16]
    float* red_l = red_m + NW * 16;                          // [NW][16]
    float* sq = red_l + NW * 16;                             // [16][16 * MT]
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int c = blockIdx.x;
    const int h = c / SPLITS, sidx = c %% SPLITS;
    const int L = *seq_len_p;
    const int nq = qlen_p ? min(*qlen_p, T) : T;
    int TS = (L + SPLITS - 1) / SPLITS;
    TS = (TS + 15) & ~15;
    const int lo = sidx * TS, hi = min(lo + TS, L);
    const int np = hi > lo ? (hi - lo + 15) / 16 : 0;
    STAMP(0)
    // the epilogue's inputs for this thread's (row, token) items (read now; under PDL after
    // the wait)
    float rres[2], rgam[2];
#define LOAD_RES() _Pragma("unroll") for (int k = 0; k < 2; ++k) { \
        const int o2 = tid + k * NT, r = o2 >> 4, t = o2 & 15; \
        const bool ok = o2 < 16 * MT * 16 && t < T; \
        rres[k] = ok ? bf(res[(size_t)t * (BLOCKS * 16 * MT) + c * 16 * MT + r]) : 0.f; \
        rgam[k] = ok ? bf(gam[c * 16 * MT + r]) : 0.f; }
#if !PDL
    LOAD_RES()
#endif
    if (tid == 0) {
        for (int i = 0; i < NST; ++i) { mbar_init(full + i, 1); mbar_init(empty + i, GROUP); }
        mbar_init(wbar, 1);
        mbar_init(rbar, 1);
        mbar_fence_init();
    }
    __syncthreads();
    float o[16][4];   // a compute warp's attention state: output rows, row maxima and sums
#pragma unroll
    for (int n = 0; n < 16; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
    const int r0 = lane >> 2, qd = lane & 3;

    if (warp == NW) {
        // 1. the producer warp: pages into the ring (their ids read 32 at a time, one per
        // lane), then the weight rows (issued among the pages they slowed the pages: at 8k
        // the attention phase took 21.2 us against 18.4, nineteenth runner session); lane 0
        // issues the copies
        if (lane == 0) mbar_expect(wbar, 16 * K_IN * 2);
        const int page_rows = nlayers * 2 * NKV * 16;
        const int row0 = (layer * 2 * NKV + h) * 16;
        int btl = 0, wnext = 0;
        // under PDL: pages with any of the last 16 positions hold this step's K/V (the
        // previous kernel's), read after the wait
        const int dep = max(0, (L - 16) / 16 - lo / 16);
        for (int i = 0; i < np; ++i) {
            if (i == dep) GDC_WAIT();
            if ((i & 31) == 0) btl = i + lane < np ? bt[lo / 16 + i + lane] : 0;
            const int y = __shfl_sync(0xffffffffu, btl, i & 31) * page_rows + row0;
            const int st = i %% NST;
            if (lane == 0) {
                if (i >= NST) mbar_wait(empty + st, ((i / NST) - 1) & 1);
                const u32 dst = sa(ring) + st * 8192;
                mbar_expect(full + st, 8192);
                tensor_copy(dst, &kvmap, 0, y, full + st);
                tensor_copy(dst + 2048, &kvmap, 64, y, full + st);
                tensor_copy(dst + 4096, &kvmap, 0, y + NKV * 16, full + st);
                tensor_copy(dst + 6144, &kvmap, 64, y + NKV * 16, full + st);
            }
            if (SPREAD && (i & 1) && wnext < 16) {
                if (lane == 0)
                    bulk_copy(sa(wsm) + wnext * WP, W + (size_t)(c * 16 * MT + wnext) * K_IN,
                              K_IN * 2, wbar);
                ++wnext;
            }
            __syncwarp();
        }
        if (lane == 0)
            copy_rows(sa(wsm) + wnext * WP, W + (size_t)(c * 16 * MT + wnext) * K_IN, 16 - wnext,
                      wbar);
#if PDL
        GDC_WAIT();
        LOAD_RES()
#endif
    } else {
        // 2. one query head's 16 rows over every WPM-th page of the split
        const int g = warp %% GROUP, par = warp / GROUP, qh = h * GROUP + g;
#if PDL
        GDC_WAIT();
        STAMP(10)
        LOAD_RES()
#endif
        u32 qa[8][4];
#pragma unroll
        for (int s = 0; s < 8; ++s) {
            const int col = 16 * s + 2 * qd;
            const bf16_t* q0 = q + (size_t)r0 * s_qt + qh * 128 + col;
            const bf16_t* q1 = q0 + 8 * s_qt;
            qa[s][0] = r0 < nq ? *(const u32*)q0 : 0u;
            qa[s][1] = r0 + 8 < nq ? *(const u32*)q1 : 0u;
            qa[s][2] = r0 < nq ? *(const u32*)(q0 + 8) : 0u;
            qa[s][3] = r0 + 8 < nq ? *(const u32*)(q1 + 8) : 0u;
        }
        const int qp0 = L - nq + r0, qp1 = qp0 + 8;
        for (int i = par; i < np; i += WPM) {
            const int st = i %% NST;
            mbar_wait(full + st, (i / NST) & 1);
            if (i == par) { STAMP(7) }
            const u32 sb = sa(ring) + st * 8192;
#if WG
            // the warpgroup (this KV head's GROUP = 4 query heads x 16 tokens: m64) multiplies
            // the page straight from the ring: S = Q K^T as eight m64n16k16 (K-major K, the
            // k-step 32 bytes along the 128-byte swizzled row), then O += P V as one m64n128k16
            // (V MN-major); the fragments are the mma.m16n8k16 ones of each warp's 16 rows
            const int k0 = lo + i * 16;
            if (k0 + 16 > hi) {
                // V rows past the split (the sequence's last page) may hold anything: zeroed
                // in the ring before the tensor cores read them
                const int wt = tid & 127;
                for (int z = wt; z < 16 * 16; z += 128) {
                    const int row = z >> 4, ch = z & 15;
                    if (k0 + row >= hi)
                        *(v4*)(ring + st * 8192 + 4096 + (ch >> 3) * 2048 + row * 128
                               + (ch & 7) * 16) = v4{0u, 0u, 0u, 0u};
                }
                asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
                asm volatile("bar.sync %%0, 128;" :: "r"(1 + par) : "memory");
            }
            float s[2][4];
            wg_fence();
#pragma unroll
            for (int ks = 0; ks < 8; ++ks) {
                const u64 d = gdesc(sb + (ks >> 2) * 2048 + (ks & 3) * 32, 16, 1024);
                if (ks == 0) wg_s<0>(&s[0][0], qa[ks], d); else wg_s<1>(&s[0][0], qa[ks], d);
            }
            wg_commit();
            wg_wait<0>();
            wg_keep8(&s[0][0]);
#else
            float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
            for (int ks = 0; ks < 8; ++ks) {
                const int tok = (lane >> 4) * 8 + (lane & 7);
                const int ch = 2 * (ks & 3) + ((lane >> 3) & 1);
                u32 b0, b1, b2, b3;
                ldsm4(sb + (ks >> 2) * 2048 + tok * 128 + ((ch ^ (tok & 7)) << 4),
                      b0, b1, b2, b3);
                mma_bf16(s[0], qa[ks][0], qa[ks][1], qa[ks][2], qa[ks][3], b0, b1);
                mma_bf16(s[1], qa[ks][0], qa[ks][1], qa[ks][2], qa[ks][3], b2, b3);
            }
#endif
#if !WG
            const int k0 = lo + i * 16;
#endif
            // LAZY: the scores stay unscaled (the scale is folded into the exponent) and a page
            // wholly inside the split and before every query needs no mask (warp-uniform)
            const bool whole = LAZY && k0 + 16 <= hi && k0 + 15 <= L - nq;
            const float sc = LAZY ? 1.f : qk_scale;
            float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    if (!whole) {
                        const int kp = k0 + 8 * j + 2 * qd + e;
                        s[j][e] = kp <= qp0 && kp < hi ? s[j][e] * sc : NEG_INF;
                        s[j][2 + e] = kp <= qp1 && kp < hi ? s[j][2 + e] * sc : NEG_INF;
                    }
                    mx0 = fmaxf(mx0, s[j][e]);
                    mx1 = fmaxf(mx1, s[j][2 + e]);
                }
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
#if LAZY
            // the running maxima move only when a row's grows by more than RESCALE (log2
            // units, a warp-uniform decision): most pages skip the rescale of o, and P may
            // reach 2^RESCALE
            const float n0 = fmaxf(m0, mx0 * qk_scale), n1 = fmaxf(m1, mx1 * qk_scale);
            if (__any_sync(0xffffffffu, n0 > m0 + RESCALE || n1 > m1 + RESCALE)) {
                const float y0 = n0 == NEG_INF ? 0.f : n0, y1 = n1 == NEG_INF ? 0.f : n1;
                const float al0 = ex2(m0 - y0), al1 = ex2(m1 - y1);
                m0 = n0; m1 = n1;
                l0 *= al0; l1 *= al1;
#pragma unroll
                for (int n = 0; n < 16; ++n) {
                    o[n][0] *= al0; o[n][1] *= al0; o[n][2] *= al1; o[n][3] *= al1;
                }
            }
            const float z0 = m0 == NEG_INF ? 0.f : m0, z1 = m1 == NEG_INF ? 0.f : m1;
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    s[j][e] = ex2(fmaf(s[j][e], qk_scale, -z0));
                    s[j][2 + e] = ex2(fmaf(s[j][2 + e], qk_scale, -z1));
                }
            l0 += (s[0][0] + s[0][1]) + (s[1][0] + s[1][1]);
            l1 += (s[0][2] + s[0][3]) + (s[1][2] + s[1][3]);
#else
            const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
            const float z0 = n0 == NEG_INF ? 0.f : n0, z1 = n1 == NEG_INF ? 0.f : n1;
            const float al0 = exp2f(m0 - z0), al1 = exp2f(m1 - z1);
            m0 = n0; m1 = n1;
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    s[j][e] = exp2f(s[j][e] - z0);
                    s[j][2 + e] = exp2f(s[j][2 + e] - z1);
                }
            l0 = l0 * al0 + (s[0][0] + s[0][1]) + (s[1][0] + s[1][1]);
            l1 = l1 * al1 + (s[0][2] + s[0][3]) + (s[1][2] + s[1][3]);
#pragma unroll
            for (int n = 0; n < 16; ++n) {
                o[n][0] *= al0; o[n][1] *= al0; o[n][2] *= al1; o[n][3] *= al1;
            }
#endif
            const u32 pa0 = pack_bf(s[0][0], s[0][1]), pa1 = pack_bf(s[0][2], s[0][3]);
            const u32 pa2 = pack_bf(s[1][0], s[1][1]), pa3 = pack_bf(s[1][2], s[1][3]);
#if WG
            wg_keep64(&o[0][0]);
            wg_fence();
            wg_pv(&o[0][0], pa0, pa1, pa2, pa3, gdesc(sb + 4096, 2048, 1024));
            wg_commit();
            wg_wait<0>();
            wg_keep64(&o[0][0]);
#else
            // V rows past the split (the sequence's last page) may hold anything: zero them
            const int kv0 = k0 + 2 * qd;
            const u32 keep0 = (kv0 < hi ? 0xffffu : 0u) | (kv0 + 1 < hi ? 0xffff0000u : 0u);
            const u32 keep1 = (kv0 + 8 < hi ? 0xffffu : 0u) | (kv0 + 9 < hi ? 0xffff0000u : 0u);
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const int mi = lane >> 3;
                const int tok = (mi & 1) * 8 + (lane & 7);
                const int ch = 2 * (u & 3) + (mi >> 1);
                u32 v0, v1, v2, v3;
                ldsm4_t(sb + 4096 + (u >> 2) * 2048 + tok * 128 + ((ch ^ (tok & 7)) << 4),
                        v0, v1, v2, v3);
                mma_bf16(o[2 * u], pa0, pa1, pa2, pa3, v0 & keep0, v1 & keep1);
                mma_bf16(o[2 * u + 1], pa0, pa1, pa2, pa3, v2 & keep0, v3 & keep1);
            }
#endif
            __syncwarp();
            if (lane == 0) mbar_arrive(empty + st);
        }
        l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
        l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
        l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
        l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
        STAMP(8)
    }
    // every page consumed: the ring holds the other warps' states now (the warpgroup build:
    // the compute warps only, the producer may still be issuing the weight rows' copies; the
    // mma build keeps block barriers: with the named one it spilled 36 bytes for 8 query heads
    // per KV head, none since the grid merge's loads are issued at once, not yet measured)
#if WG
#define COMPUTE_SYNC() if (warp < NW) asm volatile("bar.sync 4, %%0;" :: "n"(NW * 32) : "memory")
#else
#define COMPUTE_SYNC() __syncthreads()
#endif
    COMPUTE_SYNC();
    STAMP(11)
    // the split's partial of each (token, head): a head's first warp merges the states of its
    // WPM - 1 other warps (through the ring) into its registers and stores the partial
    const int gw = warp %% GROUP, pw = warp / GROUP;
    if (warp < NW && pw > 0) {
        v4* red = (v4*)ring + (warp - GROUP) * 16 * 32;
#pragma unroll
        for (int n = 0; n < 16; ++n)
            red[n * 32 + lane] = v4{__float_as_uint(o[n][0]), __float_as_uint(o[n][1]),
                                    __float_as_uint(o[n][2]), __float_as_uint(o[n][3])};
        if (qd == 0) {
            red_m[warp * 16 + r0] = m0; red_m[warp * 16 + r0 + 8] = m1;
            red_l[warp * 16 + r0] = l0; red_l[warp * 16 + r0 + 8] = l1;
        }
    }
    COMPUTE_SYNC();
    STAMP(12)
    if (warp < NW && pw == 0) {
        // each row's weights: the warps' maxima, then exp2 of the differences over the sum
        float f0[WPM], f1[WPM];
        float M0 = m0, M1 = m1;
#pragma unroll
        for (int p = 1; p < WPM; ++p) {
            M0 = fmaxf(M0, red_m[(gw + p * GROUP) * 16 + r0]);
            M1 = fmaxf(M1, red_m[(gw + p * GROUP) * 16 + r0 + 8]);
        }
        float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
        for (int p = 0; p < WPM; ++p) {
            const int w = gw + p * GROUP;
            const float a0 = p ? red_m[w * 16 + r0] : m0, a1 = p ? red_m[w * 16 + r0 + 8] : m1;
            const float b0 = p ? red_l[w * 16 + r0] : l0, b1 = p ? red_l[w * 16 + r0 + 8] : l1;
            f0[p] = M0 == NEG_INF ? 0.f : exp2f(a0 - M0);
            f1[p] = M1 == NEG_INF ? 0.f : exp2f(a1 - M1);
            sum0 += b0 * f0[p];
            sum1 += b1 * f1[p];
        }
#pragma unroll
        for (int p = 0; p < WPM; ++p) {
            f0[p] = sum0 > 0.f ? f0[p] / sum0 : 0.f;
            f1[p] = sum1 > 0.f ? f1[p] / sum1 : 0.f;
        }
        const int row0 = (sidx * 16 + r0) * HQ + h * GROUP + gw, row1 = row0 + 8 * HQ;
        float* po0 = part_o + (size_t)row0 * 128 + 2 * qd;
        float* po1 = part_o + (size_t)row1 * 128 + 2 * qd;
#pragma unroll
        for (int n = 0; n < 16; ++n) {
            float v0 = o[n][0] * f0[0], v1 = o[n][1] * f0[0];
            float v2 = o[n][2] * f1[0], v3 = o[n][3] * f1[0];
#pragma unroll
            for (int p = 1; p < WPM; ++p) {
                const v4 b = ((const v4*)ring)[((p - 1) * GROUP + gw) * 16 * 32 + n * 32 + lane];
                v0 += __uint_as_float(b.x) * f0[p]; v1 += __uint_as_float(b.y) * f0[p];
                v2 += __uint_as_float(b.z) * f1[p]; v3 += __uint_as_float(b.w) * f1[p];
            }
            if (r0 < nq) *(float2*)(po0 + 8 * n) = make_float2(v0, v1);
            if (r0 + 8 < nq) *(float2*)(po1 + 8 * n) = make_float2(v2, v3);
        }
        if (qd == 0) {
            if (r0 < nq) part_lse[row0] = sum0 > 0.f ? M0 + log2f(sum0) : NEG_INF;
            if (r0 + 8 < nq) part_lse[row1] = sum1 > 0.f ? M1 + log2f(sum1) : NEG_INF;
        }
        STAMP(9)
    }
    if (MT > 1) {
        // the ring's last reads are done: o_proj rows 16-23 into it, over the merge and the
        // barriers (memory is idle until the o_proj phase)
        __syncthreads();
        if (warp == NW && lane == 0) {
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            mbar_expect(rbar, 8 * K_IN * 2);
            copy_rows(sa(ring), W + (size_t)(c * 16 * MT + 16) * K_IN, 8, rbar);
        }

    }
    STAMP(1)

    // 3. every partial stored: this block's (token, head) rows of the attention output (the
    // barriers' arrivals come from the producer warp, which has no loads in flight)
    grid_barrier_by(ctr, NW * 32);
#if PREF
    if (MT > 1 && tid < 16 * (MT - 1)) {
        const bf16_t* src = W + (size_t)(c * 16 * MT + 16 + tid) * K_IN;
        l2_prefetch(src, K_IN * 2);
    }
#endif
    STAMP(2)
    {
        // a thread's items (token, head, dim) of this block's rows: every partial load of
        // both items issued before any is used (verify-16 0.01-0.02 ms faster at 8k, and the
        // mma build for 8 query heads per KV head no longer spills: twenty-fifth runner
        // session)
        constexpr int ITEMS = (16 * HQ / BLOCKS) * 128, PER = (ITEMS + NT - 1) / NT;
        float lse[PER][SPLITS], po[PER][SPLITS];
#pragma unroll
        for (int k = 0; k < PER; ++k) {
            const int o2 = tid + k * NT;
            const int row = c * (16 * HQ / BLOCKS) + (o2 >> 7), d = o2 & 127;
            const int t = row / HQ, hh = row %% HQ;
            const bool ok = o2 < ITEMS && t < nq;
#pragma unroll
            for (int s = 0; s < SPLITS; ++s) {
                lse[k][s] = ok ? ld_cg_f(part_lse + (s * 16 + t) * HQ + hh) : NEG_INF;
                po[k][s] = ok ? ld_cg_f(part_o + (size_t)((s * 16 + t) * HQ + hh) * 128 + d)
                              : 0.f;
            }
        }
#pragma unroll
        for (int k = 0; k < PER; ++k) {
            const int o2 = tid + k * NT;
            const int row = c * (16 * HQ / BLOCKS) + (o2 >> 7), d = o2 & 127;
            const int t = row / HQ, hh = row %% HQ;
            float M = NEG_INF, v = 0.f;
#pragma unroll
            for (int s = 0; s < SPLITS; ++s) M = fmaxf(M, lse[k][s]);
            if (M != NEG_INF) {
                float sum = 0.f, val = 0.f;
#pragma unroll
                for (int s = 0; s < SPLITS; ++s) {
                    const float e = exp2f(lse[k][s] - M);
                    sum += e;
                    val += e * po[k][s];
                }
                v = val / sum;
            }
            if (o2 < ITEMS) xbuf[(size_t)t * K_IN + hh * 128 + d] = to_bf(v);
        }
    }
    STAMP(3)
    // o_proj rows 24-31 (a lane's row r0 + 8 of the second tile), every chunk of this warp's
    // columns into registers before barrier 2: in flight through it (measured:
    // docs/benchmarks.md, twenty-third runner session)
    v4 wr[NCH][2];
    if (warp < NW && MT > 1) {
        const bf16_t* wg = W + (size_t)(c * 16 * MT + 24 + r0) * K_IN + warp * (K_IN / NW)
                           + 16 * qd;
#pragma unroll
        for (int ch = 0; ch < NCH; ++ch) {
            wr[ch][0] = *(const v4*)(wg + ch * 64);
            wr[ch][1] = *(const v4*)(wg + ch * 64 + 8);
        }
    }
    grid_barrier_by(ctr, NW * 32);
    STAMP(4)

    // 4. o_proj: out^T [16 MT rows, 16 tokens] = W rows x x^T; warp w takes K_IN / 8 columns in
    // chunks of 64 (lane quad qd holds elements 16 qd .. 16 qd + 15 of a chunk: the four
    // k-steps' fragments in one order for W and x, so every load is 16 bytes); rows 0-15 from
    // wsm, 16-23 from the ring, 24-31 from registers, x from L2 three chunks ahead
    float acc[MT][2][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int j = 0; j < 2; ++j) acc[m][j][0] = acc[m][j][1] = acc[m][j][2] = acc[m][j][3] = 0.f;
    if (warp < NW) {
        const int kw = warp * (K_IN / NW) + 16 * qd;
        const bf16_t* xg = xbuf + (size_t)r0 * K_IN + kw;
        v4 xr[NCH][4];
#define LOAD_X(ch) { \
            xr[ch][0] = ld_cg(xg + (ch) * 64); xr[ch][1] = ld_cg(xg + (ch) * 64 + 8); \
            xr[ch][2] = ld_cg(xg + 8 * K_IN + (ch) * 64); \
            xr[ch][3] = ld_cg(xg + 8 * K_IN + (ch) * 64 + 8); }
#pragma unroll
        for (int ch = 0; ch < (NCH < 3 ? NCH : 3); ++ch) LOAD_X(ch)
        mbar_wait(wbar, 0);
        if (MT > 1) mbar_wait(rbar, 0);
        const unsigned char* ws0 = wsm + r0 * WP + kw * 2;
        const unsigned char* rs0 = ring + r0 * WP + kw * 2;
#pragma unroll
        for (int ch = 0; ch < NCH; ++ch) {
            if (ch + 3 < NCH) LOAD_X(ch + 3)
            v4 a[4];
            a[0] = *(const v4*)(ws0 + ch * 128);
            a[1] = *(const v4*)(ws0 + ch * 128 + 16);
            a[2] = *(const v4*)(ws0 + 8 * WP + ch * 128);
            a[3] = *(const v4*)(ws0 + 8 * WP + ch * 128 + 16);
            const u32* A0 = (const u32*)a;
            const u32* X = (const u32*)xr[ch];
            v4 b[4];
            if (MT > 1) {
                b[0] = *(const v4*)(rs0 + ch * 128);
                b[1] = *(const v4*)(rs0 + ch * 128 + 16);
                b[2] = wr[ch][0];
                b[3] = wr[ch][1];
            }
            const u32* A1 = (const u32*)b;
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                // words 2s, 2s + 1 of a row's 8: the k-step's low and high fragment halves
                const int lo8 = (s >> 1) * 4 + (s & 1) * 2;
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const u32 b0 = X[j * 8 + lo8], b1 = X[j * 8 + lo8 + 1];
                    mma_bf16(acc[0][j], A0[lo8], A0[8 + lo8], A0[lo8 + 1], A0[8 + lo8 + 1],
                             b0, b1);
                    if (MT > 1)
                        mma_bf16(acc[MT - 1][j], A1[lo8], A1[8 + lo8], A1[lo8 + 1],
                                 A1[8 + lo8 + 1], b0, b1);
                }
            }
        }
#undef LOAD_X
        // every compute warp's reads of rows 16-23 in the ring are done before its sums go there
        if (MT > 1) asm volatile("bar.sync 3, %%0;" :: "n"(NW * 32) : "memory");
        float* red = (float*)ring + warp * (16 * MT * 16);   // [16 MT rows][16 tokens]
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    red[(m * 16 + r0) * 16 + 8 * j + 2 * qd + e] = acc[m][j][e];
                    red[(m * 16 + r0 + 8) * 16 + 8 * j + 2 * qd + e] = acc[m][j][2 + e];
                }
    }
    __syncthreads();
    STAMP(5)
    // the warps' sums in a fixed order; rounded as gemv_add_norm rounds: the product,
    // h = residual + product, g * h, and each token's sum of squares over this block's rows
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        const int o2 = tid + k * NT, r = o2 >> 4, t = o2 & 15;
        if (o2 >= 16 * MT * 16) break;
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w) v += ((float*)ring)[w * (16 * MT * 16) + o2];
        float hf = 0.f;
        if (t < T) {
            const size_t at = (size_t)t * (BLOCKS * 16 * MT) + c * 16 * MT + r;
            const bf16_t hn = to_bf(rres[k] + bf(to_bf(v)));
            hout[at] = hn;
            hf = bf(hn);
            out[at] = to_bf(rgam[k] * hf);
        }
        sq[t * 16 * MT + r] = hf * hf;
    }
    __syncthreads();
    if (tid < T) {
        float ssum = 0.f;
        for (int r = 0; r < 16 * MT; ++r) ssum += sq[tid * 16 * MT + r];
        ss_out[tid * BLOCKS + c] = ssum;
    }
    STAMP(6)
}
"""


def _env_variant() -> tuple[int, ...]:
    return variant(os.environ.get(VARIANT_ENV, ""), VARIANT, VARIANT_ENV)


def source(nkv: int, group: int, k_in: int, n_out: int, stages: int = STAGES,
           pref: int = 0, wg: int = 1, pdl: int = 0, lazy: int = 0, spread: int = 0,
           stamps: bool = False) -> str:
    """The kernel's CUDA source for one shape (``pref``: an L2 prefetch of the weight rows not
    in shared memory after the first barrier; ``wg``: attention by warpgroup products, sm_90a,
    4 query heads per KV head only; ``pdl``: a programmatic dependent launch, the pages and the
    first weight rows issued before the wait; ``lazy``: the page loop's running maxima move
    only by more than 2^8 (most pages skip the rescale), the scale folded into the exponent,
    no masks on whole pages before every query; ``spread``: the first 16 weight rows one
    after every second page, not all after the last; ``stamps``: per-block phase
    timestamps)."""
    return _SOURCE % {"prelude": PRELUDE, "wgmma": WGMMA, "nkv": nkv, "group": group,
                      "splits": BLOCKS // nkv, "k_in": k_in, "mt": n_out // (BLOCKS * 16),
                      "nst": stages, "blocks": BLOCKS, "pref": int(pref), "wg": int(wg),
                      "pdl": int(pdl), "lazy": int(lazy), "spread": int(spread),
                      "stamps": int(stamps)}


def smem_bytes(k_in: int, n_out: int, stages: int = STAGES) -> int:
    """Dynamic shared memory: 1 KB of alignment slack, the ring and 128 bytes (o_proj rows
    16-23 after attention), 16 weight rows (16-byte pad), the mbarriers, the warps' row maxima
    and sums, the squares of the epilogue."""
    mt = n_out // (BLOCKS * 16)
    return (1024 + stages * 8192 + 128 + 16 * (k_in * 2 + 16) + (2 * stages + 2) * 8
            + 2 * WARPS * 16 * 4 + 16 * 16 * mt * 4)


def build(nkv: int, group: int, k_in: int, n_out: int, stages: int, pref: int, wg: int,
          pdl: int, lazy: int, spread: int, stamps: bool) -> tuple[str, str]:
    """The source a launch compiles and its NVRTC target: the warpgroup build (4 query heads
    per KV head only) for ``sm_90a``, the ``mma`` build for ``sm_90``."""
    wg = int(bool(wg) and group == 4)
    src = source(nkv, group, k_in, n_out, stages, pref, wg, pdl, lazy, spread, stamps)
    return src, "90a" if wg else "90"


@functools.lru_cache(maxsize=None)
def _kernel(device: torch.device, nkv: int, group: int, k_in: int, n_out: int, stages: int,
            pref: int, wg: int, pdl: int, lazy: int, spread: int, stamps: bool) -> Kernel:
    src, arch = build(nkv, group, k_in, n_out, stages, pref, wg, pdl, lazy, spread, stamps)
    with torch.cuda.device(device):
        return Kernel(src, "verify_segment", smem_bytes(k_in, n_out, stages), THREADS,
                      arch=arch if arch == "90a" else None)


def verify_segment_ok(q: Tensor, kv_cache: Tensor, meta: AttentionMetadata, weight: Tensor,
                      bias: Tensor | None, sliding_window: int | None, impl: str = "auto"
                      ) -> bool:
    """Whether :func:`verify_segment` serves this layer: ``impl="auto"`` on an sm_90 GPU with
    >= 128 SMs, ``meta.max_query_len`` in :data:`DEFAULT_QUERIES` (4 query heads per KV
    head) or :data:`DEFAULT_QUERIES_MMA` (any with ``KVSTRATA_VERIFY_SEGMENT=1``, none with
    ``0``), for the shapes :func:`segment_shapes_ok` takes."""
    if not (enabled(impl, q.device, SEGMENT_ENV, "")
            and segment_shapes_ok(q, kv_cache, meta, weight, bias, sliding_window)):
        return False
    hkv = kv_cache.shape[3]
    default = DEFAULT_QUERIES if q.shape[1] == 4 * hkv else DEFAULT_QUERIES_MMA
    if not (os.environ.get(SEGMENT_ENV) == "1" or meta.max_query_len in default):
        return False
    return _compiled(q.device, hkv, q.shape[1] // hkv, weight.shape[1], weight.shape[0])


@functools.lru_cache(maxsize=None)
def _compiled(device: torch.device, nkv: int, group: int, k_in: int, n_out: int) -> bool:
    """Compiles the shape's kernel (once, before any graph capture needs it); a failure warns
    once and leaves the layer on the Triton path."""
    return compiles(lambda: _kernel(device, nkv, group, k_in, n_out, *_env_variant(), False),
                    f"kernels.verify_segment: not compiled for {nkv} KV heads x {group}, o_proj "
                    f"[{n_out}, {k_in}] on {device}",
                    "batch-1 verify keeps the Triton attention + o_proj launches")


def segment_shapes_ok(q: Tensor, kv_cache: Tensor, meta: AttentionMetadata, weight: Tensor,
                      bias: Tensor | None, sliding_window: int | None) -> bool:
    """The shapes the kernel takes (any device): 2-16 causal queries of one sequence, bf16
    ``q [T, Hq, 128]`` (heads 128 apart, tokens 8-byte aligned), a contiguous pool ``[pages,
    layers, 2, Hkv, 16, 128]`` below 2**31 rows of 128, Hkv >= 2 dividing 128 with 1, 2, 4 or 8
    query heads each and ``Hq`` a multiple of 8, a contiguous o_proj weight ``[N, Hq * 128]``
    with ``N`` 2048 or 4096, ``Hq * 128 <= 4096``, no bias, no sliding window, a block-table
    row of consecutive ids."""
    if (meta.num_seqs != 1 or not 2 <= meta.max_query_len <= MAX_QUERIES or not meta.causal
            or sliding_window is not None or bias is not None
            or meta.block_tables.stride(1) != 1):
        return False
    if (q.dim() != 3 or q.shape[0] != meta.max_query_len or q.shape[2] != 128
            or q.dtype != torch.bfloat16 or q.stride(2) != 1 or q.stride(1) != 128
            or q.stride(0) % 4 or q.data_ptr() % 16):
        return False
    hq = q.shape[1]
    if (kv_cache.dim() != 6 or kv_cache.dtype != torch.bfloat16 or not kv_cache.is_contiguous()
            or kv_cache.shape[2] != 2 or kv_cache.shape[4] != 16 or kv_cache.shape[5] != 128
            or kv_cache.numel() // 128 >= 2 ** 31 or kv_cache.data_ptr() % 16):
        return False
    hkv = kv_cache.shape[3]
    if BLOCKS % hkv or hq % hkv or hq // hkv not in (1, 2, 4, 8) or hq % 8 or hkv < 2:
        return False
    n, k = weight.shape if weight.dim() == 2 else (0, 0)
    return (k == hq * 128 and k % 512 == 0 and k <= 4096 and n in (2048, 4096)
            and weight.dtype == torch.bfloat16 and weight.is_contiguous())


def verify_segment(q: Tensor, kv_cache: Tensor, layer: int, meta: AttentionMetadata, *,
                   sm_scale: float, weight: Tensor, residual: Tensor, norm_weight: Tensor,
                   eps: float, _variant: tuple[int, ...] | None = None,
                   _stamps: Tensor | None = None) -> tuple[Tensor, Tensor, RowRms]:
    """``gemv_add_norm(paged_attention(q, ...).reshape(T, -1), weight, None, residual,
    norm_weight, eps)`` in one launch, where :func:`verify_segment_ok` holds: returns
    ``(norm_weight * h, h, RowRms)`` with ``h = residual + o_proj(attention)``. Rows past the
    plan's ``query_lens`` (a shortened block) take a zero attention output.

    ``_variant`` (:func:`source`'s ``stages, pref``; ``None``: :data:`VARIANT`, or what
    ``KVSTRATA_VERIFY_SEGMENT_VARIANT`` says) and ``_stamps`` (int64, ``BLOCKS * 16``:
    per-block phase timestamps) are for ``benchmarks/segment_proto.py``."""
    n, k_in = weight.shape
    t, hq, hkv = q.shape[0], q.shape[1], kv_cache.shape[3]
    if residual.shape != (t, n) or norm_weight.shape != (n,):
        raise ValueError(f"verify_segment: residual {tuple(residual.shape)} and norm weight "
                         f"{tuple(norm_weight.shape)} must be [{t}, {n}] and [{n}]")
    dev = q.device
    v = _variant or _env_variant()
    kern = _kernel(dev, hkv, hq // hkv, k_in, n, *v, _stamps is not None)
    splits = BLOCKS // hkv
    part_o = torch.empty(splits * MAX_QUERIES * hq * 128, dtype=torch.float32, device=dev)
    part_lse = torch.empty(splits * MAX_QUERIES * hq, dtype=torch.float32, device=dev)
    xbuf = torch.empty((MAX_QUERIES, k_in), dtype=torch.bfloat16, device=dev)
    out = torch.empty((t, n), dtype=torch.bfloat16, device=dev)
    h = torch.empty((t, n), dtype=torch.bfloat16, device=dev)
    ss = torch.empty((t, BLOCKS), dtype=torch.float32, device=dev)
    kern([tensor_map_2d(kv_cache, 16, 64), q, ctypes.c_int64(q.stride(0)),
          ctypes.c_int32(layer), ctypes.c_int32(kv_cache.shape[1]), ctypes.c_int32(t),
          meta.block_tables, meta.seq_lens,
          meta.query_lens if meta.query_lens is not None else ctypes.c_void_p(0),
          weight, residual.contiguous(), norm_weight.contiguous(), out, h, ss, part_o, part_lse,
          xbuf, grid_counter(dev), ctypes.c_float(sm_scale * _LOG2E),
          _stamps if _stamps is not None else ctypes.c_void_p(0)],
         pdl=bool(v[3]) and pdl_ok(dev, "segment"))
    return out, h, RowRms(ss, n, eps)


__all__ = ["DEFAULT_QUERIES", "DEFAULT_QUERIES_MMA", "SEGMENT_ENV", "segment_shapes_ok",
           "verify_segment", "verify_segment_ok"]
