"""Batch-1 decode attention: what its time is made of, against reading its K/V.

Issue 13's batch-1 goals leave decode attention ~10 us per layer at 8k (1.3x its K/V's read
time) where it takes ~17. This study times, 36 layers in one CUDA graph (the runner's shape:
8 KV heads, GQA 4, d 128, bf16, pages of 16 tokens, a page-major pool), per layer:

- ``shipped``: :func:`paged_attention_triton` in the runner's 34-program split grid (split
  length read from device memory), fused merge;
- ``nomerge``: the same launch with the split merge left out (partials only; wrong output);
- ``paged_read``: the same grid reading the same K/V tiles through the block table, summing
  them (no products, no softmax, no merge): what the access pattern alone costs;
- ``paged_dots``: the same, with the two products of attention but no softmax or merge;
- ``TMA page tiles``: a prototype (``_tma_decode_proto.py``: one page of K and V per step
  through Hopper bulk tensor copies, a deep ring of stages, no masks, no merge) over grids and
  stages, with its merged output checked against the shipped kernel's;
- ``flat_read``: the same bytes per layer as one contiguous buffer, read by a plain kernel over
  a few grids: the best a one-shot read of that size does in a graph;
- the K/V bytes over the device-to-device copy rate.

``--ncu`` instead launches the shipped kernel a few times (1k and 8k decode, 8k verify-16) for
Nsight Compute to profile (``ncu --set full -k regex:paged ... decode_attn_study.py --ncu``).

    python benchmarks/decode_attn_study.py --contexts 1024 8192 --out $OUT/study.md

Results: docs/benchmarks.md, "Thirteenth runner session".
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_bench import _read_floor_kernel_src  # noqa: E402
from runner_bench import _graph_us, copy_rate  # noqa: E402

from kvstrata.kernels import attention_triton as at  # noqa: E402
from kvstrata.kernels.attention_plan import plan_attention  # noqa: E402

LAYERS, HKV, HQ, D, PAGE = 36, 8, 32, 128, 16


@triton.jit
def _paged_read_kernel(kv_ptr, bt_ptr, tps_ptr, q_ptr, out_ptr, layer_off, seq_len,
                       s_page, s_kv, s_head, s_tok, BLOCK_N: tl.constexpr,
                       DOTS: tl.constexpr, STAGES: tl.constexpr):
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    tps = tl.load(tps_ptr)
    lo = split * tps
    hi = tl.minimum(lo + tps, seq_len)
    d = tl.arange(0, 128)
    kv_base = kv_ptr + layer_off + kvh * s_head
    rows = tl.arange(0, 16)
    if DOTS:
        q = tl.load(q_ptr + (kvh * 4 + rows % 4)[:, None] * 128 + d[None, :])
        acc = tl.zeros([16, 128], tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, 128], tl.float32)
    for start in tl.range(lo, hi, BLOCK_N, num_stages=STAGES):
        offs_n = start + tl.arange(0, BLOCK_N)
        page = tl.load(bt_ptr + offs_n // 16).to(tl.int64)
        tok_off = page * s_page + (offs_n % 16).to(tl.int64) * s_tok
        v = tl.load(kv_base + s_kv + tok_off[:, None] + d[None, :])
        if DOTS:
            k = tl.load(kv_base + tok_off[None, :] + d[:, None])
            s = tl.dot(q, k)
            acc += tl.dot(s.to(tl.bfloat16), v)
        else:
            k = tl.load(kv_base + tok_off[:, None] + d[None, :])
            acc += k.to(tl.float32) + v.to(tl.float32)
    pid = kvh * tl.num_programs(2) + split
    tl.store(out_ptr + pid, tl.sum(tl.sum(acc, 1), 0))


def _runner_meta(bt: torch.Tensor, ctx: int, grid: int, qlen: int = 1):
    per = -(-(-(-ctx // grid)) // 32) * 32
    return dataclasses.replace(
        plan_attention(bt, [ctx], [qlen], page_size=PAGE, num_kv_heads=HKV, num_splits=grid),
        tokens_per_split=per, split_tokens=torch.tensor([per], device="cuda"))


def study(ctx: int, bw: float, grid: int = 34, tma_only: bool = False
          ) -> list[tuple[str, float]]:
    pages = ctx // PAGE
    kv = torch.randn((pages, LAYERS, 2, HKV, PAGE, D), dtype=torch.bfloat16, device="cuda")
    bt = torch.arange(pages, dtype=torch.int32, device="cuda")[None]
    q = torch.randn((1, HQ, D), dtype=torch.bfloat16, device="cuda")
    rows = []
    floor_us = ctx * HKV * D * 2 * 2 / bw * 1e6
    rows.append(("K/V bytes / copy rate", floor_us))
    meta = _runner_meta(bt, ctx, grid)

    def attn():
        for layer in range(LAYERS):
            at.paged_attention_triton(q, kv, layer, meta, sm_scale=0.088)
    rows.append((f"shipped ({grid} splits x {HKV} heads, split {meta.tokens_per_split})",
                 _graph_us(attn, LAYERS)))
    # The merge left out: a kernel launch that never merges (arrival counter never reaches
    # num_splits because it is pre-set far below zero each replay).
    cnt = torch.zeros(4096, dtype=torch.int32, device="cuda")

    def nomerge():
        cnt.fill_(-(1 << 30))
        for layer in range(LAYERS):
            at.paged_attention_triton(q, kv, layer, meta, sm_scale=0.088, counters=cnt)
    rows.append(("shipped without the merge (+ one fill launch)", _graph_us(nomerge, LAYERS)))
    from _tma_decode_proto import merge, tma_decode
    po, pl = tma_decode(kv, bt[0], meta.split_tokens, q, 0, ctx, grid, 4)
    live = -(-ctx // meta.tokens_per_split)
    got = merge(po.view(HKV, grid, 4, D)[:, :live].reshape(-1, 4, D),
                pl.view(HKV, grid, 4)[:, :live].reshape(-1, 4), HKV, live).reshape(HQ, D)
    want = at.paged_attention_triton(q, kv, 0, meta, sm_scale=0.088)[0].float()
    rows.append((f"TMA prototype max diff vs shipped {(got - want).abs().max().item():.1e}",
                 0.0))
    for tgrid in (16, grid, 64):
        tm = _runner_meta(bt, ctx, tgrid)
        for stages in (4, 8, 12, 16):
            def tma(stages=stages, tm=tm, tgrid=tgrid):
                for layer in range(LAYERS):
                    tma_decode(kv, bt[0], tm.split_tokens, q, layer, ctx, tgrid, stages)
            try:
                us = _graph_us(tma, LAYERS)
            except Exception as e:   # out of shared memory
                print(f"skip TMA {tgrid} {stages}: {type(e).__name__}", flush=True)
                continue
            rows.append((f"TMA page tiles (no merge), {tgrid} splits (split "
                         f"{tm.tokens_per_split}), {stages} stages", us))
    if tma_only:
        return rows
    sink = torch.empty(HKV * 256, dtype=torch.float32, device="cuda")
    for splits in (16, grid, 64):
        m = _runner_meta(bt, ctx, splits)
        for dots, block_n, stages in ((False, 64, 2), (False, 64, 3), (False, 32, 4),
                                      (True, 64, 2), (True, 64, 3), (True, 32, 3)):
            if m.tokens_per_split % block_n:
                continue

            def read(m=m, dots=dots, block_n=block_n, stages=stages):
                for layer in range(LAYERS):
                    _paged_read_kernel[(1, HKV, splits)](
                        kv, bt, m.split_tokens, q, sink, layer * kv.stride(1), ctx,
                        kv.stride(0), kv.stride(2), kv.stride(3), kv.stride(4),
                        BLOCK_N=block_n, DOTS=dots, STAGES=stages, num_warps=4,
                        num_stages=stages)
            name = "paged_dots" if dots else "paged_read"
            rows.append((f"{name} {splits} splits (split {m.tokens_per_split}), N {block_n}, "
                         f"{stages} stages", _graph_us(read, LAYERS)))
    kv = None
    nbytes = ctx * HKV * D * 2 * 2
    bufs = [torch.empty(nbytes // 4, dtype=torch.int32, device="cuda") for _ in range(LAYERS)]
    kern = _read_floor_kernel_src()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(8192, dtype=torch.int32, device="cuda")
    n = nbytes // 4
    for per_sm in (1, 2, 4):
        for block, warps, stages in ((1024, 4, 4), (2048, 8, 4), (4096, 8, 3)):
            progs = per_sm * sms
            per = -(-(-(-n // progs)) // block) * block
            progs = -(-n // per)

            def flat(per=per, progs=progs, block=block, warps=warps, stages=stages):
                for b in bufs:
                    kern[(progs,)](b, out, n, per, BLOCK=block, STAGES=stages,
                                   num_warps=warps)
            rows.append((f"flat_read {progs} programs, {block} words, {warps} warps, "
                         f"{stages} stages", _graph_us(flat, LAYERS)))
    return rows


def overlap(ctx: int, bw: float, weight_mib: tuple[int, ...] = (32, 64)
            ) -> list[tuple[str, float]]:
    """What running attention beside a weight stream buys: per layer, the shipped attention
    and a plain read of ``W`` MiB of other bytes (o_proj's weights are 32 MiB), one after the
    other on one stream, or side by side on two streams joined every layer, in one graph.
    A persistent step kernel would hide attention only as far as the side-by-side time
    approaches the read of both byte counts."""
    pages = ctx // PAGE
    kv = torch.randn((pages, LAYERS, 2, HKV, PAGE, D), dtype=torch.bfloat16, device="cuda")
    bt = torch.arange(pages, dtype=torch.int32, device="cuda")[None]
    q = torch.randn((1, HQ, D), dtype=torch.bfloat16, device="cuda")
    meta = _runner_meta(bt, ctx, 34)
    kern = _read_floor_kernel_src()
    sink = torch.empty(8192, dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kv_bytes = ctx * HKV * D * 2 * 2

    def attn_only():
        for layer in range(LAYERS):
            at.paged_attention_triton(q, kv, layer, meta, sm_scale=0.088)
    rows = [("attention alone", _graph_us(attn_only, LAYERS))]
    for mib in weight_mib:
        n = (mib << 20) // 4
        bufs = [torch.empty(n, dtype=torch.int32, device="cuda") for _ in range(LAYERS)]
        progs = 2 * sms
        per = -(-(-(-n // progs)) // 4096) * 4096
        progs = -(-n // per)

        def read(layer):
            kern[(progs,)](bufs[layer], sink, n, per, BLOCK=4096, STAGES=3, num_warps=8)

        def attn(layer):
            at.paged_attention_triton(q, kv, layer, meta, sm_scale=0.088)
        side = torch.cuda.Stream()

        def serial():
            for layer in range(LAYERS):
                attn(layer)
                read(layer)

        def parallel():
            main = torch.cuda.current_stream()
            for layer in range(LAYERS):
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    read(layer)
                attn(layer)
                main.wait_stream(side)

        def only_read():
            for layer in range(LAYERS):
                read(layer)
        floor = (kv_bytes + (mib << 20)) / bw * 1e6
        rows += [(f"{mib} MiB read alone", _graph_us(only_read, LAYERS)),
                 (f"attention then {mib} MiB read, one stream", _graph_us(serial, LAYERS)),
                 (f"attention beside {mib} MiB read, two streams", _graph_us(parallel, LAYERS)),
                 (f"K/V + {mib} MiB / copy rate", floor)]
        bufs = None
    return rows


def verify(ctx: int, bw: float) -> list[tuple[str, float]]:
    """Batch-1 verify-16 attention over ``ctx`` context tokens: the shipped split launch with
    and without its merge launch, against the TMA prototype over 16 query tokens (64 rows per
    program; no causal mask, so it is checked against torch without one)."""
    from _tma_decode_proto import merge, tma_decode
    qlen = 16
    seq = ctx + qlen
    pages = -(-seq // PAGE)
    kv = torch.randn((pages, LAYERS, 2, HKV, PAGE, D), dtype=torch.bfloat16, device="cuda")
    bt = torch.arange(pages, dtype=torch.int32, device="cuda")[None]
    q = torch.randn((qlen, HQ, D), dtype=torch.bfloat16, device="cuda")
    meta = _runner_meta(bt, seq, 34, qlen)

    def shipped():
        for layer in range(LAYERS):
            at.paged_attention_triton(q, kv, layer, meta, sm_scale=0.088)
    rows = [(f"verify-16 shipped (34 splits, split {meta.tokens_per_split}, merge launch)",
             _graph_us(shipped, LAYERS))]

    class _NoLaunch:
        def __getitem__(self, grid):
            return lambda *a, **k: None
    reduce = at._reduce_splits_kernel
    at._reduce_splits_kernel = _NoLaunch()
    try:
        rows.append(("verify-16 shipped, split launch alone", _graph_us(shipped, LAYERS)))
    finally:
        at._reduce_splits_kernel = reduce
    k = kv[:, 0, 0].permute(1, 0, 2, 3).reshape(HKV, -1, D)[:, :seq].float()
    v = kv[:, 0, 1].permute(1, 0, 2, 3).reshape(HKV, -1, D)[:, :seq].float()
    qh = q.float().view(qlen, HKV, 4, D).permute(1, 0, 2, 3).reshape(HKV, 4 * qlen, D)
    ref = torch.softmax(qh @ k.transpose(1, 2) * 0.088, -1) @ v
    for grid in (34, 64):
        tm = _runner_meta(bt, seq, grid, qlen)
        live = -(-seq // tm.tokens_per_split)
        po, pl = tma_decode(kv, bt[0], tm.split_tokens, q, 0, seq, grid, 4)
        got = merge(po.view(HKV, grid, 4 * qlen, D)[:, :live].reshape(-1, 4 * qlen, D),
                    pl.view(HKV, grid, 4 * qlen)[:, :live].reshape(-1, 4 * qlen), HKV, live)
        err = (got - ref).abs().max().item()
        for stages in (4, 8):
            def tma(stages=stages, tm=tm, grid=grid):
                for layer in range(LAYERS):
                    tma_decode(kv, bt[0], tm.split_tokens, q, layer, seq, grid, stages)
            rows.append((f"verify-16 TMA (no mask, no merge), {grid} splits (split "
                         f"{tm.tokens_per_split}), {stages} stages (max diff vs torch "
                         f"{err:.1e})", _graph_us(tma, LAYERS)))
    return rows


def ncu_launches() -> None:
    """A few launches of the shipped kernel for Nsight Compute (decode 1k, 8k; verify-16 8k)."""
    for ctx, qlen in ((1024, 1), (8192, 1), (8192, 16)):
        pages = -(-(ctx + qlen) // PAGE)
        kv = torch.randn((pages, 2, 2, HKV, PAGE, D), dtype=torch.bfloat16, device="cuda")
        bt = torch.arange(pages, dtype=torch.int32, device="cuda")[None]
        q = torch.randn((qlen, HQ, D), dtype=torch.bfloat16, device="cuda")
        meta = _runner_meta(bt, ctx + qlen - 1 if qlen > 1 else ctx, 34, qlen)
        for _ in range(3):
            at.paged_attention_triton(q, kv, 1, meta, sm_scale=0.088)
        torch.cuda.synchronize()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--overlap", action="store_true",
                    help="attention beside a weight stream (two streams) against one after "
                         "the other")
    ap.add_argument("--verify", action="store_true",
                    help="verify-16: the shipped kernel against the TMA prototype")
    ap.add_argument("--tma-only", action="store_true",
                    help="only the shipped kernel and the TMA prototype")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.ncu:
        ncu_launches()
        return 0
    bw = copy_rate()
    lines = [f"copy rate {bw / 1e12:.3f} TB/s; us per layer, 36 layers in one graph", "",
             "| context | variant | us/layer | x K/V bytes |", "|---|---|---|---|"]
    for ctx in args.contexts:
        floor = ctx * HKV * D * 2 * 2 / bw * 1e6
        rows = (overlap(ctx, bw) if args.overlap else verify(ctx, bw) if args.verify
                else study(ctx, bw, tma_only=args.tma_only))
        for name, us in rows:
            lines.append(f"| {ctx} | {name} | {us:.1f} | {us / floor:.2f} |")
            print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
