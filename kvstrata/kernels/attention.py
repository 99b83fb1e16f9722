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
:mod:`kvstrata.kernels.attention_triton`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from ..dtypes import SUPPORTED_DTYPES
from ._device import num_sms as device_num_sms

_IMPLS = ("auto", "triton", "torch")
#: Split-KV never cuts a sequence into pieces shorter than this many tokens (the cost of writing
#: and reducing partial results must stay small next to the KV each split reads) ...
MIN_TOKENS_PER_SPLIT = 512
#: ... unless even splits of MIN_TOKENS_PER_SPLIT leave most SMs idle (few short sequences):
#: then splits may go down to this many tokens.
FINE_MIN_TOKENS_PER_SPLIT = 128
MAX_SPLITS = 64
#: tokens_per_split is a multiple of this (every KV tile size BLOCK_N <= 128 divides it).
SPLIT_ALIGN = 128


@dataclass(frozen=True, slots=True)
class SplitPolicy:
    """Knobs of the host-side split-KV choice (:func:`choose_num_splits`).

    Attributes:
        min_tokens: shortest split when the batch can fill the GPU with splits this long.
        fine_min_tokens: shortest split when even ``min_tokens`` splits would leave SMs idle
            (fewer than ``num_sms`` programs); ``fine_min_tokens >= align``.
        waves: target programs per SM (``programs <= waves * num_sms``).
        short_ctx: contexts up to this many tokens are not split once every SM has a program.
        verify_split_ctx: multi-token queries over contexts this long take >= 2 splits.
        verify_fine_min_tokens: ``fine_min_tokens`` for multi-token queries, unless even
            splits this long leave fewer programs than SMs (then ``fine_min_tokens``).
        max_splits: upper bound on the split factor.
        align: ``tokens_per_split`` is rounded up to a multiple of this (a power of two >= 16;
            the kernel needs its KV tile size BLOCK_N to divide it).
    """

    min_tokens: int = MIN_TOKENS_PER_SPLIT
    fine_min_tokens: int = FINE_MIN_TOKENS_PER_SPLIT
    waves: float = 4.0
    max_splits: int = MAX_SPLITS
    short_ctx: int = 2048
    verify_split_ctx: int = 8192
    verify_fine_min_tokens: int = 256
    align: int = SPLIT_ALIGN

    def __post_init__(self):
        if self.align < 16 or self.align & (self.align - 1):
            raise ValueError(f"align must be a power of two >= 16, got {self.align}")
        if not (self.align <= self.fine_min_tokens <= self.min_tokens):
            raise ValueError("need align <= fine_min_tokens <= min_tokens, got "
                             f"{self.align}, {self.fine_min_tokens}, {self.min_tokens}")
        if self.waves <= 0 or self.max_splits < 1 or self.verify_fine_min_tokens < self.align:
            raise ValueError(f"waves must be > 0 and max_splits >= 1, got {self.waves}, "
                             f"{self.max_splits}")


DEFAULT_SPLIT_POLICY = SplitPolicy()


@dataclass(slots=True)
class AttentionMetadata:
    """One step's attention plan (built once on the host, reused by every layer).

    Attributes:
        block_tables: ``[num_seqs, max_pages] int32`` page ids, on the pool's device.
        seq_lens: ``[num_seqs] int32`` tokens of paged KV visible to each sequence.
        query_start_loc: ``[num_seqs + 1] int32`` packed query offsets.
        max_query_len, max_seq_len: host ints (bounds for grids; no device->host sync at run).
        causal: causal mode (True) or DFlash block mode (False).
        page_size: tokens per page.
        num_splits: split-KV factor (1 = no split), chosen on the host at plan time.
        tokens_per_split: KV tokens each split covers (a multiple of the split policy's
            ``align``, 128 by default).
        seq_lens_host, query_lens_host: host copies when known (used by the torch path).
        split_tokens: optional ``[1] int32`` device copy of ``tokens_per_split`` that the kernel
            reads instead of the host int (a CUDA graph's plan: the runner writes it each step;
            ``tokens_per_split`` is then the largest value it may take, and the grid stays
            ``num_splits`` wide).
    """

    block_tables: Tensor
    seq_lens: Tensor
    query_start_loc: Tensor
    max_query_len: int
    max_seq_len: int
    causal: bool
    page_size: int
    num_splits: int = 1
    tokens_per_split: int = 0
    seq_lens_host: list[int] | None = None
    query_lens_host: list[int] | None = None
    split_tokens: Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]

    @property
    def num_query_tokens(self) -> int:
        if self.query_lens_host is not None:
            return sum(self.query_lens_host)
        return int(self.query_start_loc[-1])

    def host_lens(self) -> tuple[list[int], list[int]]:
        """``(seq_lens, query_lens)`` as host lists (syncs only if plan did not get host copies)."""
        sl = self.seq_lens_host if self.seq_lens_host is not None else self.seq_lens.tolist()
        ql = self.query_lens_host
        if ql is None:
            ql = torch.diff(self.query_start_loc).tolist()
        return sl, ql


def _as_host_list(x, what: str) -> list[int] | None:
    if x is None:
        return None
    if isinstance(x, Tensor):
        if x.device.type != "cpu":
            return None
        return [int(v) for v in x.tolist()]
    try:
        return [int(v) for v in x]
    except (TypeError, ValueError):
        raise ValueError(
            f"{what} must be a 1-D tensor or a sequence of ints, got {type(x)}") from None


def choose_num_splits(num_seqs: int, max_seq_len: int, *, num_kv_heads: int = 8,
                      num_q_blocks: int = 1, num_sms: int = 132,
                      policy: SplitPolicy | None = None, max_query_len: int = 1) -> int:
    """Split-KV factor for a batch (host arithmetic only, never a device sync).

    Rules, from the H200 sweeps (docs/benchmarks.md, attention config sweep):

    - Aim at ``policy.waves`` programs per SM and never more (``floor``): a last, partial wave
      runs with too few programs to keep HBM busy (32 x 8k decode: 351 us with 3 splits = 768
      programs, 255 us with 2 = 512).
    - Short contexts (``<= policy.short_ctx``) that already give every SM a program are not
      split: the partial outputs and the merge cost more than they save.
    - Multi-token queries (verify) over long contexts (``>= policy.verify_split_ctx``) take at
      least 2 splits (128 x 8k verify-16: 1300 us unsplit, 1099 us with 2).
    - No split is shorter than ``policy.min_tokens``; when that leaves fewer programs than SMs
      (a few sequences), no shorter than ``policy.fine_min_tokens`` (decode) or
      ``policy.verify_fine_min_tokens`` (verify: 1 x 8k verify-16 26.1 us with 32 splits, more
      with 64), and for verify, when even that leaves SMs idle, ``policy.fine_min_tokens``
      (1 x 1k verify-16: 14.0 us with 8 splits, 19.9 with 4). Capped at ``policy.max_splits``.
    """
    pol = policy or DEFAULT_SPLIT_POLICY
    programs = max(1, num_seqs * num_kv_heads * num_q_blocks)
    if max_seq_len <= pol.short_ctx and programs >= num_sms:
        return 1
    want = math.floor(pol.waves * num_sms / programs)
    if max_query_len > 1 and max_seq_len >= pol.verify_split_ctx:
        want = max(want, 2)
    if want <= 1:
        return 1
    most = max(1, max_seq_len // pol.min_tokens)
    if programs * most < num_sms:
        fine = pol.fine_min_tokens if max_query_len <= 1 else pol.verify_fine_min_tokens
        most = max(1, max_seq_len // fine)
        if programs * most < num_sms:
            most = max(1, max_seq_len // pol.fine_min_tokens)
    return max(1, min(want, most, pol.max_splits))


def plan_attention(block_tables: Tensor, seq_lens: Tensor | Sequence[int],
                   query_lens: Tensor | Sequence[int], *, page_size: int, causal: bool = True,
                   device: torch.device | str | None = None,
                   seq_lens_host: list[int] | None = None, num_kv_heads: int = 8,
                   num_sms: int | None = None, num_splits: int | None = None,
                   split_policy: SplitPolicy | None = None) -> AttentionMetadata:
    """Build a step's :class:`AttentionMetadata` (FlashInfer-style "plan").

    Args:
        block_tables: ``[num_seqs, max_pages] int32`` page ids (padded rows may hold anything).
        seq_lens: ``[num_seqs]`` paged tokens visible to each sequence (causal mode: including the
            queries' own tokens; block mode: the committed context only).
        query_lens: ``[num_seqs]`` query tokens per sequence (packed in this order).
        page_size: tokens per page of the pool.
        causal: causal mode (decode / prefill / verify) or False for the DFlash block mode.
        device: where the metadata tensors go (default: ``block_tables.device``).
        seq_lens_host: host copy of ``seq_lens`` when ``seq_lens`` is a device tensor; without it
            the split plan assumes every sequence fills its block table (no sync either way).
        num_kv_heads, num_sms: sizing hints for the split-KV choice (``num_sms`` defaults to the
            device's SM count, a host-side property query).
        num_splits: force a split factor (tests, benchmarks).
        split_policy: knobs of the split choice and of the ``tokens_per_split`` alignment
            (default :data:`DEFAULT_SPLIT_POLICY`).
    """
    if not isinstance(block_tables, Tensor) or block_tables.dim() != 2:
        raise ValueError("block_tables must be a [num_seqs, max_pages] int32 tensor")
    if block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be int32, got {block_tables.dtype}")
    if not isinstance(page_size, int) or page_size <= 0 or page_size & (page_size - 1):
        raise ValueError(f"page_size must be a positive power of two, got {page_size!r}")
    dev = torch.device(device) if device is not None else block_tables.device
    n = block_tables.shape[0]
    sl_host = seq_lens_host if seq_lens_host is not None else _as_host_list(seq_lens, "seq_lens")
    ql_host = _as_host_list(query_lens, "query_lens")
    for name, lst in (("seq_lens", sl_host), ("query_lens", ql_host)):
        if lst is not None and len(lst) != n:
            raise ValueError(f"{name} has {len(lst)} entries but block_tables has {n} rows")
    capacity = block_tables.shape[1] * page_size
    if sl_host is not None:
        for i, s in enumerate(sl_host):
            if s < 0 or s > capacity:
                raise ValueError(f"seq_lens[{i}]={s} is outside [0, {capacity}] (block_tables "
                                 f"has {block_tables.shape[1]} pages of {page_size} tokens)")
    if ql_host is not None:
        if any(q < 0 for q in ql_host):
            raise ValueError(f"query_lens must be >= 0, got {ql_host}")
        if causal and sl_host is not None:
            bad = [i for i, (s, q) in enumerate(zip(sl_host, ql_host)) if q > s]
            if bad:
                i = bad[0]
                raise ValueError(
                    f"causal mode: sequence {i} has {ql_host[i]} query tokens but only "
                    f"{sl_host[i]} paged tokens; seq_lens must include the queries' own tokens "
                    f"(write_kv them first)")
    if ql_host is None:
        raise ValueError("query_lens must be given on the host (a list or CPU tensor); the plan "
                         "needs their max and offsets without a device->host sync")
    qsl = torch.zeros(n + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(ql_host, dtype=torch.int64), 0).to(torch.int32)
    max_q = max(ql_host, default=0)
    max_s = max(sl_host, default=0) if sl_host is not None else capacity
    if num_splits is None:
        if num_sms is None:
            num_sms = device_num_sms(dev, 132)
        q_blocks = max(1, math.ceil(max_q / 16))
        num_splits = choose_num_splits(n, max_s, num_kv_heads=num_kv_heads,
                                       num_q_blocks=q_blocks, num_sms=num_sms,
                                       policy=split_policy, max_query_len=max_q)
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    align = (split_policy or DEFAULT_SPLIT_POLICY).align
    per = math.ceil(max(max_s, 1) / num_splits)
    per = math.ceil(per / align) * align
    sl_t = seq_lens if isinstance(seq_lens, Tensor) else torch.tensor(sl_host, dtype=torch.int32)
    return AttentionMetadata(
        block_tables=block_tables.to(dev), seq_lens=sl_t.to(device=dev, dtype=torch.int32),
        query_start_loc=qsl.to(dev), max_query_len=max_q, max_seq_len=max_s, causal=causal,
        page_size=page_size, num_splits=num_splits, tokens_per_split=per,
        seq_lens_host=sl_host, query_lens_host=ql_host)


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
    out = torch.empty_like(q)
    seq_lens, q_lens = meta.host_lens()
    bt = meta.block_tables
    start = 0
    for s, (L, ql) in enumerate(zip(seq_lens, q_lens)):
        if ql == 0:
            continue
        if meta.causal and L == 0:
            # A padding row of a captured batch (length 0): nothing visible, output 0 (as the
            # kernel writes).
            out[start:start + ql] = 0
            start += ql
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
        start += ql
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
        impl: ``"auto"`` (Triton on CUDA, torch on CPU), ``"triton"`` or ``"torch"``.

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
    from .attention_triton import paged_attention_triton
    check_attention_args(q, kv_cache, layer, meta, block_kv)
    return paged_attention_triton(q, kv_cache, layer, meta, sm_scale=sm_scale,
                                  sliding_window=sliding_window, block_kv=block_kv)


__all__ = ["AttentionMetadata", "DEFAULT_SPLIT_POLICY", "SplitPolicy", "choose_num_splits",
           "paged_attention", "paged_attention_ref", "plan_attention"]
