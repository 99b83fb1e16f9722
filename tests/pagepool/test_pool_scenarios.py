"""Scenario tests on tiny pools: exact page ids and exact eviction order."""

import pytest
import torch

from kvstrata.pagepool import (KVCacheManager, KVGroupSpec, Namespace, OutOfPagesError, PagePool,
                               PageState, page_hashes)

P = 4
GROUPS = [KVGroupSpec("target", 1, 1, 16, torch.float32), KVGroupSpec("draft", 1, 1, 16, "bf16")]


def make(num_pages=6, on_evict=None):
    pool = PagePool(GROUPS, num_pages, P, on_evict=on_evict)
    return pool, KVCacheManager(pool, Namespace("m", GROUPS, P, drafter="d"))


def run_seq(mgr, sid, tokens, salt=None):
    seq = mgr.admit(sid, tokens, cache_salt=salt)
    mgr.reserve(sid, len(tokens))
    mgr.commit(sid, tokens[seq.num_cached_tokens:])
    return seq


def test_allocation_order_and_states():
    pool, mgr = make()
    seq = run_seq(mgr, "a", list(range(10)))
    assert seq.page_ids == [0, 1, 2] and seq.num_cached_tokens == 0
    assert [pool.state(p) for p in range(6)] == [PageState.IN_USE] * 3 + [PageState.FREE] * 3
    assert (pool.num_free, pool.num_in_use, pool.num_cached) == (3, 3, 0)
    mgr.free("a")
    # full pages 0 and 1 are cached (tail first out: 1 before 0); partial page 2 is free again
    assert pool.cached_pages() == [1, 0]
    assert pool.state(2) is PageState.FREE
    pool.check_invariants()


def test_prefix_hit_reuses_exact_pages_and_caps_at_len_minus_one():
    pool, mgr = make()
    run_seq(mgr, "a", list(range(10)))
    mgr.free("a")
    b = run_seq(mgr, "b", list(range(8)))      # 8 tokens: only 1 page may be reused (7 max)
    assert b.num_cached_tokens == 4 and b.page_ids[0] == 0
    # b recomputed page 1 of the prefix into page 2: the live copy replaced the cached one
    assert b.page_ids == [0, 2] and pool.state(1) is PageState.FREE
    c = run_seq(mgr, "c", list(range(9)) + [99])
    assert c.num_cached_tokens == 8 and c.page_ids[:2] == [0, 2]
    assert pool.refcount(0) == 2 and pool.refcount(2) == 2
    pool.check_invariants()


def test_eviction_order_lru_tail_first_and_callback_sees_pages():
    seen = []
    pool, mgr = make(num_pages=4, on_evict=lambda infos: seen.append([i.page_id for i in infos]))
    run_seq(mgr, "a", list(range(8)) + [50])      # pages 0,1 full; 2 partial
    mgr.free("a")                                 # cached: [1, 0]; free: 2, 3
    run_seq(mgr, "b", [7] * 8 + [51])             # takes free 2, 3 ... then evicts 1 (tail of a)
    assert seen == [[1]]
    assert pool.lookup(page_hashes(mgr.namespace, list(range(8)))[1]) is None
    assert pool.lookup(page_hashes(mgr.namespace, list(range(8)))[0]) == 0
    with pytest.raises(OutOfPagesError, match="need 2 pages, only 1"):
        pool.allocate(2)
    pool.check_invariants()


def test_salt_separates_namespaces():
    pool, mgr = make()
    run_seq(mgr, "a", list(range(9)), salt="alice")
    mgr.free("a")
    assert mgr.admit("b", list(range(9)), cache_salt="bob").num_cached_tokens == 0
    assert mgr.admit("c", list(range(9)), cache_salt="alice").num_cached_tokens == 8
    assert mgr.admit("d", list(range(9))).num_cached_tokens == 0


def test_concurrent_duplicate_pages_stay_findable():
    pool, mgr = make(num_pages=8)
    toks = list(range(8))
    mgr.admit("a", toks); mgr.reserve("a", 8)
    mgr.admit("b", toks); mgr.reserve("b", 8)     # no hit yet: a has not committed
    mgr.commit("a", toks)
    mgr.commit("b", toks)                          # b's pages are duplicates of a's
    h = page_hashes(mgr.namespace, toks)
    assert pool.lookup(h[0]) == 0
    mgr.free("a")                                  # a's copies go free, index moves to b's pages
    assert pool.lookup(h[0]) == mgr.seqs["b"].page_ids[0]
    assert pool.num_cached == 0
    mgr.free("b")
    assert pool.cached_pages() == [3, 2]
    pool.check_invariants()


def test_block_tables_and_slots():
    pool, mgr = make(num_pages=8)
    run_seq(mgr, "a", list(range(6)))
    run_seq(mgr, "b", list(range(100, 113)))
    bt, sl = mgr.block_tables(["a", "b"])
    assert bt.dtype == torch.int32 and sl.dtype == torch.int32
    assert bt.tolist() == [[0, 1, 0, 0], [2, 3, 4, 5]]
    assert sl.tolist() == [6, 13]
    assert mgr.slots("b", 3, 6) == [2 * P + 3, 3 * P + 0, 3 * P + 1]
    with pytest.raises(ValueError, match="reserve"):
        mgr.slots("a", 0, 9)


def test_request_errors():
    pool, mgr = make(num_pages=2)
    with pytest.raises(ValueError, match="at most 8 tokens fit"):
        mgr.admit("x", list(range(9)))
    with pytest.raises(ValueError, match="empty"):
        mgr.admit("x", [])
    with pytest.raises(ValueError, match="non-negative"):
        mgr.admit("x", [1, -2])
    mgr.admit("y", [1])
    with pytest.raises(ValueError, match="already admitted"):
        mgr.admit("y", [1])
    with pytest.raises(ValueError, match="released more often"):
        pool.release([1])
    pool.check_invariants()
