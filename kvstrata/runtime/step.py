"""What the engine hands the model runner for one step, and what the runner times."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import SamplingParams


@dataclass(slots=True)
class StepItem:
    """One scheduled sequence of a step, as the engine hands it to the runner.

    Attributes:
        seq_id: the manager's sequence id (its pages are reserved for ``start + n`` tokens).
        start: tokens whose K/V is committed before this step (= the first position computed).
        n: positions computed this step (decode: the verify block length; prefill: the chunk).
        tokens: decode: ``[pending token]`` (verified, K/V not yet written); prefill: the
            chunk's ``n`` prompt tokens.
        decode: a generating sequence (verify block) or a prompt chunk.
        sample: prefill only: the chunk ends the prompt, so its last row's token is sampled.
        params, generator: the request's sampling settings and RNG (``None``: the runner's).
        banned, banned_rows: token ids masked out of the first ``banned_rows`` rows whose
            logits this item uses (``min_tokens``: stop ids cannot end a request early).
    """

    seq_id: object
    start: int
    n: int
    tokens: list[int]
    decode: bool
    params: SamplingParams
    sample: bool = False
    generator: torch.Generator | None = None
    banned: frozenset = frozenset()
    banned_rows: int = 0


@dataclass
class StepTiming:
    """Seconds spent drafting and verifying (with ``RunnerConfig.timing``)."""

    draft_s: float = 0.0
    target_s: float = 0.0


__all__ = ["StepItem", "StepTiming"]
