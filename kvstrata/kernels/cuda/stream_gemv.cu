// kvstrata.kernels.stream_gemv: one-row products streamed through shared memory
// by bulk copies (the design: that module's docstring).
// NVRTC compiles it after one `#define` per shape constant and switch (stream_gemv.build()),
// its `#include`s (files of this folder) expanded in place.
#if !defined(K_IN) || !defined(GATED) || !defined(RMS_IN) || !defined(ADD_NORM) || !defined(NW) || \
    !defined(NS) || !defined(MAXR) || !defined(PDL) || !defined(TRIGGER)
#error "built by kvstrata.kernels.stream_gemv.build(), which defines the shape"
#endif
#define STAMPS 0
#define ROWB (K_IN * 2)
#define STAGEB (ROWB * (1 + GATED))
#include "prelude.cuh"
#include "stream_block.cuh"
// row i of this block (and its up row) into stage i % NS, completing on full[i % NS]
__device__ __forceinline__ void issue(const bf16_t* W, int N, int r, unsigned char* ring,
                                      u64* full, int i) {
    const int s = i % NS;
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
        const int s = i % NS;
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
