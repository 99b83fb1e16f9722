"""The request-facing KV cache manager (the pool knows pages; the manager knows requests).

Lifecycle of a sequence::

    seq = mgr.admit("req-1", prompt, cache_salt=None)   # prefix hit: seq.num_cached_tokens
    mgr.reserve("req-1", len(prompt))                    # pages for the uncached tail
    slots = mgr.slots("req-1", seq.num_tokens, len(prompt))   # where to write the tail's K/V
    ... model writes K/V of prompt[seq.num_tokens:] into those slots ...
    mgr.commit("req-1", prompt[seq.num_tokens:])         # tokens now valid; full pages hashed
    ... decode: reserve(n + k) -> write -> commit(accepted tokens) ...
    mgr.free("req-1")                                    # full pages become cached (tail first out)

``block_tables(seq_ids)`` builds the padded ``[num_seqs, max_pages] int32`` table and the
``[num_seqs] int32`` lengths the attention kernels take.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from .hashing import Namespace, chain_hashes, page_hashes
from .pool import OutOfPagesError, PageKey, PagePool


class PrefixSource(Protocol):
    """A lower tier the manager asks when the device pool's chain misses (e.g. a TierManager)."""

    def lookup_prefix(self, namespace: Namespace, hashes: Sequence[bytes]) -> int:
        """Number of consecutive pages, starting at ``hashes[0]``, this tier can provide."""

    def load_prefix(self, namespace: Namespace, pages: Sequence[PageKey],
                    page_ids: Sequence[int]) -> int:
        """Write ``pages`` (hash, parent, tokens) into device pages ``page_ids`` in one batch.

        Returns how many leading pages were loaded and verified; pages past that number were not
        written (a miss: corrupt, evicted meanwhile, ...).
        """


class UnknownSequenceError(KeyError):
    """A sequence id the manager does not hold (never admitted, or already freed)."""

    def __str__(self) -> str:          # KeyError would quote the message
        return str(self.args[0])


@dataclass(slots=True)
class PrefixHit:
    """Result of a prefix lookup: the reusable leading full pages of a token list."""

    num_tokens: int
    hashes: list[bytes]
    page_ids: list[int]             # device page ids (only for the device part of a dry lookup)
    tier_pages: dict[str, int] = field(default_factory=dict)  # pages found per tier


@dataclass(slots=True)
class SequenceState:
    """One admitted sequence's page table and committed tokens."""

    seq_id: object
    namespace: Namespace
    page_ids: list[int]
    token_ids: list[int]             # tokens whose K/V is written and valid
    hashes: list[bytes]              # chain hashes of the full pages among them
    num_cached_tokens: int = 0       # tokens reused from a prefix hit at admission
    cached_from: dict[str, int] = field(default_factory=dict)  # prefix pages per tier

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class KVCacheManager:
    """Allocates pages for sequences, finds and reuses cached prefixes, hashes full pages.

    Args:
        pool: the :class:`PagePool`.
        namespace: the base namespace (models, groups, page size); requests add their
            ``cache_salt`` to it.
        tiers: an optional :class:`PrefixSource` (the tier manager) consulted after the device
            pool misses.
    """

    def __init__(self, pool: PagePool, namespace: Namespace, tiers: PrefixSource | None = None):
        if namespace.page_size != pool.page_size:
            raise ValueError(f"namespace page_size {namespace.page_size} != pool page_size "
                             f"{pool.page_size}")
        if tuple(g.fingerprint_fields() for g in namespace.groups) != tuple(
                g.fingerprint_fields() for g in pool.groups):
            raise ValueError("namespace groups differ from the pool's groups")
        self.pool = pool
        self.namespace = namespace
        self.tiers = tiers
        self.seqs: dict[object, SequenceState] = {}
        self._freed: OrderedDict[object, None] = OrderedDict()   # recent ids, for errors only
        self._stats = {"lookups": 0, "hit_tokens": 0, "query_tokens": 0}

    def stats(self) -> dict[str, int]:
        """Prefix lookups so far: ``lookups``, ``hit_tokens`` (reused), ``query_tokens``."""
        return dict(self._stats)

    def _seq(self, seq_id: object, op: str) -> SequenceState:
        seq = self.seqs.get(seq_id)
        if seq is None:
            state = ("was already freed" if seq_id in self._freed else
                     "was never admitted (admit() it first)")
            raise UnknownSequenceError(f"{op}: sequence {seq_id!r} {state}; {len(self.seqs)} sequence(s) are "
                           "admitted")
        return seq

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def max_tokens(self) -> int:
        """The most tokens one sequence can ever hold in this pool."""
        return self.pool.num_pages * self.pool.page_size

    def _check_length(self, n: int) -> None:
        if n > self.max_tokens:
            raise ValueError(
                f"a sequence of {n} tokens needs {math.ceil(n / self.page_size)} pages; the pool "
                f"has {self.pool.num_pages} pages of {self.page_size} tokens, so at most "
                f"{self.max_tokens} tokens fit in one sequence")

    def namespace_for(self, cache_salt: str | None) -> Namespace:
        return self.namespace.with_salt(cache_salt)

    # -- lookup ----------------------------------------------------------------------------
    def lookup(self, token_ids: Sequence[int], cache_salt: str | None = None) -> PrefixHit:
        """Longest cached prefix of ``token_ids`` in the device pool, then the lower tiers.

        No side effects: pages are not referenced, nothing is promoted.
        """
        ns = self.namespace_for(cache_salt)
        hashes = page_hashes(ns, token_ids)
        dev = self._device_prefix(hashes)
        tier_pages = {"device": len(dev)}
        n = len(dev)
        if self.tiers is not None and n < len(hashes):
            k = self.tiers.lookup_prefix(ns, hashes[n:])
            tier_pages["lower"] = k
            n += k
        return PrefixHit(n * self.page_size, hashes[:n], dev, tier_pages)

    def _device_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        out = []
        for h in hashes:
            p = self.pool.lookup(h)
            if p is None:
                break
            out.append(p)
        return out

    # -- sequence lifecycle -------------------------------------------------------------------
    def admit(self, seq_id: object, token_ids: Sequence[int], cache_salt: str | None = None,
              max_cached_tokens: int | None = None) -> SequenceState:
        """Register a sequence and reuse the longest cached prefix of ``token_ids``.

        At most ``max_cached_tokens`` (default ``len(token_ids) - 1``: the last prompt token is
        always computed, since its logits are needed) are reused, in whole pages. Pages from lower
        tiers are promoted into fresh device pages in one batch. Pages for the uncached tail are
        *not* allocated yet: call :meth:`reserve`.
        """
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} is already admitted")
        token_ids = [int(t) for t in token_ids]
        if not token_ids:
            raise ValueError(f"sequence {seq_id!r}: empty token list")
        if min(token_ids) < 0:
            raise ValueError(f"sequence {seq_id!r}: token ids must be non-negative, got "
                             f"{min(token_ids)}")
        self._check_length(len(token_ids))
        ns = self.namespace_for(cache_salt)
        if max_cached_tokens is None:
            max_cached_tokens = len(token_ids) - 1
        max_pages = max(0, min(len(token_ids), max_cached_tokens)) // self.page_size
        hashes = page_hashes(ns, token_ids[:max_pages * self.page_size])
        dev = self._device_prefix(hashes)
        self.pool.share(dev)
        page_ids = list(dev)
        cached_from = {"device": len(dev)}
        if self.tiers is not None and len(dev) < len(hashes):
            page_ids += self._promote(ns, token_ids, hashes, len(dev), cached_from)
        n_cached = len(page_ids) * self.page_size
        seq = SequenceState(seq_id, ns, page_ids, token_ids[:n_cached], hashes[:len(page_ids)],
                            n_cached, cached_from)
        self.seqs[seq_id] = seq
        self._stats["lookups"] += 1
        self._stats["hit_tokens"] += n_cached
        self._stats["query_tokens"] += len(token_ids)
        return seq

    def _promote(self, ns: Namespace, token_ids: list[int], hashes: list[bytes], start: int,
                 cached_from: dict[str, int]) -> list[int]:
        P = self.page_size
        k = self.tiers.lookup_prefix(ns, hashes[start:])
        k = min(k, self.pool.num_available)
        if k <= 0:
            return []
        infos = [PageKey(hashes[i], hashes[i - 1] if i else ns.digest,
                         tuple(token_ids[i * P:(i + 1) * P])) for i in range(start, start + k)]
        new = self.pool.allocate(k)
        try:
            m = self.tiers.load_prefix(ns, infos, new)
        except Exception:
            self.pool.release(new)
            raise
        m = max(0, min(m, k))
        for p, inf in zip(new[:m], infos[:m]):
            self.pool.set_hash(p, inf.hash, inf.parent_hash, inf.token_ids)
        # Pages past the verified count were never written: back to the free list.
        self.pool.release(new[m:])
        cached_from["lower"] = m
        return new[:m]

    def reserve(self, seq_id: object, num_tokens: int) -> list[int]:
        """Ensure the sequence has pages for ``num_tokens`` positions; returns the new page ids.

        Raises :class:`OutOfPagesError` (allocating nothing) when the pool cannot supply them, and
        ``ValueError`` when no pool of this size ever could.
        """
        seq = self._seq(seq_id, "reserve")
        if num_tokens <= len(seq.page_ids) * self.pool.page_size:
            return []       # already reserved (most decode steps); within the pool's limit
        self._check_length(num_tokens)
        need = math.ceil(num_tokens / self.page_size) - len(seq.page_ids)
        new = self.pool.allocate(need)
        seq.page_ids.extend(new)
        return new

    def slots(self, seq_id: object, start: int, end: int) -> list[int]:
        """Slot index ``page * page_size + offset`` of positions ``start..end-1``."""
        seq = self._seq(seq_id, "slots")
        P = self.page_size
        if end > len(seq.page_ids) * P or start < 0 or start > end:
            raise ValueError(f"positions [{start}, {end}) are outside the {len(seq.page_ids)} "
                             f"reserved pages of sequence {seq_id!r}; call reserve() first")
        return [seq.page_ids[i // P] * P + i % P for i in range(start, end)]

    def commit(self, seq_id: object, new_token_ids: Sequence[int]) -> list[bytes]:
        """Append tokens whose K/V (every group) is now written; hash pages that became full.

        Returns the hashes of the newly full pages.
        """
        seq = self._seq(seq_id, "commit")
        P = self.pool.page_size
        toks = seq.token_ids
        n_new = len(toks) + len(new_token_ids)
        if n_new > len(seq.page_ids) * P:
            raise ValueError(f"sequence {seq_id!r}: committing up to {n_new} tokens but only "
                             f"{len(seq.page_ids)} pages are reserved")
        toks += map(int, new_token_ids)
        # Only the pages that filled now are hashed: the tail after the last hashed page is
        # shorter than a page plus this commit, so a step's cost does not grow with the
        # sequence (the chain's parent is the last hash).
        start = len(seq.hashes)
        if n_new < (start + 1) * P:
            return []       # no page filled (most decode steps)
        parent = seq.hashes[-1] if seq.hashes else seq.namespace.digest
        new_hashes = chain_hashes(parent, toks[start * P:], P)
        for i, h in enumerate(new_hashes, start):
            self.pool.set_hash(seq.page_ids[i], h, parent, toks[i * P:(i + 1) * P])
            seq.hashes.append(h)
            parent = h
        return new_hashes

    def free(self, seq_id: object) -> None:
        """Release a finished sequence: hashed full pages become cached, tail pages leave first."""
        seq = self._seq(seq_id, "free")
        del self.seqs[seq_id]
        self._freed[seq_id] = None
        if len(self._freed) > 4096:
            self._freed.popitem(last=False)
        self.pool.release(seq.page_ids[::-1])

    # -- batch metadata -------------------------------------------------------------------
    def block_tables(self, seq_ids: Sequence[object], seq_lens: Sequence[int] | None = None,
                     device: torch.device | str | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """``block_tables [num_seqs, max_pages] int32`` (padded with 0) and
        ``seq_lens [num_seqs] int32`` (committed tokens unless ``seq_lens`` is given)."""
        seqs = [self._seq(s, "block_tables") for s in seq_ids]
        max_pages = max((len(s.page_ids) for s in seqs), default=0)
        bt = torch.zeros((len(seqs), max(max_pages, 1)), dtype=torch.int32)
        for i, s in enumerate(seqs):
            if s.page_ids:
                bt[i, :len(s.page_ids)] = torch.tensor(s.page_ids, dtype=torch.int32)
        lens = [s.num_tokens for s in seqs] if seq_lens is None else list(seq_lens)
        sl = torch.tensor(lens, dtype=torch.int32)
        dev = self.pool.device if device is None else torch.device(device)
        return bt.to(dev), sl.to(dev)


__all__ = ["KVCacheManager", "OutOfPagesError", "PrefixHit", "PrefixSource", "SequenceState",
           "UnknownSequenceError"]
