"""The decoder fields every Hugging Face ``config.json`` we read shares (Qwen3 target, DFlash
drafter): one parser, so both models read sizes, heads, RoPE base and limits the same way."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

from .loader import CheckpointError

#: Keys a decoder config must have (the others have defaults or are derived).
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads")


def decoder_fields(d: Mapping[str, Any], where: str, *, rope_theta: float,
                   max_position_embeddings: int) -> dict[str, Any]:
    """The shared fields of a Hugging Face decoder config, validated.

    ``num_key_value_heads`` defaults to the attention heads, ``head_dim`` to
    ``hidden_size // num_attention_heads``; ``rope_theta`` is read at the top level, else from
    ``rope_parameters`` / ``rope_scaling`` (transformers 5 moved it there), else the model's
    default given here, as is ``max_position_embeddings``. Raises :class:`CheckpointError` (a
    ``ValueError``) naming ``where`` for a missing key, and ``ValueError`` for a bad value.
    """
    missing = [k for k in REQUIRED if k not in d]
    if missing:
        raise CheckpointError(f"{where} lacks {missing}")
    for k in REQUIRED:
        v = d[k]
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{where}: {k!r} must be a positive integer, got {v!r}")
    heads = d["num_attention_heads"]
    kv_heads = d.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ValueError(f"{where}: num_attention_heads={heads} is not a multiple of "
                         f"num_key_value_heads={kv_heads}")
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    return dict(
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(d.get("rope_theta", rope.get("rope_theta", rope_theta))),
        max_position_embeddings=int(d.get("max_position_embeddings", max_position_embeddings)),
        attention_bias=bool(d.get("attention_bias", False)))


@dataclass(frozen=True)
class DecoderDims:
    """The sizes every decoder config names (base of the target's ``Qwen3Config`` and the
    drafter's ``DFlashConfig``): validated once, here."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for f in fields(DecoderDims):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{type(self).__name__}.{f.name} must be a positive int, "
                                 f"got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple "
                             f"of num_key_value_heads={self.num_key_value_heads}")


__all__ = ["REQUIRED", "DecoderDims", "decoder_fields"]
