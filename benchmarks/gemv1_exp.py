"""EXPERIMENT (issue 13): a one-row product without tensor cores (element-wise FMAs, weights
straight into registers, no shared memory) against the current gemv, over the decoder's
chain of products (q/k/v, o_proj, gate/up, down) x 36 layers in one graph under PDL."""

from __future__ import annotations

import itertools
import os
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from runner_bench import copy_rate  # noqa: E402

from kvstrata.kernels._device import gdc_launch_dependents, gdc_wait  # noqa: E402,F401
from kvstrata.kernels.gemv import gemv  # noqa: E402


@triton.jit
def _fma_tile(w_rows, x_cols, k0, n_ok, acc):
    # x read as a [BLOCK_N, BLOCK_K] tile in the weight tile's layout (rows repeat: L1 hits),
    # so no layout conversion through shared memory
    w = tl.load(w_rows + k0, mask=n_ok[:, None], other=0.0)
    xv = tl.load(x_cols + k0)
    return acc + w.to(tl.float32) * xv.to(tl.float32)


@triton.jit
def _gemv1_kernel(x_ptr, w_ptr, out_ptr, N, s_wn, K: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, PRE: tl.constexpr, UNROLL: tl.constexpr,
                  STAGES: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    kk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + n[:, None].to(tl.int64) * s_wn + kk[None, :]
    x_cols = x_ptr + kk[None, :] + 0 * n[:, None]
    KT: tl.constexpr = K // BLOCK_K
    w0 = tl.load(w_rows, mask=n_ok[:, None], other=0.0)
    w1 = w0
    w2 = w0
    w3 = w0
    if PRE >= 2:
        w1 = tl.load(w_rows + BLOCK_K, mask=n_ok[:, None], other=0.0)
    if PRE >= 3:
        w2 = tl.load(w_rows + 2 * BLOCK_K, mask=n_ok[:, None], other=0.0)
    if PRE >= 4:
        w3 = tl.load(w_rows + 3 * BLOCK_K, mask=n_ok[:, None], other=0.0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    acc = w0.to(tl.float32) * tl.load(x_cols).to(tl.float32)
    if PRE >= 2:
        acc += w1.to(tl.float32) * tl.load(x_cols + BLOCK_K).to(tl.float32)
    if PRE >= 3:
        acc += w2.to(tl.float32) * tl.load(x_cols + 2 * BLOCK_K).to(tl.float32)
    if PRE >= 4:
        acc += w3.to(tl.float32) * tl.load(x_cols + 3 * BLOCK_K).to(tl.float32)
    if UNROLL:
        for i in tl.static_range(PRE, KT):
            acc = _fma_tile(w_rows, x_cols, i * BLOCK_K, n_ok, acc)
    else:
        for k0 in tl.range(PRE * BLOCK_K, K, BLOCK_K, num_stages=STAGES):
            acc = _fma_tile(w_rows, x_cols, k0, n_ok, acc)
    tl.store(out_ptr + n, tl.sum(acc, 1).to(out_ptr.dtype.element_ty), mask=n_ok)


def gemv1(x, w, out, bn, bk, pre, unroll, stages, warps):
    n, k = w.shape
    _gemv1_kernel[(triton.cdiv(n, bn),)](x, w, out, n, w.stride(0), K=k, BLOCK_N=bn,
                                         BLOCK_K=bk, PRE=pre, UNROLL=unroll, STAGES=stages,
                                         PDL=True, launch_pdl=True, num_warps=warps)
    return out


def graph_ms(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ts = []
    for _ in range(reps + 2):
        ev[0].record()
        g.replay()
        ev[1].record()
        ev[1].synchronize()
        ts.append(ev[0].elapsed_time(ev[1]))
    return statistics.median(ts[2:])


def main():
    torch.manual_seed(0)
    bw = copy_rate()
    shapes = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]
    layers = 36
    ws = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for n, k in shapes]
          for _ in range(layers)]
    xs = {k: torch.randn(k, device="cuda", dtype=torch.bfloat16) for k in (4096, 12288)}
    outs = [torch.empty(n, device="cuda", dtype=torch.bfloat16) for n, _ in shapes]
    total = sum(n * k * 2 for n, k in shapes) * layers
    floor = total / bw * 1e3
    buf = torch.empty(total // 36 * 6, dtype=torch.uint8, device="cuda").view(torch.int64)
    t_read = graph_ms(buf.sum) / (buf.numel() * 8) * total
    buf = None
    print(f"copy {bw / 1e12:.3f} TB/s; chain {total / 1e9:.2f} GB; floor {floor:.3f} ms; "
          f"int64 sum read rate -> chain {t_read:.3f} ms", flush=True)

    def chain_cur():
        for lw in ws:
            for (n, k), w, o in zip(shapes, lw, outs):
                gemv(xs[k][None], w)

    def chain_cublas():
        for lw in ws:
            for (n, k), w, o in zip(shapes, lw, outs):
                F.linear(xs[k][None], w)

    for name, fn in (("current gemv (mma)", chain_cur), ("cuBLAS", chain_cublas)):
        t = graph_ms(fn)
        print(f"| {name} | {t:.3f} | {t / floor:.3f} |", flush=True)
    # correctness of the FMA kernel
    for (n, k) in shapes:
        w = ws[0][shapes.index((n, k))]
        ref = F.linear(xs[k][None].float(), w.float())[0]
        got = gemv1(xs[k], w, torch.empty(n, device="cuda", dtype=torch.bfloat16),
                    32, 256, 2, True, 1, 4)
        err = (got.float() - ref).abs().max().item()
        assert err < 0.02 * ref.abs().max().item() + 1e-3, (n, k, err)
    results = []
    tiles = ((16, 256), (32, 128), (32, 256), (16, 512), (64, 128))
    variants = [(bn, bk, pre, True, 1, w) for (bn, bk), pre, w in
                itertools.product(tiles, (1, 2), (4, 8))]
    variants += [(bn, bk, pre, False, st, 4) for (bn, bk), pre, st in
                 itertools.product(tiles, (1, 2), (3, 5))]
    for bn, bk, pre, unroll, stages, warps in variants:
        def chain():
            for lw in ws:
                for (n, k), w, o in zip(shapes, lw, outs):
                    gemv1(xs[k], w, o, bn, bk, pre, unroll, stages, warps)
        try:
            t = graph_ms(chain)
        except Exception as e:  # noqa: BLE001
            print(f"{bn}/{bk}/pre{pre}/{'unroll' if unroll else 'loop'}/w{warps}: "
                  f"{type(e).__name__}", flush=True)
            continue
        results.append((t, bn, bk, pre, unroll, stages, warps))
        print(f"| fma {bn}/{bk}/pre{pre}/{'unroll' if unroll else f'loop{stages}'}/w{warps} | "
              f"{t:.3f} | {t / floor:.3f} |", flush=True)
    results.sort()
    print("best:", results[:5], flush=True)
    # per shape alone for the best: 36 copies of one shape
    t, bn, bk, pre, unroll, stages, warps = results[0]
    for i, (n, k) in enumerate(shapes):
        sf = n * k * 2 * layers / bw * 1e3
        tc = graph_ms(lambda: [gemv(xs[k][None], lw[i]) for lw in ws])
        tf = graph_ms(lambda: [gemv1(xs[k], lw[i], outs[i], bn, bk, pre, unroll, stages,
                                     warps) for lw in ws])
        print(f"| {n}x{k} | floor {sf * 1e3 / layers:.1f} us | mma {tc * 1e3 / layers:.1f} | "
              f"fma {tf * 1e3 / layers:.1f} |", flush=True)


if __name__ == "__main__":
    main()
