"""Where a runner step's time goes (issue 13), H200: per-kernel device time of the captured
decode/verify/draft graphs, and the linear layers' shapes alone against the copy rate.

- ``--gemm``: every linear shape of the 8B-shaped target/drafter at 1 and 16 rows, ``F.linear``
  (cuBLAS) and :func:`kvstrata.kernels.gemv.gemv` over a grid of tiles (``--gemm-tiles``:
  block_n x block_k x stages); each timed as a CUDA
  graph running the product over several distinct copies of the weight (more bytes than L2
  holds), median of replays, per product. Ratio = time / (weight bytes / copy rate).
- ``--profile``: torch.profiler over replays of the runner's graphs (plain b1, speculative b1)
  at the given contexts: device time per kernel name per step, and the kernels' sum against
  the replay's own time (what is left is launch gaps inside the graph).

    python benchmarks/runner_profile.py --gemm --profile --out $OUT/profile.md
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import itertools
import os
import pstats
import sys
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from runner_bench import Bench, _graph_us, copy_rate, make_llm, pin_width, replay_ms  # noqa: E402
from engine_bench import PRESETS, build_models  # noqa: E402

from kvstrata.kernels.gemv import GemvLaunch, _gemv, gemv  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096),
          "down": (4096, 12288), "lm_head": (151936, 4096)}


def gemm_sweep(bw: float, lines: list[str], rows=(1, 16), full: bool = True,
               shapes: list[str] | None = None, hot: bool = False) -> None:
    """``hot``: also each product over one weight copy (L2-resident when it fits: what a
    weight prefetched into L2 reads at)."""
    # With a few shapes (a quicker call): no 16-row tiles and 5 stages only.
    bns, sts = ((32, 64), (5,)) if shapes else ((16, 32, 64), (3, 5))
    grid = [GemvLaunch(bn, bk, st, 4) for bn, bk, st in itertools.product(
        bns, (128, 256), sts)] if full else []
    lines += ["", f"### Linear layers alone (copy rate {bw / 1e12:.3f} TB/s)", "",
              "| shape | N x K | rows | floor us | cuBLAS us (x) | best gemv us (x) | tile | "
              "default gemv us | L2-hot gemv us |", "|---|---|---|---|---|---|---|---|---|"]
    for name, (n, k) in SHAPES.items():
        if shapes and name not in shapes:
            continue
        size = n * k * 2
        copies = max(2, min(12, -(-400_000_000 // size)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
              for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            floor = size / bw * 1e6

            def run(f):
                return _graph_us(lambda: [f(x, w) for w in ws], copies)

            ref = F.linear(x, ws[0])
            t_cublas = run(F.linear)
            best, best_lt = None, None
            for lt in grid:
                try:
                    y = _gemv(x, ws[0], None, lt)
                    err = (y.float() - ref.float()).abs().max().item()
                    if err > 0.02 * ref.float().abs().max().item() + 1e-3:
                        print(f"{name} m{m} {lt}: wrong, max err {err}", flush=True)
                        continue
                    t = run(lambda a, b: _gemv(a, b, None, lt))
                except Exception as e:  # noqa: BLE001 - tiles past the shared memory
                    print(f"{name} m{m} {lt}: {type(e).__name__}", flush=True)
                    continue
                print(f"{name} m{m} {lt}: {t:.2f} us", flush=True)
                if best is None or t < best:
                    best, best_lt = t, lt
            t_def = run(gemv)
            t_hot = _graph_us(lambda: [gemv(x, ws[0]) for _ in ws], copies) if hot else None
            print(f"{name} m{m}: default tile {t_def:.1f} us, one copy {t_hot} us", flush=True)
            if best is None:
                best, best_lt = t_def, None
            tile = ("default" if best_lt is None else
                    f"{best_lt.block_n}/{best_lt.block_k}/{best_lt.stages}/{best_lt.warps}")
            lines.append(f"| {name} | {n} x {k} | {m} | {floor:.1f} | {t_cublas:.1f} "
                         f"({t_cublas / floor:.2f}) | {best:.1f} ({best / floor:.2f}) | {tile} | "
                         f"{t_def:.1f} | {'-' if t_hot is None else f'{t_hot:.1f}'} |")
            print(lines[-1], flush=True)
        ws.clear()   # frees the copies (a del would leave the closures unbound)
        torch.cuda.empty_cache()


def gated_sweep(bw: float, lines: list[str], rows=(1, 16)) -> None:
    """gate/up with SiLU-and-multiply in the product's epilogue (``gemv(..., gated=True)``)
    against the product and ``silu_mul_merged`` as two launches."""
    from kvstrata.kernels.layer_ops import silu_mul_merged
    n, k = SHAPES["gate_up"]
    size = n * k * 2
    copies = max(2, min(12, -(-400_000_000 // size)))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    lines += ["", "### gate/up with SiLU (us per product, weights rotating past L2)", "",
              "| rows | floor | product alone | product + silu_mul_merged | gated |",
              "|---|---|---|---|---|"]
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        t_alone = _graph_us(lambda: [gemv(x, w) for w in ws], copies)
        t_sep = _graph_us(lambda: [silu_mul_merged(gemv(x, w)) for w in ws], copies)
        t_gated = _graph_us(lambda: [gemv(x, w, gated=True) for w in ws], copies)
        lines.append(f"| {m} | {size / bw * 1e6:.1f} | {t_alone:.1f} | {t_sep:.1f} | "
                     f"{t_gated:.1f} |")
        print(lines[-1], flush=True)
    ws.clear()
    torch.cuda.empty_cache()


def rope_sweep(lines: list[str], rows=(1, 16, 256, 1024),
               tiles=((1, 1), (8, 2), (8, 4), (8, 8), (4, 2), (2, 1))) -> None:
    """q/k norm + RoPE + K/V write (``qkv_norm_rope``, Qwen3-8B heads) alone, 36 launches in a
    graph, us per launch for each (heads per program, warps)."""
    from kvstrata.kernels import layer_ops
    from kvstrata.nn.layers import RotaryEmbedding
    hq, hkv, d = 32, 8, 128
    pool = torch.zeros(4096, 36, 2, hkv, 16, d, dtype=torch.bfloat16, device="cuda")
    qw = torch.rand(d, device="cuda", dtype=torch.bfloat16) + 0.5
    kw = torch.rand(d, device="cuda", dtype=torch.bfloat16) + 0.5
    lines += ["", "### q/k norm + RoPE + K/V write alone (us per launch)", "",
              "| rows | " + " | ".join(f"{h} heads / {w} warps" for h, w in tiles) + " |",
              "|---" * (len(tiles) + 1) + "|"]
    default = (layer_ops.ROPE_HEADS, layer_ops.rope_warps)
    for m in rows:
        qkv = torch.randn(m, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
        cos, sin = RotaryEmbedding(d, 1e6).to("cuda").cos_sin(torch.arange(m, device="cuda"))
        slots = torch.arange(m, device="cuda") * 3
        res = []
        for h, w in tiles:
            layer_ops.ROPE_HEADS, layer_ops.rope_warps = h, (lambda rows, w=w: w)
            res.append(_graph_us(lambda: [layer_ops.qkv_norm_rope(
                qkv, qw, kw, 1e-6, cos, sin, hq, hkv, kv_cache=pool, layer=i,
                slot_mapping=slots) for i in range(36)], 36))
        lines.append(f"| {m} | " + " | ".join(f"{t:.2f}" for t in res) + " |")
        print(lines[-1], flush=True)
    layer_ops.ROPE_HEADS, layer_ops.rope_warps = default


def kernel_table(fn, steps: int, title: str, lines: list[str], step_ms: float) -> None:
    """Per kernel name, per step: summed durations, and the kernel's share of the step's
    timeline: with programmatic dependent launch a kernel starts while the previous one runs,
    so durations overlap; walking the kernels in start order, each adds ``end - max(start,
    previous end)`` (its exposed run) and ``start - previous end`` when positive (the gap
    before it). Exposed runs and gaps sum to the device time of the step."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    tot, cnt = defaultdict(float), defaultdict(int)
    exposed, gap = defaultdict(float), defaultdict(float)
    evs = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                 key=lambda e: e.time_range.start)
    # The target's products by their place in a layer (q/k/v, o_proj, gate/up, down; o_proj
    # rides in a segment launch where one serves), counted over a replay's gemv launches in
    # order: exact when the step's other products (heads, the drafter's context write) are
    # fewer than the places and come last; else "other" and the places are approximate.
    prods = ("_gemv_kernel", "stream_gemv", "stream_rows")
    per = sum(e.name in prods for e in evs) // max(steps, 1)
    segmented = any(e.name in ("decode_segment", "verify_segment") for e in evs)
    places = ("q/k/v", "gate/up", "down") if segmented else ("q/k/v", "o_proj", "gate/up", "down")
    seen = 0
    prev_end = None
    for e in evs:
        nm = e.name if len(e.name) < 70 else e.name[:67] + "..."
        if nm in prods and per:
            i = seen % per
            seen += 1
            k = len(places)
            nm += f" [{places[i % k] if i < per - per % k else 'other'}]"
        start, end = e.time_range.start, e.time_range.end
        tot[nm] += (end - start) / steps
        cnt[nm] += 1
        if prev_end is not None:
            # A gap longer than a step's is the host between two replays, not the step's.
            g = start - prev_end
            if 0 < g < step_ms * 1e3:
                gap[nm] += g / steps
            exposed[nm] += max(0.0, end - max(start, prev_end)) / steps
        prev_end = end if prev_end is None else max(prev_end, end)
    s = sum(tot.values())
    ex = sum(exposed.values()) + sum(gap.values())
    lines += ["", f"### {title}: replay {step_ms * 1e3:.0f} us, kernels sum {s:.0f} us "
              f"({s / (step_ms * 1e3):.0%}), exposed + gaps {ex:.0f} us", "",
              "| kernel | exposed us per step | gap before us | duration us | launches |",
              "|---|---|---|---|---|"]
    for nm, t in sorted(exposed.items(), key=lambda kv: -kv[1] - gap[kv[0]])[:25]:
        lines.append(f"| `{nm}` | {t:.1f} | {gap[nm]:.1f} | {tot[nm]:.1f} | "
                     f"{cnt[nm] / steps:.0f} |")
    print("\n".join(lines[-30:]), flush=True)


def host_breakdown(bench, title: str, lines: list[str], steps: int = 20) -> None:
    """Host time of each part of a speculative step as ``Bench.step`` runs it (``perf_counter``
    around each call; the collect includes the wait for the device)."""
    run = bench.llm.runner
    parts = defaultdict(float)
    for rep in range(steps + 2):
        t = [time.perf_counter()]
        items = bench.items()
        t.append(time.perf_counter())
        h = run.submit(items)
        t.append(time.perf_counter())
        rows = run.collect(h)
        t.append(time.perf_counter())
        bench.commit(rows)
        t.append(time.perf_counter())
        if rep >= 2:
            for name, a, z in zip(("items", "submit (stage + replay calls)",
                                   "collect (waits)", "commit"), t, t[1:]):
                parts[name] += (z - a) / steps * 1e6
    lines += ["", f"### {title}: host time per step part (us)", "",
              "| " + " | ".join(parts) + " |", "|---" * len(parts) + "|",
              "| " + " | ".join(f"{v:.0f}" for v in parts.values()) + " |"]
    # and by function (cProfile over Bench.step: own time, the device wait included)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        bench.step()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(16)
    lines += ["", "```", *[ln for ln in buf.getvalue().splitlines() if ln.strip()][-18:], "```"]
    print("\n".join(lines[-26:]), flush=True)


def profile_steps(args, lines: list[str]) -> None:
    p = PRESETS["8b"]
    target, drafter = build_models(p, "cuda", torch.bfloat16)
    target._fingerprint = "bench-target-8b"
    for b in args.batches:
        for mode, d in (("plain", None), ("spec", drafter)):
            if b > 1 and d is None:
                continue   # few-rows plain decode is the batch-1 profile's; batches: the spec step
            llm = make_llm(target, d, b, max(args.contexts))
            fn = None
            for ctx in args.contexts:
                bench = Bench(llm, b, ctx, mode)
                run = llm.runner
                w = args.width if args.width in run.widths else run.widths[0]
                pin_width(llm, w)
                run._stage(bench.items(), b)
                for name in (("draft", "verify") if d is not None else ("verify",)):
                    g = run.graphs[(name, b, w)]
                    ms = replay_ms(g, 30)
                    kernel_table(g.replay, 10, f"{mode} b{b} ctx {ctx}: {name} graph"
                                 + (f" (verify width {w})" if d is not None else ""), lines, ms)
                    if ctx == args.contexts[0] and b == 1:
                        fn = run._verify_fn if name == "verify" else run._draft_fn
                        with torch.inference_mode():
                            kernel_table(lambda: fn(1), 5, f"{mode} b1 ctx {ctx}: {name} eager",
                                         lines, ms)
                if d is not None:   # the whole step: both graphs, acceptance, host work
                    host_breakdown(bench, f"{mode} b{b} ctx {ctx}", lines)
                    ms = bench.step_ms(10)
                    kernel_table(bench.step, 5, f"{mode} b{b} ctx {ctx}: step (wall {ms:.2f} ms)",
                                 lines, ms)
                bench.close()
                del bench
            llm = run = g = fn = None
            gc.collect()    # the pool must be gone before the next batch's LLM plans its own
            torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gemm", action="store_true")
    ap.add_argument("--gemm-tiles", action="store_true", help="also sweep the tile grid")
    ap.add_argument("--gemm-shapes", nargs="*", default=None, choices=sorted(SHAPES))
    ap.add_argument("--gemm-hot", action="store_true",
                    help="also each product over one (L2-resident) weight copy")
    ap.add_argument("--gated", action="store_true", help="gate/up with SiLU, alone")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--rope", action="store_true", help="q/k norm + RoPE tiles, alone")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--batches", type=int, nargs="+", default=[1],
                    help="--profile: batch 1 plain and speculative; larger: speculative")
    ap.add_argument("--width", type=int, default=None,
                    help="--profile: the verify width whose graphs and steps are profiled "
                         "(default: the full block)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = copy_rate()
    lines = [f"# runner profile, {torch.cuda.get_device_name()}, copy rate {bw / 1e12:.3f} TB/s"]
    if args.gated:
        gated_sweep(bw, lines)
    if args.rope:
        rope_sweep(lines)
    if args.profile:
        profile_steps(args, lines)
    if args.gemm:
        gemm_sweep(bw, lines, full=args.gemm_tiles, shapes=args.gemm_shapes, hot=args.gemm_hot)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
