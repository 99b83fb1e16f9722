"""Experiment (issue 13, batch-1 goals): decode attention and o_proj as one persistent launch.

At batch 1 the step's largest cost over its bytes is the attention -> o_proj segment: at 1k
attention takes ~12 us per layer in the step for ~1 us of K/V, and o_proj 12 us for 7.9 us of
weights (docs/benchmarks.md, fourteenth runner session). Attention is latency, not bytes, and
o_proj cannot start reading its weights until attention is done: Triton cannot hold weights in
shared memory across a PDL wait, and attention's programs fill every SM.

This prototype (CUDA C++, compiled with NVRTC through CuPy) runs the segment as one launch of
128 blocks, one per SM:

1. thread 0 of each block starts Hopper bulk copies of ``RS`` of its 32 o_proj weight rows into
   shared memory (no dependency on attention);
2. the block computes one (KV head, split) of split-KV decode attention (16 splits per head,
   8 warps over the split's pages, a half-warp per token, online softmax) and stores the split's
   normalised partial and log-sum-exp;
3. grid barrier; blocks 0-31 merge one query head each into the bf16 attention output;
4. grid barrier; every block reads the output (8 KB), waits for its weight rows and multiplies
   (rows past ``RS`` come from memory), then adds the residual and writes what
   ``gemv_add_norm`` writes (``g * h``, ``h``, per-block sums of squares of ``h``).

It times, 36 layers in one CUDA graph, against the shipped kernels (``paged_attention_triton``
in the runner's 34-split grid, then ``gemv_add_norm``): the segment alone, and the segment inside
a layer of products (q/k/v with the norm's row scale before it, gate/up + SiLU and down after
it; no q/k norm, RoPE or K/V write). It checks the fused outputs against the shipped ones.

    python benchmarks/segment_proto.py --contexts 1024 8192 --out $OUT/segment.md
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_attn_study import _runner_meta  # noqa: E402
from persistent_chain import HELPERS  # noqa: E402
from runner_bench import _graph_us, copy_rate  # noqa: E402

from kvstrata.kernels import attention_triton as at  # noqa: E402
from kvstrata.kernels.gemv import RowRms, gemv, gemv_add_norm  # noqa: E402

LAYERS, HKV, HQ, D, PAGE, HID, INTER = 36, 8, 32, 128, 16, 4096, 12288
BLOCKS, SPLITS, ROWS = 128, 16, 32       # blocks; splits per KV head; o_proj rows per block
EPS, SCALE = 1e-6, D ** -0.5

SOURCE = r"""
#define RS %(rs)d
#define PF %(pf)d
#define WAFTER %(wafter)d
#define CPA %(cpa)d
#define RREG %(rreg)d
#define SYNC %(sync)d
#define NW 8
#define SPLITS 16
#define ROWS 32
#define HIDDEN 4096
#define NEG_INF (__int_as_float(0xff800000))
""" + HELPERS + r"""
#define STAMP(k) if (stamps != nullptr && threadIdx.x == 0) { u64 t_; \
    asm volatile("mov.u64 %%0, %%%%globaltimer;" : "=l"(t_)); stamps[blockIdx.x * 8 + (k)] = t_; }

__device__ __forceinline__ void unpack8(const v4& v, float* f) {
    f[0] = __uint_as_float(v.x << 16); f[1] = __uint_as_float(v.x & 0xffff0000u);
    f[2] = __uint_as_float(v.y << 16); f[3] = __uint_as_float(v.y & 0xffff0000u);
    f[4] = __uint_as_float(v.z << 16); f[5] = __uint_as_float(v.z & 0xffff0000u);
    f[6] = __uint_as_float(v.w << 16); f[7] = __uint_as_float(v.w & 0xffff0000u);
}

// All blocks of the grid meet; one counter that only grows (a launch's arrivals are
// gridDim.x per barrier, and 2^32 is a multiple of the grid), so graph replays need no reset.
__device__ __forceinline__ void grid_barrier(u32* ctr) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const u32 old = atomicAdd(ctr, 1u);
        const u32 target = old - old %% gridDim.x + gridDim.x;
        while ((int)(ld_acquire(ctr) - target) < 0) { }
        __threadfence();
    }
    __syncthreads();
}

// This block's first RS o_proj rows into shared memory: Hopper bulk copies of 16 KB (one
// thread, an mbarrier), or (CPA) 16-byte cp.async by every thread.
__device__ __forceinline__ void start_rows(const bf16_t* W, int c, unsigned char* smem, u64* bar,
                                           int tid) {
    if (RS == 0) return;
    const unsigned char* src = (const unsigned char*)(W + (size_t)c * ROWS * HIDDEN);
#if CPA
    for (int off = tid * 16; off < RS * HIDDEN * 2; off += NW * 32 * 16)
        asm volatile("cp.async.cg.shared.global [%%0], [%%1], 16;"
                     :: "r"(sa(smem + off)), "l"(src + off) : "memory");
    asm volatile("cp.async.commit_group;" ::: "memory");
#else
    if (tid == 0) {
        mbar_init(bar, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        mbar_expect(bar, RS * HIDDEN * 2);
        for (int off = 0; off < RS * HIDDEN * 2; off += 16384)
            bulk_copy(smem + off, src + off, 16384, bar);
    }
#endif
}

__device__ __forceinline__ void wait_rows(u64* bar) {
    if (RS == 0) return;
#if CPA
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
#else
    mbar_wait(bar, 0);
#endif
}

// The merged attention output of query head qh, dim d: the SPLITS partials' log-sum-exp
// weighted mean, read through L2 (other blocks wrote them in this launch).
__device__ __forceinline__ float merge_one(const float* part_o, const float* part_lse, int qh,
                                           int d) {
    float lse[SPLITS], o[SPLITS], M = NEG_INF;
#pragma unroll
    for (int s2 = 0; s2 < SPLITS; ++s2) {
        asm volatile("ld.global.cg.f32 %%0, [%%1];" : "=f"(lse[s2])
                     : "l"(part_lse + s2 * 32 + qh) : "memory");
        asm volatile("ld.global.cg.f32 %%0, [%%1];" : "=f"(o[s2])
                     : "l"(part_o + (size_t)(s2 * 32 + qh) * 128 + d) : "memory");
    }
#pragma unroll
    for (int s2 = 0; s2 < SPLITS; ++s2) M = fmaxf(M, lse[s2]);
    if (M == NEG_INF) return 0.f;
    float sum = 0.f, val = 0.f;
#pragma unroll
    for (int s2 = 0; s2 < SPLITS; ++s2) {
        const float e = exp2f(lse[s2] - M);
        sum += e;
        val += e * o[s2];
    }
    return val / sum;
}

// One page of K/V (16 tokens) of the split: a half-warp per token, 8 dims per lane.
__device__ __forceinline__ void load_page(const bf16_t* kp, long long s_kv, int half, int li,
                                          v4* kr, v4* vr) {
    const bf16_t* vp = kp + s_kv;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        kr[i] = *(const v4*)(kp + (2 * i + half) * 128 + 8 * li);
        vr[i] = *(const v4*)(vp + (2 * i + half) * 128 + 8 * li);
    }
}

__device__ __forceinline__ void attend_page(const v4* kr, const v4* vr, int p, int hi, int half,
                                            float (&qr)[4][8], float* m, float* l,
                                            float (&acc)[4][8]) {
    const unsigned FULL = 0xffffffffu;
    float s[4][8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        float kf[8];
        unpack8(kr[i], kf);
#pragma unroll
        for (int g = 0; g < 4; ++g) {
            float d = 0.f;
#pragma unroll
            for (int j = 0; j < 8; ++j) d = fmaf(qr[g][j], kf[j], d);
            s[g][i] = d;
        }
    }
#pragma unroll
    for (int off = 8; off > 0; off >>= 1)
#pragma unroll
        for (int g = 0; g < 4; ++g)
#pragma unroll
            for (int i = 0; i < 8; ++i) s[g][i] += __shfl_xor_sync(FULL, s[g][i], off);
    bool ok[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) ok[i] = p * 16 + 2 * i + half < hi;
#pragma unroll
    for (int g = 0; g < 4; ++g) {
        float mx = NEG_INF;
#pragma unroll
        for (int i = 0; i < 8; ++i) if (ok[i]) mx = fmaxf(mx, s[g][i]);
        const float mn = fmaxf(m[g], mx);
        const float ms = mn == NEG_INF ? 0.f : mn;
        const float alpha = exp2f(m[g] - ms);
        float pr[8], ps = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) { pr[i] = ok[i] ? exp2f(s[g][i] - ms) : 0.f; ps += pr[i]; }
        l[g] = l[g] * alpha + ps;
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[g][j] *= alpha;
        m[g] = mn;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            float vf[8];
            unpack8(vr[i], vf);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[g][j] = fmaf(pr[i], vf[j], acc[g][j]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(NW * 32, 1)
seg(const bf16_t* __restrict__ q, const bf16_t* __restrict__ kv, long long layer_off,
    long long s_page, long long s_kv, long long s_head,
    const int* __restrict__ bt, const int* __restrict__ seq_len_p,
    const bf16_t* __restrict__ W, const bf16_t* __restrict__ res, const bf16_t* __restrict__ gam,
    bf16_t* __restrict__ out, bf16_t* __restrict__ hout, float* __restrict__ ss_out,
    float* part_o, float* part_lse, bf16_t* xbuf, u32* ctr, float qk_scale, u64* stamps) {
    extern __shared__ __align__(128) unsigned char smem[];
    bf16_t* wsm = (bf16_t*)smem;                                   // RS rows of W
    float* red = (float*)(smem + RS * HIDDEN * 2);                 // [NW][4][128] + m, l
    float* red_m = red + NW * 4 * 128;
    float* red_l = red_m + NW * 4;
    float* ssw = red_l + NW * 4;                                   // [NW]
    u64* bar = (u64*)(ssw + NW + (NW & 1));
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int half = lane >> 4, li = lane & 15;
    const int c = blockIdx.x;
    const unsigned FULL = 0xffffffffu;
    STAMP(0)

    // the epilogue's inputs for this warp's four rows, read now
    float rres[4], rgam[4];
#pragma unroll
    for (int rr = 0; rr < 4; ++rr) {
        rres[rr] = bf(res[c * ROWS + warp + rr * NW]);
        rgam[rr] = bf(gam[c * ROWS + warp + rr * NW]);
    }
    // 2. one (KV head, split) of decode attention
    const int h = c / SPLITS, sidx = c %% SPLITS;
    const int L = *seq_len_p;
    int T = (L + SPLITS - 1) / SPLITS;
    T = (T + 15) & ~15;
    const int lo = sidx * T, hi = min(lo + T, L);
    float qr[4][8], m[4], l[4], acc[4][8];
#pragma unroll
    for (int g = 0; g < 4; ++g) {
        v4 qv = *(const v4*)(q + (size_t)(4 * h + g) * 128 + 8 * li);
        unpack8(qv, qr[g]);
#pragma unroll
        for (int j = 0; j < 8; ++j) { qr[g][j] *= qk_scale; acc[g][j] = 0.f; }
        m[g] = NEG_INF; l[g] = 0.f;
    }
    const bf16_t* kbase = kv + layer_off + (long long)h * s_head;
    // this warp's pages p0, p0 + NW, ...: their ids loaded once, one per lane (<= 32)
    const int p0 = lo / 16 + warp, pend = (hi + 15) / 16;
    const int npw = hi > lo && pend > p0 ? (pend - p0 + NW - 1) / NW : 0;
    const int btl = lane < npw ? bt[p0 + lane * NW] : 0;
    v4 kr[8], vr[8];
#if !WAFTER
    // 1. this block's o_proj rows into shared memory (independent of attention), before or
    // (WAFTER) after the first K/V loads
    start_rows(W, c, smem, bar, tid);
#endif
    if (npw > 0)
        load_page(kbase + (long long)__shfl_sync(FULL, btl, 0) * s_page, s_kv, half, li, kr, vr);
#if WAFTER
    start_rows(W, c, smem, bar, tid);
#endif
    for (int k = 0; k < npw; ++k) {
        const int p = p0 + k * NW;
#if PF
        v4 kn[8], vn[8];
        if (k + 1 < npw)
            load_page(kbase + (long long)__shfl_sync(FULL, btl, k + 1) * s_page, s_kv, half, li,
                      kn, vn);
        attend_page(kr, vr, p, hi, half, qr, m, l, acc);
#pragma unroll
        for (int i = 0; i < 8; ++i) { kr[i] = kn[i]; vr[i] = vn[i]; }
#else
        attend_page(kr, vr, p, hi, half, qr, m, l, acc);
        if (k + 1 < npw)
            load_page(kbase + (long long)__shfl_sync(FULL, btl, k + 1) * s_page, s_kv, half, li,
                      kr, vr);
#endif
    }
    // the two half-warps' states, then the warps' through shared memory
#pragma unroll
    for (int g = 0; g < 4; ++g) {
        const float mo = __shfl_xor_sync(FULL, m[g], 16), lo2 = __shfl_xor_sync(FULL, l[g], 16);
        const float mn = fmaxf(m[g], mo), ms = mn == NEG_INF ? 0.f : mn;
        const float a = exp2f(m[g] - ms), b = exp2f(mo - ms);
        l[g] = l[g] * a + lo2 * b;
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[g][j] = acc[g][j] * a + __shfl_xor_sync(FULL, acc[g][j], 16) * b;
        m[g] = mn;
        if (half == 0) {
#pragma unroll
            for (int j = 0; j < 8; ++j) red[(warp * 4 + g) * 128 + 8 * li + j] = acc[g][j];
        }
        if (lane == 0) { red_m[warp * 4 + g] = m[g]; red_l[warp * 4 + g] = l[g]; }
    }
    __syncthreads();
    for (int o = tid; o < 512; o += NW * 32) {
        const int g = o >> 7, d = o & 127;
        float M = NEG_INF;
        for (int w = 0; w < NW; ++w) M = fmaxf(M, red_m[w * 4 + g]);
        float sum = 0.f, val = 0.f;
        if (M != NEG_INF) {
            for (int w = 0; w < NW; ++w) {
                const float e = exp2f(red_m[w * 4 + g] - M);
                sum += red_l[w * 4 + g] * e;
                val += red[(w * 4 + g) * 128 + d] * e;
            }
        }
        const int row = sidx * 32 + 4 * h + g;
        part_o[(size_t)row * 128 + d] = sum > 0.f ? val / sum : 0.f;
        if (d == 0) part_lse[row] = sum > 0.f ? M + log2f(sum) : NEG_INF;
    }

#if RREG
    // this warp's rows past RS: into registers now (attention's registers are free), so their
    // loads run during the barriers and the merge
    v4 wg[4 - RS / NW][16];
#pragma unroll
    for (int rr = RS / NW; rr < 4; ++rr)
#pragma unroll
        for (int it = 0; it < 16; ++it)
            wg[rr - RS / NW][it] = *(const v4*)(W + (size_t)(c * ROWS + warp + rr * NW) * HIDDEN
                                                + it * 256 + lane * 8);
#endif
    STAMP(1)
#if SYNC == 0
    // 3. every partial stored; blocks 0-31 merge one query head each
    grid_barrier(ctr);
    STAMP(2)
    if (c < 32 && tid < 128) xbuf[c * 128 + tid] = to_bf(merge_one(part_o, part_lse, c, tid));
    STAMP(3)
    grid_barrier(ctr);
#else
    // 3. the last of a KV head's SPLITS blocks to store its partial merges that head's four
    // query heads, then counts the head done; every block waits for all eight. The counters
    // only grow (a head's by SPLITS per launch, the done count by 8), so replays need no reset.
    __syncthreads();
    __shared__ u32 s_old;
    if (tid == 0) {
        __threadfence();
        s_old = atomicAdd(ctr + 8 + h, 1u);
        __threadfence();
    }
    __syncthreads();
    const u32 old = s_old;
    STAMP(2)
    if (old %% SPLITS == SPLITS - 1) {
        for (int o = tid; o < 512; o += NW * 32)
            xbuf[(4 * h + (o >> 7)) * 128 + (o & 127)] =
                to_bf(merge_one(part_o, part_lse, 4 * h + (o >> 7), o & 127));
        __syncthreads();
        if (tid == 0) { __threadfence(); atomicAdd(ctr + 16, 1u); }
    }
    STAMP(3)
    if (tid == 0) {
        const u32 target = (old / SPLITS + 1) * 8;
        while ((int)(ld_acquire(ctr + 16) - target) < 0) { }
        __threadfence();
    }
    __syncthreads();
#endif
    STAMP(4)

    // 4. o_proj rows of this block: this lane's 128 columns of x in registers (bf16), a warp's four
    // rows (warp, warp + 8, ...) at once; rows below RS from shared memory
    v4 xp[16];
#pragma unroll
    for (int it = 0; it < 16; ++it) xp[it] = ld_cg(xbuf + it * 256 + lane * 8);
    wait_rows(bar);
    STAMP(5)
    float a[4];
    const bf16_t* wr[4];
#pragma unroll
    for (int rr = 0; rr < 4; ++rr) {
        a[rr] = 0.f;
        const int r = warp + rr * NW;
        wr[rr] = (rr < RS / NW ? wsm + (size_t)r * HIDDEN : W + (size_t)(c * ROWS + r) * HIDDEN)
                 + lane * 8;
    }
#pragma unroll
    for (int it = 0; it < 16; ++it) {
        float xf[8];
        unpack8(xp[it], xf);
#pragma unroll
        for (int rr = 0; rr < 4; ++rr) {
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
        for (int rr = 0; rr < 4; ++rr) a[rr] += __shfl_xor_sync(FULL, a[rr], off);
    float ssum = 0.f;
    if (lane == 0) {
#pragma unroll
        for (int rr = 0; rr < 4; ++rr) {
            const int row = c * ROWS + warp + rr * NW;
            const float yb = bf(to_bf(a[rr]));
            const bf16_t hn = to_bf(rres[rr] + yb);
            hout[row] = hn;
            const float hf = bf(hn);
            out[row] = to_bf(rgam[rr] * hf);
            ssum += hf * hf;
        }
    }
    if (lane == 0) ssw[warp] = ssum;
    __syncthreads();
    if (tid == 0) {
        float t = 0.f;
        for (int w = 0; w < NW; ++w) t += ssw[w];
        ss_out[c] = t;
    }
    STAMP(6)
}
"""


def smem_bytes(rs: int) -> int:
    return rs * HID * 2 + (8 * 4 * 128 + 8 * 4 * 2 + 8 + 2) * 4 + 16


def build(rs: int, pf: int, wafter: int, cpa: int = 0, rreg: int = 0, sync: int = 0):
    import cupy as cp
    src = SOURCE % {"rs": rs, "pf": pf, "wafter": wafter, "cpa": cpa, "rreg": rreg,
                    "sync": sync}
    try:
        mod = cp.RawModule(code=src, options=("-std=c++17",), backend="nvrtc")
        k = mod.get_function("seg")
    except Exception as e:    # noqa: BLE001 - the image's nvcc instead
        print(f"NVRTC: {str(e)[:2000]}; building with nvcc", flush=True)
        mod = cp.RawModule(code=src, options=("-std=c++17", "-arch=sm_90"), backend="nvcc")
        k = mod.get_function("seg")
    k.max_dynamic_shared_size_bytes = smem_bytes(rs)
    return k


def main() -> None:
    import cupy as cp
    import numpy as np
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--variants", nargs="+",
                    default=["16:1:1:0:0:0", "16:1:1:0:0:1", "16:0:1:0:1:1", "16:0:1:0:1:0",
                             "24:0:1:0:1:1"],
                    help="RS:PF:WAFTER:CPA:RREG:SYNC (rows in shared memory, next page's K/V "
                    "loaded early, weight copies after the first K/V loads, cp.async instead "
                    "of bulk copies, the other rows into registers before the barriers, "
                    "last-arriver merge per KV head instead of two grid barriers)")
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    nl = args.layers
    dev = torch.device("cuda")
    torch.manual_seed(0)
    bw = copy_rate()
    lines = [f"# attention + o_proj as one launch, {torch.cuda.get_device_name()}", "",
             f"{nl} layers, batch 1, copy rate {bw / 1e12:.3f} TB/s; us per layer, median of "
             "20 graph replays", ""]

    def say(s):
        lines.append(s)
        print(s, flush=True)

    def rnd(*shape, scale=0.02):
        return (torch.randn(*shape, device=dev) * scale).to(torch.bfloat16)

    wo = [rnd(HID, HID) for _ in range(nl)]
    wqkv = [rnd(6144, HID) for _ in range(nl)]
    wgu = [rnd(2 * INTER, HID) for _ in range(nl)]
    wd = [rnd(HID, INTER) for _ in range(nl)]
    res = rnd(1, HID, scale=1.0)
    gam = (1 + rnd(HID, scale=0.1).float()).to(torch.bfloat16)
    xin = rnd(1, HID, scale=1.0)
    ss_in = torch.full((1, 64), 64.0, device=dev)
    q_alone = rnd(1, HQ, D, scale=1.0)
    variants = [tuple(int(x) for x in v.split(":")) for v in args.variants]
    kern = {v: build(*v) for v in variants}
    stamps = torch.zeros(nl, BLOCKS * 8, dtype=torch.int64, device=dev)
    part_o = torch.empty(SPLITS * HQ * D, device=dev)
    part_lse = torch.empty(SPLITS * HQ, device=dev)
    xbuf = torch.empty(HID, dtype=torch.bfloat16, device=dev)
    ctr = torch.zeros(64, dtype=torch.int32, device=dev)
    out = torch.empty(1, HID, dtype=torch.bfloat16, device=dev)
    hout = torch.empty_like(out)
    ss = torch.empty(1, BLOCKS, device=dev)
    c = cp.from_dlpack
    for ctx in args.contexts:
        pages = ctx // PAGE
        kv = rnd(pages, nl, 2, HKV, PAGE, D, scale=1.0)
        bt = torch.randperm(pages, device=dev).to(torch.int32)[None]
        sl = torch.tensor([ctx], dtype=torch.int32, device=dev)
        meta = _runner_meta(bt, ctx, 34)
        floor_seg = (HID * HID * 2 + ctx * HKV * D * 2 * 2) / bw * 1e6
        floor_layer = floor_seg + (6144 + 2 * INTER + INTER) * HID * 2 / bw * 1e6
        say(f"## context {ctx}: segment floor {floor_seg:.1f} us, layer floor "
            f"{floor_layer:.1f} us (o_proj + K/V; + q/k/v, gate/up, down)")
        say("")
        say("| variant | segment alone | in a layer of products |")
        say("|---|---|---|")
        s = kv.stride()

        def fused(layer, q, v, stamp=None):
            with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                kern[v]((BLOCKS,), (256,), (
                    c(q), c(kv), np.int64(layer * s[1]), np.int64(s[0]), np.int64(s[2]),
                    np.int64(s[3]), c(bt), c(sl), c(wo[layer]), c(res), c(gam), c(out),
                    c(hout), c(ss), c(part_o), c(part_lse), c(xbuf), c(ctr),
                    np.float32(SCALE * 1.4426950408889634),
                    c(stamp[layer]) if stamp is not None else np.uint64(0)),
                    shared_mem=smem_bytes(v[0]))

        def shipped(layer, q):
            a = at.paged_attention_triton(q, kv, layer, meta, sm_scale=SCALE)
            return gemv_add_norm(a.view(1, HID), wo[layer], None, res, gam, EPS)

        # correctness: layer 3, against the shipped kernels
        want_o, want_h, _ = shipped(3, q_alone)
        want_x = at.paged_attention_triton(q_alone, kv, 3, meta, sm_scale=SCALE).view(-1)
        for v in variants:
            fused(3, q_alone, v)
            torch.cuda.synchronize()
            say(f"| check RS:PF={v}: attention max diff "
                f"{(xbuf.float() - want_x.float()).abs().max().item():.2e}, out "
                f"{(out.float() - want_o.float()).abs().max().item():.2e}, h "
                f"{(hout.float() - want_h.float()).abs().max().item():.2e} | | |")

        def layer_chain(seg):
            def fn():
                for layer in range(nl):
                    qkv = gemv(xin, wqkv[layer], rms=RowRms(ss_in, HID, EPS))
                    o, h, rr = seg(layer, qkv[:, :HQ * D].view(1, HQ, D))
                    a = gemv(o, wgu[layer], gated=True, rms=rr)
                    gemv_add_norm(a, wd[layer], None, h, gam, EPS)
            return fn

        def seg_shipped(layer, q):
            return shipped(layer, q)

        def seg_fused(v, stamp=None):
            def f(layer, q):
                fused(layer, q, v, stamp)
                return out, hout, RowRms(ss, HID, EPS)
            return f

        alone = _graph_us(lambda: [shipped(i, q_alone) for i in range(nl)], nl)
        inlayer = _graph_us(layer_chain(seg_shipped), nl)
        say(f"| shipped: attention (34 splits, fused merge) + o_proj `gemv_add_norm` | "
            f"{alone:.1f} | {inlayer:.1f} |")
        phases = []
        for v in variants:
            alone = _graph_us(lambda: [fused(i, q_alone, v) for i in range(nl)], nl)
            inlayer = _graph_us(layer_chain(seg_fused(v)), nl)
            say(f"| one launch, RS:PF:WAFTER:CPA:RREG:SYNC {v} | {alone:.1f} | {inlayer:.1f} |")
            # the phases inside the graph: every layer's blocks stamp their phases
            for name, fn in (("alone", lambda: [fused(i, q_alone, v, stamps)
                                                for i in range(nl)]),
                             ("in a layer", layer_chain(seg_fused(v, stamps)))):
                _graph_us(fn, nl, reps=3)
                t = stamps.view(nl, BLOCKS, 8)[nl // 4: 3 * nl // 4, :, :7].double().cpu()
                t = (t - t[:, :, 0].min(1).values[:, None, None]) / 1e3
                med = t.median(1).values.median(0).values
                last = t.max(1).values.median(0).values
                phases.append(f"| {v} {name} | " + " | ".join(
                    f"{med[k]:.1f} / {last[k]:.1f}" for k in range(7)) + " |")
        say("")
        say("Phases in the graph (us from the layer's first block start, median / last block, "
            "median over the middle half of the layers):")
        say("")
        say("| RS:PF:WAFTER:CPA:RREG:SYNC | start | partial stored | barrier 1 | merged | barrier 2 | x + weights "
            "ready | end |")
        say("|---|---|---|---|---|---|---|---|")
        for row in phases:
            say(row)
        say("")

    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
