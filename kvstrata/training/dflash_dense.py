"""Dense (training) implementation of the DFlash drafter, in the z-lab checkpoint layout.

Weights (exactly the public ``dflash``/z-lab names; no embedding, no LM head)::

    fc.weight [H, n_taps*H_t]   hidden_norm.weight [H]   norm.weight [H]
    layers.{i}.input_layernorm.weight, layers.{i}.post_attention_layernorm.weight
    layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.self_attn.{q,k}_norm.weight
    layers.{i}.mlp.{gate,up,down}_proj.weight

Semantics (those of ``dflash.model.dflash_generate``, which inference follows): a block anchored at
position ``a`` holds ``[token a, MASK x (B-1)]`` at positions ``a .. a+B-1``; it attends to the
fused target taps ``c = hidden_norm(fc(concat(taps)))`` of positions ``0 .. a-1`` (strictly before
the anchor: the anchor's own taps only exist after the target verified it) and, bidirectionally, to
the block itself. Block output ``k`` (1..B-1) predicts the token at position ``a+k``. RoPE is at
absolute positions for context and block alike.

:meth:`DenseDFlash.forward_blocks` runs *all* anchors of a batch in one attention call per layer:
keys are ``[context K/V of the sequence ; every block's own K/V]`` under a boolean mask (a block
sees context keys ``< anchor`` and its own block only). Only full-attention layers are supported
(the shipped drafter has no sliding layers).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.layers import AttentionProjections, RMSNorm, SwiGLUMLP, rope_cos_sin


def rope(x: Tensor, pos: Tensor, theta: float) -> Tensor:
    """Rotate-half RoPE. x ``[b, heads, T, D]``, pos ``[b, T]`` int64 -> x's shape and dtype."""
    d = x.shape[-1]
    cos, sin = rope_cos_sin(pos, d, theta, x.dtype)
    cos, sin = cos[:, None], sin[:, None]  # [b, 1, T, D]
    rot = torch.cat([-x[..., d // 2:], x[..., :d // 2]], dim=-1)
    return x * cos + rot * sin


class DraftAttention(AttentionProjections):
    """Qwen3 attention weights (the shared ``AttentionProjections``) with DFlash's batched block
    forward."""

    def _kv(self, x: Tensor, pos: Tensor, theta: float) -> tuple[Tensor, Tensor]:
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim))
        k = k.transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return rope(k, pos, theta), v

    def forward(self, x: Tensor, ctx: Tensor, x_pos: Tensor, ctx_pos: Tensor, mask: Tensor,
                theta: float) -> Tensor:
        """x ``[b, Q, H]`` block states, ctx ``[b, L, H]`` fused taps, mask ``[b, 1, Q, L+Q]``."""
        b, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.num_heads, self.head_dim))
        q = q.transpose(1, 2)
        q = rope(q, x_pos, theta)
        kc, vc = self._kv(ctx, ctx_pos, theta)
        kb, vb = self._kv(x, x_pos, theta)
        k, v = torch.cat([kc, kb], dim=2), torch.cat([vc, vb], dim=2)
        # under autocast the norms return fp32 and the projections bf16: one dtype for sdpa
        q, k = q.to(v.dtype), k.to(v.dtype)
        rep = self.num_heads // self.num_kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                           scale=1.0 / math.sqrt(self.head_dim))
        return self.o_proj(o.transpose(1, 2).reshape(b, q_len, self.num_heads * self.head_dim))


class DraftLayer(nn.Module):
    def __init__(self, hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int,
                 eps: float):
        super().__init__()
        self.self_attn = DraftAttention(hidden, heads, kv_heads, head_dim, eps)
        self.mlp = SwiGLUMLP(hidden, inter)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, x, ctx, x_pos, ctx_pos, mask, theta):
        x = x + self.self_attn(self.input_layernorm(x), ctx, x_pos, ctx_pos, mask, theta)
        return x + self.mlp(self.post_attention_layernorm(x))


def block_mask(anchors: Tensor, ctx_len: int, block_size: int) -> Tensor:
    """``[b, 1, N*B, L + N*B]`` bool: block ``j`` sees context keys ``< anchors[:, j]`` and itself.

    anchors: ``[b, N]`` int64 (the anchor's absolute position, ``>= 1``).
    """
    b, n = anchors.shape
    dev = anchors.device
    q_block = torch.arange(n * block_size, device=dev) // block_size            # [Q]
    ctx = torch.arange(ctx_len, device=dev)[None, None, :] < anchors[:, :, None]  # [b, N, L]
    ctx = ctx[:, q_block]                                                         # [b, Q, L]
    own = (q_block[:, None] == q_block[None, :]).expand(b, -1, -1)                # [b, Q, Q]
    return torch.cat([ctx, own], dim=-1)[:, None]


class DenseDFlash(nn.Module):
    """The DFlash drafter for training and dense evaluation (config: the z-lab ``config.json``)."""

    def __init__(self, config: dict):
        super().__init__()
        d = dict(config)
        dcfg = d.get("dflash_config") or {}
        self.config = d
        self.hidden_size = int(d["hidden_size"])
        heads, kv = int(d["num_attention_heads"]), int(d["num_key_value_heads"])
        head_dim = int(d.get("head_dim") or self.hidden_size // heads)
        eps = float(d.get("rms_norm_eps", 1e-6))
        rp = d.get("rope_parameters") or {}
        self.rope_theta = float(d.get("rope_theta", rp.get("rope_theta", 10_000.0)))
        self.block_size = int(dcfg.get("block_size", d.get("block_size", 16)))
        self.mask_token_id = int(dcfg["mask_token_id"])
        self.target_layer_ids = [int(t) for t in dcfg["target_layer_ids"]]
        types = d.get("layer_types") or ["full_attention"] * int(d["num_hidden_layers"])
        if any(t != "full_attention" for t in types) or d.get("is_causal"):
            raise ValueError("DenseDFlash trains full-attention (bidirectional-block) layers only; "
                             f"got layer_types={types}, is_causal={d.get('is_causal')}")
        target_hidden = int(d.get("target_hidden_size", self.hidden_size))
        self.layers = nn.ModuleList(
            DraftLayer(self.hidden_size, int(d["intermediate_size"]), heads, kv, head_dim, eps)
            for _ in range(int(d["num_hidden_layers"])))
        self.norm = RMSNorm(self.hidden_size, eps)
        self.fc = nn.Linear(len(self.target_layer_ids) * target_hidden, self.hidden_size,
                            bias=False)
        self.hidden_norm = RMSNorm(self.hidden_size, eps)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def fuse(self, taps: Tensor) -> Tensor:
        """``[b, L, n_taps*H_t]`` concatenated target taps -> ``[b, L, H]`` context states."""
        return self.hidden_norm(self.fc(taps))

    def forward_blocks(self, ctx: Tensor, anchors: Tensor, block_embeds: Tensor) -> Tensor:
        """Hidden states (after the final norm) of every block, ``[b, N, B, H]``.

        ctx: ``[b, L, H]`` fused context (:meth:`fuse`) of positions ``0..L-1``; anchors ``[b, N]``
        int64 anchor positions in ``[1, L]``; block_embeds ``[b, N, B, H]`` target embeddings of
        ``[anchor token, MASK, ...]``.
        """
        b, n, bs, h = block_embeds.shape
        if bs != self.block_size or h != self.hidden_size:
            raise ValueError(f"block_embeds {tuple(block_embeds.shape)} does not match "
                             f"block_size={self.block_size}, hidden={self.hidden_size}")
        L = ctx.shape[1]
        if anchors.numel() and (int(anchors.min()) < 1 or int(anchors.max()) > L):
            raise ValueError(f"anchors must lie in [1, {L}] (a block needs >= 1 context token)")
        x = block_embeds.reshape(b, n * bs, h)
        x_pos = (anchors[:, :, None] + torch.arange(bs, device=anchors.device)).reshape(b, -1)
        ctx_pos = torch.arange(L, device=ctx.device)[None].expand(b, -1)
        mask = block_mask(anchors, L, bs)
        for layer in self.layers:
            x = layer(x, ctx, x_pos, ctx_pos, mask, self.rope_theta)
        return self.norm(x).view(b, n, bs, h)


def gather_blocks(ids: Tensor, anchors: Tensor, block_size: int, mask_token_id: int
                  ) -> tuple[Tensor, Tensor]:
    """Block inputs ``[anchor, MASK...]`` and labels ``ids[a+1 .. a+B-1]``, each ``[b, N, B]``/
    ``[b, N, B-1]``. ids ``[b, S]``; anchors ``[b, N]`` with ``a + B - 1 < S``."""
    offs = torch.arange(block_size, device=ids.device)
    idx = anchors[:, :, None] + offs                                   # [b, N, B]
    seq = torch.gather(ids, 1, idx.reshape(ids.shape[0], -1)).view(idx.shape)
    inputs = torch.full_like(seq, mask_token_id)
    inputs[:, :, 0] = seq[:, :, 0]
    return inputs, seq[:, :, 1:]


def position_weights(block_size: int, gamma: float, device=None) -> Tensor:
    """``exp(-(k-1)/gamma)`` for block offsets ``k = 1..B-1`` (the DFlash loss decay)."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


__all__ = ["DenseDFlash", "block_mask", "gather_blocks", "position_weights", "rope"]
