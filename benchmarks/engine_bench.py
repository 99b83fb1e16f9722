"""Engine benchmark: speculative vs plain decoding end to end, and draft/verify step times.

Two tables (markdown):

1. ``e2e``: tokens/s and acceptance length (AL) of speculative vs plain greedy decoding through
   ``LLM.generate`` at batch 1 and 16, with random tiny models (a crafted target/drafter pair that
   agrees often, so AL > 1 as with a trained drafter; random weights otherwise).
2. ``steps``: time of one draft step (drafter forward over the paged context + draft logits) and
   one verify step (target forward of B tokens per sequence, taps captured) next to a plain
   decode step (1 token per sequence), at batch 1/16/64 and context 1k/8k, with a Qwen3-8B-shaped
   random target and a DFlash-b16-shaped random drafter (``--preset 8b``; bf16). The verify/decode
   ratio says what a speculative step costs relative to a plain one.

    python benchmarks/engine_bench.py --device cpu                 # tiny, minutes on a laptop CPU
    python benchmarks/engine_bench.py --device cuda --preset 8b --out /tmp/out.md

``--target-layers`` shrinks the 8B-shaped target (fewer layers, same widths) if time or memory is
short; the table says how many layers ran.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from kvstrata.drafter import DFlashConfig, DFlashDrafter, PagedDraftAttention
from kvstrata.kernels.attention_plan import plan_attention
from kvstrata.pagepool.pool import PagePool
from kvstrata.runtime import LLM, CacheConfig, SamplingParams
from kvstrata.runtime.qwen3 import Qwen3Config, Qwen3Model

from _report import emit  # benchmarks/ is on sys.path when a script here runs

PRESETS = {
    # hidden, heads, kv heads, head_dim, intermediate, vocab, target layers, draft layers
    "tiny": dict(hidden=64, heads=4, kv=2, hd=16, inter=128, vocab=300, tl=4, dl=2, block=4),
    "8b": dict(hidden=4096, heads=32, kv=8, hd=128, inter=12288, vocab=151936, tl=36, dl=5,
               block=16),
}


def build_models(p: dict, device, dtype, target_layers=None, agree=0.0, seed=0):
    tl = target_layers or p["tl"]
    tcfg = Qwen3Config(vocab_size=p["vocab"], hidden_size=p["hidden"],
                       intermediate_size=p["inter"], num_hidden_layers=tl,
                       num_attention_heads=p["heads"], num_key_value_heads=p["kv"],
                       head_dim=p["hd"], max_position_embeddings=16384, torch_dtype="float32")
    taps = [round(1 + i * (max(tl - 4, 0)) / max(p["dl"] - 1, 1)) for i in range(p["dl"])]
    taps = [min(t, tl - 1) for t in taps]
    dcfg = DFlashConfig.from_dict(dict(
        hidden_size=p["hidden"], intermediate_size=p["inter"], num_hidden_layers=p["dl"],
        num_attention_heads=p["heads"], num_key_value_heads=p["kv"], head_dim=p["hd"],
        vocab_size=p["vocab"], max_position_embeddings=16384, block_size=p["block"],
        num_target_layers=tl,
        dflash_config={"mask_token_id": p["vocab"] - 1, "target_layer_ids": taps}))
    g = torch.Generator(device=device).manual_seed(seed)   # on the device: 8B in seconds
    with torch.device(device):
        target = Qwen3Model(tcfg).to(dtype)
        drafter = DFlashDrafter(dcfg).to(dtype)
    for m in (target, drafter):
        with torch.no_grad():
            for n, w in m.named_parameters():
                if n.endswith("norm.weight"):
                    w.fill_(1.0)
                else:
                    w.normal_(0, 0.05, generator=g)
        m.eval().requires_grad_(False)
    if agree:   # see tests/runtime/tiny_dflash.py: a shared bias direction -> frequent agreement
        with torch.no_grad():
            target.embed_tokens.weight[:, 0] = agree
            head = target.lm_head.weight if target.lm_head is not None else None
            if head is not None:
                head[:, 0] = 0
                head[[5, 17, 42], 0] = torch.tensor([3.0, 2.9, 2.8], dtype=head.dtype, device=head.device)
    drafter._fingerprint = f"bench-drafter-{seed}"
    return target, drafter


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def e2e(args, dtype) -> list[str]:
    p = PRESETS["tiny"]
    target, drafter = build_models(p, args.device, dtype, agree=args.agree)
    rows = ["| mode | batch | prompt | new tokens | tokens/s | AL | steps |",
            "|---|---|---|---|---|---|---|"]
    for batch in (1, 16):
        prompts = [[(7 * i + 13 * b) % 290 for i in range(args.prompt_len)] for b in range(batch)]
        sp = SamplingParams(max_tokens=args.new_tokens)
        res = {}
        for mode, d in (("plain", None), ("speculative", drafter)):
            cache = CacheConfig(page_size=16, max_seq_len=args.prompt_len + args.new_tokens + 16,
                                max_batch_size=batch, target_codec="identity",
                                draft_codec="identity")
            llm = LLM(target, d, cache, device=args.device)
            llm.generate(prompts[:1], SamplingParams(max_tokens=4))     # warm-up
            s0 = llm.stats()["engine"]["steps"]
            t0 = sync(args.device)
            outs = llm.generate(prompts, sp, cache_salt=f"{mode}-{batch}")
            dt = sync(args.device) - t0
            n = sum(len(o.token_ids) for o in outs)
            als = [a for o in outs for a in o.acceptance_lengths]
            res[mode] = [o.token_ids for o in outs]
            rows.append(f"| {mode} | {batch} | {args.prompt_len} | {n} | {n / dt:.1f} | "
                        f"{sum(als) / len(als):.2f} | {llm.stats()['engine']['steps'] - s0} |")
        if res["plain"] != res["speculative"]:
            raise SystemExit("speculative output differs from plain greedy output")
    return rows


def step_times(args, dtype) -> list[str]:
    p = PRESETS[args.preset]
    target, drafter = build_models(p, args.device, dtype, target_layers=args.target_layers)
    B, P, dev = p["block"], 16, args.device
    rows = [f"| batch | context | decode ms | verify ms (B={B}) | draft ms | verify/decode | "
            f"(draft+verify)/decode |", "|---|---|---|---|---|---|---|"]
    for ctx in args.contexts:
        for batch in args.batches:
            pages_per_seq = (ctx + B + P - 1) // P
            pool = PagePool([target.kv_spec(codec="identity"), drafter.kv_spec()],
                            batch * pages_per_seq, P, dev)
            for t in pool.kv.values():
                t.normal_(0, 0.5)
            bt = torch.arange(batch * pages_per_seq, dtype=torch.int32,
                              device=dev).view(batch, pages_per_seq)

            def slots_for(q):
                pos = torch.arange(ctx, ctx + q, device=dev)
                return (bt[:, pos // P].long() * P + pos % P).reshape(-1), pos.repeat(batch)

            def target_step(q):
                slots, pos = slots_for(q)
                ids = torch.randint(0, p["vocab"] - 1, (batch * q,), device=dev)
                meta = plan_attention(bt, [ctx + q] * batch, [q] * batch, page_size=P,
                                      num_kv_heads=p["kv"])
                h, cap = target(ids, pos, meta, slots, pool.kv["target"],
                                capture_layers=drafter.cfg.target_layer_ids if q > 1 else ())
                return target.compute_logits(h)

            def draft_step():
                slots, pos = slots_for(B)
                ids = torch.full((batch * B,), p["vocab"] - 1, device=dev)
                attn = PagedDraftAttention(drafter, pool.kv["draft"], bt, [ctx] * batch,
                                           [B] * batch, slots, P)
                h = drafter(target.embed(ids), pos, attn).view(batch, B, -1)[:, 1:]
                return target.compute_logits(h.reshape(-1, h.shape[-1])).argmax(-1)

            def timed(fn):
                with torch.inference_mode():
                    fn()
                    ts = []
                    for _ in range(args.iters):
                        t0 = sync(dev)
                        fn()
                        ts.append(sync(dev) - t0)
                return statistics.median(ts) * 1e3

            dec, ver, dra = timed(lambda: target_step(1)), timed(lambda: target_step(B)), \
                timed(draft_step)
            rows.append(f"| {batch} | {ctx} | {dec:.2f} | {ver:.2f} | {dra:.2f} | "
                        f"{ver / dec:.2f} | {(ver + dra) / dec:.2f} |")
            del pool
            if torch.device(dev).type == "cuda":
                torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", choices=list(PRESETS), default="tiny",
                    help="model shapes of the step-time table")
    ap.add_argument("--dtype", default=None, help="default: bf16 on cuda, fp32 on cpu")
    ap.add_argument("--target-layers", type=int, default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--agree", type=float, default=8.0,
                    help="e2e: bias that makes the random pair agree (0 = fully random, AL ~1)")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--skip-steps", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        args.dtype or ("bf16" if dev.type == "cuda" else "fp32")]
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    lines = [f"# engine benchmark ({name}, {dtype}, torch {torch.__version__})", ""]
    if not args.skip_e2e:
        lines += ["## end to end (tiny random models, greedy, page 16, block 4)", ""]
        lines += e2e(args, torch.float32 if dev.type == "cpu" else dtype) + [""]
    if not args.skip_steps:
        p = PRESETS[args.preset]
        lines += [f"## step times (preset {args.preset}: target {args.target_layers or p['tl']} "
                  f"layers x hidden {p['hidden']}, drafter {p['dl']} layers, block {p['block']}, "
                  f"vocab {p['vocab']}, page 16; median of {args.iters})", ""]
        lines += step_times(args, dtype) + [""]
    emit("\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
