"""Batch-1 decode attention + o_proj as one launch (``kernels.decode_segment``; with
``--queries 2-16`` the verify step's, ``kernels.verify_segment``), against the shipped kernels
(issue 13).

Times, 36 layers in one CUDA graph: the Triton path (``paged_attention_triton`` in the runner's
34-split grid, then ``gemv_add_norm``) and :func:`kvstrata.kernels.decode_segment` in variants
(``RS:RREG``: o_proj rows per block kept in shared memory; the other rows loaded into registers
after the first grid barrier), each alone and inside a layer of products (q/k/v with the norm's
row scale before it, gate/up + SiLU and down after it; no q/k norm, RoPE or K/V write). It
checks the outputs against the Triton path, and reads each variant's phases inside the graph
from per-block timestamps (``%globaltimer``, 16 slots per block): attention's partial stored, the
two grid barriers, the merge, the input and weights ready, the end; for the verify segment also
warp 0's first page in, its pages done, the split merged in the block, its PDL wait over,
every compute warp's pages done and the warps' states exchanged.

    python benchmarks/segment_proto.py --contexts 1024 8192 --out $OUT/segment.md

Results: docs/benchmarks.md, fifteenth runner session (the earlier prototype's variants too:
cp.async copies, rows loaded before the barriers, a last-arriver merge).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_attn_study import _runner_meta  # noqa: E402
from runner_bench import _graph_us, copy_rate  # noqa: E402

from kvstrata.kernels import attention_triton as at  # noqa: E402
from kvstrata.kernels import decode_segment as seg  # noqa: E402
from kvstrata.kernels import verify_segment as vseg  # noqa: E402
from kvstrata.kernels._cuda import variant  # noqa: E402
from kvstrata.kernels.attention_plan import plan_attention  # noqa: E402
from kvstrata.kernels.gemv import RowRms, gemv, gemv_add_norm  # noqa: E402

LAYERS, HKV, HQ, D, PAGE, HID, INTER = 36, 8, 32, 128, 16, 4096, 12288
EPS, SCALE = 1e-6, D ** -0.5


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--variants", nargs="+", default=None,
                    help="the kernel's switches, colon-separated, missing ones as shipped: "
                    "decode_segment RS:RREG, verify_segment NST:PREF (the kernels' source() "
                    "documents them)")
    ap.add_argument("--queries", type=int, default=1,
                    help="query tokens: 1 times kernels.decode_segment, 2-16 "
                    "kernels.verify_segment")
    ap.add_argument("--lib", choices=["decode", "verify"], default=None,
                    help="the kernel (default: decode_segment for 1 query, else verify_segment)")
    ap.add_argument("--launches", type=int, default=0,
                    help="for a profiler (ncu -k regex:segment): only launch each variant this "
                    "many times per context, eagerly, and time nothing")
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
    nq = args.queries
    use_verify = args.lib == "verify" or (args.lib is None and nq > 1)
    lib = vseg.verify_segment if use_verify else seg.decode_segment
    res = rnd(nq, HID, scale=1.0)
    gam = (1 + rnd(HID, scale=0.1).float()).to(torch.bfloat16)
    xin = rnd(nq, HID, scale=1.0)
    ss_in = torch.full((nq, 64), 64.0, device=dev)
    q_alone = rnd(nq, HQ, D, scale=1.0)
    shipped_v = (vseg if use_verify else seg).VARIANT
    if args.variants is None:
        args.variants = ["8:0", "8:1", "10:0"] if use_verify else ["16:0", "16:1", "24:0", "8:0"]
    variants = [variant(v, shipped_v, "--variants") for v in args.variants]
    knobs = "NST:PREF:WG:PDL:LAZY:SPREAD" if use_verify else "RS:RREG"
    stamps = torch.zeros(nl, seg.BLOCKS * 16, dtype=torch.int64, device=dev)
    for ctx in args.contexts:
        pages = ctx // PAGE
        kv = rnd(pages, nl, 2, HKV, PAGE, D, scale=1.0)
        bt = torch.randperm(pages, device=dev).to(torch.int32)[None]
        meta = (_runner_meta(bt, ctx, 34) if nq == 1 else
                plan_attention(bt, [ctx], [nq], page_size=PAGE, num_kv_heads=HKV))
        floor_seg = (HID * HID * 2 + ctx * HKV * D * 2 * 2) / bw * 1e6
        floor_layer = floor_seg + (6144 + 2 * INTER + INTER) * HID * 2 / bw * 1e6
        say(f"## context {ctx}: segment floor {floor_seg:.1f} us, layer floor "
            f"{floor_layer:.1f} us (o_proj + K/V; + q/k/v, gate/up, down)")
        say("")
        say("| variant | segment alone | in a layer of products |")
        say("|---|---|---|")

        def fused(layer, q, v, stamp=None):
            # the library's call in variant v, timestamps on (into stamp[layer] when given)
            return lib(q, kv, layer, meta, sm_scale=SCALE, weight=wo[layer], residual=res,
                       norm_weight=gam, eps=EPS, _variant=v,
                       _stamps=stamp[layer] if stamp is not None else stamps[0])

        def shipped(layer, q):
            a = at.paged_attention_triton(q, kv, layer, meta, sm_scale=SCALE)
            return gemv_add_norm(a.view(nq, HID), wo[layer], None, res, gam, EPS)

        def library(layer, q):
            return lib(q, kv, layer, meta, sm_scale=SCALE, weight=wo[layer], residual=res,
                       norm_weight=gam, eps=EPS)

        if args.launches:
            for v in variants:
                for _ in range(args.launches):
                    lib(q_alone, kv, 3, meta, sm_scale=SCALE, weight=wo[3], residual=res,
                        norm_weight=gam, eps=EPS, _variant=v)
            torch.cuda.synchronize()
            continue
        # correctness: layer 3, against the Triton path
        want_o, want_h, want_r = shipped(3, q_alone)
        for v in variants:
            out, hout, rr = fused(3, q_alone, v)
            torch.cuda.synchronize()
            say(f"| check {v}: out max diff "
                f"{(out.float() - want_o.float()).abs().max().item():.2e}, h "
                f"{(hout.float() - want_h.float()).abs().max().item():.2e}, row sums rel "
                f"{((rr.parts.sum() - want_r.parts.sum()) / want_r.parts.sum()).abs().item():.1e}"
                " | | |")

        def layer_chain(segment):
            def fn():
                for layer in range(nl):
                    qkv = gemv(xin, wqkv[layer], rms=RowRms(ss_in, HID, EPS))
                    o, h, rr = segment(layer, qkv[:, :HQ * D].view(nq, HQ, D))
                    a = gemv(o, wgu[layer], gated=True, rms=rr)
                    gemv_add_norm(a, wd[layer], None, h, gam, EPS)
            return fn

        def seg_fused(v, stamp=None):
            return lambda layer, q: fused(layer, q, v, stamp)

        for name, f in ((f"Triton: attention ({meta.num_splits} splits) + o_proj "
                         "`gemv_add_norm`", shipped),
                        (f"`{lib.__name__}` (the library's call, no timestamps)", library)):
            alone = _graph_us(lambda: [f(i, q_alone) for i in range(nl)], nl)
            inlayer = _graph_us(layer_chain(f), nl)
            say(f"| {name} | {alone:.1f} | {inlayer:.1f} |")
        phases = []
        for v in variants:
            alone = _graph_us(lambda: [fused(i, q_alone, v) for i in range(nl)], nl)
            inlayer = _graph_us(layer_chain(seg_fused(v)), nl)
            say(f"| one launch, {knobs} {v}, timestamps on | {alone:.1f} | {inlayer:.1f} |")
            # the phases inside the graph: every layer's blocks stamp their phases
            for name, fn in (("alone", lambda: [fused(i, q_alone, v, stamps)
                                                for i in range(nl)]),
                             ("in a layer", layer_chain(seg_fused(v, stamps)))):
                nk = 13 if use_verify else 7
                stamps.zero_()
                _graph_us(fn, nl, reps=3)
                t = stamps.view(nl, seg.BLOCKS, 16)[nl // 4: 3 * nl // 4, :, :nk].double().cpu()
                t = (t - t[:, :, 0].min(1).values[:, None, None]) / 1e3
                med = t.median(1).values.median(0).values
                last = t.max(1).values.median(0).values
                phases.append(f"| {v} {name} | " + " | ".join(
                    f"{med[k]:.1f} / {last[k]:.1f}" if t[:, :, k].min() >= 0 else "-"
                    for k in range(nk)) + " |")
        say("")
        say("Phases in the graph (us from the layer's first block start, median / last block, "
            "median over the middle half of the layers):")
        say("")
        extra = (" first page in (warp 0) | pages done (warp 0) | split merged in the block |"
                 " after the PDL wait (warp 0) | all pages done | states exchanged |"
                 if use_verify else "")
        say(f"| {knobs} | start | partial stored | barrier 1 (+ RREG loads or the "
            "prefetch issued) | merged | barrier 2 | x + weights ready (decode) or products "
            f"summed (verify) | end |{extra}")
        say("|---|---|---|---|---|---|---|---|" + ("---|" * 6 if use_verify else ""))
        for row in phases:
            say(row)
        say("")

    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
