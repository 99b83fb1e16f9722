"""Engine configuration, validated when the engine is built (not when the first request OOMs).

:class:`CacheConfig` holds the user's choices for the pool and the scheduler; :func:`plan_cache`
checks them against the loaded models and returns the pool size, with messages that say what
would fit. :class:`RunnerConfig` holds the model runner's (CUDA graphs, overlapped steps, split
sizes, verify widths), with the environment switches that override them.
"""

from __future__ import annotations

import bisect
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from ..codecs import available_codecs
from ..pagepool.spec import KVGroupSpec, bytes_per_page, check_page_size, format_bytes

if TYPE_CHECKING:
    import torch

BACKENDS = ("paged", "arena")


@dataclass(frozen=True)
class CacheConfig:
    """KV cache and scheduling settings.

    Args:
        kv_cache_bytes: KV budget for every group together. ``None``: exactly what
            ``max_batch_size`` sequences of ``max_seq_len`` tokens need. Less is fine (requests
            are admitted by what they need, and preempted under pressure) as long as one
            sequence of ``max_seq_len`` fits.
        page_size: tokens per page (a power of two).
        max_seq_len: prompt + generated tokens per sequence (default: the models' limit).
        max_batch_size: sequences running at once.
        max_num_batched_tokens: per-step token budget (verify blocks + prefill chunks). A budget
            below ``max_batch_size * block_size`` is fine: at most ``budget // block_size``
            sequences generate per step.
        target_codec, draft_codec: cold-page codecs of the two groups.
        drafter_backend: ``"paged"`` (draft context in the pool; the default) or ``"arena"``
            (private dense per-request buffer; a baseline only).
        tiers: a dict for ``TierManager.from_config`` (``host_bytes``, ``disk`` = a directory
            or a DiskTier, ``remote`` = a ``redis://`` URL or a RemoteTier, ``write_through``,
            ...; checked when the engine is built), or a callable ``(pool, namespace) ->
            TierManager``; ``None`` keeps KV on the device only.
    """

    kv_cache_bytes: int | None = None
    page_size: int = 16
    max_seq_len: int | None = None
    max_batch_size: int = 16
    max_num_batched_tokens: int = 2048
    target_codec: str = "nvfp4"
    draft_codec: str = "lossless"
    drafter_backend: str = "paged"
    tiers: Any = None

    def __post_init__(self) -> None:
        check_page_size(self.page_size)
        for name in ("max_batch_size", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"CacheConfig.{name} must be a positive integer, got {v!r}")
        if self.max_seq_len is not None and (not isinstance(self.max_seq_len, int)
                                             or self.max_seq_len < 2):
            raise ValueError(f"CacheConfig.max_seq_len must be an integer >= 2, got "
                             f"{self.max_seq_len!r}")
        if self.kv_cache_bytes is not None and (not isinstance(self.kv_cache_bytes, int)
                                                or self.kv_cache_bytes <= 0):
            raise ValueError(f"CacheConfig.kv_cache_bytes must be a positive integer, got "
                             f"{self.kv_cache_bytes!r}")
        for name in ("target_codec", "draft_codec"):
            codec = getattr(self, name)
            if codec not in available_codecs():
                raise ValueError(f"CacheConfig.{name}: unknown codec {codec!r}; known: "
                                 f"{', '.join(available_codecs())}")
        if self.drafter_backend not in BACKENDS:
            raise ValueError(f"CacheConfig.drafter_backend must be one of {BACKENDS}, got "
                             f"{self.drafter_backend!r}")


@dataclass(frozen=True)
class CachePlan:
    num_pages: int
    max_seq_len: int
    pages_per_seq: int
    bytes_per_page: int


def plan_cache(cfg: CacheConfig, groups: Sequence[KVGroupSpec], model_limits: dict[str, int],
               block_size: int, free_bytes: int | None = None) -> CachePlan:
    """Check the cache config against the models; return the pool size.

    model_limits: ``{"target": max_position_embeddings, "drafter": ...}``.
    free_bytes: device memory available for KV (checked only when known).
    """
    limit = min(model_limits.values())
    max_seq_len = cfg.max_seq_len if cfg.max_seq_len is not None else limit
    for who, lim in model_limits.items():
        if max_seq_len > lim:
            raise ValueError(f"max_seq_len={max_seq_len} exceeds the {who}'s "
                             f"max_position_embeddings={lim}; the largest that fits is {limit}")
    if cfg.max_num_batched_tokens < block_size:
        raise ValueError(f"max_num_batched_tokens={cfg.max_num_batched_tokens} cannot hold one "
                         f"verify block of block_size={block_size}; use at least {block_size}")
    P = cfg.page_size
    per_page = bytes_per_page(groups, P)
    # Verify blocks never run past max_seq_len (the last block is shortened), so a sequence
    # writes at most max_seq_len positions.
    pages_per_seq = math.ceil(max_seq_len / P)
    need = cfg.max_batch_size * pages_per_seq
    if cfg.kv_cache_bytes is None:
        num_pages = need
    else:
        # Admission is by actual need and a running sequence is preempted when the pool runs
        # dry, so a pool below max_batch_size x max_seq_len is fine; it must hold one sequence.
        num_pages = cfg.kv_cache_bytes // per_page
        if num_pages < pages_per_seq:
            fit_len = num_pages * P
            raise ValueError(
                f"one sequence of max_seq_len={max_seq_len} needs {pages_per_seq} pages = "
                f"{format_bytes(pages_per_seq * per_page)} of KV ({format_bytes(per_page)} per "
                f"page of {P} tokens over groups {[g.name for g in groups]}); "
                f"kv_cache_bytes={format_bytes(cfg.kv_cache_bytes)} holds {num_pages} pages. "
                f"The largest max_seq_len that fits is {fit_len}; "
                f"{format_bytes(need * per_page)} hold max_batch_size={cfg.max_batch_size} "
                f"sequences of max_seq_len={max_seq_len} without preemption")
    if free_bytes is not None and num_pages * per_page > free_bytes:
        fit = free_bytes // per_page
        raise ValueError(
            f"the KV pool needs {format_bytes(num_pages * per_page)} but only "
            f"{format_bytes(free_bytes)} of device memory are free; at max_seq_len={max_seq_len} "
            f"the largest max_batch_size that fits is {fit // pages_per_seq}")
    return CachePlan(num_pages, max_seq_len, pages_per_seq, per_page)


def check_drafter_compat(target_cfg, drafter_cfg) -> None:
    """Hidden size, tap ids and vocabulary of a drafter against its target (``ValueError``)."""
    t, d = target_cfg, drafter_cfg
    problems = []
    if d.hidden_size != t.hidden_size:
        problems.append(f"drafter hidden_size={d.hidden_size} != target hidden_size="
                        f"{t.hidden_size} (the drafter reads the target's embeddings and taps)")
    bad = [i for i in d.target_layer_ids if i >= t.num_hidden_layers]
    if bad:
        problems.append(f"drafter target_layer_ids {list(d.target_layer_ids)} include {bad}, "
                        f"but the target has {t.num_hidden_layers} layers")
    if d.num_target_layers != t.num_hidden_layers:
        problems.append(f"drafter was built for num_target_layers={d.num_target_layers}, the "
                        f"target has {t.num_hidden_layers}")
    if d.vocab_size != t.vocab_size:
        problems.append(f"drafter vocab_size={d.vocab_size} != target vocab_size={t.vocab_size}")
    if d.mask_token_id >= t.vocab_size:
        problems.append(f"mask_token_id={d.mask_token_id} is outside the target vocabulary "
                        f"({t.vocab_size})")
    if problems:
        raise ValueError("drafter does not fit the target: " + "; ".join(problems))


#: Environment switch: ``0``/``false``/``off`` turns CUDA graphs off, ``1``/``true``/``on`` on
#: (overrides :attr:`RunnerConfig.cuda_graphs`).
GRAPHS_ENV = "KVSTRATA_CUDA_GRAPHS"
#: Environment switch of :attr:`RunnerConfig.overlap` (same values).
OVERLAP_ENV = "KVSTRATA_OVERLAP"
#: ``min_split_tokens`` is a multiple of this (every kernel tile divides it); so is a step's
#: split length when a model has sliding-window layers (the kernel's window start needs its
#: KV tile to divide the split length).
SPLIT_ALIGN = 128
#: Default :attr:`RunnerConfig.min_split_tokens`: the H200 split sweep (docs/benchmarks.md, issue
#: 13) ran batch-1 decode and verify-16 at 8k fastest with 128-256-token splits (64 or 32 of
#: them), against 21.9 / 23.9 us per layer with the 512-token splits the default policy chose.
MIN_SPLIT_TOKENS = 256
#: Environment switch of :attr:`RunnerConfig.draft_block` (``width`` or ``full``).
DRAFT_BLOCK_ENV = "KVSTRATA_DRAFT_BLOCK"
DRAFT_BLOCKS = ("width", "full")


@dataclass(frozen=True)
class RunnerConfig:
    """Model runner settings.

    Args:
        cuda_graphs: capture the decode/verify/draft steps as CUDA graphs (CUDA only; the
            ``KVSTRATA_CUDA_GRAPHS`` environment variable overrides it).
        batch_sizes: the ladder of captured batch sizes (default :func:`default_ladder`); a
            batch runs in the graph of the smallest size that holds it.
        overlap: let the engine submit a decode step before it has read the previous step's
            tokens (the device continues each sequence from the previous step's output), so
            the host's work on step N (stops, text, commit, scheduling) runs while the device
            computes step N + 1. ``None`` (default): on for CUDA devices, off on the CPU, where
            nothing runs concurrently and the step submitted past a request's end would only
            cost time. The ``KVSTRATA_OVERLAP`` environment variable overrides it.
        timing: time the draft and verify stages with CUDA events (``LLM.stats()``
            ``draft_s``/``target_s``); off by default, since reading events waits for them.
        min_split_tokens: sizes the decode path's split-KV grids (a multiple of 128): the
            graphs hold as many split programs as splits this long of ``max_seq_len`` need
            (the plan policy's ``min_tokens``), and each step spreads the longest context of
            the batch evenly over all of them, in multiples of 32 tokens (128 with
            sliding-window layers), so short contexts run short splits
            (``benchmarks/runner_bench.py --sweep``).
        verify_widths: the verify widths (positions a speculative step verifies per sequence,
            ``1 .. block_size``; 1 drafts nothing) captured per batch size; each step runs the
            one with the most expected tokens per unit of device time (:mod:`.verify_width`).
            ``None`` (default): the block, half and a quarter of it, 2 and 1 with CUDA graphs
            (:func:`~.verify_width.default_widths`), the block without (nothing times the
            widths then). One width pins it. The
            ``KVSTRATA_VERIFY_WIDTHS`` environment variable (e.g. ``16`` or ``16,8,4``)
            overrides it.
        draft_block: the block the drafter runs at a verify width ``V`` below the block
            ``B``: ``"width"`` (default) drafts ``[pending token, MASK x (V-1)]``, a block of
            ``V`` rows, as a drafter with block size ``V`` would (the drafts the step reads;
            ``V / B`` of the draft's rows); ``"full"`` drafts the whole block of ``B`` and the
            verify step reads its first ``V - 1`` drafts. Greedy output is the same either way;
            the drafts, and so the acceptance, can differ (the block's attention is
            bidirectional). The ``KVSTRATA_DRAFT_BLOCK`` environment variable overrides it.
    """

    cuda_graphs: bool = True
    batch_sizes: tuple[int, ...] | None = None
    overlap: bool | None = None
    timing: bool = False
    min_split_tokens: int = MIN_SPLIT_TOKENS
    verify_widths: tuple[int, ...] | None = None
    draft_block: str = "width"

    def __post_init__(self) -> None:
        if self.draft_block not in DRAFT_BLOCKS:
            raise ValueError(f"RunnerConfig.draft_block must be one of "
                             f"{', '.join(DRAFT_BLOCKS)}, got {self.draft_block!r}")
        if self.overlap is not None and not isinstance(self.overlap, bool):
            raise ValueError(f"RunnerConfig.overlap must be True, False or None (by device), "
                             f"got {self.overlap!r}")
        m = self.min_split_tokens
        if not isinstance(m, int) or isinstance(m, bool) or m < SPLIT_ALIGN or m % SPLIT_ALIGN:
            raise ValueError(f"RunnerConfig.min_split_tokens must be a positive multiple of "
                             f"{SPLIT_ALIGN}, got {m!r}")
        if self.batch_sizes is not None:
            object.__setattr__(self, "batch_sizes",
                               tuple(sorted(set(self._positive_ints("batch_sizes")))))
        if self.verify_widths is not None:     # their range needs the block: the runner checks
            object.__setattr__(self, "verify_widths", self._positive_ints("verify_widths"))

    def _positive_ints(self, name: str) -> tuple[int, ...]:
        v = getattr(self, name)
        vals = tuple(v)
        if not vals or any(not isinstance(x, int) or isinstance(x, bool) or x < 1
                           for x in vals):
            raise ValueError(f"RunnerConfig.{name} must be positive integers, got {v!r}")
        return vals


def _switch(name: str, want: bool) -> bool:
    """``want``, unless the environment variable ``name`` says on or off."""
    env = os.environ.get(name)
    if env is not None and env.strip():
        v = env.strip().lower()
        if v in ("0", "false", "off", "no"):
            return False
        if v in ("1", "true", "on", "yes"):
            return True
        raise ValueError(f"{name}={env!r}: use 0/false/off or 1/true/on")
    return want


def graphs_enabled(cfg: RunnerConfig, device: torch.device) -> bool:
    """Whether this runner captures CUDA graphs (config, then the environment switch)."""
    return _switch(GRAPHS_ENV, cfg.cuda_graphs) and device.type == "cuda"


def overlap_enabled(cfg: RunnerConfig, device: torch.device) -> bool:
    """Whether the engine overlaps decode steps (config, default by device, then the
    environment switch)."""
    want = cfg.overlap if cfg.overlap is not None else device.type == "cuda"
    return _switch(OVERLAP_ENV, want)


def default_ladder(max_batch: int) -> tuple[int, ...]:
    """Captured batch sizes: 1, 2, 4, 8, then every 16 up to ``max_batch`` (always included)."""
    sizes = {s for s in (1, 2, 4, 8) if s < max_batch}
    sizes.update(range(16, max_batch, 16))
    sizes.add(max_batch)
    return tuple(sorted(sizes))


def graph_batch_size(ladder: tuple[int, ...], n: int) -> int | None:
    """The smallest captured size holding ``n`` sequences (``None``: larger than any)."""
    i = bisect.bisect_left(ladder, n)
    return ladder[i] if i < len(ladder) else None


def draft_block_mode(cfg: RunnerConfig) -> str:
    """:attr:`RunnerConfig.draft_block`, unless ``KVSTRATA_DRAFT_BLOCK`` says otherwise."""
    env = os.environ.get(DRAFT_BLOCK_ENV, "").strip().lower()
    if not env:
        return cfg.draft_block
    if env not in DRAFT_BLOCKS:
        raise ValueError(f"{DRAFT_BLOCK_ENV}={env!r}: use one of {', '.join(DRAFT_BLOCKS)}")
    return env
