"""Sampling parameters, sampling distributions and speculative acceptance.

Acceptance follows the DFlash reference: greedy accepts drafts while they equal the target's argmax
and appends the target's token at the first mismatch (the bonus); at temperature > 0 it runs
rejection sampling (accept draft ``x`` with probability ``min(1, p(x)/q(x))``, resample the first
rejected position from ``max(p - q, 0)``), which leaves the output distributed exactly as the
target's sampling distribution ``p`` (after temperature, top-k and top-p).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings (vLLM's names and meanings).

    ``temperature == 0`` is greedy. ``top_k == 0`` and ``top_p == 1`` disable those filters.
    ``seed`` makes a sampled request reproducible on its own.

    Stopping: generation ends at the target's end-of-sequence ids (from its ``config.json`` /
    ``generation_config.json``) unless ``ignore_eos``; at any of ``stop_token_ids`` (kept as the
    last output token); or at any of the ``stop`` strings (the output text ends before the stop
    string; the token that completed it is the last output token). None of these can end a
    request before ``min_tokens`` tokens were generated.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    min_tokens: int = 0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or \
                self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _real(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got "
                             f"{self.temperature!r}")
        if not _real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        stops = tuple(self.stop_token_ids or ())
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in stops):
            raise ValueError(f"stop_token_ids must be non-negative token ids, got {stops!r}")
        object.__setattr__(self, "stop_token_ids", stops)
        strs = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(x, str) or not x for x in strs):
            raise ValueError(f"stop must be a non-empty string or a list of them, got "
                             f"{self.stop!r}")
        object.__setattr__(self, "stop", strs)
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or \
                not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}]"
                             f", got {self.min_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def sampling_probs(logits: Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0
                   ) -> Tensor:
    """``[..., V]`` logits -> float32 probabilities after temperature, top-k, then top-p.

    top-p keeps the smallest prefix of the sorted distribution whose mass reaches ``top_p``
    (a token is kept if the mass *before* it is below ``top_p``), as the reference does.
    """
    scores = logits.float() / temperature
    V = scores.shape[-1]
    if 0 < top_k < V:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        sp, order = probs.sort(dim=-1, descending=True)
        keep = sp.cumsum(-1) - sp < top_p
        sp = sp * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sp)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_from(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One draw per row of ``[..., V]`` probabilities."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def greedy_accept(drafts: list[int], target_argmax: list[int]) -> tuple[int, int]:
    """``(accepted drafts, bonus token)``: drafts ``[k]``, target argmax of the ``k+1`` rows."""
    n = 0
    while n < len(drafts) and drafts[n] == target_argmax[n]:
        n += 1
    return n, target_argmax[n]


def rejection_accept(drafts: Tensor, target_probs: Tensor, draft_probs: Tensor,
                     generator: torch.Generator | None) -> tuple[int, int]:
    """Speculative rejection sampling for one sequence.

    drafts: ``[k]`` int64 draft tokens; target_probs: ``[k+1, V]``; draft_probs: ``[k, V]`` (the
    distribution each draft was sampled from). Returns ``(accepted, next token)``.
    """
    k = drafts.shape[0]
    if k:
        idx = drafts[:, None]
        p = target_probs[:k].gather(-1, idx)[:, 0]
        q = draft_probs.gather(-1, idx)[:, 0]
        u = torch.rand(k, generator=generator, device=p.device)
        ok = (u * q < p).to(torch.int32)
        acc = int(ok.cumprod(0).sum())
    else:
        acc = 0
    if acc == k:
        return acc, int(sample_from(target_probs[k], generator))
    residual = (target_probs[acc] - draft_probs[acc]).clamp_min(0)
    total = residual.sum()
    # p == q on the draft's support leaves no residual mass; then p itself is the right law.
    dist = residual / total if float(total) > 0 else target_probs[acc]
    return acc, int(sample_from(dist, generator))
