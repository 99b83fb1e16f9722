"""Experiment (issue 13, batch-1 goals): a persistent one-row product chain against the shipped one.

At batch 1 a decoder step is a chain of dependent matrix-vector products (per Qwen3-8B layer:
q/k/v 6144x4096, o_proj 4096x4096, gate/up 24576x4096, down 4096x12288), each reading its
weight once. The shipped path launches one ``kernels.gemv`` per product, chained under PDL; a
product's programs read at most one weight tile before they wait for the previous product, so
every product pays a ramp and a tail (docs/benchmarks.md, runner sessions 3-10).

This script measures the alternative the ninth session's note proposed, as a prototype in CUDA
C++ (compiled here with NVRTC through CuPy): one persistent launch for the whole chain, one
block per multiprocessor. A producer warp streams the block's share of *every* product's weight
rows, in chain order, into a ring of shared-memory stages with Hopper bulk copies
(``cp.async.bulk`` + mbarriers); up to twelve consumer warps, each on stages of its own,
multiply them by the product's input vector, write the block's output rows and meet the other
blocks at a grid barrier before the next product. Weight loads do not depend on the barrier,
so the memory system keeps streaming the next product's rows while the blocks wait for each
other.

It is a measurement, not a kernel of the library: the products are chained as ``x_{p+1} =
y_p[:K_{p+1}]`` (no norms, SiLU, attention), the reductions use shared-memory atomics (not
bit-reproducible), and it needs sm_90. It prints, from one run: the read floor (weight bytes
over the measured copy rate); per ring size this chain, the chain without its grid barriers
and the weight stream alone (no products); the shipped ``gemv`` chain in a CUDA graph (PDL as
shipped) and cuBLAS (``F.linear``) in a CUDA graph.

    python3 benchmarks/persistent_chain.py [--layers 36] [--rings 16x12 8x24] [--out FILE]

Measured on the H200: docs/benchmarks.md, tenth runner session, part 7 (with a race in the
ring, since fixed), and the eleventh runner session (the barrier's cost, tensor-core consumers:
``--modes mma``).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from runner_bench import copy_rate  # noqa: E402

from kvstrata.kernels._cuda import cuda_source  # noqa: E402
from kvstrata.kernels.gemv import gemv  # noqa: E402

#: Qwen3-8B layer: (N, K) of q/k/v, o_proj, gate/up, down
LAYER = ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288))
CHUNK = 16384           # bytes per ring stage
MAX_CONSUMERS = 12      # consumer warps at most; the warp after them is the producer


def consumers(stages: int) -> int:
    """Consumer warps for a ring: the largest divisor of ``stages`` up to MAX_CONSUMERS. Chunk
    ``i`` goes to warp ``i mod NCONS``; with ``NCONS`` dividing ``STAGES`` every phase of a
    stage is taken by one warp, in order. (With 8 warps on 12 stages, a warp could wait on a
    stage's phase ``n`` before phase ``n - 1`` completed: ``try_wait.parity`` on the older
    parity returns at once, the warp read a stale stage and released it early. That version's
    figures, docs/benchmarks.md tenth session part 7, ran with this race.)"""
    return max(n for n in range(1, MAX_CONSUMERS + 1) if stages % n == 0)

#: Device helpers shared with ``dataflow_chain.py`` (a %-template: ``%%`` escapes): the
#: kernels' own (``kvstrata/kernels/cuda/prelude.cuh``: shared-memory addresses, mbarriers,
#: bulk copies, bf16 conversions, L2 loads) and a ring's mbarriers.
HELPERS = cuda_source("prelude.cuh", {"STAMPS": 0}).replace("%", "%%") + r"""
// Thread 0 initialises a ring's full/empty mbarriers (one arrival each); the caller then
// synchronises the block.
__device__ __forceinline__ void ring_init(u64* full, u64* empty, int stages) {
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; ++s) { mbar_init(&full[s], 1); mbar_init(&empty[s], 1); }
        mbar_fence_init();
    }
}

"""

SOURCE = r"""
#define CHUNK %(chunk)d
#define STAGES %(stages)d
#define NCONS %(ncons)d
#define MAXK 12288
#define MAXROWS 256
#define BARRIER %(barrier)d
#define CONSUME %(consume)d

""" + HELPERS + r"""
// Rows [r0, r1) of an N-row product for block c of G.
__device__ __forceinline__ void rows_of(int N, int c, int G, int* r0, int* r1) {
    *r0 = (int)(((long long)N * c) / G);
    *r1 = (int)(((long long)N * (c + 1)) / G);
}

// The consumers' start of a product: its input vector into shared memory, the row sums zeroed.
__device__ __forceinline__ void begin_product(bf16_t* xs, const bf16_t* xin, int K, float* acc,
                                              int ct) {
    for (int e = ct * 8; e < K; e += NCONS * 32 * 8)
        *(v4*)(xs + e) = ld_cg(xin + e);
    for (int r = ct; r < MAXROWS; r += NCONS * 32) acc[r] = 0.f;
    asm volatile("bar.sync 1, %%0;" :: "r"(NCONS * 32) : "memory");
}

// The consumers' end of a product: every warp's sums are in, the block's rows stored.
__device__ __forceinline__ void store_rows(const float* acc, bf16_t* y, int n, int ct) {
    asm volatile("bar.sync 1, %%0;" :: "r"(NCONS * 32) : "memory");
    for (int r = ct; r < n; r += NCONS * 32) y[r] = to_bf(acc[r]);
    asm volatile("bar.sync 1, %%0;" :: "r"(NCONS * 32) : "memory");
}

// Grid barrier: one arrival counter, ``target`` arrivals in all (every block's rows stored).
__device__ __forceinline__ void counter_barrier(u32* counter, u32 target, int ct) {
    if (ct == 0) {
        __threadfence();
        atomicAdd(counter, 1u);
        while (ld_acquire(counter) < target) { }
    }
    asm volatile("bar.sync 1, %%0;" :: "r"(NCONS * 32) : "memory");
}

extern "C" __global__ void __launch_bounds__((NCONS + 1) * 32, 1)
chain(const u64* __restrict__ wptr, const int* __restrict__ Ns, const int* __restrict__ Ks,
      const u64* __restrict__ yptr, const bf16_t* __restrict__ x0, int P, u32* counter) {
    extern __shared__ unsigned char smem[];   // 16-byte aligned: enough for v4 and bulk copies
    unsigned char* ring = smem;
    bf16_t* xs = (bf16_t*)(smem + STAGES * CHUNK);
    float* acc = (float*)(smem + STAGES * CHUNK + MAXK * 2);
    u64* full = (u64*)(smem + STAGES * CHUNK + MAXK * 2 + MAXROWS * 4);
    u64* empty = full + STAGES;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int c = blockIdx.x, G = gridDim.x;
    ring_init(full, empty, STAGES);
    __syncthreads();

    if (warp == NCONS) {                        // producer: every product's rows, in order
        if (lane == 0) {
            u32 i = 0;
            for (int p = 0; p < P; ++p) {
                int r0, r1;
                rows_of(Ns[p], c, G, &r0, &r1);
                const int K = Ks[p];
                const unsigned char* src = (const unsigned char*)wptr[p] + (u64)r0 * K * 2;
                long long left = (long long)(r1 - r0) * K * 2;
                for (; left > 0; left -= CHUNK, src += CHUNK, ++i) {
                    const u32 s = i %% STAGES, n = i / STAGES;
                    if (n > 0) mbar_wait(&empty[s], (n - 1) & 1);
                    const u32 bytes = left < CHUNK ? (u32)left : CHUNK;
                    mbar_expect(&full[s], bytes);
                    bulk_copy(sa(ring + s * CHUNK), src, bytes, &full[s]);
                }
            }
        }
        return;
    }

    // consumers: NCONS warps
    const int ct = tid;                          // 0 .. NCONS*32-1
    u32 i = 0;
    for (int p = 0; p < P; ++p) {
        const int K = Ks[p];
        int r0, r1;
        rows_of(Ns[p], c, G, &r0, &r1);
        // the product's input: x0, or the previous product's output (after the grid barrier)
        begin_product(xs, p == 0 ? x0 : (const bf16_t*)yptr[p - 1], K, acc, ct);
        long long left = (long long)(r1 - r0) * K * 2;
        int row0 = 0, col0 = 0;                  // where the chunk starts in the block's rows
        // Each chunk goes to one warp (chunk i to warp i mod NCONS), so the warps work on
        // different stages at once. A chunk (8192 elements) spans at most two rows; lane l
        // takes the 16 bytes at l * 8 + j * 256 (consecutive across the warp: no bank
        // conflicts), and each 256-element group lies in one row.
        for (; left > 0; left -= CHUNK, ++i) {
            const int nel = left < CHUNK ? (int)(left / 2) : CHUNK / 2;
            if ((int)(i %% NCONS) == warp) {
                const u32 s = i %% STAGES, n = i / STAGES;
                mbar_wait(&full[s], n & 1);
                if (CONSUME == 0) {              // the stream alone: release the stage at once
                    __syncwarp();
                    if (lane == 0) mbar_arrive(&empty[s]);
                    col0 += CHUNK / 2;
                    while (col0 >= K) { col0 -= K; ++row0; }
                    continue;
                }
                const int split = K - col0;      // first element of the second row, if any
                float sa0 = 0.f, sa1 = 0.f;
                const unsigned char* st = ring + s * CHUNK;
#pragma unroll 4
                for (int j = 0; j < CHUNK / 2 / 256; ++j) {
                    const int e = j * 256 + lane * 8;
                    if (e < nel) {
                        int col = col0 + e;
                        if (col >= K) col -= K;
                        const v4 a = *(const v4*)(st + e * 2);
                        const v4 b = *(const v4*)(xs + col);
                        const u32 aw[4] = {a.x, a.y, a.z, a.w}, bw[4] = {b.x, b.y, b.z, b.w};
                        float t = 0.f;
#pragma unroll
                        for (int h = 0; h < 4; ++h) {
                            t = fmaf(bf(aw[h] & 0xffffu), bf(bw[h] & 0xffffu), t);
                            t = fmaf(bf(aw[h] >> 16), bf(bw[h] >> 16), t);
                        }
                        if (j * 256 < split) sa0 += t; else sa1 += t;
                    }
                }
                if (CONSUME == 2) {              // the products without their reductions
                    __syncwarp();
                    if (lane == 0) mbar_arrive(&empty[s]);
                    if (sa0 + sa1 == 1.2345e30f) acc[row0] = sa0;   // keeps the FMAs
                } else {
#pragma unroll
                    for (int o = 16; o > 0; o >>= 1) {
                        sa0 += __shfl_xor_sync(0xffffffffu, sa0, o);
                        sa1 += __shfl_xor_sync(0xffffffffu, sa1, o);
                    }
                    __syncwarp();
                    if (lane == 0) {
                        mbar_arrive(&empty[s]);
                        atomicAdd(&acc[row0], sa0);
                        if (split < nel) atomicAdd(&acc[row0 + 1], sa1);
                    }
                }
            }
            col0 += CHUNK / 2;
            while (col0 >= K) { col0 -= K; ++row0; }
        }
        store_rows(acc, (bf16_t*)yptr[p] + r0, r1 - r0, ct);
        if (BARRIER == 2 && p + 1 < P) {         // flags: block c sets its own, each
            u32* f = counter + (u64)p * G;        // thread ct < G polls block ct's
            if (ct == 0) {
                __threadfence();
                asm volatile("st.release.gpu.global.u32 [%%0], %%1;" :: "l"(f + c), "r"(1u)
                             : "memory");
            }
            if (ct < G) { while (ld_acquire(f + ct) == 0) { } }
            asm volatile("bar.sync 1, %%0;" :: "r"(NCONS * 32) : "memory");
        }
        if (BARRIER == 1 && p + 1 < P)           // grid barrier: every block's rows of y_p
            counter_barrier(counter, (u32)(p + 1) * G, ct);
    }
}

// The same chain with tensor-core consumers: a stage is 8 weight rows x CW columns (8 bulk
// copies, rows CW * 2 + 64 bytes apart in shared memory: a quarter-warp's 16-byte loads of two
// rows fall in distinct banks), and a warp multiplies
// it with mma.m16n8k16 (bf16 in, fp32 out) whose A has one useful row, x. Columns are taken in
// a permuted order (the same for A and B), so a lane reads 16 contiguous bytes of its row per
// two mmas. Lanes 0-3 end with the 8 rows' partial sums (2 each).
#define CW (CHUNK / 16)
#define RSTRIDE (CW * 2 + 64)
#define STG (8 * RSTRIDE)

__device__ __forceinline__ void mma16816(float* c, u32 a0, u32 a2, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%%0, %%1, %%2, %%3}, {%%4, %%5, %%6, %%7}, {%%8, %%9}, "
                 "{%%0, %%1, %%2, %%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
}

extern "C" __global__ void __launch_bounds__((NCONS + 1) * 32, 1)
chain_mma(const u64* __restrict__ wptr, const int* __restrict__ Ns,
          const int* __restrict__ Ks, const u64* __restrict__ yptr,
          const bf16_t* __restrict__ x0, int P, u32* counter) {
    extern __shared__ unsigned char smem[];
    unsigned char* ring = smem;
    bf16_t* xs = (bf16_t*)(smem + STAGES * STG);
    float* acc = (float*)(smem + STAGES * STG + MAXK * 2);
    u64* full = (u64*)(smem + STAGES * STG + MAXK * 2 + MAXROWS * 4);
    u64* empty = full + STAGES;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int c = blockIdx.x, G = gridDim.x;
    ring_init(full, empty, STAGES);
    __syncthreads();

    if (warp == NCONS) {      // producer: per product, row groups of 8, column chunks of CW
        if (lane == 0) {
            u32 i = 0;
            for (int p = 0; p < P; ++p) {
                int r0, r1;
                rows_of(Ns[p], c, G, &r0, &r1);
                const int K = Ks[p];
                const bf16_t* w = (const bf16_t*)wptr[p];
                for (int g0 = r0; g0 < r1; g0 += 8) {
                    const int nr = min(8, r1 - g0);
                    for (int k0 = 0; k0 < K; k0 += CW, ++i) {
                        const u32 s = i %% STAGES, n = i / STAGES;
                        if (n > 0) mbar_wait(&empty[s], (n - 1) & 1);
                        mbar_expect(&full[s], (u32)(nr * CW * 2));
                        for (int r = 0; r < nr; ++r)
                            bulk_copy(sa(ring + s * STG + r * RSTRIDE),
                                      w + (u64)(g0 + r) * K + k0, CW * 2, &full[s]);
                    }
                }
            }
        }
        return;
    }

    const int ct = tid, g = lane >> 2, q = lane & 3;
    u32 i = 0;
    for (int p = 0; p < P; ++p) {
        const int K = Ks[p];
        int r0, r1;
        rows_of(Ns[p], c, G, &r0, &r1);
        begin_product(xs, p == 0 ? x0 : (const bf16_t*)yptr[p - 1], K, acc, ct);
        for (int g0 = r0; g0 < r1; g0 += 8) {
            const int nr = min(8, r1 - g0);
            for (int k0 = 0; k0 < K; k0 += CW, ++i) {
                if ((int)(i %% NCONS) != warp) continue;
                const u32 s = i %% STAGES, n = i / STAGES;
                mbar_wait(&full[s], n & 1);
                if (CONSUME) {
                    float cc[4] = {0.f, 0.f, 0.f, 0.f};
                    const unsigned char* row = ring + s * STG + g * RSTRIDE + q * 16;
                    const bf16_t* xq = xs + k0 + q * 8;
#pragma unroll 4
                    for (int kk = 0; kk < CW; kk += 32) {
                        const v4 b = *(const v4*)(row + kk * 2);
                        v4 a = {0u, 0u, 0u, 0u};
                        if (g == 0) a = *(const v4*)(xq + kk);
                        mma16816(cc, a.x, a.y, b.x, b.y);
                        mma16816(cc, a.z, a.w, b.z, b.w);
                    }
                    __syncwarp();
                    if (lane == 0) mbar_arrive(&empty[s]);
                    if (g == 0) {     // rows 2q, 2q + 1 of the group
                        if (2 * q < nr) atomicAdd(&acc[g0 - r0 + 2 * q], cc[0]);
                        if (2 * q + 1 < nr) atomicAdd(&acc[g0 - r0 + 2 * q + 1], cc[1]);
                    }
                } else {
                    __syncwarp();
                    if (lane == 0) mbar_arrive(&empty[s]);
                }
            }
        }
        store_rows(acc, (bf16_t*)yptr[p] + r0, r1 - r0, ct);
        if (BARRIER == 1 && p + 1 < P) counter_barrier(counter, (u32)(p + 1) * G, ct);
    }
}
"""


def build(stages: int, barrier: int = 1, chunk: int = CHUNK, consume: int = 1,
          mma: bool = False):
    """barrier: 0 none, 1 one arrival counter, 2 a flag per (product, block); consume: 0 the
    stream alone, 1 the products, 2 the products without their reductions (wrong values);
    mma: the tensor-core kernel (``chain_mma``: barriers 0/1, consume 0/1)."""
    import cupy as cp
    name = "chain_mma" if mma else "chain"
    src = SOURCE % {"chunk": chunk, "stages": stages, "ncons": consumers(stages),
                    "barrier": barrier, "consume": consume}
    try:
        mod = cp.RawModule(code=src, options=("-std=c++17",), backend="nvrtc")
        k = mod.get_function(name)
    except Exception as e:    # noqa: BLE001 - the image's nvcc instead
        print(f"NVRTC: {str(e).splitlines()[0][:200]}; building with nvcc", flush=True)
        mod = cp.RawModule(code=src, options=("-std=c++17", "-arch=sm_90"), backend="nvcc")
        k = mod.get_function(name)
    smem = smem_bytes(stages, chunk, mma)
    k.max_dynamic_shared_size_bytes = smem
    return k, smem


def smem_bytes(stages: int, chunk: int, mma: bool) -> int:
    """Dynamic shared memory of a ring: stages (the mma stages' rows padded by 64 bytes), the
    input vector, the row sums and the mbarriers."""
    stage = chunk + 512 if mma else chunk
    return stages * stage + 12288 * 2 + 256 * 4 + 2 * stages * 8


def cuda_ms(fn, reps: int) -> float:
    """Median of ``reps`` CUDA-event timings of ``fn`` (after one untimed call)."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    fn()
    torch.cuda.synchronize()
    t = []
    for _ in range(reps):
        ev[0].record()
        fn()
        ev[1].record()
        ev[1].synchronize()
        t.append(ev[0].elapsed_time(ev[1]))
    return float(np.median(t))


class Report:
    """The chain scripts' table: each row in ms and against the read floor, printed as it
    comes; :meth:`write` saves the markdown."""

    def __init__(self, head: list[str], floor: float):
        self.floor = floor
        self.lines = head + ["", "| chain | ms | x floor |", "|---|---|---|"]

    @classmethod
    def over_weights(cls, title: str, layers: str, ws, notes: str, reps: int) -> "Report":
        """A chain's report: ``title``; the weights' bytes, the copy rate measured now and the
        read floor (``notes`` after them, then the repetitions); the floor as the first row."""
        nbytes = sum(w.numel() * 2 for w in ws)
        bw = copy_rate()
        floor = nbytes / bw * 1e3
        rep = cls([title, "", f"{layers}, weights {nbytes / 1e9:.2f} GB, copy rate "
                   f"{bw / 1e12:.3f} TB/s, read floor {floor:.3f} ms; {notes}CUDA-event "
                   f"medians of {reps}"], floor)
        rep.row("read floor", floor)
        return rep

    def row(self, name: str, ms: float) -> None:
        self.lines.append(f"| {name} | {ms:.3f} | {ms / self.floor:.3f} |")
        print(self.lines[-1], flush=True)

    def write(self, path: str | None) -> None:
        if path:
            with open(path, "w") as f:
                f.write("\n".join(self.lines) + "\n")


def chain_graph(shapes, ws, x0, prod) -> torch.cuda.CUDAGraph:
    """The products chained as the kernels chain them (``x_{p+1} = y_p[:K_{p+1}]``, each
    ``prod(x, w)``), captured as one CUDA graph (warmed up on a side stream)."""
    outs = [None] * len(ws)

    def fn():
        x = x0[None]
        for p, ((_, k), w) in enumerate(zip(shapes, ws)):
            outs[p] = prod(x[:, :k], w)
            x = outs[p]
    with torch.inference_mode():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
    g.outs = outs          # the graph's outputs stay alive with it
    return g


def max_rel_err(ps, shapes, ws, ys, x0) -> float:
    """The largest error of products ``ps`` relative to their largest value, each against
    torch on the kernel's own input (``x0``, else the previous product's output)."""
    err = 0.0
    for p in ps:
        xin = x0 if p == 0 else ys[p - 1]
        want = F.linear(xin[None, :shapes[p][1]].float(), ws[p].float())[0]
        err = max(err, (ys[p].float() - want).abs().max().item()
                  / max(want.abs().max().item(), 1e-6))
    return err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--rings", nargs="+", default=["16x12", "8x24", "8x12"],
                    help="ring stages as KBxCOUNT (8 or 16 KB: a stage spans at most two "
                         "weight rows)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--modes", choices=("all", "fma", "mma"), default="all",
                    help="the FMA consumers' modes, the tensor-core ones, or both")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    try:
        rings = [tuple(map(int, r.split("x"))) for r in args.rings]
    except ValueError:
        ap.error(f"--rings {args.rings}: KBxCOUNT, e.g. 16x12")
    if any(kb not in (8, 16) or n < 2 for kb, n in rings):
        ap.error(f"--rings {args.rings}: 8 or 16 KB stages (a stage spans at most two weight "
                 "rows), at least 2 of them")
    import cupy as cp

    dev = torch.device("cuda")
    torch.manual_seed(0)
    shapes = [s for _ in range(args.layers) for s in LAYER]
    P = len(shapes)
    # weights ~ N(0, 1/K): the chained vector stays O(1)
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5 for n, k in shapes]
    ys = [torch.zeros(n, device=dev, dtype=torch.bfloat16) for n, _ in shapes]
    x0 = torch.randn(4096, device=dev, dtype=torch.bfloat16)
    wptr = torch.tensor([w.data_ptr() for w in ws], dtype=torch.int64, device=dev)
    yptr = torch.tensor([y.data_ptr() for y in ys], dtype=torch.int64, device=dev)
    Ns = torch.tensor([n for n, _ in shapes], dtype=torch.int32, device=dev)
    Ks = torch.tensor([k for _, k in shapes], dtype=torch.int32, device=dev)
    G = torch.cuda.get_device_properties(dev).multi_processor_count
    # sm_90's opt-in limit per block (227 KB) where torch does not report it
    limit = getattr(torch.cuda.get_device_properties(dev), "shared_memory_per_block_optin",
                    232448)
    counter = torch.zeros(P * G, dtype=torch.int32, device=dev)   # the counter, or the flags
    no_rows = torch.zeros_like(Ns)
    rep = Report.over_weights(
        f"# persistent one-row product chain, {torch.cuda.get_device_name()}",
        f"{args.layers} Qwen3-8B layers (q/k/v, o_proj, gate/up, down)", ws, "", args.reps)
    row = rep.row
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)  # noqa
    c = lambda t: cp.from_dlpack(t)   # noqa: E731
    # per ring: the chain (grid barrier by one counter, or by per-block flags); without the
    # barriers (the products alone, then without their reductions); the weight stream alone;
    # and the barriers alone (no weight rows: each product's input reload and barrier)
    modes = (("chain, one arrival counter", 1, 1, Ns, False),
             ("chain, a flag per block", 2, 1, Ns, False),
             ("no grid barriers (wrong values): the products", 0, 1, Ns, False),
             ("no grid barriers, the products without their reductions", 0, 2, Ns, False),
             ("the weight stream alone (bulk copies into the ring)", 0, 0, Ns, False),
             ("no weight rows: input reloads + counter barriers", 1, 1, no_rows, False),
             ("no weight rows: input reloads + flag barriers", 2, 1, no_rows, False),
             ("tensor cores (8 rows x 1/16 of the stage's bytes per row), one arrival counter",
              1, 1, Ns, True),
             ("tensor cores, no grid barriers (wrong values)", 0, 1, Ns, True),
             ("tensor cores' layout, the weight stream alone", 0, 0, Ns, True))
    modes = tuple(m for m in modes if args.modes == "all" or m[4] == (args.modes == "mma"))
    for (kb, stages), (label, barrier, consume, ns, mma) in [(r, m) for r in rings
                                                            for m in modes]:
        chunk = kb * 1024
        if smem_bytes(stages, chunk, mma) > limit:
            print(f"{label}, {stages} x {kb} KB stages: needs "
                  f"{smem_bytes(stages, chunk, mma)} bytes of shared memory, the block has "
                  f"{limit}: skipped", flush=True)
            continue
        k, smem = build(stages, barrier, chunk, consume, mma)

        def run():
            counter.zero_()
            with stream:
                k((G,), ((consumers(stages) + 1) * 32,),
                  (c(wptr), c(ns), c(Ks), c(yptr), c(x0), np.int32(P), c(counter)),
                  shared_mem=smem)
        run()
        torch.cuda.synchronize()
        # each product against torch on the kernel's own input (its rounding differs)
        err = None
        if barrier and ns is Ns:
            err = max_rel_err(range(min(P, 8)), shapes, ws, ys, x0)
        note = "" if err is None else f" (max rel err of the first 8 products {err:.1e})"
        row(f"{label}, {G} blocks, {stages} x {kb} KB stages{note}", cuda_ms(run, args.reps))

    g = chain_graph(shapes, ws, x0, gemv)
    row("shipped `gemv`, one launch per product, PDL, CUDA graph", cuda_ms(g.replay, args.reps))
    g = chain_graph(shapes, ws, x0, F.linear)
    row("cuBLAS (`F.linear`), CUDA graph", cuda_ms(g.replay, args.reps))
    rep.write(args.out)


if __name__ == "__main__":
    main()
