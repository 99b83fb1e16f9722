"""The decoder fields every Hugging Face ``config.json`` we read shares (Qwen3 target, DFlash
drafter): one base class and one parser, so both models read sizes, heads, RoPE base and limits
the same way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .loader import CheckpointError


@dataclass(frozen=True)
class DecoderConfig:
    """Sizes, heads and RoPE of a decoder (the fields :func:`decoder_fields` reads); the model
    configs add their own fields (defaults here are Qwen3's)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    attention_bias: bool = False

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


__all__ = ["DecoderConfig", "REQUIRED", "decoder_fields"]
