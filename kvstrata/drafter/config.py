"""DFlash drafter configuration, read from the public z-lab checkpoint layout.

A DFlash checkpoint is a Qwen3-style ``config.json`` plus::

    "block_size": 16, "num_target_layers": 36,
    "dflash_config": {"mask_token_id": ..., "target_layer_ids": [...]},
    optional "layer_types": [...], "sliding_window": W, "is_causal": bool,
    optional "input_embedding_scale", "output_multiplier", "final_logit_softcapping"

Fields under ``dflash_config`` win over top-level fields of the same name (as in the reference).
Per-layer attention semantics follow the reference exactly: a ``sliding_attention`` layer is causal
inside the draft block and looks back ``sliding_window`` tokens; every other layer is
bidirectional over the block and sees the whole context (``is_causal`` overrides the first part).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from ..dtypes import canonical_dtype
from ..nn.hfconfig import DecoderDims, decoder_fields


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Evenly spaced taps between layer 1 and ``num_target_layers - 3`` (the DFlash default)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


#: The fields of :class:`DFlashConfig` that name a drafter's K/V, in the order its fingerprint
#: has always listed them (changing this tuple changes the namespace of every stored draft page).
FINGERPRINT_FIELDS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "rope_theta",
    "max_position_embeddings", "block_size", "num_target_layers", "mask_token_id",
    "target_layer_ids", "layer_causal", "layer_window", "attention_bias", "input_embedding_scale",
    "output_multiplier", "final_logit_softcapping", "dtype")


@dataclass(frozen=True)
class DFlashConfig(DecoderDims):
    # The drafter's fingerprint (the prefix-cache namespace of its pages) is built from
    # ``fingerprint_text()``, which lists FINGERPRINT_FIELDS in a pinned order, so fields can be
    # added or re-arranged here without orphaning stored draft pages (a new field that changes
    # the K/V must be appended to FINGERPRINT_FIELDS). The sizes come from DecoderDims.
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    block_size: int
    num_target_layers: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    layer_causal: tuple[bool, ...]             # per draft layer: causal inside the block
    layer_window: tuple[int | None, ...]       # per draft layer: sliding window (tokens) or None
    attention_bias: bool = False
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    dtype: torch.dtype | None = None           # the checkpoint's dtype, if config.json says

    def fingerprint_text(self) -> str:
        """The config's part of the drafter fingerprint: ``FINGERPRINT_FIELDS`` in their pinned
        order, written as the dataclass repr wrote them when the fingerprint was introduced."""
        return "DFlashConfig(" + ", ".join(f"{n}={getattr(self, n)!r}"
                                           for n in FINGERPRINT_FIELDS) + ")"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "drafter config") -> "DFlashConfig":
        dcfg = d.get("dflash_config") or {}
        if not isinstance(dcfg, Mapping):
            raise ValueError(f"{where}: 'dflash_config' must be an object, got {type(dcfg).__name__}")

        def get(name, default=None):
            return dcfg.get(name, d.get(name, default))

        common = decoder_fields(d, where, rope_theta=10000.0, max_position_embeddings=32768)
        n_layers = common["num_hidden_layers"]
        n_target = get("num_target_layers")
        if not isinstance(n_target, int) or n_target <= 0:
            raise ValueError(f"{where}: 'num_target_layers' must be a positive integer (the "
                             f"target model's layer count), got {n_target!r}")
        taps = get("target_layer_ids")
        if taps is None:
            taps = default_target_layer_ids(n_target, n_layers)
        taps = tuple(int(t) for t in taps)
        if not taps or any(t < 0 or t >= n_target for t in taps):
            raise ValueError(f"{where}: target_layer_ids {list(taps)} must be non-empty and in "
                             f"[0, num_target_layers={n_target})")
        mask = get("mask_token_id")
        if not isinstance(mask, int) or mask < 0:
            raise ValueError(f"{where}: dflash_config.mask_token_id must be a token id, got {mask!r}")
        block = get("block_size", 16)
        if not isinstance(block, int) or block < 1:
            raise ValueError(f"{where}: block_size must be a positive integer, got {block!r}")
        types = d.get("layer_types") or ["full_attention"] * n_layers
        if len(types) != n_layers:
            raise ValueError(f"{where}: layer_types has {len(types)} entries for {n_layers} layers")
        forced = d.get("is_causal")
        causal = tuple(t == "sliding_attention" if forced is None else bool(forced) for t in types)
        window = d.get("sliding_window")
        windows = tuple(window if t == "sliding_attention" else None for t in types)
        for i, (c, w) in enumerate(zip(causal, windows)):
            if w is not None and not c and w < block:
                # Bidirectional windowed layers would hide block tokens from each other; the paged
                # kernels treat the block as always visible, so refuse rather than diverge.
                raise ValueError(f"{where}: layer {i} is bidirectional with sliding_window={w} < "
                                 f"block_size={block}; use a window >= {block}")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"{where}: rope type {rope_type!r} is not supported (only 'default')")
        softcap = get("final_logit_softcapping")
        dt = d.get("dtype") or d.get("torch_dtype")
        return cls(
            **common, block_size=block, num_target_layers=n_target, mask_token_id=mask,
            target_layer_ids=taps, layer_causal=causal, layer_window=windows,
            input_embedding_scale=float(get("input_embedding_scale", 1.0)),
            output_multiplier=float(get("output_multiplier", 1.0)),
            final_logit_softcapping=float(softcap) if softcap else None,
            dtype=canonical_dtype(dt) if dt else None)

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "DFlashConfig":
        fn = os.path.join(os.fspath(path), "config.json")
        if not os.path.isfile(fn):
            raise ValueError(f"drafter directory {os.fspath(path)!r} has no config.json")
        with open(fn) as f:
            return cls.from_dict(json.load(f), where=fn)

    @property
    def all_sliding(self) -> int | None:
        """The common window if every layer is windowed (the KV group's window), else None."""
        ws = set(self.layer_window)
        return ws.pop() if len(ws) == 1 and None not in ws else None
