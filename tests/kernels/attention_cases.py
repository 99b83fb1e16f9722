"""Shared builders for the attention tests (random paged KV with shuffled page tables)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvstrata.kernels.attention_plan import AttentionMetadata, SplitPolicy, plan_attention


@dataclass
class PagedCase:
    q: torch.Tensor                  # [T, Hq, D]
    kv_cache: torch.Tensor           # [num_pages, L, 2, Hkv, P, D]
    layer: int
    meta: AttentionMetadata
    dense_k: list[torch.Tensor]      # per sequence [Hkv, seq_len, D]
    dense_v: list[torch.Tensor]
    block_kv: tuple[torch.Tensor, torch.Tensor] | None


def make_case(seq_lens, q_lens, *, hkv=2, group=4, head_dim=64, page_size=16, num_layers=2,
              layer=1, dtype=torch.float32, causal=True, seed=0, extra_pages=3,
              num_splits=None, block=False, split_policy=None) -> PagedCase:
    """Random (never zero) paged KV; each sequence's pages are a random, shuffled subset.

    ``split_policy`` (a :class:`~kvstrata.kernels.attention_plan.SplitPolicy`) lets short test
    sequences use short splits (e.g. ``align=16``) so every split holds real keys."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(s / page_size) for s in seq_lens]
    num_pages = sum(need) + extra_pages
    kv = torch.randn(num_pages, num_layers, 2, hkv, page_size, head_dim, generator=g).to(dtype)
    perm = torch.randperm(num_pages, generator=g).tolist()
    max_pages = max(max(need), 1)
    # Padding entries point at real (other sequences') pages so a kernel that ignores seq_lens
    # would read wrong but finite data and fail the comparison.
    bt = torch.tensor(perm[:max_pages], dtype=torch.int32).repeat(len(seq_lens), 1)
    dense_k, dense_v = [], []
    at = 0
    for i, n in enumerate(need):
        pages = perm[at:at + n]
        at += n
        if n:
            bt[i, :n] = torch.tensor(pages, dtype=torch.int32)
        sel = kv[torch.tensor(pages, dtype=torch.long), layer] if n else kv[:0, layer]
        flat = sel.permute(1, 2, 0, 3, 4).reshape(2, hkv, n * page_size, head_dim)
        dense_k.append(flat[0, :, :seq_lens[i]])
        dense_v.append(flat[1, :, :seq_lens[i]])
    total = sum(q_lens)
    q = torch.randn(total, hkv * group, head_dim, generator=g).to(dtype)
    block_kv = None
    if block:
        block_kv = (torch.randn(total, hkv, head_dim, generator=g).to(dtype),
                    torch.randn(total, hkv, head_dim, generator=g).to(dtype))
    meta = plan_attention(bt, torch.tensor(seq_lens, dtype=torch.int32), list(q_lens),
                          page_size=page_size, causal=causal and not block, num_splits=num_splits,
                          num_kv_heads=hkv, split_policy=split_policy)
    return PagedCase(q, kv, layer, meta, dense_k, dense_v, block_kv)


#: Short splits for short test sequences (every split of a ~100-token sequence holds keys).
FINE_SPLITS = SplitPolicy(min_tokens=16, fine_min_tokens=16, align=16)


def tol(dtype: torch.dtype) -> dict:
    return {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
            torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}[dtype]
