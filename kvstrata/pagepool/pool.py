"""The physical page pool: storage per layer group, page states, refcounts, LRU, prefix index.

The pool knows pages, not requests (see :mod:`kvstrata.pagepool.manager` for the request side).
Every page is in exactly one state:

- **free**: no content; on the free list.
- **in use**: refcount >= 1 (one or more sequences hold it).
- **cached**: refcount 0 but it holds a hashed full page; findable by hash, evictable (LRU).

A page id indexes *every* group at once, so the target and draft KV of the same tokens share one
id, one refcount, one hash and one lifetime.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Iterable, Sequence

import torch

from .spec import (KVGroupSpec, bytes_per_page, check_groups, check_page_size, format_bytes,
                   pages_for_budget)


class PageState(Enum):
    FREE = "free"
    IN_USE = "in_use"
    CACHED = "cached"


class OutOfPagesError(RuntimeError):
    """Not enough free or evictable pages for an allocation (a capacity condition, not bad input)."""


@dataclass(slots=True, frozen=True)
class PageKey:
    """What a hashed page holds, wherever it lives: its chain hash, its parent's, and the page's
    token ids (a page in a lower tier, or about to be loaded: no device page id)."""

    hash: bytes
    parent_hash: bytes
    token_ids: tuple[int, ...]


@dataclass(slots=True, frozen=True)
class PageInfo:
    """A hashed device page: its id in the pool, and what it holds (as in :class:`PageKey`)."""

    page_id: int
    hash: bytes
    parent_hash: bytes
    token_ids: tuple[int, ...]

    @property
    def key(self) -> PageKey:
        """What the page holds, without the device page it sits in."""
        return PageKey(self.hash, self.parent_hash, self.token_ids)


#: Called with the pages about to be evicted (their content is still intact during the call).
EvictCallback = Callable[[list[PageInfo]], None]


class PagePool:
    """Paged KV storage shared by several layer groups.

    Args:
        groups: the layer groups; ``kv[g.name]`` is ``[num_pages, num_layers, 2, num_kv_heads,
            page_size, head_dim]`` of ``g.dtype`` on ``device``.
        num_pages: pages in the pool (every group has this many).
        page_size: tokens per page (a power of two).
        device: any torch device.
        on_evict: called with a batch of :class:`PageInfo` just before cached pages are reused, so a
            lower tier can copy them out (their storage is untouched during the call).
    """

    def __init__(self, groups: Sequence[KVGroupSpec], num_pages: int, page_size: int = 16,
                 device: torch.device | str = "cpu", on_evict: EvictCallback | None = None):
        self.groups = check_groups(groups)
        check_page_size(page_size)
        if not isinstance(num_pages, int) or num_pages <= 0:
            raise ValueError(f"num_pages must be a positive integer, got {num_pages!r}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = torch.device(device)
        self.on_evict = on_evict
        #: Optional ``(PageInfo) -> None`` called when a page becomes findable by its hash (its
        #: content is final): lets a lower tier write pages through as soon as they are full.
        self.on_hashed: Callable[[PageInfo], None] | None = None
        self.kv: dict[str, torch.Tensor] = {
            g.name: torch.empty((num_pages, *g.page_shape(page_size)), dtype=g.dtype,
                                device=self.device)
            for g in self.groups}
        self.specs: dict[str, KVGroupSpec] = {g.name: g for g in self.groups}
        self._ref = [0] * num_pages
        # NOTE: the free list is a deque used LIFO-from-left for recently freed pages' locality;
        # cached pages live in `_lru` (oldest first) and are findable through `_index`.
        self._free: deque[int] = deque(range(num_pages))
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._info: list[PageInfo | None] = [None] * num_pages
        self._index: dict[bytes, int] = {}
        # NOTE: in-use pages holding a hash that another in-use page already indexes (two sequences
        # computed the same page concurrently). When the indexed one is released, the index moves to
        # one of these, so a page held by a live sequence is always findable by its hash.
        self._dups: dict[bytes, set[int]] = {}
        self.num_evictions = 0

    # -- construction helpers ---------------------------------------------------------------
    @classmethod
    def from_budget(cls, groups: Sequence[KVGroupSpec], budget_bytes: int, page_size: int = 16,
                    device: torch.device | str = "cpu", on_evict: EvictCallback | None = None
                    ) -> "PagePool":
        """A pool with as many pages as ``budget_bytes`` buys (see :func:`pages_for_budget`)."""
        return cls(groups, pages_for_budget(groups, page_size, budget_bytes), page_size, device,
                   on_evict)

    @property
    def bytes_per_page(self) -> int:
        return bytes_per_page(self.groups, self.page_size)

    @property
    def nbytes(self) -> int:
        return self.bytes_per_page * self.num_pages

    def __repr__(self) -> str:
        return (f"PagePool(groups={[g.name for g in self.groups]}, num_pages={self.num_pages}, "
                f"page_size={self.page_size}, device={self.device}, {format_bytes(self.nbytes)}; "
                f"free={self.num_free}, in_use={self.num_in_use}, cached={self.num_cached})")

    # -- state queries ------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    @property
    def num_in_use(self) -> int:
        return self.num_pages - len(self._free) - len(self._lru)

    @property
    def num_available(self) -> int:
        """Pages an allocation can take now (free + evictable cached)."""
        return len(self._free) + len(self._lru)

    def refcount(self, page_id: int) -> int:
        return self._ref[page_id]

    def state(self, page_id: int) -> PageState:
        if self._ref[page_id] > 0:
            return PageState.IN_USE
        return PageState.CACHED if page_id in self._lru else PageState.FREE

    def info(self, page_id: int) -> PageInfo | None:
        """Hash, parent hash and tokens of a hashed page (``None`` for an unhashed page)."""
        return self._info[page_id]

    def lookup(self, page_hash: bytes) -> int | None:
        """Page id holding ``page_hash`` (in use or cached), or ``None``."""
        return self._index.get(page_hash)

    def hashed_pages(self) -> list[PageInfo]:
        """Every page findable by its hash (in use or cached): content final."""
        return [self._info[p] for p in self._index.values()]

    def cached_pages(self) -> list[int]:
        """Cached pages, next to be evicted first."""
        return list(self._lru)

    # -- transitions --------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` pages (refcount 1 each): free pages first, then evict the LRU cached pages.

        Raises :class:`OutOfPagesError` (taking nothing) if fewer than ``n`` are available.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self.num_available:
            raise OutOfPagesError(
                f"need {n} pages, only {self.num_available} are free or evictable "
                f"({self.num_in_use} of {self.num_pages} in use)")
        out: list[int] = []
        take_free = min(n, len(self._free))
        for _ in range(take_free):
            out.append(self._free.popleft())
        if n > take_free:
            out.extend(self._evict(n - take_free))
        for p in out:
            self._ref[p] = 1
        return out

    def _evict(self, n: int) -> list[int]:
        victims = []
        for _ in range(n):
            p, _ = self._lru.popitem(last=False)
            victims.append(p)
        infos = [self._info[p] for p in victims]
        if self.on_evict is not None:
            # The callback sees the pages' content intact; nothing can reuse them until we return.
            self.on_evict([i for i in infos if i is not None])
        for p, inf in zip(victims, infos):
            if inf is not None and self._index.get(inf.hash) == p:
                del self._index[inf.hash]
            self._info[p] = None
        self.num_evictions += n
        return victims

    def evict(self, n: int) -> list[int]:
        """Evict up to ``n`` cached pages (LRU first) to the free list; returns their ids."""
        victims = self._evict(min(n, len(self._lru)))
        self._free.extend(victims)
        return victims

    def share(self, page_ids: Iterable[int]) -> None:
        """Take a reference on existing pages (a prefix hit): cached pages become in use.
        (Not "touch": in the tiers that word is only an access hint for their LRU.)"""
        for p in page_ids:
            if self._ref[p] == 0:
                if p not in self._lru:
                    raise ValueError(f"page {p} is free; only in-use or cached pages can be shared")
                del self._lru[p]
            self._ref[p] += 1

    def release(self, page_ids: Sequence[int]) -> None:
        """Drop one reference on each page, in the order given.

        A page whose refcount reaches 0 becomes *cached* if it is hashed (appended to the LRU, so
        pages released earlier are evicted earlier) and *free* otherwise. Callers pass a request's
        pages tail first so its tail pages leave first.
        """
        for p in page_ids:
            if self._ref[p] <= 0:
                raise ValueError(f"page {p} released more often than it was referenced")
        for p in page_ids:
            self._ref[p] -= 1
            if self._ref[p] == 0:
                self._unref(p)

    def _unref(self, p: int) -> None:
        inf = self._info[p]
        if inf is not None and self._index.get(inf.hash) == p:
            dups = self._dups.get(inf.hash)
            if not dups:
                self._lru[p] = None
                return
            # A live duplicate takes over the index; this copy is redundant.
            self._index[inf.hash] = dups.pop()
            if not dups:
                del self._dups[inf.hash]
        elif inf is not None:
            dups = self._dups[inf.hash]
            dups.discard(p)
            if not dups:
                del self._dups[inf.hash]
        self._info[p] = None
        self._free.appendleft(p)

    def set_hash(self, page_id: int, page_hash: bytes, parent_hash: bytes,
                 token_ids: Sequence[int]) -> bool:
        """Record that in-use page ``page_id`` holds the full page hashed ``page_hash``.

        If another *in-use* page already holds that hash (two sequences computed the same page
        concurrently), the index keeps it, this page is recorded as a duplicate and ``False`` is
        returned; whichever copy is released last is the one that stays cached. A *cached* copy is
        replaced by this live page (and freed).
        """
        if self._ref[page_id] <= 0:
            raise ValueError(f"page {page_id} is not in use; only in-use pages can be hashed")
        if len(token_ids) != self.page_size:
            raise ValueError(f"a hashed page holds {self.page_size} tokens, got {len(token_ids)}")
        old = self._info[page_id]
        if old is not None:
            if old.hash == page_hash:
                return self._index.get(page_hash) == page_id
            raise ValueError(f"page {page_id} is already hashed as {old.hash.hex()}")
        self._info[page_id] = PageInfo(page_id, page_hash, parent_hash, tuple(token_ids))
        owner = self._index.get(page_hash)
        if owner is not None and self._ref[owner] == 0:
            # A cached copy of the same page exists: the live one takes its place in the index.
            del self._lru[owner]
            self._info[owner] = None
            self._free.appendleft(owner)
        elif owner is not None:
            self._dups.setdefault(page_hash, set()).add(page_id)
            return False
        self._index[page_hash] = page_id
        if self.on_hashed is not None:
            self.on_hashed(self._info[page_id])
        return True

    # -- data access ------------------------------------------------------------------------
    def page(self, group: str, page_id: int) -> torch.Tensor:
        """View of one page of one group: ``[num_layers, 2, num_kv_heads, page_size, head_dim]``."""
        return self.kv[group][page_id]

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy every group's content of pages ``src`` into pages ``dst`` (one gather per group)."""
        if len(src) != len(dst):
            raise ValueError("copy_pages needs as many destinations as sources")
        if not src:
            return
        s = torch.as_tensor(list(src), dtype=torch.long, device=self.device)
        d = torch.as_tensor(list(dst), dtype=torch.long, device=self.device)
        for t in self.kv.values():
            t.index_copy_(0, d, t.index_select(0, s))

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the page states are inconsistent (used by tests)."""
        free = set(self._free)
        cached = set(self._lru)
        assert len(free) == len(self._free), "duplicate page on the free list"
        assert not (free & cached), f"pages both free and cached: {free & cached}"
        for p in range(self.num_pages):
            r = self._ref[p]
            assert r >= 0, f"page {p} has refcount {r}"
            n_states = (p in free) + (p in cached) + (r > 0)
            assert n_states == 1, f"page {p} is in {n_states} states (ref={r})"
            if p in cached:
                inf = self._info[p]
                assert inf is not None and self._index.get(inf.hash) == p, \
                    f"cached page {p} is not indexed"
            if p in free:
                assert self._info[p] is None, f"free page {p} still has hash info"
            inf = self._info[p]
            if r > 0 and inf is not None:
                assert self._index.get(inf.hash) == p or p in self._dups.get(inf.hash, ()), \
                    f"live hashed page {p} is neither indexed nor a recorded duplicate"
        for h, ds in self._dups.items():
            owner = self._index.get(h)
            assert owner is not None and self._ref[owner] > 0, f"duplicates of {h.hex()} w/o live owner"
            for d in ds:
                assert self._ref[d] > 0 and d != owner and self._info[d].hash == h
        for h, p in self._index.items():
            inf = self._info[p]
            assert inf is not None and inf.hash == h, f"index maps {h.hex()} to page {p} holding other"
            assert self._ref[p] > 0 or p in cached
        assert len(free) + len(cached) + self.num_in_use == self.num_pages
