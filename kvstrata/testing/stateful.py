"""Hypothesis state machine for the page pool and its request manager.

It drives a real :class:`PagePool` + :class:`KVCacheManager` and a trivially correct model side by
side. Every token's K/V is a deterministic function of (namespace, token prefix), written through the
manager's slots, so a wrong prefix reuse shows up as wrong *data*, not only as wrong bookkeeping.

Lives in the package (not in ``tests/``) so that the tier stack can run the same machine with a
lower tier attached: subclass it, override :meth:`make_pool` / :meth:`make_manager`, and add rules.

Use::

    from kvstrata.testing.stateful import PoolMachine
    TestPool = PoolMachine.TestCase
"""

from __future__ import annotations

import hashlib

import torch
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from ..pagepool import (KVCacheManager, KVGroupSpec, Namespace, OutOfPagesError, PagePool,
                        PageState)

PAGE_SIZE = 4
NUM_PAGES = 12
VOCAB = 3          # a tiny vocabulary makes shared prefixes (and hash-chain hits) common
SALTS = (None, "tenant-a")


def token_kv(ns_digest: bytes, prefix: tuple[int, ...], numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Deterministic K/V content of the last token of ``prefix`` (depends on the whole prefix)."""
    h = hashlib.blake2b(ns_digest + bytes(prefix), digest_size=8).digest()
    seed = int.from_bytes(h, "little") & 0x7FFFFFFF
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=g).to(dtype)


class PoolMachine(RuleBasedStateMachine):
    """Pool + manager against a model: allocate, grow, share a prefix, free, evict, look up."""

    groups = (KVGroupSpec("target", 2, 1, 16, torch.float32, "identity"),
              KVGroupSpec("draft", 1, 1, 16, torch.bfloat16, "identity"))

    seqs = Bundle("seqs")

    def __init__(self) -> None:
        super().__init__()
        self.ns = Namespace("model-under-test", self.groups, PAGE_SIZE, drafter="draft-under-test")
        self.pool = self.make_pool()
        self.mgr = self.make_manager()
        self.model: dict[int, tuple[tuple[int, ...], str | None]] = {}  # seq -> (tokens, salt)
        self.next_id = 0

    # -- hooks for subclasses -------------------------------------------------------------
    def make_pool(self) -> PagePool:
        return PagePool(self.groups, NUM_PAGES, PAGE_SIZE)

    def make_manager(self) -> KVCacheManager:
        return KVCacheManager(self.pool, self.ns)

    # -- helpers ------------------------------------------------------------------------------
    def _write(self, sid: int, tokens: tuple[int, ...], start: int, salt: str | None) -> None:
        P = PAGE_SIZE
        digest = self.ns.digest + repr(salt).encode()  # independent of the hashing code
        for pos, slot in zip(range(start, len(tokens)), self.mgr.slots(sid, start, len(tokens))):
            for g in self.groups:
                numel = g.num_layers * 2 * g.num_kv_heads * g.head_dim
                kv = token_kv(digest, tokens[:pos + 1], numel, g.dtype)
                self.pool.kv[g.name][slot // P, :, :, :, slot % P, :] = kv.view(
                    g.num_layers, 2, g.num_kv_heads, g.head_dim)

    def _check_data(self, sid: int, tokens: tuple[int, ...], n: int, salt: str | None) -> None:
        P = PAGE_SIZE
        digest = self.ns.digest + repr(salt).encode()  # independent of the hashing code
        for pos, slot in zip(range(n), self.mgr.slots(sid, 0, n)):
            for g in self.groups:
                numel = g.num_layers * 2 * g.num_kv_heads * g.head_dim
                want = token_kv(digest, tokens[:pos + 1], numel, g.dtype)
                got = self.pool.kv[g.name][slot // P, :, :, :, slot % P, :].reshape(-1)
                assert torch.equal(got, want), f"seq {sid}: reused K/V at position {pos} is wrong"

    # -- rules ----------------------------------------------------------------------------------
    @rule(target=seqs, tokens=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=14),
          salt=st.sampled_from(SALTS))
    def admit(self, tokens, salt):
        tokens = tuple(tokens)
        sid = self.next_id
        self.next_id += 1
        seq = self.mgr.admit(sid, list(tokens), cache_salt=salt)
        n = seq.num_cached_tokens
        note(f"admit seq {sid} tokens={tokens} salt={salt!r} -> cached {n}")
        assert n % PAGE_SIZE == 0 and n <= len(tokens) - 1
        self._check_data(sid, tokens, n, salt)
        try:
            self.mgr.reserve(sid, len(tokens))
        except OutOfPagesError:
            note(f"  seq {sid}: out of pages, freed")
            self.mgr.free(sid)
            return None
        self._write(sid, tokens, n, salt)
        self.mgr.commit(sid, list(tokens[n:]))
        self.model[sid] = (tokens, salt)
        return sid

    @rule(sid=seqs, extra=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6))
    def grow(self, sid, extra):
        if sid is None or sid not in self.model:
            return
        tokens, salt = self.model[sid]
        new = tokens + tuple(extra)
        try:
            self.mgr.reserve(sid, len(new))
        except OutOfPagesError:
            note(f"grow seq {sid}: out of pages")
            return
        note(f"grow seq {sid} by {tuple(extra)}")
        self._write(sid, new, len(tokens), salt)
        self.mgr.commit(sid, list(extra))
        self.model[sid] = (new, salt)

    @rule(sid=consumes(seqs))
    def free(self, sid):
        if sid is None or sid not in self.model:
            return
        note(f"free seq {sid}")
        self.mgr.free(sid)
        del self.model[sid]

    @precondition(lambda self: self.pool.num_cached > 0)
    @rule(n=st.integers(1, 4))
    def evict(self, n):
        before = self.pool.cached_pages()
        victims = self.pool.evict(n)
        note(f"evict {n} -> {victims}")
        assert victims == before[:len(victims)], "eviction is not LRU order"

    @rule(tokens=st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=14),
          salt=st.sampled_from(SALTS))
    def lookup(self, tokens, salt):
        hit = self.mgr.lookup(tokens, cache_salt=salt)
        # The model: a page is reusable iff some live or cached page was produced from exactly this
        # (salt, prefix); the pool can only under-report (evicted pages), never over-report.
        for i, p in enumerate(hit.page_ids):
            info = self.pool.info(p)
            assert info is not None and info.hash == hit.hashes[i]
            assert list(info.token_ids) == list(tokens[i * PAGE_SIZE:(i + 1) * PAGE_SIZE])
        live_prefixes = {(s, t[:k]) for t, s in self.model.values()
                         for k in range(PAGE_SIZE, len(t) + 1, PAGE_SIZE)}
        want_min = 0
        for k in range(PAGE_SIZE, len(tokens) + 1, PAGE_SIZE):
            if (salt, tuple(tokens[:k])) in live_prefixes:
                want_min = k
            else:
                break
        assert hit.num_tokens >= want_min, (
            f"lookup found {hit.num_tokens} tokens, but a live sequence holds {want_min}")

    # -- invariants -------------------------------------------------------------------------
    @invariant()
    def pool_consistent(self):
        self.pool.check_invariants()

    @invariant()
    def refcounts_match_model(self):
        want = [0] * self.pool.num_pages
        for sid in self.model:
            for p in self.mgr.seqs[sid].page_ids:
                want[p] += 1
        got = [self.pool.refcount(p) for p in range(self.pool.num_pages)]
        assert got == want, f"refcounts {got} != held pages {want}"

    @invariant()
    def no_page_double_used(self):
        # A page held by two sequences must be a full hashed page both of them share as a prefix.
        owners: dict[int, list[int]] = {}
        for sid in self.model:
            for i, p in enumerate(self.mgr.seqs[sid].page_ids):
                owners.setdefault(p, []).append((sid, i))
        for p, held in owners.items():
            if len(held) > 1:
                info = self.pool.info(p)
                assert info is not None, f"unhashed page {p} shared by {held}"
                assert self.pool.state(p) is PageState.IN_USE
                hashes = {self.mgr.seqs[s].hashes[i] for s, i in held}
                assert hashes == {info.hash}, f"page {p} shared under different hashes"

    @invariant()
    def live_pages_findable(self):
        # Every full page a live sequence holds can be found by its hash, under its own namespace.
        for sid in self.model:
            seq = self.mgr.seqs[sid]
            for h in seq.hashes:
                p = self.pool.lookup(h)
                assert p is not None, f"seq {sid}: live page with hash {h.hex()} is not findable"
                assert self.pool.info(p).hash == h

    @invariant()
    def sequences_hold_their_data(self):
        for sid, (tokens, salt) in self.model.items():
            assert self.mgr.seqs[sid].token_ids == list(tokens)
            self._check_data(sid, tokens, len(tokens), salt)
