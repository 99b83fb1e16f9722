"""Train a DFlash drafter for any Hugging Face Qwen3 target directory.

Recipe (the published DFlash one): the target is frozen; its taps (outputs of decoder layers
``target_layer_ids``) of the *clean* sequence form the drafter's context; every training sequence
carries ``anchors`` random blocks ``[x_a, MASK x (B-1)]`` (all in one attention call, see
:mod:`.dflash_dense`), and block output ``k`` is trained with cross-entropy against ``x_{a+k}``,
weighted by ``exp(-(k-1)/gamma)``. Training windows are long (4,096 tokens by default) and the
corpus rows' anchors are spread over the whole window, so the drafter learns to draft from any
context length up to the target's ``max_position_embeddings``. Optionally (``selfgen_seqs > 0``)
part of the data is the target's own greedy continuation (``selfgen_new_tokens``) of
training-corpus prompts whose lengths are stratified over ``[selfgen_prompt_len, seq_len -
selfgen_new_tokens]``, with anchors only in the generated part: greedy acceptance is measured
against exactly that text, after short and long prompts alike.

Output: ``config.json`` (z-lab layout: ``block_size``, ``num_target_layers``,
``dflash_config{mask_token_id, target_layer_ids}``) and bf16 ``model.safetensors``.
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import tokenizer as tok
from ..assets.corpus import TokenStream, corpus_files, heldout_prompts, line_prompts, load_tokens
from .dflash_dense import DenseDFlash, position_weights
from .evaluate import (acceptance_length, check_taps, draft_logits, greedy_generate,
                       load_hf_target, target_taps)
from .loop import (Clock, autocast, log, make_optimizer, optimizer_step, resolve_device,
                   seed_everything, set_lr)


def spread_taps(num_target_layers: int, n: int) -> list[int]:
    """``n`` taps evenly spread over layers ``1 .. L-2`` (the last layer is never tapped)."""
    hi = num_target_layers - 2
    if n < 1 or hi < 0:
        raise ValueError(f"cannot place {n} taps in a {num_target_layers}-layer target")
    lo = min(1, hi)
    if n == 1:
        return [(lo + hi) // 2]
    taps = sorted({round(lo + i * (hi - lo) / (n - 1)) for i in range(n)})
    if len(taps) != n:
        raise ValueError(f"a {num_target_layers}-layer target has no {n} distinct usable taps")
    return taps


def drafter_config(target_config: dict, *, num_layers: int = 2, taps: list[int] | None = None,
                   num_taps: int = 4, block_size: int = 16, mask_token_id: int = tok.MASK) -> dict:
    """A z-lab-layout drafter ``config.json`` dict with target-shaped layers."""
    t = dict(target_config)
    n_target = int(t["num_hidden_layers"])
    taps = list(taps) if taps is not None else spread_taps(n_target, num_taps)
    if any(not 0 <= l <= n_target - 2 for l in taps):
        raise ValueError(f"taps {taps} must lie in [0, {n_target - 2}]")
    if not 0 <= mask_token_id < int(t["vocab_size"]):
        raise ValueError(f"mask_token_id={mask_token_id} is outside the target's vocabulary")
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    rp = t.get("rope_parameters") or {}
    theta = float(t.get("rope_theta", rp.get("rope_theta", 1_000_000.0)))
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "rms_norm_eps", "max_position_embeddings", "hidden_act")
    cfg = {k: t[k] for k in keys if k in t}
    cfg.update({
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "num_hidden_layers": num_layers, "attention_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": False, "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "layer_types": ["full_attention"] * num_layers, "use_sliding_window": False,
        "sliding_window": None, "block_size": block_size, "num_target_layers": n_target,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": taps},
        "dtype": "bfloat16"})
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    return cfg


@dataclass(frozen=True)
class DrafterTrainConfig:
    steps: int = 20000              # the time cap binds on an H200 (training.json records steps)
    batch_size: int = 16
    seq_len: int = 4096
    anchors: int = 128
    lr: float = 1.5e-3
    weight_decay: float = 0.01
    warmup: int = 100
    gamma: float = 7.0
    max_seconds: float = 280.0
    num_layers: int = 2
    num_taps: int = 4
    block_size: int = 16
    selfgen_seqs: int = 8192        # target-generated training sequences (0: corpus only)
    selfgen_prompt_len: int = 64    # shortest prompt; lengths are stratified up to the window
    selfgen_new_tokens: int = 256   # greedy tokens generated after each prompt
    selfgen_mix: float = 0.75       # fraction of each batch drawn from the self-generated set
    selfgen_max_seconds: float = 140.0
    gen_batch: int = 1024
    eval_prompts: int = 64
    eval_prompt_len: int = 128
    eval_new_tokens: int = 256
    eval_prompt_lens: tuple[int, ...] = (256, 1024, 2048, 3584)   # dense AL per prompt length
    eval_len_prompts: int = 32
    eval_len_new_tokens: int = 128
    log_every: int = 200
    seed: int = 4321

    def __post_init__(self) -> None:
        if self.seq_len < self.block_size + 2 or self.anchors < 1:
            raise ValueError(f"seq_len={self.seq_len} must exceed block_size+1 and anchors >= 1")
        if not 0.0 <= self.selfgen_mix <= 1.0:
            raise ValueError(f"selfgen_mix must be in [0, 1], got {self.selfgen_mix}")
        if self.selfgen_seqs and (self.selfgen_new_tokens < self.block_size + 1 or
                                  self.selfgen_prompt_len + self.selfgen_new_tokens
                                  > self.seq_len):
            raise ValueError(f"selfgen_new_tokens={self.selfgen_new_tokens} must exceed "
                             f"block_size={self.block_size} and selfgen_prompt_len + "
                             f"selfgen_new_tokens must fit in seq_len={self.seq_len}")


def sample_anchors(batch: int, lo: int, hi: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """``[batch, n]`` anchor positions in ``[lo, hi]`` (distinct when the range allows)."""
    span = hi - lo + 1
    if span <= 0:
        raise ValueError(f"empty anchor range [{lo}, {hi}]")
    if span >= n:
        return torch.rand(batch, span, generator=gen).argsort(-1)[:, :n] + lo
    return torch.randint(lo, hi + 1, (batch, n), generator=gen)


def block_loss(drafter: DenseDFlash, target, ids: torch.Tensor, anchors: torch.Tensor,
               weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted same-position CE and per-offset greedy match rate ``[B-1]`` (no grad)."""
    taps = target_taps(target, ids, drafter.target_layer_ids)
    ctx = drafter.fuse(taps.to(drafter.fc.weight.dtype))
    logits, labels = draft_logits(drafter, target, ctx, ids, anchors)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                         reduction="none").view(labels.shape)
    w = weights.to(ce.device)
    loss = (ce * w).sum() / (w.sum() * labels.shape[0] * labels.shape[1])
    with torch.no_grad():
        match = (logits.argmax(-1) == labels).float().cumprod(-1).mean((0, 1))
    return loss, match


@dataclass
class SelfGenerated:
    """Greedy target continuations: ``seqs [n, seq_len]`` (``PAD`` after the generated part) and
    ``prompt_len [n]`` (where each row's generated part starts)."""

    seqs: torch.Tensor
    prompt_len: torch.Tensor

    def __len__(self) -> int:
        return self.seqs.shape[0]


def selfgen_prompt_lengths(cfg: DrafterTrainConfig) -> list[int]:
    """One prompt length per generation batch, stratified over ``[selfgen_prompt_len, seq_len -
    selfgen_new_tokens]`` (batch ``k`` draws from the ``k``-th equal slice) and shuffled, so a time
    cap that stops generation early drops random strata, not the long prompts."""
    lo, hi = cfg.selfgen_prompt_len, cfg.seq_len - cfg.selfgen_new_tokens
    n = -(-cfg.selfgen_seqs // cfg.gen_batch)
    rng = random.Random(cfg.seed)
    lens = [rng.randint(lo + (hi - lo) * k // n, max(lo + (hi - lo) * k // n,
                                                     lo + (hi - lo) * (k + 1) // n - 1))
            for k in range(n)]
    rng.shuffle(lens)
    return lens


def self_generated(target, cfg: DrafterTrainConfig, device: torch.device
                   ) -> SelfGenerated | None:
    """Greedy target continuations of training-corpus prompts of stratified lengths
    (time-capped by ``selfgen_max_seconds``)."""
    if cfg.selfgen_seqs <= 0:
        return None
    t0 = time.perf_counter()
    files = corpus_files("train")
    seqs, starts = [], []
    for k, p in enumerate(selfgen_prompt_lengths(cfg)):
        n = min(cfg.gen_batch, cfg.selfgen_seqs - k * cfg.gen_batch)
        prompts = torch.tensor(line_prompts(files, n, p, cfg.seed + k), device=device)
        rows = torch.full((n, cfg.seq_len), tok.PAD, dtype=torch.long, device=device)
        rows[:, :p + cfg.selfgen_new_tokens] = greedy_generate(target, prompts,
                                                               cfg.selfgen_new_tokens, n)
        seqs.append(rows)
        starts.append(torch.full((n,), p, dtype=torch.long))
        if time.perf_counter() - t0 > cfg.selfgen_max_seconds:
            break
    out = SelfGenerated(torch.cat(seqs), torch.cat(starts))
    log(f"[drafter] self-generated {len(out)} x {cfg.selfgen_new_tokens} tokens after prompts of "
        f"{sorted(set(out.prompt_len.tolist()))} tokens in {time.perf_counter() - t0:.0f}s")
    return out


def save_drafter(drafter: DenseDFlash, out_dir: str | os.PathLike, meta: dict | None = None
                 ) -> Path:
    """``config.json`` + bf16 ``model.safetensors`` in the z-lab layout."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to(torch.bfloat16).cpu().contiguous()
          for k, v in drafter.state_dict().items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(drafter.config, indent=2))
    if meta is not None:
        (out / "training.json").write_text(json.dumps(meta, indent=2, default=str))
    return out


def load_drafter(path: str | os.PathLike, device: str | torch.device = "cpu") -> DenseDFlash:
    """A :class:`DenseDFlash` (fp32) from a z-lab-layout directory."""
    from safetensors.torch import load_file

    d = Path(path)
    if not (d / "config.json").is_file() or not (d / "model.safetensors").is_file():
        raise ValueError(f"{d} is not a drafter directory (config.json + model.safetensors)")
    model = DenseDFlash(json.loads((d / "config.json").read_text()))
    weights = load_file(str(d / "model.safetensors"))
    model.load_state_dict({k: v.float() for k, v in weights.items()})
    return model.to(device)


def train_drafter(target_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                  cfg: DrafterTrainConfig = DrafterTrainConfig(), device: str | None = None,
                  mask_token_id: int = tok.MASK, taps: list[int] | None = None,
                  train_tokens: torch.Tensor | None = None) -> dict:
    """Train a drafter for the target in ``target_dir``; save it to ``out_dir``; return a summary
    (held-out greedy AL included; also written to ``out_dir/training.json``)."""
    dev = resolve_device(device)
    gen = seed_everything(cfg.seed)
    t_start = time.perf_counter()
    target = load_hf_target(target_dir, dev)
    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    dcfg = drafter_config(tcfg, num_layers=cfg.num_layers, taps=taps, num_taps=cfg.num_taps,
                          block_size=cfg.block_size, mask_token_id=mask_token_id)
    drafter = DenseDFlash(dcfg).to(dev)
    check_taps(target, drafter.target_layer_ids)
    corpus = TokenStream(train_tokens if train_tokens is not None else load_tokens("train")).to(dev)
    selfgen = self_generated(target, cfg, dev)
    n_params = sum(p.numel() for p in drafter.parameters())
    log(f"[drafter] {n_params / 1e6:.2f}M params, taps {drafter.target_layer_ids}, block "
        f"{cfg.block_size}, batch {cfg.batch_size}x{cfg.seq_len} x {cfg.anchors} anchors, "
        f"steps={cfg.steps}, cap={cfg.max_seconds:.0f}s")
    opt = make_optimizer(drafter.parameters(), cfg.lr, cfg.weight_decay, dev)
    weights = position_weights(cfg.block_size, cfg.gamma, dev)
    n_self = 0 if selfgen is None else round(cfg.batch_size * cfg.selfgen_mix)
    clock = Clock(cfg.steps, cfg.max_seconds, cfg.lr, warmup=cfg.warmup)
    hi = cfg.seq_len - cfg.block_size
    step = 0
    while not clock.done(step):
        set_lr(opt, clock.lr_at(step))
        parts, anchors = [], []
        if n_self:
            rows = torch.randint(0, len(selfgen), (n_self,), generator=gen)
            parts.append(selfgen.seqs[rows.to(dev)])
            # anchors in the generated part only: [p, p + new_tokens - block_size] per row
            anchors.append(sample_anchors(n_self, 0, cfg.selfgen_new_tokens - cfg.block_size,
                                          cfg.anchors, gen) + selfgen.prompt_len[rows][:, None])
        if cfg.batch_size - n_self:
            parts.append(corpus.sample(cfg.batch_size - n_self, cfg.seq_len, gen))
            anchors.append(sample_anchors(cfg.batch_size - n_self, 1, hi, cfg.anchors, gen))
        ids, anc = torch.cat(parts), torch.cat(anchors).to(dev)
        with autocast(dev):
            loss, match = block_loss(drafter, target, ids, anc, weights)
        optimizer_step(opt, loss, drafter.parameters())
        step += 1
        if step % cfg.log_every == 0 or step == 1:
            log(f"[drafter] step {step} loss {loss.item():.4f} block-AL(teacher-forced) "
                f"{1 + match.sum().item():.2f} lr {clock.lr_at(step):.2e} {clock.elapsed:.0f}s")
    train_s = clock.elapsed
    with autocast(dev):
        report = acceptance_length(target, drafter,
                                   heldout_prompts(cfg.eval_prompts, cfg.eval_prompt_len, seed=0),
                                   cfg.eval_new_tokens, gen_batch=cfg.gen_batch)
        by_len = {n: acceptance_length(target, drafter,
                                       heldout_prompts(cfg.eval_len_prompts, n, seed=0),
                                       cfg.eval_len_new_tokens, gen_batch=cfg.gen_batch).mean_al
                  for n in cfg.eval_prompt_lens}
    log(f"[drafter] done: {step} steps ({clock.bound(step)}) in {train_s:.0f}s; held-out "
        f"{report.summary()}")
    log(f"[drafter] held-out greedy AL by prompt length ({cfg.eval_len_prompts} prompts x "
        f"{cfg.eval_len_new_tokens} new tokens): "
        + ", ".join(f"{n}: {al:.3f}" for n, al in by_len.items()))
    summary = {"params": n_params, "steps": step, "bound_by": clock.bound(step),
               "train_seconds": round(train_s, 1),
               "total_seconds": round(time.perf_counter() - t_start, 1),
               "selfgen_seqs": 0 if selfgen is None else len(selfgen),
               "heldout_al": round(report.mean_al, 4),
               "heldout_al_by_prompt_len": {str(n): round(al, 4) for n, al in by_len.items()},
               "heldout_report": report.to_dict(),
               "train": asdict(cfg), "target_dir": str(target_dir), "device": str(dev),
               "torch": torch.__version__}
    save_drafter(drafter, out_dir, summary)
    return summary


__all__ = ["DrafterTrainConfig", "SelfGenerated", "block_loss", "drafter_config", "load_drafter",
           "sample_anchors", "save_drafter", "self_generated", "selfgen_prompt_lengths",
           "spread_taps", "train_drafter"]
