"""Train the small Qwen3 target: next-byte cross-entropy on the stdlib corpus.

The model is a stock ``transformers`` ``Qwen3ForCausalLM`` (dense sdpa attention, fp32 master
weights, bf16 autocast on CUDA), saved with ``save_pretrained`` in bf16 as a standard Hugging Face
directory (``config.json`` + ``model.safetensors``) that kvstrata's loader reads, plus a
``tokenizer_config.json`` naming the byte tokenizer.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import tokenizer as tok
from ..assets.corpus import TokenStream, load_tokens
from .loop import (Clock, autocast, log, make_optimizer, optimizer_step, resolve_device,
                   seed_everything, set_lr)


@dataclass(frozen=True)
class TargetShape:
    """Architecture of the target (defaults: the shipped ``kvstrata-tiny-py`` target, ~4.8M)."""

    hidden_size: int = 256
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    rope_theta: float = 10_000.0
    max_position_embeddings: int = 4096

    def __post_init__(self) -> None:
        if self.head_dim not in (64, 128):
            raise ValueError(f"head_dim={self.head_dim}: kvstrata's kernels take 64 or 128")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.num_hidden_layers < 2:
            raise ValueError("the target needs >= 2 layers (the drafter taps inner layers)")

    def hf_config(self):
        from transformers import Qwen3Config

        return Qwen3Config(
            vocab_size=tok.VOCAB_SIZE, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            rope_theta=self.rope_theta, max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=True, rms_norm_eps=1e-6, attention_bias=False,
            bos_token_id=tok.BOS, eos_token_id=tok.EOS, pad_token_id=tok.PAD,
            use_sliding_window=False)


@dataclass(frozen=True)
class TargetTrainConfig:
    steps: int = 3000
    batch_size: int = 16
    seq_len: int = 4096             # whole windows of max_position_embeddings: positions 0..4095
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup: int = 100
    max_seconds: float = 90.0
    eval_windows: int = 32
    log_every: int = 100
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.seq_len < 2 or self.steps < 1:
            raise ValueError("batch_size >= 1, seq_len >= 2 and steps >= 1 are required")


def build_target(shape: TargetShape, seed: int):
    """A freshly initialised ``Qwen3ForCausalLM`` (fp32) with sdpa attention."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = shape.hf_config()
    cfg._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(cfg)


@torch.no_grad()
def heldout_loss(model, stream: TokenStream, windows: int, seq_len: int,
                 device: torch.device, batch: int = 16) -> dict:
    """Mean next-token CE (nats) and bits/byte over fixed held-out windows."""
    was_training = model.training
    model.eval()
    data = stream.windows(windows, seq_len + 1).to(device)
    total, count = 0.0, 0
    for i in range(0, data.shape[0], batch):
        x = data[i:i + batch]
        with autocast(device):
            logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                               x[:, 1:].reshape(-1), reduction="sum")
        total += loss.item()
        count += x[:, 1:].numel()
    model.train(was_training)
    ce = total / max(1, count)
    return {"loss": ce, "bits_per_byte": ce / math.log(2), "tokens": count}


def save_target(model, out_dir: str | os.PathLike, meta: dict | None = None) -> Path:
    """Write a bf16 Hugging Face directory (+ tokenizer_config.json, training.json)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    gen = out / "generation_config.json"
    if gen.exists():
        gen.unlink()  # defaults only; keeps the directory to config + weights
    (out / "tokenizer_config.json").write_text(json.dumps(tok.tokenizer_config(), indent=2))
    if meta is not None:
        (out / "training.json").write_text(json.dumps(meta, indent=2, default=str))
    return out


def train_target(out_dir: str | os.PathLike, *, shape: TargetShape = TargetShape(),
                 cfg: TargetTrainConfig = TargetTrainConfig(), device: str | None = None,
                 train_tokens: torch.Tensor | None = None,
                 heldout_tokens: torch.Tensor | None = None) -> dict:
    """Train the target and save it to ``out_dir``; returns the summary (also in training.json).

    ``train_tokens``/``heldout_tokens`` (``[N] int16``) default to the stdlib corpus split.
    """
    if cfg.seq_len > shape.max_position_embeddings:
        raise ValueError(f"seq_len={cfg.seq_len} exceeds max_position_embeddings="
                         f"{shape.max_position_embeddings}")
    dev = resolve_device(device)
    gen = seed_everything(cfg.seed)
    train = TokenStream(train_tokens if train_tokens is not None else load_tokens("train")).to(dev)
    held = TokenStream(heldout_tokens if heldout_tokens is not None else load_tokens("heldout"))
    model = build_target(shape, cfg.seed).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"[target] {n_params / 1e6:.2f}M params, {train.tokens.numel() / 1e6:.1f}M train tokens, "
        f"device={dev}, batch={cfg.batch_size}x{cfg.seq_len}, steps={cfg.steps}, "
        f"cap={cfg.max_seconds:.0f}s")
    opt = make_optimizer(model.parameters(), cfg.lr, cfg.weight_decay, dev)
    clock = Clock(cfg.steps, cfg.max_seconds, cfg.lr, warmup=cfg.warmup)
    model.train()
    step, loss_ema = 0, None
    while not clock.done(step):
        set_lr(opt, clock.lr_at(step))
        x = train.sample(cfg.batch_size, cfg.seq_len + 1, gen)
        with autocast(dev):
            logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                               x[:, 1:].reshape(-1))
        optimizer_step(opt, loss, model.parameters())
        step += 1
        if step % cfg.log_every == 0 or step == 1:
            lv = loss.item()
            loss_ema = lv if loss_ema is None else 0.9 * loss_ema + 0.1 * lv
            tps = step * cfg.batch_size * cfg.seq_len / clock.elapsed
            log(f"[target] step {step} loss {lv:.4f} ({lv / math.log(2):.3f} bits/byte) "
                f"lr {clock.lr_at(step):.2e} {tps / 1e6:.2f}M tok/s {clock.elapsed:.0f}s")
    train_s = clock.elapsed
    ev = heldout_loss(model, held, cfg.eval_windows, cfg.seq_len, dev)
    summary = {"params": n_params, "steps": step, "bound_by": clock.bound(step),
               "train_seconds": round(train_s, 1),
               "tokens_seen": step * cfg.batch_size * cfg.seq_len,
               "heldout_loss": round(ev["loss"], 4),
               "heldout_bits_per_byte": round(ev["bits_per_byte"], 4),
               "shape": asdict(shape), "train": asdict(cfg), "device": str(dev),
               "torch": torch.__version__}
    log(f"[target] done: {step} steps ({summary['bound_by']}) in {train_s:.0f}s; held-out loss "
        f"{ev['loss']:.4f} nats, {ev['bits_per_byte']:.4f} bits/byte")
    save_target(model, out_dir, summary)
    return summary


__all__ = ["TargetShape", "TargetTrainConfig", "build_target", "heldout_loss", "save_target",
           "train_target"]
