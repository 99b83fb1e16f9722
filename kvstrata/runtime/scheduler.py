"""Continuous batching: which sequences verify and which prompt chunks prefill in a step.

A step packs, into one target forward, a verify block for every scheduled generating sequence
(``[last verified token, B-1 drafts]``) and prefill chunks of admitted prompts, within a token
budget. Generating sequences come first (at most ``budget // block_size`` of them, rotated so none
starves); prompts fill what is left, chunked at any token boundary.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams

WAITING, PREFILL, DECODE, DONE = "waiting", "prefill", "decode", "done"
# A handoff request (``LLM.prefill``) stops here after its first token: its pages stay held.
PREFILLED = "prefilled"


@dataclass(slots=True, eq=False)
class Request:
    """A request's progress. ``tokens`` = prompt + generated; in DECODE the last one is the
    pending token (verified, its K/V not yet written), so ``num_computed == len(tokens) - 1``."""

    rid: int
    prompt: list[int]
    params: SamplingParams
    max_length: int                 # prompt + generated tokens never exceed this
    salt: str | None = None
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0           # tokens whose K/V (every group) is written and committed
    state: str = WAITING
    num_cached_tokens: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    handoff: bool = False           # stop at PREFILLED (first token sampled) instead of decoding
    rid_key: tuple | None = None    # the manager's sequence id (unique across generate calls)
    t_admit: float = 0.0
    t_first: float = 0.0
    t_done: float = 0.0

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt)

    def block_len(self, block_size: int) -> int:
        """Verify positions this step (the reference shortens the last block to fit)."""
        return min(block_size, self.max_length - self.num_computed)

    def append(self, new: list[int]) -> None:
        """Append generated tokens; finish on a stop token or at ``max_length``."""
        stops = self.params.stop_token_ids
        for t in new:
            self.tokens.append(t)
            if t in stops:
                self.finish("stop")
                return
        if len(self.tokens) >= self.max_length:
            self.finish("length")

    def finish(self, reason: str) -> None:
        self.state, self.finish_reason, self.t_done = DONE, reason, time.perf_counter()


@dataclass(slots=True)
class StepPlan:
    decode: list[tuple[Request, int]]      # (request, verify block length)
    prefill: list[tuple[Request, int]]     # (request, chunk length)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.decode) + sum(n for _, n in self.prefill)


class Scheduler:
    def __init__(self, max_batch_size: int, token_budget: int, block_size: int):
        self.max_batch_size = max_batch_size
        self.budget = token_budget
        self.block_size = block_size
        self.waiting: deque[Request] = deque()
        self.running: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def free_slots(self) -> int:
        return self.max_batch_size - len(self.running)

    def schedule(self) -> StepPlan:
        budget = self.budget
        decode, prefill = [], []
        gen = [r for r in self.running if r.state == DECODE]
        for r in gen[:budget // self.block_size]:
            n = r.block_len(self.block_size)
            decode.append((r, n))
            budget -= n
        # Scheduled generators move to the back, so those left out this step go first next.
        chosen = {id(r) for r, _ in decode}
        self.running = deque([r for r in self.running if id(r) not in chosen] +
                             [r for r, _ in decode])
        for r in self.running:
            if budget <= 0:
                break
            if r.state == PREFILL:
                n = min(len(r.prompt) - r.num_computed, budget)
                prefill.append((r, n))
                budget -= n
        return StepPlan(decode, prefill)

    def retire(self) -> list[Request]:
        """Remove and return finished (DONE) and handed-off (PREFILLED) requests."""
        done = [r for r in self.running if r.state in (DONE, PREFILLED)]
        if done:
            self.running = deque(r for r in self.running if r.state not in (DONE, PREFILLED))
        return done
