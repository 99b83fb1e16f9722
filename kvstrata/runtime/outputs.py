"""What ``LLM.generate`` returns, one object per prompt (in prompt order)."""

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
        finish_reason: ``"stop"``, ``"length"`` or ``"rejected"`` (bad request; see ``error``).
        error: why the request was rejected, else ``None``.
        metrics: ``ttft_s`` (admission to first token), ``total_s``, ``num_steps``.
    """

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def mean_acceptance_length(self) -> float:
        a = self.acceptance_lengths
        return sum(a) / len(a) if a else 0.0
