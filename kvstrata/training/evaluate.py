"""Dense greedy evaluation of a target + DFlash drafter pair (no paged engine needed).

:func:`acceptance_length` replays ``dflash_generate`` at temperature 0: the target's greedy
continuation of each prompt is computed once (KV-cached), then, step by step, the drafter proposes
``B-1`` tokens from a block ``[x_start, MASK...]`` that sees the target taps of positions
``< start``; the step commits the leading proposals that equal the greedy tokens plus the target's
bonus token (``produced = accepted + 1``), exactly the acceptance rule of the reference. Since
greedy speculative decoding reproduces the greedy output, the only difference to a live loop is
that the taps come from one dense pass over the final sequence instead of per-step verifies.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from .dflash_dense import DenseDFlash, gather_blocks


def load_hf_target(path: str | os.PathLike, device: torch.device):
    """A frozen ``Qwen3ForCausalLM`` from a Hugging Face directory (bf16 on CUDA, fp32 on CPU)."""
    from transformers import Qwen3ForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        model = Qwen3ForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    except TypeError:  # transformers < 4.56 spells it torch_dtype
        model = Qwen3ForCausalLM.from_pretrained(path, torch_dtype=dtype,
                                                 attn_implementation="sdpa")
    # explicit: older transformers may ignore the dtype keyword instead of raising
    model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    return model


def check_taps(model, layer_ids) -> None:
    n = model.config.num_hidden_layers
    bad = [l for l in layer_ids if not 0 <= l <= n - 2]
    if bad:
        # HF's hidden_states[n] is the final-norm output, not layer n-1's output as the paged
        # runtime captures it; refusing keeps training and inference on the same features.
        raise ValueError(f"target_layer_ids {bad} must lie in [0, {n - 2}] for a {n}-layer "
                         "target (the last layer's output is not a usable tap)")


@torch.no_grad()
def target_taps(model, ids: torch.Tensor, layer_ids) -> torch.Tensor:
    """``[b, S]`` ids -> ``[b, S, len(layer_ids)*H]``: outputs of decoder layers ``layer_ids``."""
    check_taps(model, layer_ids)
    hs = model(input_ids=ids, output_hidden_states=True).hidden_states
    return torch.cat([hs[l + 1] for l in layer_ids], dim=-1)


@torch.no_grad()
def greedy_generate(model, prompts: torch.Tensor, new_tokens: int, batch: int = 256
                    ) -> torch.Tensor:
    """Greedy continuation: ``[n, P]`` prompts (equal length) -> ``[n, P + new_tokens]``."""
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
    outs = []
    for i in range(0, prompts.shape[0], batch):
        x = prompts[i:i + batch]
        # only the last position's logits: a [batch, 4k, vocab] prefill tensor would be GBs
        out = model(input_ids=x, use_cache=True, logits_to_keep=1)
        past, seq = out.past_key_values, [x]
        nxt = out.logits[:, -1].argmax(-1)
        for _ in range(new_tokens - 1):
            seq.append(nxt[:, None])
            out = model(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1)
        seq.append(nxt[:, None])
        outs.append(torch.cat(seq, dim=1))
    return torch.cat(outs)


def draft_logits(drafter: DenseDFlash, target, ctx: torch.Tensor, ids: torch.Tensor,
                 anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafter logits ``[b, N, B-1, V]`` (float32) for blocks at ``anchors`` and their labels."""
    inputs, labels = gather_blocks(ids, anchors, drafter.block_size, drafter.mask_token_id)
    emb = target.get_input_embeddings().weight
    scale = float((drafter.config.get("dflash_config") or {}).get("input_embedding_scale", 1.0))
    hidden = drafter.forward_blocks(ctx, anchors, F.embedding(inputs, emb).to(ctx.dtype) * scale)
    head = target.get_output_embeddings().weight
    return F.linear(hidden[:, :, 1:], head.to(hidden.dtype)).float(), labels


@dataclass
class ALReport:
    mean_al: float                 # tokens committed per target step (accepted drafts + bonus)
    accept_rate: list[float]       # per draft position k=1..B-1: fraction of steps accepting it
    histogram: list[int]           # steps that committed 1..B tokens
    steps: int
    prompts: int
    new_tokens: int
    lengths: list[list[int]]       # per prompt, tokens committed at each step

    def summary(self) -> str:
        rates = " ".join(f"{r:.2f}" for r in self.accept_rate)
        return (f"greedy AL {self.mean_al:.3f} over {self.steps} steps ({self.prompts} prompts x "
                f"{self.new_tokens} new tokens); per-position acceptance: {rates}")

    def to_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def acceptance_length(target, drafter: DenseDFlash, prompts: list[list[int]], new_tokens: int,
                      gen_batch: int = 256) -> ALReport:
    """Greedy AL of ``drafter`` against ``target`` on ``prompts`` (equal-length token lists)."""
    if not prompts or len({len(p) for p in prompts}) != 1:
        raise ValueError("prompts must be a non-empty list of equal-length token lists")
    dev = next(target.parameters()).device
    was = drafter.training
    drafter.eval()
    B = drafter.block_size
    p_len = len(prompts[0])
    seqs = greedy_generate(target, torch.tensor(prompts, device=dev), new_tokens, gen_batch)
    total = seqs.shape[1]
    ctx = torch.cat([drafter.fuse(target_taps(target, seqs[i:i + 64],
                                              drafter.target_layer_ids).to(drafter.fc.weight.dtype))
                     for i in range(0, seqs.shape[0], 64)])
    start = torch.full((seqs.shape[0],), p_len, device=dev, dtype=torch.long)
    accepted_at = torch.zeros(B - 1, dtype=torch.long)
    hist = torch.zeros(B, dtype=torch.long)
    produced_sum, steps = 0, 0
    lengths: list[list[int]] = [[] for _ in prompts]
    while True:
        # a full block plus its bonus must lie inside the known greedy continuation
        act = (start + B < total).nonzero(as_tuple=True)[0]
        if act.numel() == 0:
            break
        anchors = start[act][:, None]
        logits, labels = draft_logits(drafter, target, ctx[act], seqs[act], anchors)
        ok = (logits.argmax(-1) == labels)[:, 0].long().cumprod(-1)   # [a, B-1]
        acc = ok.sum(-1)
        accepted_at += ok.sum(0).cpu()
        hist += torch.bincount(acc.cpu(), minlength=B)
        produced_sum += int((acc + 1).sum())
        steps += act.numel()
        for i, a in zip(act.tolist(), acc.tolist()):
            lengths[i].append(a + 1)
        start[act] += acc + 1
    drafter.train(was)
    if steps == 0:
        raise ValueError(f"new_tokens={new_tokens} is too short for one block of {B}")
    return ALReport(mean_al=produced_sum / steps,
                    accept_rate=[round(float(a) / steps, 4) for a in accepted_at],
                    histogram=[int(h) for h in hist], steps=steps, prompts=len(prompts),
                    new_tokens=new_tokens, lengths=lengths)


__all__ = ["ALReport", "acceptance_length", "check_taps", "draft_logits", "greedy_generate",
           "load_hf_target", "target_taps"]
