"""KVCacheManager on its own: the request-facing side of the pool (admit, reserve, slots, commit,
free, page tables), with exact page ids."""

from __future__ import annotations

import random

import pytest
import torch

from kvstrata.pagepool import KVCacheManager, KVGroupSpec, Namespace, OutOfPagesError, PagePool
from kvstrata.pagepool import page_hashes
from kvstrata.pagepool.manager import UnknownSequenceError

P = 4
GROUPS = [KVGroupSpec("target", 1, 1, 16, torch.float32)]


def make(num_pages=8):
    pool = PagePool(GROUPS, num_pages, P)
    return pool, KVCacheManager(pool, Namespace("m", GROUPS, P))


def test_reserve_slots_and_page_tables():
    pool, mgr = make()
    mgr.admit("a", [1, 2, 3])
    assert mgr.reserve("a", 6) == [0, 1] and mgr.reserve("a", 8) == []
    assert mgr.slots("a", 2, 7) == [2, 3, 4, 5, 6]
    with pytest.raises(ValueError, match=r"positions \[6, 9\) are outside the 2 reserved pages"):
        mgr.slots("a", 6, 9)
    mgr.admit("b", [9])
    mgr.reserve("b", 1)
    bt, sl = mgr.block_tables(["a", "b"], seq_lens=[7, 1])
    assert bt.tolist() == [[0, 1], [2, 0]] and bt.dtype == torch.int32
    assert sl.tolist() == [7, 1] and sl.dtype == torch.int32


def test_reserve_beyond_the_pool_allocates_nothing():
    pool, mgr = make(num_pages=3)
    mgr.admit("a", [1])
    mgr.reserve("a", 8)
    with pytest.raises(OutOfPagesError):
        mgr.admit("b", [2]) and mgr.reserve("b", 8)
    assert pool.num_free == 1 and mgr.seqs["b"].page_ids == []
    with pytest.raises(ValueError, match="at most 12 tokens fit in one sequence"):
        mgr.reserve("a", 13)


def test_incremental_commit_hashes_equal_hashing_from_scratch():
    rng = random.Random(0)
    pool, mgr = make(num_pages=64)
    toks = [rng.randrange(1000) for _ in range(200)]
    mgr.admit("s", toks[:1])          # nothing cached: the sequence holds no tokens yet
    done, got = 0, []
    while done < len(toks):
        chunk = toks[done:done + rng.randint(1, 9)]
        mgr.reserve("s", done + len(chunk))
        got += mgr.commit("s", chunk)
        done += len(chunk)
    want = page_hashes(mgr.namespace, toks)
    assert got == want == mgr.seqs["s"].hashes
    infos = [pool.info(p) for p in mgr.seqs["s"].page_ids[:len(want)]]
    assert [i.hash for i in infos] == want
    assert [i.parent_hash for i in infos] == [mgr.namespace.digest] + want[:-1]
    assert [list(i.token_ids) for i in infos] == [toks[i * P:(i + 1) * P] for i in range(len(want))]


def test_commit_past_reserved_pages_is_refused():
    _, mgr = make()
    mgr.admit("a", [1, 2])
    mgr.reserve("a", 4)
    with pytest.raises(ValueError, match="committing up to 5 tokens but only 1 pages"):
        mgr.commit("a", [1, 2, 3, 4, 5])


def test_unknown_and_freed_sequences_are_named():
    _, mgr = make()
    mgr.admit("a", [1])
    mgr.free("a")
    for op, call in [("free", lambda: mgr.free("a")), ("slots", lambda: mgr.slots("a", 0, 1)),
                     ("block_tables", lambda: mgr.block_tables(["a"]))]:
        with pytest.raises(UnknownSequenceError, match=f"{op}: sequence 'a' was already freed"):
            call()
    with pytest.raises(UnknownSequenceError, match="sequence 7 was never admitted"):
        mgr.commit(7, [1])
    with pytest.raises(ValueError, match="sequence 'x' is already admitted"):
        mgr.admit("x", [1]) and mgr.admit("x", [1])
