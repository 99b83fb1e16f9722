// kvstrata.kernels.decode_segment: batch-1 decode attention and o_proj in one
// cooperative launch (the design: that module's docstring).
// NVRTC compiles it after one `#define` per shape constant and switch (decode_segment.source()),
// its `#include`s (files of this folder) expanded in place.
#if !defined(NKV) || !defined(GROUP) || !defined(SPLITS) || !defined(K_IN) || !defined(RPW) || \
    !defined(RS) || !defined(RREG) || !defined(RLATE) || !defined(PDL) || !defined(STAMPS) || \
    !defined(ATTN_ONLY) || !defined(PAGES) || !defined(UNROLL) || !defined(HWAIT) || !defined(NW)
#error "built by kvstrata.kernels.decode_segment.source(), which defines the shape"
#endif
#define ROWS (RPW * NW)
static_assert(!HWAIT || GROUP <= SPLITS, "hwait: a head's query heads merged by its splits");
#include "prelude.cuh"
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
    const int h = c / SPLITS, sidx = c % SPLITS;
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
#if UNROLL == 1
    // two pages per trip, the buffers' roles swapped: no register copy waits for the next
    // page's loads, so a warp waits on page k + 1 with page k + 2's loads already issued
    for (int k = 0; k < npw; k += 2) {
        PAGE_STEP(k, kr, vr, kn, vn)
        if (k + 1 < npw) PAGE_STEP(k + 1, kn, vn, kr, vr)
    }
#elif UNROLL == 2
    // each page loaded, then used: no registers for the next page (room for more warps)
    for (int k = 0; k < npw; ++k) {
        if (k > 0) {
            if ((k & 31) == 0) btl = k + lane < npw ? bt[p0 + (k + lane) * pstep] : 0;
            LOAD_PAGE(kbase + (long long)__shfl_sync(FULL, btl, k & 31) * s_page, kr, vr);
            if (RLATE == 2 && tid == 0 && k == npw - 1)
                start_rows(W + (size_t)c * ROWS * K_IN, smem, bar);
        }
        attend_page(kr, vr, p0 + k * pstep, hi, r4, t4, qv, qk_scale, m, l, acc);
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
    const int mq = c % SPLITS < GROUP ? GROUP * (c / SPLITS) + c % SPLITS : -1;
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
