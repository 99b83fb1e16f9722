"""The plan of a paged-attention step: what is decided once per batch on the host.

:func:`plan_attention` builds an :class:`AttentionMetadata` (page tables, lengths, the split-KV
choice of :func:`choose_num_splits` under a :class:`SplitPolicy`) that every layer's
:func:`kvstrata.kernels.attention.paged_attention` call reuses; :func:`kernel_config` picks the
Triton kernel's tiles and launch knobs for a plan. Both the torch reference
(:mod:`kvstrata.kernels.attention`) and the Triton kernels
(:mod:`kvstrata.kernels.attention_triton`) import this module; it imports neither (no Triton
needed to plan).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from ._device import num_sms as device_num_sms

#: Split-KV never cuts a sequence into pieces shorter than this many tokens (the cost of writing
#: and reducing partial results must stay small next to the KV each split reads) ...
MIN_TOKENS_PER_SPLIT = 512
#: ... unless even splits of MIN_TOKENS_PER_SPLIT leave most SMs idle (few short sequences):
#: then splits may go down to this many tokens.
FINE_MIN_TOKENS_PER_SPLIT = 128
MAX_SPLITS = 64
#: tokens_per_split is a multiple of this (every KV tile size BLOCK_N <= 128 divides it).
SPLIT_ALIGN = 128
#: Decode launches of at most this many (sequence, query block, KV head) groups merge their
#: splits in the same launch (``kernel_config``'s ``FUSED_REDUCE``) over a grid of
#: ``SplitPolicy.fused_waves`` programs per SM; larger ones merge in a second launch. H200, one
#: layer, cold L2, graph replay, us (docs/benchmarks.md, thirtieth runner session): 1 x 8k
#: fused with 32 splits 22.2 against 23.3 for two launches; 8 x 32k (64 groups) fused 284.8
#: against 259.7, 32 x 8k (256 groups) 286.1 against 260.2.
FUSED_MERGE_GROUPS = 16


@dataclass(frozen=True, slots=True)
class SplitPolicy:
    """Knobs of the host-side split-KV choice (:func:`choose_num_splits`).

    Attributes:
        min_tokens: shortest split when the batch can fill the GPU with splits this long.
        fine_min_tokens: shortest split when even ``min_tokens`` splits would leave SMs idle
            (fewer than ``num_sms`` programs); ``fine_min_tokens >= align``.
        waves: target programs per SM (``programs <= waves * num_sms``).
        fused_waves: the same for decode that merges in the same launch (at most
            :data:`FUSED_MERGE_GROUPS` groups): 1 x 8k 22.2 us with 32 splits (2 programs per
            SM) against 26.6 with 64; 1 x 32k 50.8 against 56.2.
        short_ctx: contexts up to this many tokens are not split once every SM has a program.
        verify_split_ctx: multi-token queries over contexts this long take >= 2 splits (when
            unsplit they would exceed ``waves`` programs per SM).
        verify_fine_min_tokens: ``fine_min_tokens`` for multi-token queries, unless even
            splits this long leave fewer programs than SMs (then ``fine_min_tokens``).
        max_splits: upper bound on the split factor.
        align: ``tokens_per_split`` is rounded up to a multiple of this (a power of two >= 16;
            the kernel needs its KV tile size BLOCK_N to divide it).
    """

    min_tokens: int = MIN_TOKENS_PER_SPLIT
    fine_min_tokens: int = FINE_MIN_TOKENS_PER_SPLIT
    waves: float = 4.0
    fused_waves: float = 2.0
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
        if (self.waves <= 0 or self.fused_waves <= 0 or self.max_splits < 1
                or self.verify_fine_min_tokens < self.align):
            raise ValueError(f"need waves > 0, fused_waves > 0, max_splits >= 1 and "
                             f"verify_fine_min_tokens >= align, got {self.waves}, "
                             f"{self.fused_waves}, {self.max_splits}, "
                             f"{self.verify_fine_min_tokens} (align {self.align})")


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
        query_lens: optional ``[num_seqs] int32`` device lengths of each sequence's queries,
            which then start at ``query_start_loc[s]`` and may be shorter than the gap to the
            next sequence (a CUDA graph's plan packs every sequence at a fixed stride; a
            shortened block uses its first ``query_lens[s]`` rows; the rest are left
            unwritten and nothing reads them).
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
    query_lens: Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]

    @property
    def num_query_tokens(self) -> int:
        if self.query_lens_host is not None:
            return sum(self.query_lens_host)
        return int(self.query_start_loc[-1])

    def host_lens(self) -> tuple[list[int], list[int]]:
        """``(seq_lens, query_lens)`` as host lists (syncs only if plan did not get host copies).
        With device ``query_lens`` these are the per-row lengths (see :meth:`host_starts`)."""
        sl = self.seq_lens_host if self.seq_lens_host is not None else self.seq_lens.tolist()
        if self.query_lens is not None:
            return sl, self.query_lens.tolist()
        ql = self.query_lens_host
        if ql is None:
            ql = torch.diff(self.query_start_loc).tolist()
        return sl, ql

    def host_starts(self) -> list[int]:
        """First packed row of each sequence's queries, as a host list."""
        if self.query_lens is not None:
            return self.query_start_loc[:-1].tolist()
        ql = self.host_lens()[1]
        return [sum(ql[:i]) for i in range(len(ql))]


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
      programs, 255 us with 2 = 512). Decode of at most :data:`FUSED_MERGE_GROUPS` groups,
      which merges in the same launch, aims at ``policy.fused_waves``.
    - Short contexts (``<= policy.short_ctx``) that already give every SM a program are not
      split: the partial outputs and the merge cost more than they save.
    - Multi-token queries (verify) over long contexts (``>= policy.verify_split_ctx``) take at
      least 2 splits (128 x 8k verify-16: 1300 us unsplit, 1099 us with 2) when the unsplit
      grid exceeds ``policy.waves`` programs per SM; one that fits (64 x verify-16: 512
      programs) stays whole (runner's grid, per layer: 82.4 us unsplit at 1k against 104.4
      with 2 splits, 635.6 / 645.7 at 8k; docs/benchmarks.md, sixth runner session).
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
    fused = max_query_len <= 1 and programs <= FUSED_MERGE_GROUPS
    want = math.floor((pol.fused_waves if fused else pol.waves) * num_sms / programs)
    if (max_query_len > 1 and max_seq_len >= pol.verify_split_ctx
            and programs > pol.waves * num_sms):
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
    chosen = num_splits is None
    if chosen:
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
    if chosen:   # no program whose split starts past the longest sequence (1 x 8k: 33 -> 32)
        num_splits = math.ceil(max(max_s, 1) / per)
    sl_t = seq_lens if isinstance(seq_lens, Tensor) else torch.tensor(sl_host, dtype=torch.int32)
    return AttentionMetadata(
        block_tables=block_tables.to(dev), seq_lens=sl_t.to(device=dev, dtype=torch.int32),
        query_start_loc=qsl.to(dev), max_query_len=max_q, max_seq_len=max_s, causal=causal,
        page_size=page_size, num_splits=num_splits, tokens_per_split=per,
        seq_lens_host=sl_host, query_lens_host=ql_host)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for ``n <= 1``); Triton's rule, without Triton."""
    return 1 << max(0, int(n) - 1).bit_length()


#: Partial-output elements one merge program holds (heads x splits x head_dim).
REDUCE_TILE = 4096


def block_q_for(group: int, max_query_len: int) -> int:
    """Query tokens per program: ``BLOCK_Q * GROUP_PAD`` rows, >= 16 for tl.dot, <= 64."""
    group_pad = next_power_of_2(group)
    block_q = max(1, min(next_power_of_2(max(max_query_len, 1)), 64 // group_pad))
    return max(block_q, 16 // group_pad) if group_pad < 16 else block_q


def kernel_config(group: int, head_dim: int, max_query_len: int, tokens_per_split: int = 0,
                  programs: int = 0, num_sms: int = 132, groups: int = 0) -> dict:
    """Default tile and launch knobs (``config=`` of :func:`paged_attention_triton` overrides
    any of them; ``benchmarks/attention_bench.py --sweep-cases`` measures the alternatives).

    ``BLOCK_Q * GROUP_PAD`` rows (>= 16 for tl.dot, ~64 for verify/prefill); ``BLOCK_N`` KV
    tokens per tile; ``FUSED_REDUCE``: split-KV merges its partials in the same launch (the last
    split program of each (sequence, q block, KV head) merges) instead of a second kernel;
    ``RED_CHUNK``: splits merged per step by that program; ``SPLIT_LOOP``: run the KV tiles
    that every query row sees whole without masks (causal/no-window), masking only the tail;
    ``maxnreg`` (optional): cap the registers per thread (more programs per SM);
    ``TMA_STAGES``: when > 0, causal launches over a pool that allows it take whole pages by
    bulk tensor copies into that many stages (``_paged_attention_tma_kernel``).
    ``programs``: the launch's grid size (0 = unknown), against ``num_sms``; ``groups``: its
    (sequence, query block, KV head) groups (0 = unknown: taken as few).
    """
    group_pad = next_power_of_2(group)
    block_q = block_q_for(group, max_query_len)
    block_d = max(16, next_power_of_2(head_dim))
    # Measured on an H200 (docs/benchmarks.md, attention config sweep, bf16 GQA 32/8 d128):
    # 64 query rows (verify-16) run best on 32-token KV tiles with 2 stages; decode on 64-token
    # tiles with 2 stages, or 32-token tiles when splits are as short as 128 tokens (1 x 8k).
    # Unmasked interior tiles (SPLIT_LOOP) won or tied everywhere. (A first fused reduce that
    # merged row by row lost everywhere: 31.7 vs 18.1 us per layer at 1 x 8k; the tile merge
    # below replaced it.)
    # 64 query rows (verify-16, prefill, the draft block) hold a 64 x 128 fp32 accumulator: 147
    # registers and 3 programs per SM. A launch that fits one wave of those (<= 2 per SM: 32 x 1k
    # verify unsplit, 1 x 8k with 32 splits) runs best on 64-token tiles (32 x 1k 53.3 us vs
    # 61.9 with 32; the register cap loses there, 58.7); more programs run best on 32-token
    # tiles capped at 128 registers, 4 programs per SM (128 x 1k verify 157.3 us vs 184.9;
    # 8 x 2k prefill 852 vs 989; 64 x 2k draft block 152 vs 221; 8 x 8k verify: tie).
    block_m = block_q * group_pad
    maxnreg = None
    if block_d > 128:
        block_n = 32
    elif block_m >= 64:
        block_n = 64 if 0 < programs <= 2 * num_sms else 32
        if programs > 2 * num_sms:
            maxnreg = 128
    else:
        block_n = 32 if 0 < tokens_per_split <= 128 else 64
        # Verify of 4 or 8 query tokens (the runner's narrower verify widths: 16 or 32 rows)
        # over more than two programs per SM: the same cap. H200, 16 x 8k, 4 splits, 36
        # layers in a graph (docs/benchmarks.md, ninth runner session): 8 tokens 171.2 us
        # per layer against 179.4 uncapped, 4 tokens 141.3 against 157.8.
        if max_query_len > 1 and programs > 2 * num_sms:
            maxnreg = 128
    # Decode (one query row per head) of few groups (FUSED_MERGE_GROUPS) merges its splits in
    # the same launch: the last split
    # program of a KV head reads [GROUP_PAD, RED_CHUNK, BLOCK_D] fp32 partial tiles. H200, batch
    # 1, 36 layers in a graph, the runner's 34-program grid (docs/benchmarks.md, fifth runner
    # session), us per layer at 1k / 8k / 32k: split + merge 8.9 / 20.6 / 67.5, fused with
    # 8-split tiles 10.3 / 21.6 / 69.3, 16: 8.8 / 20.7 / 66.2, 32: 7.8 / 18.1 / 56.7 (two-pass
    # merge; the one-pass merge of 32: 7.1 / 17.4 / 55.4). Verify's 64 rows per program would
    # merge serially: it keeps the merge launch.
    red_chunk = max(2, min(64, 16384 // (group_pad * block_d)))
    # Verify-sized queries over a grid of at most ~3 programs per SM (batch 1) copy one page
    # of K and V per step into 8 stages with bulk tensor copies where the pool allows
    # (attention_triton._tma_ok). H200, batch-1 verify-16, the runner's 34-split grid, 36
    # layers in one graph, the split launch: 15.2 against 19.8 us per layer at 8k, 7.0
    # against 7.2 at 1k (docs/benchmarks.md, thirteenth runner session). Decode in that grid
    # gained 0.9 us at 1k and nothing at 8k (before its merge), and larger grids were not
    # measured: both keep the tiles.
    tma = 8 if 1 < max_query_len <= 16 and 0 < programs <= 3 * num_sms else 0
    return dict(GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_D=block_d, BLOCK_N=block_n,
                num_warps=4 if block_m <= 64 else 8, num_stages=2,
                FUSED_REDUCE=max_query_len == 1 and groups <= FUSED_MERGE_GROUPS,
                RED_CHUNK=red_chunk, SPLIT_LOOP=True,
                maxnreg=maxnreg, TMA_STAGES=tma)


__all__ = ["AttentionMetadata", "DEFAULT_SPLIT_POLICY", "FUSED_MERGE_GROUPS", "SplitPolicy",
           "block_q_for", "choose_num_splits", "kernel_config", "plan_attention"]
