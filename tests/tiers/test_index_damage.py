"""Damage inside LMDB's own file (data.mdb), under a running tier stack and at open.

Reads never raise, open never fails, and after the rebuild every record whose segment bytes are
intact is served again, byte-exact (``Stack.run`` compares every reused page with what was
written); a record whose bytes are not is a miss.
"""

from __future__ import annotations

import logging
import os
import random

import pytest

from kvstrata.pagepool import page_hashes
from kvstrata.testing import damage
from kvstrata.tiers import DiskTier, TierDamaged
from kvstrata.tiers.diskindex import walk_index
from kvstrata.tiers.lmdbcheck import check_file

from tierutil import PAGE, Stack

PAGES = 2                   # pages per prompt


def _prompts(n, seed):
    rng = random.Random(seed)
    return [[rng.randrange(1000) for _ in range(PAGES * PAGE + 1)] for _ in range(n)]


def _filled(tmp_path, n=6, seed=0) -> tuple[Stack, list]:
    """A stack whose disk tier holds every page of ``n`` prompts (device and host emptied)."""
    s = Stack(tmp_path, num_pages=16, host_pages=4)
    prompts = _prompts(n, seed)
    for p in prompts:
        s.run(p)
    s.pool.evict(s.pool.num_cached)
    s.tiers.drain_host()
    assert len(s.disk) == n * PAGES
    return s, prompts


def _all_served(s: Stack, prompts) -> None:
    for p in prompts:
        assert s.run(p).cached_from.get("lower", 0) == PAGES     # checked byte for byte inside run
    s.pool.evict(s.pool.num_cached)


DAMAGE = {
    "page type bits": lambda path: damage.flip_page_type(
        path, damage.some_pages(path, 4, random.Random(1))),
    "records root page": lambda path: damage.damage_root(path, b"records"),
    "lru root page": lambda path: damage.damage_root(path, b"lru"),
    "one meta page": lambda path: damage.damage_meta(path, (1,)),
    "both meta pages": lambda path: damage.damage_meta(path),
    "truncated": damage.truncate,
    "deleted": damage.delete,
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_index_at_open_is_rebuilt_and_every_page_served(tmp_path, kind, caplog):
    s, prompts = _filled(tmp_path)
    s.tiers.close()
    DAMAGE[kind](s.path)
    if kind != "deleted":
        assert check_file(os.path.join(s.path, "data.mdb")) or walk_index(str(s.path))
    with pytest.raises(TierDamaged):                   # a reader says what is wrong ...
        DiskTier(s.path, readonly=True).close()
    with caplog.at_level(logging.WARNING, "kvstrata.tiers.disk"):
        s2 = Stack(tmp_path, num_pages=16, host_pages=4)    # ... a writer rebuilds, once
    assert s2.disk.counters()["rebuilds"] == 1 and s2.disk.counters()["rebuilt_records"] == 12
    assert len([r for r in caplog.records if "rebuilt it from" in r.message]) == 1
    _all_served(s2, prompts)
    assert s2.tiers.stats()["checksum_failures"] == 0
    s2.tiers.close()
    assert check_file(os.path.join(s.path, "data.mdb")) is None and walk_index(str(s.path)) is None


@pytest.mark.parametrize("kind", ["page type bits", "records root page", "truncated", "deleted",
                                  "both meta pages"])
def test_damaged_index_under_a_running_stack_is_a_miss_then_rebuilt(tmp_path, kind, caplog):
    s, prompts = _filled(tmp_path)
    DAMAGE[kind](s.path)
    with caplog.at_level(logging.WARNING, "kvstrata.tiers.disk"):
        first = s.run(prompts[0])          # never raises: a miss, or served if undetected
        s.pool.evict(s.pool.num_cached)
        _all_served(s, prompts[1:])
    st = s.disk.counters()
    if kind in ("page type bits", "records root page", "truncated"):
        assert first.cached_from.get("lower", 0) == 0 and st["index_errors"] >= 1
        assert st["rebuilds"] == 1 and st["rebuilt_records"] == 12
        assert len([r for r in caplog.records if "the index is damaged" in r.message]) == 2
    else:   # the open map still holds the old pages: nothing breaks until the next open
        assert first.cached_from.get("lower", 0) == PAGES and st["rebuilds"] == 0
    s.tiers.close()
    s2 = Stack(tmp_path, num_pages=16, host_pages=4)
    _all_served(s2, prompts)
    assert s2.tiers.stats()["checksum_failures"] == 0
    s2.tiers.close()


def test_random_bytes_in_the_index_never_raise_nor_serve_wrong_pages(tmp_path):
    rng = random.Random(5)
    for trial in range(8):
        s, prompts = _filled(tmp_path / str(trial), seed=trial)
        s.tiers.close()
        if trial % 2:               # meta pages included: check_file must not raise either
            damage.random_bytes(s.path, 64, rng, metas=True)
            check_file(os.path.join(s.path, "data.mdb"))
        else:
            damage.random_bytes(s.path, 3, rng)
        s2 = Stack(tmp_path / str(trial), num_pages=16, host_pages=4)
        for p in prompts:
            s2.run(p)               # pages served are compared with what was written
            s2.pool.evict(s2.pool.num_cached)
        s2.tiers.close()


def test_record_damaged_in_its_segment_is_a_miss_after_a_rebuild(tmp_path):
    s, prompts = _filled(tmp_path)
    victim = s.disk.keys_by_age()[5]
    seg, off, lens = s.disk.where(victim)
    s.tiers.close()
    with open(seg, "r+b") as f:             # one flipped payload byte
        f.seek(off + lens[0] + 3)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x20]))
    damage.delete(s.path)
    s2 = Stack(tmp_path, num_pages=16, host_pages=4)
    assert s2.disk.counters()["rebuilt_records"] == 11 and s2.disk.contains([victim]) == [False]
    want = [hs.index(victim) if victim in hs else PAGES
            for hs in (page_hashes(s2.ns, p)[:PAGES] for p in prompts)]
    assert [s2.run(p).cached_from.get("lower", 0) for p in prompts] == want
    assert sorted(want)[0] < PAGES
    s2.tiers.close()


def test_rebuild_keeps_the_newest_copy_and_respects_the_capacity(tmp_path):
    s, prompts = _filled(tmp_path)
    keys = s.disk.keys_by_age()
    with s.disk.reader() as get:
        recs = {k: [bytes(p) for p in get(k)] for k in keys}
    again = keys[0]
    s.disk.delete([again])                      # written again: a second, newer copy
    assert s.disk.put_batch([(again, recs[again])]) == 1
    s.tiers.close()
    damage.delete(s.path)
    with DiskTier(s.path, map_size=1 << 24, capacity_bytes=1 << 20) as d:
        order = d.keys_by_age()                 # the write order stands in for the access order
        assert sorted(order) == sorted(keys) and order[-1] == again and len(d) == 12
        with d.reader() as get:
            assert all([bytes(p) for p in get(k)] == recs[k] for k in keys)
    cap = sum(sum(map(len, recs[k])) for k in order[-4:])
    damage.delete(s.path)
    with DiskTier(s.path, map_size=1 << 24, capacity_bytes=cap) as d:
        assert d.keys_by_age() == order[-4:]   # the newest writes that fit
        assert d.stored_bytes() == cap


def test_unclean_shutdown_or_a_changed_file_walks_the_index_in_a_child(tmp_path):
    s, prompts = _filled(tmp_path)
    s.tiers.close()
    mdb = os.path.join(s.path, "data.mdb")
    st = os.stat(mdb)
    damage.flip_page_type(s.path, [damage.root_page(s.path, b"byseg")])
    os.utime(mdb, ns=(st.st_atime_ns, st.st_mtime_ns))   # damage the stamp cannot see
    with DiskTier(s.path, map_size=1 << 24) as d:  # a clean shutdown, the same file: no walk
        assert d.counters()["rebuilds"] == 0 and len(d) == 12
    open(os.path.join(s.path, "writer.active"), "w").close()   # as a killed writer leaves it
    with DiskTier(s.path, map_size=1 << 24) as d:
        assert d.counters()["rebuilds"] == 1 and len(d) == 12
    assert walk_index(str(s.path)) is None
    damage.flip_page_type(s.path, [damage.root_page(s.path, b"lru")])   # written meanwhile
    with DiskTier(s.path, map_size=1 << 24) as d:
        assert d.counters()["rebuilds"] == 1 and len(d) == 12


def test_rebuild_impossible_moves_the_files_aside_and_starts_empty(tmp_path, monkeypatch, caplog):
    s, prompts = _filled(tmp_path)
    s.tiers.close()
    damage.damage_meta(s.path)
    from kvstrata.tiers import diskindex

    def broken(*a, **kw):
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(diskindex, "rebuild", broken)
    with caplog.at_level(logging.ERROR, "kvstrata.tiers.disk"):
        with DiskTier(s.path, map_size=1 << 24) as d:
            assert len(d) == 0 and d.counters()["moved_aside"] == 1
            assert d.put_batch([(b"k" * 16, [b"x"])]) == 1
    aside = [n for n in os.listdir(s.path) if n.startswith("damaged-")]
    assert len(aside) == 1 and {"data.mdb", "segments"} <= set(os.listdir(s.path / aside[0]))
    assert len([r for r in caplog.records if "started empty" in r.message]) == 1


def test_a_walk_that_dies_reports_the_signal_and_the_writer_rebuilds(tmp_path, monkeypatch):
    """LMDB aborts (SIGABRT) on some damage, and a cut map raises SIGBUS: neither can be
    caught in-process, so the walk runs in a child whose death is the verdict."""
    s, prompts = _filled(tmp_path)
    s.tiers.close()
    from kvstrata.tiers import lmdbcheck
    monkeypatch.setattr(lmdbcheck, "_WALK", "import os; os.abort()")
    problem = walk_index(str(s.path))
    assert problem == "reading the index killed the reading process (signal 6)"
    with DiskTier(s.path, map_size=1 << 24, check=True) as d:
        assert d.counters()["rebuilds"] == 1 and len(d) == 12


def test_a_malformed_index_value_is_a_counted_miss_then_rebuilt(tmp_path):
    """Damage the walk would catch but a clean open does not look for: a value cut short."""
    s, prompts = _filled(tmp_path)
    victim = s.disk.keys_by_age()[0]
    with s.disk.env.begin(write=True) as txn:
        txn.put(victim, b"\0" * 12, db=s.disk._records)
    want = [hs.index(victim) if victim in hs else PAGES
            for hs in (page_hashes(s.ns, p)[:PAGES] for p in prompts)]
    got = [s.run(p).cached_from.get("lower", 0) for p in prompts]
    assert [min(g, w) for g, w in zip(got, want)] == want     # a miss at the victim at most
    assert s.disk.counters()["index_errors"] >= 1 and s.disk.counters()["rebuilds"] == 1
    s.pool.evict(s.pool.num_cached)
    s.tiers.drain_host()
    _all_served(s, prompts)                 # the rebuilt index serves the victim again
    s.tiers.close()


def test_a_segment_cut_under_a_live_map_is_a_miss_not_a_bus_error(tmp_path):
    s, prompts = _filled(tmp_path)
    _all_served(s, prompts[:1])             # maps the segment
    s.tiers.drain_host()
    s.pool.evict(s.pool.num_cached)
    (seg,) = s.disk.segments()
    os.truncate(s.disk.files.path(seg), 100)
    for p in prompts:
        assert s.run(p).cached_from.get("lower", 0) == 0
    assert s.tiers.stats()["checksum_failures"] >= 1
    s.tiers.close()


def test_repair_on_request_and_a_sound_index(tmp_path):
    s, prompts = _filled(tmp_path)
    assert s.disk.repair() is None and s.disk.counters()["rebuilds"] == 0
    damage.flip_page_type(s.path, [damage.root_page(s.path, b"byseg")])
    problem = s.disk.repair()           # the walk finds what no read has met yet
    assert problem.startswith("reading the index failed") and s.disk.counters()["rebuilds"] == 1
    assert s.disk.repair(force=True) is None and s.disk.counters()["rebuilds"] == 2
    _all_served(s, prompts)
    s.tiers.close()
    with pytest.raises(ValueError, match="readonly"):
        with DiskTier(s.path, readonly=True) as r:
            r.repair()


def test_a_newer_layout_is_refused_in_one_line(tmp_path):
    import lmdb
    with DiskTier(tmp_path / "d", map_size=1 << 22):
        pass
    env = lmdb.open(str(tmp_path / "d"), max_dbs=8)
    with env.begin(write=True) as txn:
        txn.put(b"layout", (5).to_bytes(8, "little"), db=env.open_db(b"meta", txn=txn))
    env.close()
    for readonly in (True, False):
        with pytest.raises(ValueError, match=r"newer kvstrata \(disk layout 5\)"):
            DiskTier(tmp_path / "d", map_size=1 << 22, readonly=readonly)
    with pytest.raises(ValueError, match="newer kvstrata"):     # (the writer lock was released)
        DiskTier(tmp_path / "d", map_size=1 << 22)
    assert "data.mdb" in os.listdir(tmp_path / "d")               # left as it was


@pytest.mark.slow
def test_random_bytes_fuzz_never_kills_the_process(tmp_path):
    """Many copies of one tier, each with random bytes anywhere in data.mdb, each opened and
    read by a forked child: no child may die (SIGBUS, SIGSEGV, abort) or raise, and every page
    it serves is checked byte for byte."""
    import shutil
    s, prompts = _filled(tmp_path / "orig")
    s.tiers.close()
    dead = []
    for trial in range(int(os.environ.get("KVSTRATA_FUZZ_TRIALS", "150"))):
        d = tmp_path / f"t{trial}"
        shutil.copytree(tmp_path / "orig", d)
        rng = random.Random(trial)
        damage.random_bytes(d / "disk", rng.choice([1, 3, 10, 64]), rng, metas=trial % 3 == 0)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                s2 = Stack(d, num_pages=16, host_pages=4)
                for p in prompts:
                    s2.run(p)
                    s2.pool.evict(s2.pool.num_cached)
                s2.tiers.close()
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        if status:
            dead.append((trial, status))
        shutil.rmtree(d)
    assert dead == []
