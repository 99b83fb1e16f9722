"""The Qwen3 target model, attending over the page pool's ``target`` group.

Packed, batch-free forward: a step's tokens of all sequences are concatenated (``[T]``), their K/V
are written to ``slot_mapping`` of the pool tensor and attention reads the pages through
:func:`kvstrata.kernels.paged_attention` with the step's :class:`AttentionMetadata` (planned once,
used by every layer). One forward serves prefill chunks, decode and speculative verify.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor, nn

from ..dtypes import canonical_dtype, dtype_name
from ..kernels.attention import paged_attention
from ..kernels.attention_plan import AttentionMetadata
from ..kernels.decode_segment import decode_segment, decode_segment_ok
from ..kernels.gemv import RowRms, gemv, gemv_add_norm, gemv_ok
from ..kernels.layer_ops import (add_rms_norm, embed_rms_norm, embed_rows, qkv_norm_rope,
                                 rope_cos_sin_rows)
from ..kernels.verify_segment import verify_segment, verify_segment_ok
from ..nn.layers import (AttentionProjections, RMSNorm, RotaryEmbedding, SwiGLUMLP,
                         merge_layer_weights)
from ..nn.hfconfig import DecoderDims, decoder_fields
from ..nn.loader import (CheckpointError, load_safetensors_dir, read_config,
                         weights_fingerprint)
from ..pagepool.spec import KVGroupSpec

_ARCHS = ("Qwen3ForCausalLM", "Qwen3Model")


@dataclass(frozen=True)
class Qwen3Config(DecoderDims):
    """The fields of a Hugging Face Qwen3 ``config.json`` the model needs (validated); the sizes
    are :class:`~kvstrata.nn.hfconfig.DecoderDims`'."""

    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    rope_scaling: Mapping[str, Any] | None = None
    attention_bias: bool = False
    #: per-layer window (tokens) or None; from ``use_sliding_window``/``layer_types``.
    sliding_windows: tuple[int | None, ...] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head_dim % 16 or self.head_dim > 256:
            raise ValueError(f"head_dim={self.head_dim}: the attention kernels take multiples of "
                             "16 up to 256")
        try:
            object.__setattr__(self, "torch_dtype", dtype_name(canonical_dtype(self.torch_dtype)))
        except ValueError as e:
            raise ValueError(f"Qwen3Config.torch_dtype: {e}") from None
        if self.sliding_windows is not None and len(self.sliding_windows) != self.num_hidden_layers:
            raise ValueError("sliding_windows needs one entry per layer")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Qwen3Config":
        """From a Hugging Face config dict; raises ``ValueError`` for a non-Qwen3 config."""
        mt = d.get("model_type")
        archs = d.get("architectures") or []
        if mt != "qwen3" and not any(a in _ARCHS for a in archs):
            raise CheckpointError(f"not a Qwen3 checkpoint: model_type={mt!r}, "
                                  f"architectures={archs}; kvstrata's target model is Qwen3")
        common = decoder_fields(d, "Qwen3 config", rope_theta=1_000_000.0,
                                max_position_embeddings=40960)
        layers = common["num_hidden_layers"]
        windows = None
        if d.get("use_sliding_window") and d.get("sliding_window"):
            types = d.get("layer_types") or [
                "sliding_attention" if i >= d.get("max_window_layers", layers) else
                "full_attention" for i in range(layers)]
            windows = tuple(d["sliding_window"] if t == "sliding_attention" else None
                            for t in types)
        return cls(
            **common, tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "bfloat16"),
            rope_scaling=_rope_scaling(d), sliding_windows=windows)

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "Qwen3Config":
        return cls.from_dict(read_config(path))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, default=str)


def _rope_scaling(d: Mapping[str, Any]) -> Mapping[str, Any] | None:
    rs = d.get("rope_scaling")
    if rs is None:  # transformers 5 moved it into rope_parameters
        rp = d.get("rope_parameters") or {}
        if rp.get("rope_type", "default") != "default":
            rs = rp
    if rs is not None and rs.get("rope_type", rs.get("type", "default")) == "default":
        return None
    return rs


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.self_attn = AttentionProjections(cfg.hidden_size, cfg.num_attention_heads,
                                              cfg.num_key_value_heads, cfg.head_dim,
                                              cfg.rms_norm_eps, bias=cfg.attention_bias)
        self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3Model(nn.Module):
    """Qwen3 decoder (RMSNorm, GQA with q/k-norm and RoPE, SwiGLU) over paged KV.

    Parameter names are the Hugging Face ones without the ``model.`` prefix.
    """

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (None if config.tie_word_embeddings else
                        nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.sm_scale = config.head_dim ** -0.5
        self._fingerprint: str | None = None

    # -- loading ----------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, device: torch.device | str = "cpu",
                        dtype: torch.dtype | str = "auto") -> "Qwen3Model":
        """Load a Hugging Face Qwen3 directory (``config.json`` + safetensors).

        ``dtype="auto"`` keeps the checkpoint's ``torch_dtype``. Raises ``ValueError``
        (:class:`CheckpointError`) for a non-Qwen3 directory, missing/unexpected/mis-shaped
        tensors, or a dtype the kernels cannot take.
        """
        cfg = Qwen3Config.from_dir(path)
        dt = canonical_dtype(cfg.torch_dtype if dtype == "auto" else dtype)
        weights = load_safetensors_dir(path)
        with torch.device("meta"):
            model = cls(cfg)
        model.load_weights(weights, device=device, dtype=dt)
        return model

    def load_weights(self, weights: Mapping[str, Tensor], device: torch.device | str = "cpu",
                     dtype: torch.dtype = torch.bfloat16) -> None:
        """Assign checkpoint tensors (HF names, ``model.`` prefix optional) to the parameters."""
        names = {n if not n.startswith("model.") else n[len("model."):]: n for n in weights}
        own = dict(self.named_parameters())
        if self.lm_head is None:
            names.pop("lm_head.weight", None)  # tied: some exports still ship a copy
        missing = sorted(set(own) - set(names))
        unexpected = sorted(n for n in set(names) - set(own) if "rotary_emb" not in n)
        if missing or unexpected:
            raise CheckpointError(
                f"checkpoint does not match the Qwen3 config: missing {missing[:8]}"
                f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                f"{' ...' if len(unexpected) > 8 else ''}")
        state = {}
        for n, p in own.items():
            t = weights[names[n]]
            if tuple(t.shape) != tuple(p.shape):
                raise CheckpointError(f"tensor {names[n]!r} has shape {list(t.shape)}; the config "
                                      f"implies {list(p.shape)}")
            if not t.is_floating_point():
                raise CheckpointError(f"tensor {names[n]!r} has non-float dtype {t.dtype}")
            state[n] = t.to(device=device, dtype=dtype)
        self.load_state_dict(state, strict=True, assign=True)
        self.rotary = RotaryEmbedding(self.config.head_dim, self.config.rope_theta,
                                      self.config.rope_scaling).to(device)
        self._fingerprint = None
        self.merge_weights()

    def merge_weights(self) -> None:
        """Per layer, q/k/v as one matrix and gate/up as one (:func:`merge_layer_weights`).
        Loading merges; call it again after replacing parameters or on a model built in code."""
        merge_layer_weights(self.layers)

    # -- identity / KV layout ---------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def kv_spec(self, name: str = "target", codec: str = "nvfp4") -> KVGroupSpec:
        """The pool group this model's K/V lives in (all layers, the model's dtype)."""
        wins = {w for w in (self.config.sliding_windows or ()) if w is not None}
        full = self.config.sliding_windows is None or None in self.config.sliding_windows
        return KVGroupSpec(name, self.config.num_hidden_layers, self.config.num_key_value_heads,
                           self.config.head_dim, self.dtype, codec,
                           sliding_window=None if full or len(wins) != 1 else wins.pop())

    def fingerprint(self) -> str:
        """Hex BLAKE2b-128 of the config and every weight's name, dtype, shape and bytes.

        Computed once (it reads every weight; seconds for a multi-GB model) and cached until
        :meth:`load_weights` runs again.
        """
        if self._fingerprint is None:
            self._fingerprint = weights_fingerprint(self.config.to_json(), self.state_dict())
        return self._fingerprint

    # -- compute ----------------------------------------------------------------------------
    def embed(self, input_ids: Tensor) -> Tensor:
        """``[T]`` int64 token ids -> ``[T, hidden]`` embeddings (model dtype)."""
        return embed_rows(input_ids, self.embed_tokens.weight)

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata,
                slot_mapping: Tensor, kv_cache: Tensor, *,
                capture_layers: Sequence[int] = (), attn_impl: str = "auto"
                ) -> tuple[Tensor, list[Tensor]]:
        """One packed step through every decoder layer.

        Args:
            input_ids, positions: ``[T]`` int64, packed like ``meta.query_start_loc``.
            meta: causal :class:`AttentionMetadata` whose ``seq_lens`` include these tokens.
            slot_mapping: ``[T]`` int64 pool slots for these tokens' K/V.
            kv_cache: the ``target`` group tensor ``[num_pages, num_layers, 2, num_kv_heads,
                page_size, head_dim]`` in the model dtype.
            capture_layers: decoder layer ids whose outputs to return (HF ``hidden_states[l+1]``;
                for the last layer HF returns it after the final norm, kvstrata before).

        Returns:
            ``(hidden [T, hidden] after the final norm, [captured [T, hidden] per layer id])``.
        """
        cfg = self.config
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids and positions must both be [T], got "
                             f"{tuple(input_ids.shape)} and {tuple(positions.shape)}")
        want = (cfg.num_hidden_layers, 2, cfg.num_key_value_heads)
        if kv_cache.dim() != 6 or tuple(kv_cache.shape[1:4]) != want or (
                kv_cache.shape[5] != cfg.head_dim):
            raise ValueError(f"kv_cache must be [num_pages, {want[0]}, 2, {want[2]}, page_size, "
                             f"{cfg.head_dim}], got {tuple(kv_cache.shape)}")
        if kv_cache.dtype != self.dtype:
            raise ValueError(f"kv_cache dtype {kv_cache.dtype} != model dtype {self.dtype}")
        bad = [l for l in capture_layers if not 0 <= l < cfg.num_hidden_layers]
        if bad:
            raise ValueError(f"capture_layers {bad} outside [0, {cfg.num_hidden_layers})")
        # RotaryEmbedding.cos_sin's values, one launch on CUDA
        cos, sin = rope_cos_sin_rows(positions, self.rotary.inv_freq,
                                     self.rotary.attention_scaling, impl=attn_impl)
        captured: list[Tensor | None] = [None] * len(capture_layers)
        eps = cfg.rms_norm_eps
        windows = cfg.sliding_windows or (None,) * cfg.num_hidden_layers
        # Residual adds ride in the next norm's launch (layer_ops: one launch per fused op on
        # CUDA, the plain torch ops elsewhere): x is the normed input, h the residual stream.
        # Every product is kernels.gemv: one Triton launch for a few rows (decode, verify at
        # batch 1) on CUDA, F.linear otherwise. Where gemv runs its kernel, o_proj and down
        # also add the residual and apply the next norm's weight in their epilogues
        # (gemv_add_norm), and the next product scales its rows by the norm's rsqrt (rms):
        # two launches less per layer.
        # the embedding rows and the first norm in one launch
        x, h = embed_rms_norm(input_ids, self.embed_tokens.weight,
                              self.layers[0].input_layernorm.weight, eps, impl=attn_impl)
        mm = functools.partial(gemv, impl=attn_impl)
        fuse = gemv_ok(x, self.layers[0].self_attn.o_proj.weight, attn_impl)
        rms = None
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            # One product for q/k/v (merged weights), then attention and o_proj
            qkv = attn.qkv(x, product=functools.partial(mm, rms=rms))
            x, h, rms = self._attention(i, qkv, h, cos, sin, meta, slot_mapping, kv_cache,
                                        windows[i], fuse, attn_impl)
            # gate/up with SiLU-and-multiply in its epilogue (kernels.gemv, gated)
            g = gemv(x, *mlp.gate_up_weight(), impl=attn_impl, gated=True, rms=rms)
            nxt = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            if fuse and i + 1 < len(self.layers):
                x, h, rms = gemv_add_norm(g, mlp.down_proj.weight, mlp.down_proj.bias, h,
                                          nxt.weight, eps, impl=attn_impl)
            else:
                x, h = add_rms_norm(mm(g, mlp.down_proj.weight, mlp.down_proj.bias),
                                    nxt.weight, eps, residual=h, impl=attn_impl)
                rms = None
            for j, l in enumerate(capture_layers):
                if l == i:
                    captured[j] = h
        return x, captured  # type: ignore[return-value]

    def _attention(self, i: int, qkv: Tensor, h: Tensor, cos: Tensor, sin: Tensor,
                   meta: AttentionMetadata, slot_mapping: Tensor, kv_cache: Tensor,
                   window: int | None, fuse: bool, attn_impl: str
                   ) -> tuple[Tensor, Tensor, RowRms | None]:
        """Layer ``i`` from its q/k/v product to the next norm's input: q/k norms, RoPE, the
        K/V write into the pool, attention, o_proj and the residual add. Returns ``(x, h,
        rms)``: the normed input of the MLP (with ``rms``, the norm's row scale the next
        product applies; ``None``: ``x`` is fully normed) and the residual stream."""
        cfg = self.config
        attn = self.layers[i].self_attn
        post = self.layers[i].post_attention_layernorm.weight
        eps, hq, hkv = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads
        seg = dict(sm_scale=self.sm_scale, weight=attn.o_proj.weight, residual=h,
                   norm_weight=post, eps=eps)
        # both norms, RoPE and the K/V write into the pool in one launch
        q, _, _ = qkv_norm_rope(qkv, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps,
                                cos, sin, hq, hkv, kv_cache=kv_cache, layer=i,
                                slot_mapping=slot_mapping, impl=attn_impl)
        if fuse and decode_segment_ok(q, kv_cache, meta, attn.o_proj.weight, attn.o_proj.bias,
                                      window, attn_impl):
            # batch-1 decode on Hopper: attention and o_proj (+ residual, next norm) in one
            # persistent launch (kernels.decode_segment)
            return decode_segment(q, kv_cache, i, meta, **seg)
        if fuse and verify_segment_ok(q, kv_cache, meta, attn.o_proj.weight, attn.o_proj.bias,
                                      window, attn_impl):
            # batch-1 verify (2-16 queries) on Hopper: the same, with matrix products
            # (kernels.verify_segment)
            return verify_segment(q, kv_cache, i, meta, **seg)
        o = paged_attention(q, kv_cache, i, meta, sm_scale=self.sm_scale, sliding_window=window,
                            impl=attn_impl)
        if fuse:
            return attn.project_out(o, product=functools.partial(
                gemv_add_norm, residual=h, norm_weight=post, eps=eps, impl=attn_impl))
        x, h = add_rms_norm(attn.project_out(o, product=functools.partial(gemv, impl=attn_impl)),
                            post, eps, residual=h, impl=attn_impl)
        return x, h, None

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """``[T, hidden]`` -> ``[T, vocab]`` float32 (tied or untied head)."""
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(hidden, w).float()


__all__ = ["Qwen3Config", "Qwen3DecoderLayer", "Qwen3Model"]
