"""What the demo may assert about two runs' answers, and the float32 reference that decides it.

Greedy speculative decoding commits the target's argmax at every position, whatever the drafter
proposes. Over bit-exact K/V the paged and arena runs therefore produce the same tokens *except*
where the target's two best logits are closer than the arithmetic noise of the run: the verify
batch differs between the backends (other drafts, other accepted lengths), so its reductions run
in another order and a near-tie can break the other way. In float32 that noise is ~1e-5 and such
ties are rare; in bfloat16 (the GPU default) every activation is rounded to 8 mantissa bits and
they happen (issue 14, item 9). What holds by construction is therefore: at the first token where
two answers differ, *both* tokens are (near-)argmaxes of the target given the common prefix. The
demo checks exactly that against a float32 CPU forward of the target over the prompt plus the
common prefix, and fails if either token sits more than :data:`TIE_TOLERANCE` below the
reference maximum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: nats a committed token's float32 reference logit may sit below the reference maximum. float32
#: runs differ from the reference by reduction order only; bfloat16 / float16 runs by rounding of
#: every activation (a few tenths of a nat on this model's logits, which reach ~20).
TIE_TOLERANCE = {torch.float32: 1e-3, torch.float16: 0.25, torch.bfloat16: 1.0}


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where two answers to the same prompt first differ, and what the reference says about it."""

    turn: int
    conversation: int
    position: int            # index into the generated tokens
    tokens: tuple[int, int]  # (paged, arena)
    gaps: tuple[float, float]  # reference max logit minus each token's reference logit (nats)
    tolerance: float

    @property
    def near_tie(self) -> bool:
        return max(self.gaps) <= self.tolerance

    def as_dict(self) -> dict:
        return {"turn": self.turn, "conversation": self.conversation, "position": self.position,
                "tokens": list(self.tokens), "gaps": list(self.gaps),
                "tolerance": self.tolerance, "near_tie": self.near_tie}


class ReferenceTarget:
    """The target in float32 on the CPU, run densely (torch attention) over one sequence."""

    def __init__(self, model: str):
        from ..runtime.qwen3 import Qwen3Model
        from ..assets import resolve_model
        self.model = Qwen3Model.from_pretrained(resolve_model(model, part="target"), device="cpu",
                                                dtype=torch.float32)

    @torch.no_grad()
    def next_logits(self, ids: list[int]) -> torch.Tensor:
        """float32 logits ``[vocab]`` of the token that follows ``ids``."""
        from ..kernels.attention import plan_attention
        cfg = self.model.config
        P = 16
        T = len(ids)
        pages = -(-T // P)
        kv = torch.zeros(pages, cfg.num_hidden_layers, 2, cfg.num_key_value_heads, P,
                         cfg.head_dim, dtype=torch.float32)
        meta = plan_attention(torch.arange(pages, dtype=torch.int32)[None], [T], [T],
                              page_size=P, causal=True, num_kv_heads=cfg.num_key_value_heads,
                              num_splits=1)
        pos = torch.arange(T, dtype=torch.int64)
        hidden, _ = self.model(torch.tensor(ids, dtype=torch.int64), pos, meta, pos, kv,
                               attn_impl="torch")
        return self.model.compute_logits(hidden[-1:])[0]


def first_divergence(x: list[int], y: list[int]) -> int | None:
    """Index of the first differing token of two answers, ``None`` when they are equal."""
    if x == y:
        return None
    return next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))


def judge(ref: ReferenceTarget, prompt: list[int], x: list[int], y: list[int], k: int,
          tolerance: float, turn: int, conversation: int) -> Divergence | None:
    """The reference's verdict on answers ``x`` / ``y`` that first differ at ``k``; ``None`` when
    one answer is a strict prefix of the other (nothing to compare: a bug either way)."""
    if k >= min(len(x), len(y)):
        return None
    logits = ref.next_logits(list(prompt) + list(x[:k]))
    top = float(logits.max())
    return Divergence(turn, conversation, k, (x[k], y[k]),
                      (top - float(logits[x[k]]), top - float(logits[y[k]])), tolerance)
