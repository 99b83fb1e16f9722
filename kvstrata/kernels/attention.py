"""Paged attention over the page pool: plan once per step, run for every layer.

The KV of one layer group lives in the pool tensor
``kv_cache: [num_pages, num_layers, 2, num_kv_heads, page_size, head_dim]`` (K then V). A step's
metadata (:class:`AttentionMetadata`) is built once on the host by :func:`plan_attention` and
reused by every layer's :func:`paged_attention` call, so the run path never syncs the device.

Two query modes share one kernel family:

- **causal** (``meta.causal``, no ``block_kv``): query ``i`` of sequence ``s`` sits at absolute
  position ``seq_lens[s] - q_len_s + i`` and attends to paged positions ``j <= pos`` (and
  ``j > pos - sliding_window``). The queries' own K/V must already be in the pages
  (:func:`kvstrata.kernels.kv_write.write_kv`). Serves decode, chunked prefill and speculative
  verify.
- **block** (``block_kv=(k, v)``, ``meta.causal`` False): the DFlash draft block. Query ``i``
  attends to every committed position ``j < seq_lens[s]`` (window relative to ``seq_lens[s] + i``)
  and bidirectionally to all ``q_len_s`` tokens of its own block, whose K/V is scratch.

:func:`paged_attention_ref` is the plain-torch oracle (and the CPU path); the Triton kernels live in
:mod:`kvstrata.kernels.attention_triton`. Batch-1 decode on an sm_90 GPU (bf16, 128-dim heads,
16-token pages, contexts up to 32k) runs :func:`kvstrata.kernels.decode_segment.decode_attention`
instead: one CUDA launch, its page products on tensor cores, 1 x 8k 19.7 us against 22.1 for
the Triton kernel (docs/benchmarks.md, thirty-first runner session).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..dtypes import SUPPORTED_DTYPES
# The plan's public names stay importable from here too (the plan lives in attention_plan.py,
# which both this module and the Triton kernels import: no loop).
from .attention_plan import (DEFAULT_SPLIT_POLICY, AttentionMetadata, SplitPolicy,
                             choose_num_splits, plan_attention)

_IMPLS = ("auto", "triton", "torch")


def check_attention_args(q: Tensor, kv_cache: Tensor, layer: int, meta: AttentionMetadata,
                         block_kv: tuple[Tensor, Tensor] | None) -> None:
    """Shape/dtype validation shared by every implementation (raises ``ValueError``)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [num_q_tokens, num_q_heads, head_dim], got {tuple(q.shape)}")
    if kv_cache.dim() != 6 or kv_cache.shape[2] != 2:
        raise ValueError("kv_cache must be [num_pages, num_layers, 2, num_kv_heads, page_size, "
                         f"head_dim], got {tuple(kv_cache.shape)}")
    if q.dtype not in SUPPORTED_DTYPES.values() or q.dtype != kv_cache.dtype:
        raise ValueError(f"q ({q.dtype}) and kv_cache ({kv_cache.dtype}) must share one of "
                         f"{sorted(SUPPORTED_DTYPES)}")
    _, num_layers, _, hkv, page_size, d = kv_cache.shape
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer={layer} is outside the group's {num_layers} layers")
    if page_size != meta.page_size:
        raise ValueError(f"kv_cache page_size {page_size} != planned page_size {meta.page_size}")
    if q.shape[2] != d:
        raise ValueError(f"q head_dim {q.shape[2]} != kv_cache head_dim {d}")
    if q.shape[1] % hkv:
        raise ValueError(f"num_q_heads={q.shape[1]} is not a multiple of num_kv_heads={hkv}")
    if meta.query_lens_host is not None and q.shape[0] != sum(meta.query_lens_host):
        raise ValueError(f"q has {q.shape[0]} tokens but the plan packs "
                         f"{sum(meta.query_lens_host)}")
    if block_kv is None:
        if not meta.causal:
            raise ValueError("block mode (meta.causal=False) needs block_kv=(k, v)")
    else:
        if meta.causal:
            raise ValueError("block_kv given but the plan is causal; plan with causal=False")
        k, v = block_kv
        want = (q.shape[0], hkv, d)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != want or t.dtype != q.dtype:
                raise ValueError(f"block_kv {name} must be {list(want)} {q.dtype}, got "
                                 f"{list(t.shape)} {t.dtype}")


def paged_attention_ref(q: Tensor, kv_cache: Tensor, layer: int, meta: AttentionMetadata, *,
                        sm_scale: float, sliding_window: int | None = None,
                        block_kv: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Plain-torch paged attention (the oracle); same contract as :func:`paged_attention`.

    Computes in float32 one sequence at a time; returns ``[num_q_tokens, num_q_heads, head_dim]``
    in ``q.dtype``.
    """
    check_attention_args(q, kv_cache, layer, meta, block_kv)
    _, _, _, hkv, page_size, d = kv_cache.shape
    hq = q.shape[1]
    group = hq // hkv
    out = torch.empty_like(q) if meta.query_lens is None else torch.zeros_like(q)
    seq_lens, q_lens = meta.host_lens()
    starts = meta.host_starts()
    bt = meta.block_tables
    for s, (L, ql, start) in enumerate(zip(seq_lens, q_lens, starts)):
        if ql == 0:
            continue
        if meta.causal and L == 0:
            # A padding row of a captured batch (length 0): nothing visible, output 0 (as the
            # kernel writes).
            out[start:start + ql] = 0
            continue
        n_pages = math.ceil(L / page_size)
        pages = kv_cache[bt[s, :n_pages].long(), layer].float()  # [n, 2, hkv, P, D]
        kv = pages.permute(1, 2, 0, 3, 4).reshape(2, hkv, n_pages * page_size, d)[:, :, :L]
        k, v = kv[0], kv[1]
        if meta.causal:
            pos = torch.arange(L - ql, L)
        else:
            pos = torch.arange(L, L + ql)
        j = torch.arange(L)
        mask = torch.ones(ql, L, dtype=torch.bool)
        if meta.causal:
            mask &= j[None, :] <= pos[:, None]
        if sliding_window is not None:
            mask &= j[None, :] > pos[:, None] - sliding_window
        if block_kv is not None:
            bk = block_kv[0][start:start + ql].float().transpose(0, 1)  # [hkv, ql, D]
            bv = block_kv[1][start:start + ql].float().transpose(0, 1)
            k = torch.cat([k, bk], 1)
            v = torch.cat([v, bv], 1)
            mask = torch.cat([mask, torch.ones(ql, ql, dtype=torch.bool)], 1)
        qs = q[start:start + ql].float().view(ql, hkv, group, d).permute(1, 2, 0, 3)
        scores = torch.einsum("hgqd,hkd->hgqk", qs, k) * sm_scale
        scores = scores.masked_fill(~mask.to(scores.device), float("-inf"))
        p = torch.softmax(scores, dim=-1)
        o = torch.einsum("hgqk,hkd->hgqd", p, v)  # [hkv, group, ql, D]
        out[start:start + ql] = o.permute(2, 0, 1, 3).reshape(ql, hq, d).to(q.dtype)
    return out


def paged_attention(q: Tensor, kv_cache: Tensor, layer: int, meta: AttentionMetadata, *,
                    sm_scale: float, sliding_window: int | None = None,
                    block_kv: tuple[Tensor, Tensor] | None = None, impl: str = "auto") -> Tensor:
    """Paged attention of packed queries over one layer of one group's pool tensor.

    Args:
        q: ``[num_q_tokens, num_q_heads, head_dim]`` bf16/fp16/fp32, packed by sequence per
            ``meta.query_start_loc``.
        kv_cache: ``[num_pages, num_layers, 2, num_kv_heads, page_size, head_dim]``, q's dtype.
        layer: layer index inside the group.
        meta: the step's :class:`AttentionMetadata` from :func:`plan_attention`.
        sm_scale: softmax scale (usually ``head_dim ** -0.5``).
        sliding_window: optional window in tokens (see the module docstring for each mode).
        block_kv: ``(k, v)``, each ``[num_q_tokens, num_kv_heads, head_dim]``: DFlash block mode.
        impl: ``"auto"`` (Triton on CUDA, torch on CPU; batch-1 decode on an sm_90 GPU: the
            CUDA kernel of :func:`~.decode_segment.decode_attention_ok`), ``"triton"`` or
            ``"torch"``.

    Returns:
        ``[num_q_tokens, num_q_heads, head_dim]`` in ``q.dtype``. GQA:
        ``num_q_heads % num_kv_heads == 0``.
    """
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window <= 0):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if impl == "torch" or (impl == "auto" and q.device.type != "cuda"):
        return paged_attention_ref(q, kv_cache, layer, meta, sm_scale=sm_scale,
                                   sliding_window=sliding_window, block_kv=block_kv)
    check_attention_args(q, kv_cache, layer, meta, block_kv)
    if block_kv is None:
        from .decode_segment import decode_attention, decode_attention_ok
        if decode_attention_ok(q, kv_cache, meta, sliding_window, impl):
            return decode_attention(q, kv_cache, layer, meta, sm_scale=sm_scale)
    from .attention_triton import paged_attention_triton
    return paged_attention_triton(q, kv_cache, layer, meta, sm_scale=sm_scale,
                                  sliding_window=sliding_window, block_kv=block_kv)


__all__ = ["AttentionMetadata", "DEFAULT_SPLIT_POLICY", "SplitPolicy", "check_attention_args",
           "choose_num_splits", "paged_attention", "paged_attention_ref", "plan_attention"]
