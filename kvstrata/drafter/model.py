"""The DFlash block drafter: context K/V writer + block forward, over pluggable attention.

The drafter has no embedding and no LM head: it borrows the target's. Per step it sees

- *context*: for every committed token, ``c = hidden_norm(fc(concat(target taps)))`` projected per
  draft layer into ``k_norm(k_proj(c))`` (RoPE at the token's absolute position) and ``v_proj(c)``.
  :meth:`DFlashDrafter.write_context` writes these into the ``draft`` group of the token's page, so
  they are cached, reused and moved with the target K/V of the same tokens.
- *block*: ``[last verified token, MASK x (B-1)]`` embedded by the target; its own K/V is scratch.

Attention is a callable ``attn(layer, q, k, v) -> o`` so the paged backend
(:class:`PagedDraftAttention`, the default) and the arena baseline (:mod:`.arena`) share one forward.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Iterator

import torch
from torch import Tensor, nn

from ..dtypes import canonical_dtype
from ..kernels.attention import paged_attention
from ..kernels.attention_plan import plan_attention
from ..kernels.gemv import gemv
from ..kernels.kv_write import write_kv
from ..kernels.layer_ops import add_rms_norm, qkv_norm_rope, rope_cos_sin_rows
from ..nn.layers import (AttentionProjections, RMSNorm, SwiGLUMLP, merge_layer_weights,
                         rope_inv_freq)
from ..nn.loader import load_safetensors_dir, weights_fingerprint
from ..pagepool.spec import KVGroupSpec
from .config import DFlashConfig

#: attn(layer, q [Tq, Hq, D], k [Tq, Hkv, D], v [Tq, Hkv, D]) -> [Tq, Hq, D]
DraftAttentionFn = Callable[[int, Tensor, Tensor, Tensor], Tensor]


class _Attn(AttentionProjections):
    """The shared Qwen3 attention projections; a DFlash checkpoint with ``attention_bias``
    also biases ``o_proj``."""

    def __init__(self, cfg: DFlashConfig):
        H, D, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        super().__init__(H, cfg.num_attention_heads, cfg.num_key_value_heads, D,
                         cfg.rms_norm_eps, bias=bias)
        if bias:
            self.o_proj = nn.Linear(cfg.num_attention_heads * D, H, bias=True)


class _Layer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.self_attn = _Attn(cfg)
        self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DFlashDrafter(nn.Module):
    """A DFlash drafter (parameter names follow the z-lab checkpoints, so they load unchanged)."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size,
                            bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sm_scale = cfg.head_dim ** -0.5
        self._fingerprint = "unloaded"
        self._inv_freq: dict[torch.device, Tensor] = {}     # RoPE, per device (see _rope)

    # -- loading -------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, device: torch.device | str = "cpu",
                        dtype: torch.dtype | str = "auto") -> "DFlashDrafter":
        """Load a z-lab layout checkpoint; ``dtype="auto"`` keeps the checkpoint's dtype."""
        cfg = DFlashConfig.from_dir(path)
        state = load_safetensors_dir(path)
        if any(k.startswith("candidate_selector.") or "_conv." in k for k in state):
            raise ValueError(f"{os.fspath(path)!r} is a DFlash2 checkpoint (candidate selector / "
                             "dynamic convolutions); only DFlash (v1) drafters are supported")
        if dtype == "auto":
            dt = cfg.dtype or next(iter(state.values())).dtype
        else:
            dt = dtype
        dt = canonical_dtype(dt)
        model = cls(cfg)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"drafter checkpoint {os.fspath(path)!r} does not match its config: "
                             f"missing {sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}")
        model.to(device=device, dtype=dt).eval()
        model.requires_grad_(False)
        model.merge_weights()
        model._fingerprint = "dflash-" + weights_fingerprint(json.dumps(cfg.fingerprint_text()), state)
        return model

    def merge_weights(self) -> None:
        """Per layer, q/k/v as one matrix and gate/up as one (:func:`merge_layer_weights`)."""
        merge_layer_weights(self.layers)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def fingerprint(self) -> str:
        return self._fingerprint

    def kv_spec(self, name: str = "draft", codec: str = "lossless") -> KVGroupSpec:
        """The ``draft`` layer group: K/V of every draft layer for each slot (token position) of
        the pool."""
        c = self.cfg
        return KVGroupSpec(name, c.num_hidden_layers, c.num_key_value_heads, c.head_dim,
                           self.dtype, codec, sliding_window=c.all_sliding)

    # -- context ---------------------------------------------------------------------------------
    def context_kv(self, taps: Tensor, positions: Tensor) -> Iterator[tuple[Tensor, Tensor]]:
        """Per draft layer ``(k, v)``, each ``[T, Hkv, D]``, of committed tokens.

        taps: ``[T, len(target_layer_ids) * hidden]`` (target layer outputs, concatenated in
        ``target_layer_ids`` order); positions: ``[T]`` absolute positions (int64).
        """
        feat, cos, sin = self._context_features(taps, positions)
        for layer in self.layers:
            a = layer.self_attn
            _, k, v = qkv_norm_rope(a.qkv(feat, with_q=False, product=gemv), None,
                                    a.k_norm.weight, a.k_norm.eps, cos, sin, 0,
                                    self.cfg.num_key_value_heads)
            yield k, v

    def _context_features(self, taps: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        # hidden_norm in one launch on CUDA (as the layers' norms)
        feat, _ = add_rms_norm(gemv(taps.to(self.dtype), self.fc.weight, self.fc.bias),
                               self.hidden_norm.weight, self.hidden_norm.eps)
        return (feat, *self._rope(positions, feat.dtype))

    def _rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``nn.layers.rope_cos_sin(positions, head_dim, rope_theta, dtype)``'s values, in one
        launch on CUDA (``kernels.layer_ops.rope_cos_sin_rows``); the inverse frequencies are
        built once per device, by the same ops."""
        inv = self._inv_freq.get(positions.device)
        if inv is None:
            inv = self._inv_freq[positions.device] = rope_inv_freq(
                self.cfg.head_dim, self.cfg.rope_theta, positions.device)
        return rope_cos_sin_rows(positions, inv, 1.0, dtype)

    def write_context(self, taps: Tensor, positions: Tensor, slot_mapping: Tensor,
                      kv_cache: Tensor, impl: str = "auto") -> None:
        """Write the context K/V of committed tokens into the draft group ``kv_cache``
        (``[num_pages, num_layers, 2, Hkv, page_size, D]``) at ``slot_mapping [T] int64``."""
        feat, cos, sin = self._context_features(taps, positions)
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            # k/v in one product, k-norm + RoPE and the write in one launch.
            qkv_norm_rope(a.qkv(feat, with_q=False, product=gemv), None, a.k_norm.weight,
                          a.k_norm.eps, cos, sin, 0, self.cfg.num_key_value_heads,
                          kv_cache=kv_cache, layer=i, slot_mapping=slot_mapping, impl=impl)

    # -- block -----------------------------------------------------------------------------------
    def forward(self, noise: Tensor, positions: Tensor, attn: DraftAttentionFn,
                rows: tuple[int, int, int] | None = None) -> Tensor:
        """Run packed draft blocks.

        noise: ``[Tq, hidden]`` target embeddings of the blocks (times ``input_embedding_scale``);
        positions: ``[Tq]`` absolute positions. Returns the final-normed hidden ``[Tq, hidden]``.

        rows ``(block, lo, hi)``: the blocks are ``block`` rows each, and only positions ``lo
        .. hi - 1`` of each are read: the last layer's output projection, MLP and final norm run
        on those alone, and the result is ``[Tq / block * (hi - lo), hidden]``. Every row still
        feeds every layer's attention, so the kept rows' values are the full forward's (up to
        the products' rounding at fewer rows).
        """
        c = self.cfg
        x = noise.to(self.dtype)
        eps, hq, hkv = c.rms_norm_eps, c.num_attention_heads, c.num_key_value_heads
        cos, sin = self._rope(positions, x.dtype)
        # As the target's forward: residual adds fused into the next norm (kernels.layer_ops),
        # products through kernels.gemv (one launch for a few rows on CUDA, else F.linear),
        # SiLU-and-multiply inside gate/up's.
        h, x = add_rms_norm(x, self.layers[0].input_layernorm.weight, eps)
        for i, layer in enumerate(self.layers):
            a, mlp = layer.self_attn, layer.mlp
            q, k, v = qkv_norm_rope(a.qkv(h, product=gemv), a.q_norm.weight, a.k_norm.weight,
                                    a.q_norm.eps, cos, sin, hq, hkv)
            o = attn(i, q, k, v)
            if rows is not None and i + 1 == len(self.layers):
                o, x = (_block_rows(t, rows) for t in (o, x))
            h, x = add_rms_norm(a.project_out(o, product=gemv),
                                layer.post_attention_layernorm.weight, eps, residual=x)
            y = gemv(gemv(h, *mlp.gate_up_weight(), gated=True), mlp.down_proj.weight,
                     mlp.down_proj.bias)
            nxt = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            h, x = add_rms_norm(y, nxt.weight, eps, residual=x)
        return h

    def postprocess_logits(self, logits: Tensor) -> Tensor:
        """Output multiplier and soft-capping of the reference, on the target head's logits."""
        c = self.cfg
        if c.output_multiplier != 1.0:
            logits = logits * c.output_multiplier
        if c.final_logit_softcapping:
            logits = torch.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
        return logits


def _block_rows(t: Tensor, rows: tuple[int, int, int]) -> Tensor:
    """Rows ``lo .. hi - 1`` of every ``block`` consecutive rows of ``t`` (packed)."""
    block, lo, hi = rows
    return t.unflatten(0, (-1, block))[:, lo:hi].flatten(0, 1)


class PagedDraftAttention:
    """Draft-block attention over the ``draft`` group of the page pool (the default backend).

    Bidirectional layers use the kernels' block mode: every committed context token (window
    relative to the query's position) plus the whole block, whose K/V stays scratch. Causal
    (``sliding_attention``) layers follow the reference, which is causal *inside* the block too:
    the block's K/V goes into the sequence's own not-yet-committed slots (reserved for the verify
    step anyway, overwritten when tokens commit, hidden by the sequence length until then) and the
    kernels' causal mode runs over ``context + block``.

    Args:
        block_tables: ``[S, max_pages] int32``; ctx_lens: committed tokens per sequence;
        q_lens: block length per sequence; block_slots: ``[sum(q_lens)] int64`` slots of the block
            positions (only used by causal layers).
    """

    def __init__(self, drafter: DFlashDrafter, kv_cache: Tensor, block_tables: Tensor,
                 ctx_lens: list[int], q_lens: list[int], block_slots: Tensor | None,
                 page_size: int, impl: str = "auto"):
        self.d, self.kv, self.impl = drafter, kv_cache, impl
        self.block_slots = block_slots
        H = drafter.cfg.num_key_value_heads
        self.meta_block = plan_attention(block_tables, ctx_lens, q_lens, page_size=page_size,
                                         causal=False, num_kv_heads=H)
        self.meta_causal = None
        if any(drafter.cfg.layer_causal):
            if block_slots is None:
                raise ValueError("causal draft layers need the block's slots")
            self.meta_causal = plan_attention(block_tables, [c + q for c, q in zip(ctx_lens, q_lens)],
                                              q_lens, page_size=page_size, causal=True,
                                              num_kv_heads=H)

    @classmethod
    def from_plans(cls, drafter: DFlashDrafter, kv_cache: Tensor, meta_block, meta_causal,
                   block_slots: Tensor | None, impl: str = "auto") -> "PagedDraftAttention":
        """Over plans built elsewhere (the runner's persistent, CUDA-graph-safe plans):
        ``meta_block`` in block mode over the context, ``meta_causal`` (or ``None`` without
        causal layers) over context + block."""
        if any(drafter.cfg.layer_causal) and (meta_causal is None or block_slots is None):
            raise ValueError("causal draft layers need a causal plan and the block's slots")
        self = cls.__new__(cls)
        self.d, self.kv, self.impl = drafter, kv_cache, impl
        self.block_slots = block_slots
        self.meta_block, self.meta_causal = meta_block, meta_causal
        return self

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        cfg = self.d.cfg
        w = cfg.layer_window[layer]
        if cfg.layer_causal[layer]:
            write_kv(self.kv, layer, k, v, self.block_slots, impl=self.impl)
            return paged_attention(q, self.kv, layer, self.meta_causal, sm_scale=self.d.sm_scale,
                                   sliding_window=w, impl=self.impl)
        return paged_attention(q, self.kv, layer, self.meta_block, sm_scale=self.d.sm_scale,
                               sliding_window=w, block_kv=(k, v), impl=self.impl)
