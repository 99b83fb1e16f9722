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
    # Output text so far (stop strings cut off): ``text`` joins the pieces appended since it was
    # last read, so appending costs the new text only, never a copy of all the text before it.
    _text: str = field(default="", init=False, repr=False)
    _pieces: list[str] = field(default_factory=list, init=False, repr=False)
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

    @property
    def text(self) -> str:
        """Output text so far (a stop string cut off; a partial character held back)."""
        if self._pieces:
            self._text += "".join(self._pieces)
            self._pieces.clear()
        return self._text

    @text.setter
    def text(self, value: str) -> None:
        self._text = value
        self._pieces.clear()

    def append(self, new: list[int]) -> int:
        """Append generated tokens up to the first that ends the request; returns how many were
        appended. Finishes on a stop id or string (after ``min_tokens``) or at ``max_length``.

        Without stop strings the text matters only once the tokens are in, so they go in at once
        (the detokenizer's :meth:`~kvstrata.tokenizer.Detokenizer.extend`); stop strings are
        looked for after every token (:meth:`_append_each`).
        """
        if self.params.stop:
            return self._append_each(new)
        stop = 0 if self.stop_ids.isdisjoint(new) else self._stop_id_at(new)
        take = new[:stop] if stop else new
        self.tokens += take
        if self.detok is not None:
            self._pieces.append(self.detok.extend(take))
        if stop:
            self.finish("stop")
            return stop
        if len(self.tokens) >= self.max_length:
            self.finish("length")
        return len(new)

    def _stop_id_at(self, new: list[int]) -> int:
        """How many of ``new`` go in up to the first stop id past ``min_tokens`` (0: none)."""
        g = len(self.tokens) - len(self.prompt)
        for j, t in enumerate(new, 1):
            if t in self.stop_ids and g + j > self.params.min_tokens:
                return j
        return 0

    def _append_each(self, new: list[int]) -> int:
        """:meth:`append` token by token, looking for stop strings in the text each token adds.

        A stop string completed by this token starts at most ``len(stop) - 1`` characters before
        its text, so the search runs over ``window``: the last ``max(len(stop)) - 1`` characters
        before it plus its text (at any output length, a token costs the same).
        """
        sp = self.params
        keep = max(map(len, sp.stop)) - 1
        text = self.text
        tail = text[max(0, len(text) - keep):]
        for j, t in enumerate(new, 1):
            self.tokens.append(t)
            piece = self.detok.push(t) if self.detok is not None else ""
            self._pieces.append(piece)
            g = len(self.tokens) - len(self.prompt)
            if t in self.stop_ids and g > sp.min_tokens:
                self.finish("stop")
                return j
            window = tail + piece
            if g >= sp.min_tokens:
                cut = _find_stop(window, len(tail), sp.stop)
                if cut >= 0:
                    text = self.text
                    self.text = text[:len(text) - len(window) + cut]
                    self.finish("stop")
                    return j
            tail = window[max(0, len(window) - keep):]
        if len(self.tokens) >= self.max_length:
            self.finish("length")
        return len(new)

    def finish(self, reason: str, error: str | None = None) -> None:
        if self.detok is not None and reason != "stop":
            self._pieces.append(self.detok.flush())
        self.state, self.finish_reason, self.t_done = DONE, reason, time.perf_counter()
        self.error = error


def _find_stop(text: str, before: int, stops: tuple[str, ...]) -> int:
    """Where ``text`` is cut: the start of the first stop string that ends past
    ``text[:before]`` (one the text after ``before`` completed); -1: none."""
    cut = [i for i in (text.find(s, max(0, before - len(s) + 1)) for s in stops) if i >= 0]
    return min(cut) if cut else -1


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
        if len(decode) == len(self.running):
            return StepPlan(decode, prefill)    # all of them generate and verify: nothing moves
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
