"""``python -m kvstrata.training OUT_DIR``: train the kvstrata-tiny-py target + DFlash drafter.

Writes ``OUT_DIR/target/`` and ``OUT_DIR/drafter/`` (config.json + model.safetensors each, plus
training.json) and ``OUT_DIR/summary.json``. ``--stage target|drafter|all`` splits or resumes a
run (the drafter stage reads ``OUT_DIR/target`` or ``--target-dir``). ``--smoke`` shrinks the
models, corpus and step counts for an end-to-end CPU check in well under a minute.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from .drafter import DrafterTrainConfig, train_drafter
from .loop import log, resolve_device
from .target import TargetShape, TargetTrainConfig, train_target

SMOKE_SHAPE = TargetShape(hidden_size=64, num_hidden_layers=4, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=64, intermediate_size=128)


def parse_args(argv=None) -> argparse.Namespace:
    t, d = TargetTrainConfig(), DrafterTrainConfig()
    p = argparse.ArgumentParser(prog="python -m kvstrata.training", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--stage", choices=("target", "drafter", "all"), default="all")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (default)")
    p.add_argument("--smoke", action="store_true", help="tiny models/corpus/steps (CPU check)")
    p.add_argument("--steps", type=int, default=None,
                   help="override both stages' step counts (e.g. --steps 20 for a smoke run)")
    p.add_argument("--target-dir", default=None, help="drafter stage: target to train against")
    stages = (("target", t), ("drafter", d))
    groups = {name: p.add_argument_group(name) for name, _ in stages}
    for name, cfg in stages:  # the options both stages have, one --<stage>-<option> each
        for opt, field, kind in (("steps", "steps", int), ("batch", "batch_size", int),
                                 ("seq-len", "seq_len", int), ("lr", "lr", float),
                                 ("max-seconds", "max_seconds", float)):
            groups[name].add_argument(f"--{name}-{opt}", type=kind, default=getattr(cfg, field))
    groups["target"].add_argument("--target-seed", type=int, default=t.seed)
    g = groups["drafter"]
    g.add_argument("--drafter-layers", type=int, default=d.num_layers)
    g.add_argument("--taps", default=None, help="comma-separated target layer ids")
    g.add_argument("--anchors", type=int, default=d.anchors)
    g.add_argument("--gamma", type=float, default=d.gamma)
    g.add_argument("--selfgen-seqs", type=int, default=d.selfgen_seqs,
                   help="target-generated training sequences (0 = corpus only)")
    g.add_argument("--selfgen-new-tokens", type=int, default=d.selfgen_new_tokens,
                   help="greedy tokens generated after each self-generation prompt")
    g.add_argument("--selfgen-mix", type=float, default=d.selfgen_mix)
    g.add_argument("--selfgen-max-seconds", type=float, default=d.selfgen_max_seconds)
    g.add_argument("--eval-prompts", type=int, default=d.eval_prompts)
    g.add_argument("--eval-new-tokens", type=int, default=d.eval_new_tokens)
    g.add_argument("--eval-prompt-lens", default=",".join(map(str, d.eval_prompt_lens)),
                   help="comma-separated prompt lengths of the dense AL-by-length evaluation")
    g.add_argument("--drafter-seed", type=int, default=d.seed)
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        dev = resolve_device(a.device)
    except ValueError as e:
        print(f"python -m kvstrata.training: error: --device: {e}", file=sys.stderr)
        return 2
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    shape = SMOKE_SHAPE if a.smoke else TargetShape()
    tcfg = TargetTrainConfig(steps=a.target_steps, batch_size=a.target_batch,
                             seq_len=a.target_seq_len, lr=a.target_lr,
                             max_seconds=a.target_max_seconds, seed=a.target_seed)
    dcfg = DrafterTrainConfig(
        steps=a.drafter_steps, batch_size=a.drafter_batch, seq_len=a.drafter_seq_len,
        lr=a.drafter_lr, max_seconds=a.drafter_max_seconds, num_layers=a.drafter_layers,
        anchors=a.anchors, gamma=a.gamma, selfgen_seqs=a.selfgen_seqs,
        selfgen_new_tokens=a.selfgen_new_tokens, selfgen_mix=a.selfgen_mix,
        selfgen_max_seconds=a.selfgen_max_seconds, eval_prompts=a.eval_prompts,
        eval_new_tokens=a.eval_new_tokens,
        eval_prompt_lens=tuple(int(x) for x in a.eval_prompt_lens.split(",") if x),
        seed=a.drafter_seed)
    train_tokens = None
    if a.smoke:
        from ..assets.corpus import load_tokens

        train_tokens = load_tokens("train")[:300_000]
        # no time caps: a busy CPU must not cut a smoke run short (the step counts bound it)
        tcfg = replace(tcfg, steps=min(tcfg.steps, 30), batch_size=4, seq_len=256, warmup=5,
                       eval_windows=4, log_every=10, max_seconds=1e9)
        dcfg = replace(dcfg, steps=min(dcfg.steps, 30), batch_size=4, seq_len=160, anchors=4,
                       num_taps=2, warmup=5, selfgen_seqs=min(dcfg.selfgen_seqs, 8),
                       selfgen_prompt_len=16, selfgen_new_tokens=48, gen_batch=4,
                       eval_prompts=4, eval_prompt_len=32, eval_new_tokens=64,
                       eval_prompt_lens=(32, 96), eval_len_prompts=2, eval_len_new_tokens=40,
                       log_every=10, max_seconds=1e9, selfgen_max_seconds=1e9)
    if a.steps is not None:
        tcfg, dcfg = replace(tcfg, steps=a.steps), replace(dcfg, steps=a.steps)
    taps = [int(x) for x in a.taps.split(",")] if a.taps else None
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    if a.stage in ("target", "all"):
        s = train_target(out / "target", shape=shape, cfg=tcfg, device=str(dev),
                         train_tokens=train_tokens)
        summary["target"] = {k: s[k] for k in ("params", "steps", "bound_by", "train_seconds",
                                                "heldout_loss", "heldout_bits_per_byte")}
        log(f"[time] target stage done at {time.perf_counter() - t0:.0f}s")
    if a.stage in ("drafter", "all"):
        target_dir = Path(a.target_dir) if a.target_dir else out / "target"
        if not (target_dir / "config.json").is_file():
            raise SystemExit(f"no target at {target_dir}: run --stage target first or pass "
                             "--target-dir")
        s = train_drafter(target_dir, out / "drafter", cfg=dcfg, device=str(dev), taps=taps,
                          train_tokens=train_tokens)
        summary["drafter"] = {k: s[k] for k in ("params", "steps", "bound_by", "train_seconds",
                                                 "total_seconds", "selfgen_seqs", "heldout_al")}
        summary["drafter"]["accept_rate"] = s["heldout_report"]["accept_rate"]
        summary["drafter"]["heldout_al_by_prompt_len"] = s["heldout_al_by_prompt_len"]
        log(f"[time] drafter stage done at {time.perf_counter() - t0:.0f}s")
    sizes = {p.parent.name: p.stat().st_size for p in out.glob("*/model.safetensors")}
    summary["weights_bytes"] = sizes
    summary_path.write_text(json.dumps(summary, indent=2))
    log(f"[summary] {json.dumps(summary)}")
    log(f"[time] total {time.perf_counter() - t0:.0f}s; weights {sum(sizes.values()) / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
