"""EXPERIMENT (issue 13): a Triton matrix product for the batch-16/64 verify rows (M = 256,
1024) against cuBLAS, plain and with the gated SiLU epilogue, over the decoder's shapes."""

from __future__ import annotations

import os
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from runner_bench import matmul_rate  # noqa: E402

from kvstrata.kernels.layer_ops import silu_mul_merged  # noqa: E402


@triton.jit
def _mm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, s_xm, s_wn, s_om,
               GATED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               STAGES: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    # m fastest inside groups of GROUP_M: the programs sharing a weight tile run together
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    gm = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % gm
    pid_n = (pid % (GROUP_M * num_n)) // gm
    m = pid_m * BM + tl.arange(0, BM)
    n = pid_n * BN + tl.arange(0, BN)
    kk = tl.arange(0, BK)
    m_ok = m < M
    n_ok = n < N
    x_rows = x_ptr + m[:, None].to(tl.int64) * s_xm + kk[None, :]
    w_rows = w_ptr + n[:, None].to(tl.int64) * s_wn + kk[None, :]
    u_rows = w_rows + N * s_wn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = acc
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        x = tl.load(x_rows + k0, mask=m_ok[:, None], other=0.0)
        w = tl.load(w_rows + k0, mask=n_ok[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        if GATED:
            wu = tl.load(u_rows + k0, mask=n_ok[:, None], other=0.0)
            acc_u = tl.dot(x, tl.trans(wu), acc_u)
    dt = out_ptr.dtype.element_ty
    if GATED:
        gate = acc.to(dt).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
        acc = silu * acc_u.to(dt).to(tl.float32)
    tl.store(out_ptr + m[:, None].to(tl.int64) * s_om + n[None, :], acc.to(dt),
             mask=m_ok[:, None] & n_ok[None, :])


def mm(x, w, bm, bn, bk, stages, warps, gated=False, group_m=8):
    m, k = x.shape
    n = w.shape[0] // (2 if gated else 1)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _mm_kernel[grid](x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
                     GATED=gated, BM=bm, BN=bn, BK=bk, STAGES=stages, GROUP_M=group_m,
                     num_warps=warps)
    return out


def graph_us(fn, copies, reps=20):
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
    return statistics.median(ts[2:]) * 1e3 / copies


def main():
    torch.manual_seed(0)
    rate = matmul_rate()
    print(f"bf16 8192^3 rate {rate / 1e12:.0f} TFLOP/s", flush=True)
    shapes = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096),
              "down": (4096, 12288)}
    tiles = [(128, 128, 64, 4, 4), (128, 128, 64, 4, 8), (128, 256, 64, 3, 8),
             (256, 128, 64, 3, 8), (64, 128, 64, 4, 4), (64, 256, 64, 4, 4),
             (128, 64, 64, 4, 4), (128, 128, 128, 3, 8), (64, 128, 128, 3, 4),
             (128, 256, 32, 4, 8)]
    for rows in (256, 1024):
        print(f"\n### {rows} rows (us per product; floor = FLOPs / 8192^3 rate)", flush=True)
        tot_cublas, tot_best = 0.0, 0.0
        for name, (n, k) in shapes.items():
            copies = 8
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                  for _ in range(copies)]
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            floor = 2 * rows * n * k / rate * 1e6
            t_cu = graph_us(lambda: [F.linear(x, w) for w in ws], copies)
            extra = ""
            if name == "gate_up":
                t_cu_silu = graph_us(lambda: [silu_mul_merged(F.linear(x, w)) for w in ws],
                                     copies)
                extra = f" cuBLAS+silu {t_cu_silu:.1f}"
            ref = F.linear(x, ws[0])
            res = []
            for bm, bn, bk, st, wp in tiles:
                try:
                    y = mm(x, ws[0], bm, bn, bk, st, wp)
                    err = (y.float() - ref.float()).abs().max().item()
                    if err > 0.02 * ref.float().abs().max().item():
                        print(f"  {name} {bm}/{bn}/{bk}/{st}/{wp}: wrong {err}", flush=True)
                        continue
                    t = graph_us(lambda: [mm(x, w, bm, bn, bk, st, wp) for w in ws], copies)
                except Exception as e:  # noqa: BLE001 - shared memory limits
                    print(f"  {name} {bm}/{bn}/{bk}/{st}/{wp}: {type(e).__name__}", flush=True)
                    continue
                res.append((t, (bm, bn, bk, st, wp)))
            res.sort()
            t_best, cfg = res[0]
            line = (f"| {name} | {rows} | floor {floor:.1f} | cuBLAS {t_cu:.1f} | triton best "
                    f"{t_best:.1f} {cfg} | next {[(round(t, 1), c) for t, c in res[1:4]]}")
            if name == "gate_up":
                gres = []
                for bm, bn, bk, st, wp in tiles:
                    if bn > 128 and bm > 64:
                        continue
                    try:
                        y = mm(x, ws[0], bm, bn // 2 if bn > 64 else bn, bk, st, wp,
                               gated=True)
                        t = graph_us(lambda: [mm(x, w, bm, bn // 2 if bn > 64 else bn, bk,
                                                 st, wp, gated=True) for w in ws], copies)
                    except Exception as e:  # noqa: BLE001
                        print(f"  gated {bm}/{bn}: {type(e).__name__}", flush=True)
                        continue
                    gres.append((t, (bm, bn // 2 if bn > 64 else bn, bk, st, wp)))
                gres.sort()
                exp = silu_mul_merged(ref)
                got = mm(x, ws[0], *gres[0][1][:3], gres[0][1][3], gres[0][1][4], gated=True)
                gerr = (got.float() - exp.float()).abs().max().item()
                line += f"{extra} | gated best {gres[0][0]:.1f} {gres[0][1]} (err {gerr:.3g})"
                tot_cublas += t_cu_silu
                tot_best += gres[0][0]
            else:
                tot_cublas += t_cu
                tot_best += t_best
            print(line, flush=True)
        print(f"| per layer (gate/up with SiLU) | {rows} | cuBLAS {tot_cublas:.1f} | triton "
              f"{tot_best:.1f} |", flush=True)


if __name__ == "__main__":
    main()
