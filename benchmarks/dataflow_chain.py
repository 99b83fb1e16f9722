"""Experiment (issue 13, batch-1 goals): the persistent product chain without grid barriers.

``persistent_chain.py`` found that a grid barrier per product costs ~3 us on its own (the
barrier, the input's reload) and that its ring does not hide it (docs/benchmarks.md, eleventh
runner session). This prototype removes the barrier. Rows of every product are split over the
blocks in units of 16; the part of the next product's input that block ``j`` wrote is *slice*
``j`` (grouped ``--sg`` blocks to a slice). The weights are pre-tiled once, per product and
block, into tiles of (the block's rows) x (one slice's columns), stored in the order the block
uses them: its own slice first, then the next ones, round the ring. So each block streams one
contiguous region per product, and a consumer warp about to use a slice waits only for the
flags of the blocks that wrote it (then loads the slice from L2 into shared memory, once
per block). A block meets its own warps at the end of a product (the output rows, then its
flag); no block waits for all the others.

It is a measurement, not a kernel of the library: the products are chained as in
``persistent_chain.py`` (``x_{p+1} = y_p[:K_{p+1}]``, no norms, SiLU or attention), the
reductions use shared-memory atomics, and it needs sm_90. Printed, from one run: the read floor;
per ring the dataflow chain; the same without waiting for the flags (wrong values: the stream
and the consumers alone); the tiled weight stream alone; the shipped ``gemv`` chain.

    python3 benchmarks/dataflow_chain.py [--layers 36] [--rings 16x10 12x12] [--sg 4] [--out FILE]

Measured on the H200 (it loses to the shipped chain): docs/benchmarks.md, eleventh runner
session.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from persistent_chain import (HELPERS, LAYER, Report, chain_graph, consumers,  # noqa: E402
                              cuda_ms, max_rel_err)

from kvstrata.kernels.gemv import gemv  # noqa: E402

UNIT = 16               # rows per unit of the row split

SOURCE = r"""
#define CHUNK %(chunk)d
#define STAGES %(stages)d
#define NCONS %(ncons)d
#define UNIT %(unit)d
#define SG %(sg)d
#define WAIT %(wait)d
#define CONSUME %(consume)d
#define MAXK 12288
#define MAXROWS 256
#define MAXQ 64

""" + HELPERS + r"""
// Rows [lo, hi) of an N-row product held by block c of G (whole units of UNIT rows).
__device__ __forceinline__ int row_lo(int N, int c, int G) {
    return UNIT * (int)(((long long)(N / UNIT) * c) / G);
}
struct Desc { int p, q, a, w, r0, nr; };

extern "C" __global__ void __launch_bounds__((NCONS + 1) * 32, 1)
chain(const u64* __restrict__ wptr, const int* __restrict__ Ns, const int* __restrict__ Ks,
      const u64* __restrict__ yptr, const bf16_t* __restrict__ x0, int P, u32* flags) {
    extern __shared__ unsigned char smem[];
    unsigned char* ring = smem;
    bf16_t* xs = (bf16_t*)(smem + STAGES * CHUNK);                 // [2][MAXK]
    float* acc = (float*)(smem + STAGES * CHUNK + 2 * MAXK * 2);    // [MAXROWS]
    u64* full = (u64*)(acc + MAXROWS);
    u64* empty = full + STAGES;
    Desc* desc = (Desc*)(empty + STAGES);
    int* sstate = (int*)(desc + STAGES);                            // [2][MAXQ]
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int c = blockIdx.x, G = gridDim.x, NQ = (G + SG - 1) / SG;
    ring_init(full, empty, STAGES);
    for (int r = tid; r < MAXROWS; r += blockDim.x) acc[r] = 0.f;
    for (int r = tid; r < 2 * MAXQ; r += blockDim.x) sstate[r] = 0;
    __syncthreads();

    if (warp == NCONS) {      // producer: the block's tiles of every product, in order
        if (lane == 0) {
            u32 i = 0;
            for (int p = 0; p <= P; ++p) {
                if (p == P) {                 // one end marker per consumer warp
                    for (int k = 0; k < NCONS; ++k, ++i) {
                        const u32 s = i %% STAGES, n = i / STAGES;
                        if (n > 0) mbar_wait(&empty[s], (n - 1) & 1);
                        desc[s].p = P;
                        mbar_arrive(&full[s]);
                    }
                    break;
                }
                const int N = Ns[p], K = Ks[p], prevN = p ? Ns[p - 1] : K;
                const int lo = row_lo(N, c, G), R = row_lo(N, c + 1, G) - lo;
                const unsigned char* src = (const unsigned char*)wptr[p] + (u64)lo * K * 2;
                for (int t = 0; t < NQ; ++t) {
                    const int q = (c / SG + t) %% NQ;
                    const int a = min(row_lo(prevN, q * SG, G), K);
                    const int b = min(row_lo(prevN, min(q * SG + SG, G), G), K);
                    const int W = b - a;
                    if (W <= 0) continue;
                    const int rpc = max(1, min(R, CHUNK / (W * 2)));
                    for (int r0 = 0; r0 < R; r0 += rpc, ++i) {
                        const int nr = min(rpc, R - r0);
                        const u32 bytes = (u32)(nr * W * 2);
                        const u32 s = i %% STAGES, n = i / STAGES;
                        if (n > 0) mbar_wait(&empty[s], (n - 1) & 1);
                        desc[s].p = p; desc[s].q = q; desc[s].a = a; desc[s].w = W;
                        desc[s].r0 = r0; desc[s].nr = nr;
                        mbar_expect(&full[s], bytes);
                        bulk_copy(sa(ring + s * CHUNK), src, bytes, &full[s]);
                        src += bytes;
                    }
                }
            }
        }
        return;
    }

    // consumers: chunk i to warp i mod NCONS (NCONS divides STAGES: a stage's phases in order)
    const int ct = tid, g = lane >> 3, lig = lane & 7;
    int cur = 0;
    for (u32 i = warp; ; i += NCONS) {
        const u32 s = i %% STAGES, n = i / STAGES;
        mbar_wait(&full[s], n & 1);
        const Desc d = desc[s];
        while (cur < d.p) {                   // the end of product cur: every warp is here
            asm volatile("bar.sync 1, %%0;" :: "r"(NCONS * 32) : "memory");
            const int N = Ns[cur], lo = row_lo(N, c, G), R = row_lo(N, c + 1, G) - lo;
            bf16_t* y = (bf16_t*)yptr[cur];
            for (int r = ct; r < R; r += NCONS * 32) y[lo + r] = to_bf(acc[r]);
            for (int r = ct; r < MAXQ; r += NCONS * 32) sstate[((cur + 1) & 1) * MAXQ + r] = 0;
            asm volatile("bar.sync 1, %%0;" :: "r"(NCONS * 32) : "memory");
            if (ct == 0) {
                __threadfence();
                asm volatile("st.release.gpu.global.u32 [%%0], %%1;"
                             :: "l"(flags + (u64)cur * G + c), "r"(1u) : "memory");
            }
            for (int r = ct; r < MAXROWS; r += NCONS * 32) acc[r] = 0.f;
            asm volatile("bar.sync 1, %%0;" :: "r"(NCONS * 32) : "memory");
            ++cur;
        }
        if (d.p >= P) break;
        const int par = d.p & 1;
        bf16_t* xp = xs + par * MAXK;
        if (CONSUME) {
            // the slice this chunk multiplies: loaded once per block and product
            volatile int* st = sstate + par * MAXQ + d.q;
            if (*st != 2) {
                int won = 0;
                if (lane == 0) won = atomicCAS((int*)st, 0, 1) == 0;
                won = __shfl_sync(0xffffffffu, won, 0);
                if (won) {
                    if (WAIT && d.p > 0 && lane < SG && d.q * SG + lane < G) {
                        const u32* f = flags + (u64)(d.p - 1) * G + d.q * SG + lane;
                        while (ld_acquire(f) == 0) { }
                    }
                    __syncwarp();
                    const bf16_t* src = d.p ? (const bf16_t*)yptr[d.p - 1] : x0;
                    for (int e = lane * 8; e < d.w; e += 256)
                        *(v4*)(xp + d.a + e) = ld_cg(src + d.a + e);
                    __syncwarp();
                    __threadfence_block();
                    if (lane == 0) atomicExch((int*)st, 2);
                } else {
                    while (*st != 2) { }
                }
                __threadfence_block();
            }
            // rows r0 .. r0+nr of the tile, 8 lanes to a row, 4 rows at a time
            const unsigned char* stg = ring + s * CHUNK;
            const int pieces = d.w >> 3;
            for (int rr0 = 0; rr0 < d.nr; rr0 += 4) {
                const int rr = rr0 + g;
                float sum = 0.f;
                if (rr < d.nr) {
                    for (int cp = lig; cp < pieces; cp += 8) {
                        const v4 a = *(const v4*)(stg + (rr * d.w + cp * 8) * 2);
                        const v4 b = *(const v4*)(xp + d.a + cp * 8);
                        const u32 aw[4] = {a.x, a.y, a.z, a.w}, bw[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
                        for (int h = 0; h < 4; ++h) {
                            sum = fmaf(bf(aw[h] & 0xffffu), bf(bw[h] & 0xffffu), sum);
                            sum = fmaf(bf(aw[h] >> 16), bf(bw[h] >> 16), sum);
                        }
                    }
                }
                sum += __shfl_xor_sync(0xffffffffu, sum, 1);
                sum += __shfl_xor_sync(0xffffffffu, sum, 2);
                sum += __shfl_xor_sync(0xffffffffu, sum, 4);
                if (lig == 0 && rr < d.nr) atomicAdd(&acc[d.r0 + rr], sum);
            }
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[s]);
    }
}
"""


def row_lo(n: int, c: int, g: int) -> int:
    return UNIT * ((n // UNIT) * c // g)


def tile_order(n: int, k: int, prev_n: int, g: int, sg: int, dev) -> torch.Tensor:
    """Flat source indices (``row * k + col``) of an ``n x k`` weight in the kernel's order:
    block-major; per block its tiles from its own slice (of ``sg`` blocks) on; each tile
    row-major."""
    nq = -(-g // sg)
    parts = []
    for c in range(g):
        lo, hi = row_lo(n, c, g), row_lo(n, c + 1, g)
        rows = torch.arange(lo, hi, device=dev, dtype=torch.int64)[:, None] * k
        for t in range(nq):
            q = (c // sg + t) % nq
            a = min(row_lo(prev_n, q * sg, g), k)
            b = min(row_lo(prev_n, min(q * sg + sg, g), g), k)
            if b > a:
                parts.append((rows + torch.arange(a, b, device=dev)[None, :]).flatten())
    return torch.cat(parts)


def build(stages: int, chunk: int, sg: int, wait: bool, consume: bool):
    import cupy as cp
    src = SOURCE % {"chunk": chunk, "stages": stages, "ncons": consumers(stages), "unit": UNIT,
                    "sg": sg, "wait": int(wait), "consume": int(consume)}
    mod = cp.RawModule(code=src, options=("-std=c++17",), backend="nvrtc")
    k = mod.get_function("chain")
    smem = stages * chunk + 2 * 12288 * 2 + 256 * 4 + 2 * stages * 8 + stages * 24 + 2 * 64 * 4
    k.max_dynamic_shared_size_bytes = smem
    return k, smem


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--rings", nargs="+", default=["16x10", "12x12"],
                    help="ring stages as KBxCOUNT (shared memory: count x KB + 49 KB)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sg", type=int, default=4, help="blocks per input slice")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sg = args.sg
    rings = [tuple(map(int, r.split("x"))) for r in args.rings]
    import cupy as cp

    dev = torch.device("cuda")
    G = torch.cuda.get_device_properties(dev).multi_processor_count
    if -(-G // sg) > 64:
        raise SystemExit(f"{G} multiprocessors: more than 64 slices of {sg}")
    torch.manual_seed(0)
    shapes = [s for _ in range(args.layers) for s in LAYER]
    P = len(shapes)
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5 for n, k in shapes]
    orders = {}
    tiled = []
    for p, (n, k) in enumerate(shapes):
        key = (n, k, shapes[p - 1][0] if p else k)
        if key not in orders:
            orders[key] = tile_order(*key, G, sg, dev)
        tiled.append(ws[p].flatten()[orders[key]])
    del orders
    ys = [torch.zeros(n, device=dev, dtype=torch.bfloat16) for n, _ in shapes]
    x0 = torch.randn(4096, device=dev, dtype=torch.bfloat16)
    wptr = torch.tensor([w.data_ptr() for w in tiled], dtype=torch.int64, device=dev)
    yptr = torch.tensor([y.data_ptr() for y in ys], dtype=torch.int64, device=dev)
    Ns = torch.tensor([n for n, _ in shapes], dtype=torch.int32, device=dev)
    Ks = torch.tensor([k for _, k in shapes], dtype=torch.int32, device=dev)
    flags = torch.zeros(P * G, dtype=torch.int32, device=dev)
    rep = Report.over_weights(
        f"# dataflow product chain (no grid barriers), {torch.cuda.get_device_name()}",
        f"{args.layers} Qwen3-8B layers", ws,
        f"rows in units of {UNIT}, slices of {sg} blocks; ", args.reps)
    row = rep.row
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)  # noqa
    c = lambda t: cp.from_dlpack(t)   # noqa: E731
    modes = (("dataflow chain", True, True),
             ("without waiting for the flags (wrong values)", False, True),
             ("the tiled weight stream alone", False, False))
    for (kb, stages), (label, wait, consume) in [(r, m) for r in rings for m in modes]:
        k, smem = build(stages, kb * 1024, sg, wait, consume)

        def run():
            flags.zero_()
            with stream:
                k((G,), ((consumers(stages) + 1) * 32,),
                  (c(wptr), c(Ns), c(Ks), c(yptr), c(x0), np.int32(P), c(flags)),
                  shared_mem=smem)
        for y in ys:
            y.zero_()
        run()
        torch.cuda.synchronize()
        note = ""
        if wait:
            err = max_rel_err(list(range(min(P, 8))) + [P - 1], shapes, ws, ys, x0)
            note = f" (max rel err of products 1-8 and the last {err:.1e})"
        row(f"{label}, {G} blocks, {stages} x {kb} KB stages{note}", cuda_ms(run, args.reps))

    g = chain_graph(shapes, ws, x0, gemv)
    row("shipped `gemv`, one launch per product, PDL, CUDA graph", cuda_ms(g.replay, args.reps))
    rep.write(args.out)


if __name__ == "__main__":
    main()
