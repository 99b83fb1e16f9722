"""The ``arena`` drafter backend: a private dense context buffer per request (baseline only).

This is how serving engines commonly keep the DFlash context: outside the KV manager, dense in
``max_seq_len``, and empty after a prefix hit (only the tokens the engine computes reach it). It is
kept to measure what the paged backend buys; nothing else in kvstrata depends on it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .model import DFlashDrafter


class DraftArena:
    """Dense per-request context K/V: ``[num_layers, 2, Hkv, capacity, D]`` per request."""

    def __init__(self, drafter: DFlashDrafter, capacity: int):
        if capacity <= 0:
            raise ValueError(f"arena capacity must be positive, got {capacity}")
        self.d = drafter
        self.capacity = capacity
        self._buf: dict[object, Tensor] = {}
        self._first: dict[object, int] = {}   # absolute position of the buffer's first token
        self._len: dict[object, int] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buf.values())

    def open(self, seq_id: object, first_position: int) -> None:
        c = self.d.cfg
        self._buf[seq_id] = torch.zeros(
            (c.num_hidden_layers, 2, c.num_key_value_heads, self.capacity, c.head_dim),
            dtype=self.d.dtype, device=self.d.device)
        self._first[seq_id] = first_position
        self._len[seq_id] = 0

    def close(self, seq_id: object) -> None:
        for m in (self._buf, self._first, self._len):
            m.pop(seq_id, None)

    def append(self, seq_id: object, taps: Tensor, positions: Tensor) -> None:
        """Add committed tokens (consecutive positions continuing the buffer)."""
        n = self._len[seq_id]
        T = taps.shape[0]
        if n + T > self.capacity:
            raise ValueError(f"arena of {self.capacity} tokens is full for {seq_id!r}")
        buf = self._buf[seq_id]
        for i, (k, v) in enumerate(self.d.context_kv(taps, positions)):
            buf[i, 0, :, n:n + T] = k.transpose(0, 1)
            buf[i, 1, :, n:n + T] = v.transpose(0, 1)
        self._len[seq_id] = n + T

    def attention(self, seq_ids: list[object], starts: list[int], q_lens: list[int]):
        """Attention callable for one drafter forward over these sequences' blocks
        (block of sequence ``s`` at positions ``starts[s] .. starts[s] + q_lens[s] - 1``)."""
        cfg = self.d.cfg
        scale = self.d.sm_scale

        def attn(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            out = torch.empty_like(q)
            off = 0
            causal, w = cfg.layer_causal[layer], cfg.layer_window[layer]
            for sid, st, ql in zip(seq_ids, starts, q_lens):
                n, first = self._len[sid], self._first[sid]
                ck = self._buf[sid][layer, 0, :, :n].float()
                cv = self._buf[sid][layer, 1, :, :n].float()
                kk = torch.cat([ck, k[off:off + ql].float().transpose(0, 1)], 1)
                vv = torch.cat([cv, v[off:off + ql].float().transpose(0, 1)], 1)
                qpos = torch.arange(st, st + ql, device=q.device)[:, None]
                kpos = torch.cat([torch.arange(first, first + n, device=q.device),
                                  torch.arange(st, st + ql, device=q.device)])[None, :]
                is_blk = torch.arange(n + ql, device=q.device)[None, :] >= n
                vis = torch.ones(ql, n + ql, dtype=torch.bool, device=q.device)
                if causal:
                    vis &= kpos <= qpos
                if w is not None:
                    # Bidirectional windowed layers keep the whole block visible (as the paged path).
                    vis &= (kpos > qpos - w) | (is_blk & ~torch.tensor(causal))
                hkv = kk.shape[0]
                g = q.shape[1] // hkv
                qs = q[off:off + ql].float().view(ql, hkv, g, -1).permute(1, 2, 0, 3)
                s = torch.einsum("hgqd,hkd->hgqk", qs, kk) * scale
                s = s.masked_fill(~vis, float("-inf"))
                o = torch.einsum("hgqk,hkd->hgqd", torch.softmax(s, -1), vv)
                out[off:off + ql] = o.permute(2, 0, 1, 3).reshape(ql, q.shape[1], -1).to(q.dtype)
                off += ql
            return out

        return attn
