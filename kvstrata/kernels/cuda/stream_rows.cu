// kvstrata.kernels.stream_rows: products of 2-16 rows streamed through shared
// memory by tensor-map copies (the design: that module's docstring).
// NVRTC compiles it after one `#define` per shape constant and switch (stream_rows.build_rows()),
// its `#include`s (files of this folder) expanded in place.
#if !defined(K_IN) || !defined(RMS_IN) || !defined(ADD_NORM) || !defined(GATED) || !defined(NW) || \
    !defined(NS) || !defined(KC) || !defined(MTG) || !defined(MAXR) || !defined(PDL) || \
    !defined(TRIGGER)
#error "built by kvstrata.kernels.stream_rows.build_rows(), which defines the shape"
#endif
#define MT (MTG * (1 + GATED))
#define STAMPS 0
#define NC (K_IN / KC)
#define NB (KC / 64)
#define WBOX (MT * 2048)
#define XOFF (NB * WBOX)
#define STAGEB (NB * (WBOX + 2048))
#define RED (MT * 16 * 17)
#define EPI ((16 * MAXR + NW * 32 - 1) / (NW * 32))
#include "prelude.cuh"
#include "stream_block.cuh"
// chunk i (KC columns, 64-column boxes) of this block's weight rows (GATED: its gate rows,
// then from m-tile MTG on its up rows, N further) into stage i % NS, and after the wait
// (issue_x) of the 16 input rows (rows past m read as zeros), on full[i % NS]: 128-byte
// swizzled rows, 16-byte chunk c of row r at c ^ (r % 8)
__device__ __forceinline__ void issue_w(const TMap* wm, int N, int r0, int nr,
                                        unsigned char* ring, u64* full, int i) {
    const int s = i % NS;
    mbar_expect(&full[s], NB * (nr * (1 + GATED) + 16) * 128);
#pragma unroll
    for (int j = 0; j < NB; ++j)
#pragma unroll
        for (int part = 0; part <= GATED; ++part)
            tensor_copy(sa(ring + s * STAGEB + j * WBOX + part * MTG * 2048), wm,
                        i * KC + j * 64, r0 + part * N, &full[s]);
}
__device__ __forceinline__ void issue_x(const TMap* xm, unsigned char* ring, u64* full, int i) {
    const int s = i % NS;
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
    // ldmatrix rows: weight rows lane % 16 of an m-tile (chunk lane / 16 of a k-step), input
    // rows lane % 8 + 8 * (lane / 16) (chunk lane / 8 % 2): two n-tiles of 8 in one x4 load;
    // both swizzled by the row's r % 8 == lane % 8
    const u32 a_row = (lane & 15) * 128, b_row = ((lane & 7) + ((lane >> 4) << 3)) * 128;
    const u32 a_sw = (lane >> 4) ^ (lane & 7), b_sw = ((lane >> 3) & 1) ^ (lane & 7);
    float acc[MT][2][4];
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[t][j >> 2][j & 3] = 0.f;
    for (int i = warp; i < NC; i += NW) {
        const int s = i % NS;
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
