"""What the engine returns: ``RequestOutput`` per prompt from ``LLM.generate`` (in prompt order),
``RequestDelta`` per changed request from each ``LLM.step``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestOutput:
    """One request's result.

    Attributes:
        request_id: index of the prompt in the ``generate`` call.
        prompt_token_ids: the prompt.
        token_ids: generated tokens (a stop token, when hit, is the last one).
        acceptance_lengths: tokens committed per speculative step (the first token, which comes
            from the prefill, is not a step); plain decoding gives 1 per step.
        num_cached_tokens: prompt tokens reused from the prefix cache (device pool or tiers).
        finish_reason: ``"stop"`` (EOS, a stop id or a stop string), ``"length"``,
            ``"rejected"`` (bad request; see ``error``), ``"error"`` (failed while running; see
            ``error``) or ``"abort"``.
        error: why the request was rejected or failed, else ``None``.
        metrics: ``ttft_s`` (arrival to first token), ``total_s``, ``num_steps``,
            ``num_preemptions``.
        text: the generated text (with a tokenizer; stop strings cut off), else ``""``.
    """

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    text: str = ""

    @property
    def mean_acceptance_length(self) -> float:
        a = self.acceptance_lengths
        return sum(a) / len(a) if a else 0.0


@dataclass(slots=True)
class RequestDelta:
    """What one ``LLM.step`` changed for one request.

    Attributes:
        request_id: the id ``add_request`` returned.
        new_token_ids: tokens produced this step (possibly empty).
        new_text: their text (incremental detokenization; a stop string is cut off; a partial
            UTF-8 character waits for the token that completes it).
        finished: the request ended this step; ``finish_reason`` says how (``"stop"``,
            ``"length"``, ``"abort"``, ``"error"``; ``error`` says why for the last).
        acceptance_length: tokens committed by this step's verify (``None``: no verify).
        num_prompt_tokens, num_cached_tokens: prompt size and prompt tokens reused from the
            prefix cache; ``cached_by_tier``: those tokens per tier they came from.
        ttft_s: arrival to first token, on the delta that carries the first token.
    """

    request_id: object
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    acceptance_length: int | None
    num_prompt_tokens: int
    num_cached_tokens: int
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    ttft_s: float | None = None
    error: str | None = None
