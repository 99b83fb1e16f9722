// kvstrata.kernels.verify_segment: batch-1 verify attention (2-16 queries) and
// o_proj in one cooperative launch (the design: that module's docstring).
// NVRTC compiles it after one `#define` per shape constant and switch (verify_segment.source()),
// its `#include`s (files of this folder) expanded in place.
#if !defined(NKV) || !defined(GROUP) || !defined(SPLITS) || !defined(K_IN) || !defined(MT) || \
    !defined(NST) || !defined(PREF) || !defined(STAMPS) || !defined(BLOCKS) || !defined(WG) || \
    !defined(PDL) || !defined(LAZY) || !defined(SPREAD)
#error "built by kvstrata.kernels.verify_segment.source(), which defines the shape"
#endif
#define NW 8
#define NT (NW * 32 + 32)
#define WPM (NW / GROUP)
#define HQ (NKV * GROUP)
#define WP (K_IN * 2 + 16)
#define RING (NST * 8192)
#define NCH (K_IN / 512)
#define RESCALE 8.f
// exp2 without denormal results (their flush to zero is below every use here)
__device__ __forceinline__ float ex2(float x) {
    float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
#include "prelude.cuh"
static_assert(NST >= NW, "the ring holds the compute warps' states after attention");
static_assert(MT <= 2 && 8 * WP <= RING + 128, "o_proj rows 16-23 fit the ring (+ its slack)");
#if WG
static_assert(GROUP == 4 && NW == 8, "a warpgroup is one KV head's 4 query heads x 16 tokens");
#include "wgmma.cuh"
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
    const int h = c / SPLITS, sidx = c % SPLITS;
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
            const int st = i % NST;
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
        const int g = warp % GROUP, par = warp / GROUP, qh = h * GROUP + g;
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
            const int st = i % NST;
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
                asm volatile("bar.sync %0, 128;" :: "r"(1 + par) : "memory");
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
#define COMPUTE_SYNC() if (warp < NW) asm volatile("bar.sync 4, %0;" :: "n"(NW * 32) : "memory")
#else
#define COMPUTE_SYNC() __syncthreads()
#endif
    COMPUTE_SYNC();
    STAMP(11)
    // the split's partial of each (token, head): a head's first warp merges the states of its
    // WPM - 1 other warps (through the ring) into its registers and stores the partial
    const int gw = warp % GROUP, pw = warp / GROUP;
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
            const int t = row / HQ, hh = row % HQ;
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
            const int t = row / HQ, hh = row % HQ;
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
        if (MT > 1) asm volatile("bar.sync 3, %0;" :: "n"(NW * 32) : "memory");
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
