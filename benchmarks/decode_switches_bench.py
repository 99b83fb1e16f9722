"""Batch-1 decode attention (``decode_segment.decode_attention``, one CUDA launch) in several
builds of its switches, against the read floor and the Triton kernel, in one process (issue 13).

    python benchmarks/decode_switches_bench.py [--contexts 1024 8192 ...] [--variants 0:0:0 ...]

A variant is ``pages:unroll[:hwait[:warps]]`` (:func:`kvstrata.kernels.decode_segment.source`;
unroll 2: each page loaded then used; warps 8, 12 or 16 per block). Per
context one layer of a shuffled paged pool (``attention_bench.make_kv``: bf16, GQA 32/8, 128-dim
heads, 16-token pages); the read floor (``attention_bench.read_floor``, the issue's
single-launch floor) and the Triton kernel measured once, then ``--rounds`` rounds over the
variants in turn (each round's order rotated), each a CUDA-graph replay timed with CUDA events
with the L2 flushed before each run (median of ``--reps``). Each variant's output is checked
against the shipped build's (bit-equal where the pages per split are the same, else within
the Triton kernel's distance from the shipped build). Prints a markdown table: per variant the
median over rounds, its spread, and its ratio to the floor.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from attention_bench import HQ, PAGE, Timer, make_kv, read_floor
from _report import emit

from kvstrata.kernels import decode_segment as ds
from kvstrata.kernels.attention_plan import plan_attention
from kvstrata.kernels.attention_triton import paged_attention_triton

SHIPPED = ds.ATTENTION_VARIANT


def parse_variant(text: str) -> tuple[int, ...]:
    try:
        v = tuple(int(x) for x in text.split(":"))
    except ValueError:
        v = ()
    if (len(v) not in (2, 3, 4) or any(x not in (0, 1) for x in v[:3:2])
            or v[1] not in (0, 1, 2) or v[3:] not in ((), (8,), (12,), (16,))):
        raise SystemExit(f"--variants {text!r}: pages:unroll[:hwait[:warps]], pages and hwait "
                         "0 or 1, unroll 0-2, warps 8, 12 or 16, e.g. 1:2:1:12")
    return v + SHIPPED[len(v):]


def bit_equal_to_shipped(v: tuple[int, ...]) -> bool:
    """The builds that keep the shipped build's sums: the same pages per split and warps (the
    loop's unrolling and the merge's wait keep the products and their order)."""
    return v[0] == SHIPPED[0] and v[3] == SHIPPED[3]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768, 65536])
    ap.add_argument("--variants", nargs="+",
                    default=["0:0:0", "1:1:0", "1:1:1"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--out", default=None, help="also write the table here")
    args = ap.parse_args(argv)
    variants = [parse_variant(v) for v in args.variants]
    if not torch.cuda.is_available():
        raise SystemExit("decode_switches_bench: needs a CUDA device (an sm_90 GPU)")
    if SHIPPED not in variants:
        variants.insert(0, SHIPPED)
    device = torch.device("cuda")
    timer = Timer(device, args.reps)
    gen = torch.Generator(device=device).manual_seed(0)
    lines = [
        f"Device: {torch.cuda.get_device_name(device)}; torch {torch.__version__}. One layer, "
        f"bf16, GQA {HQ}/8, page {PAGE}, shuffled page table; CUDA-graph replay, L2 flushed "
        f"before each run, CUDA-event median of {args.reps}; {args.rounds} rounds over the "
        "variants (order rotated each round); a variant's cell: median over rounds (min-max), "
        "x floor. Variant = pages:unroll:hwait:warps.", "",
        "| context | floor us | Triton us | "
        + " | ".join(":".join(map(str, v)) + (" (shipped)" if v == SHIPPED else "")
                     for v in variants) + " |",
        "|---:|---:|---:|" + "---|" * len(variants)]
    for ctx in args.contexts:
        kv, bt, _, _ = make_kv(device, 1, ctx, gen)
        q = torch.randn(1, HQ, 128, dtype=torch.bfloat16, device=device, generator=gen)
        meta = plan_attention(bt, [ctx], [1], page_size=PAGE, num_kv_heads=8)
        scale = 128 ** -0.5
        floor = read_floor(timer, device, 2 * ctx * 8 * 128 * 2)
        tri_ms, tri = timer.graph_run(lambda: paged_attention_triton(q, kv, 0, meta,
                                                                     sm_scale=scale))

        def run(v):
            return ds.decode_attention(q, kv, 0, meta, sm_scale=scale, _variant=v)
        shipped = run(SHIPPED)
        tol = (tri.float() - shipped.float()).abs().max().item()
        times: dict[tuple, list[float]] = {v: [] for v in variants}
        for r in range(args.rounds):
            for v in variants[r % len(variants):] + variants[:r % len(variants)]:
                ms, out = timer.graph_run(lambda: run(v))
                err = (out.float() - shipped.float()).abs().max().item()
                if (err != 0 if bit_equal_to_shipped(v) else err > max(2 * tol, 4e-3)):
                    raise SystemExit(f"context {ctx}, variant {v}: max abs diff {err:.2e} "
                                     f"from the shipped build (Triton's: {tol:.2e})")
                times[v].append(ms * 1e3)
        cells = []
        for v in variants:
            t = times[v]
            cells.append(f"{statistics.median(t):.1f} ({min(t):.1f}-{max(t):.1f}), "
                         f"{statistics.median(t) / (floor * 1e3):.2f}x")
        lines.append(f"| {ctx} | {floor * 1e3:.1f} | {tri_ms * 1e3:.1f} | "
                     + " | ".join(cells) + " |")
        print(lines[-1], file=sys.stderr, flush=True)
        del kv, bt
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
