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

from ..tokenizer import Detokenizer
from .sampling import SamplingParams

WAITING, PREFILL, DECODE, DONE = "waiting", "prefill", "decode", "done"
# A handoff request (``LLM.prefill``) stops here after its first token: its pages stay held.
PREFILLED = "prefilled"
# Preempted under pool pressure: its sequence was freed (full pages stay cached, and move to the
# tiers when evicted); it waits to be re-admitted and recomputes what the cache no longer holds.
PREEMPTED = "preempted"


@dataclass(slots=True, eq=False)
class Request:
    """A request's progress. ``tokens`` = prompt + generated; in DECODE the last one is the
    pending token (verified, its K/V not yet written), so ``num_computed == len(tokens) - 1``.

    Stopping (:meth:`append`): ``stop_ids`` (the params' ``stop_token_ids`` plus the model's EOS
    ids unless ``ignore_eos``) end the request with the stop token as the last output token; the
    params' ``stop`` strings end it with the output text cut before the stop string; neither can
    end it before ``min_tokens`` tokens (the engine also masks ``stop_ids`` out of the target's
    distribution until then, as vLLM does).
    """

    request_id: object              # request id (``add_request``'s, or a prompt index)
    prompt: list[int]
    params: SamplingParams
    max_length: int                 # prompt + generated tokens never exceed this
    salt: str | None = None
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0           # tokens whose K/V (every group) is written and committed
    state: str = WAITING
    num_cached_tokens: int = 0
    cached_from: dict = field(default_factory=dict)   # prefix pages reused per tier (admission)
    acceptance_lengths: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    generator: torch.Generator | None = None
    handoff: bool = False           # stop at PREFILLED (first token sampled) instead of decoding
    seq_id: tuple | None = None     # the manager's sequence id (unique across generate calls)
    stop_ids: frozenset = frozenset()
    detok: Detokenizer | None = None
    text: str = ""                  # output text so far (stop strings cut off)
    resume_to: int = 0              # PREEMPTED: tokens to recompute before decoding resumes
    admit_order: int = 0            # admission counter (preemption takes the newest)
    num_preemptions: int = 0
    sent_tokens: int = 0            # output tokens / text already reported by ``LLM.step``
    sent_text: int = 0
    last_al: int | None = None      # acceptance length of this step (None: no verify)
    t_arrival: float = 0.0
    t_admit: float = 0.0
    t_first: float = 0.0
    t_done: float = 0.0

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def prefill_target(self) -> int:
        """Tokens to compute before decoding: the prompt, or what a preemption dropped."""
        return self.resume_to if self.resume_to else len(self.prompt)

    def block_len(self, block_size: int) -> int:
        """Verify positions this step (the reference shortens the last block to fit)."""
        return min(block_size, self.max_length - self.num_computed)

    def append(self, new: list[int]) -> int:
        """Append generated tokens up to the first that ends the request; returns how many were
        appended. Finishes on a stop id or string (after ``min_tokens``) or at ``max_length``."""
        sp = self.params
        for j, t in enumerate(new):
            self.tokens.append(t)
            before = len(self.text)
            if self.detok is not None:
                self.text += self.detok.push(t)
            g = self.num_generated
            if t in self.stop_ids and g > sp.min_tokens:
                self.finish("stop")
                return j + 1
            if sp.stop and g >= sp.min_tokens and self._cut_stop_string(before):
                self.finish("stop")
                return j + 1
        if len(self.tokens) >= self.max_length:
            self.finish("length")
        return len(new)

    def _cut_stop_string(self, before: int) -> bool:
        """Cut the text at the first stop string that this token's text completed."""
        cut = [i for i in (self.text.find(s, max(0, before - len(s) + 1))
                           for s in self.params.stop) if i >= 0]
        if not cut:
            return False
        self.text = self.text[:min(cut)]
        return True

    def finish(self, reason: str, error: str | None = None) -> None:
        if self.detok is not None and reason != "stop":
            self.text += self.detok.flush()
        self.state, self.finish_reason, self.t_done = DONE, reason, time.perf_counter()
        self.error = error


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
        self.finished: list[Request] = []     # retired this step (for ``LLM._drive``)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def free_seats(self) -> int:
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
                n = min(r.prefill_target - r.num_computed, budget)
                prefill.append((r, n))
                budget -= n
        return StepPlan(decode, prefill)

    def retire(self) -> list[Request]:
        """Remove and return finished (DONE) and handed-off (PREFILLED) requests."""
        done = [r for r in self.running if r.state in (DONE, PREFILLED)]
        if done:
            self.running = deque(r for r in self.running if r.state not in (DONE, PREFILLED))
        return done
