"""Engine configuration, validated when the engine is built (not when the first request OOMs).

:class:`CacheConfig` holds the user's choices; :func:`plan_cache` checks them against the loaded
models and returns the pool size, with messages that say what would fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from ..pagepool.spec import KVGroupSpec, bytes_per_page, check_page_size, format_bytes

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
