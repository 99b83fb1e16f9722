"""Fault injection: killed writers, flipped bytes, a map too small, foreign records."""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import struct
import time

import pytest
import torch

from kvstrata.codecs import get_codec
from kvstrata.pagepool import PageInfo, hash_page
from kvstrata.tiers import DiskTier, record
from kvstrata.tiers import diskindex
from kvstrata.tiers.record import build_record, check_groups, check_identity, check_payloads, parse_record

from tierutil import PAGE, Stack, make_groups, page_content

GROUPS = make_groups()
CODECS = [get_codec(g.codec) for g in GROUPS]
NS_DIGEST = b"n" * 16
TRIALS = int(os.environ.get("KVSTRATA_KILL_TRIALS", "24"))


def _records(n: int, seed: int) -> list[tuple[bytes, list[bytes]]]:
    """``(hash, record parts)``: the head and one payload per group, as the disk tier stores them."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        toks = tuple(rng.randrange(1 << 20) for _ in range(PAGE))
        info = PageInfo(0, hash_page(NS_DIGEST, toks), NS_DIGEST, toks)
        encs = [c.encode(page_content(info.hash, g)) for g, c in zip(GROUPS, CODECS)]
        parts = build_record(NS_DIGEST, info, [g.name for g in GROUPS], encs,
                             [e.payload.numpy().data for e in encs])
        out.append((info.hash, [bytes(p) for p in parts]))
    return out


def _verify_all(path) -> int:
    """Every visible page is whole and verifies; the bookkeeping agrees. Returns the count."""
    with DiskTier(path, map_size=1 << 26) as d:
        n = 0
        total = 0
        for key, buf in d.iter_records():
            rec = parse_record(buf)
            check_identity(rec, NS_DIGEST, None)
            check_groups(rec, GROUPS, CODECS, PAGE)
            check_payloads(rec)
            assert rec.page_hash == key
            for g, c, enc in zip(GROUPS, CODECS, rec.encoded()):
                assert torch.equal(c.decode(enc), page_content(key, g))
            n += 1
            total += len(buf)
        assert len(d.keys_by_age()) == n and d.stored_bytes() == total
        # the writer's open cut every torn tail: the files hold exactly the committed bytes
        for seg, (live, count, end) in d.segments().items():
            assert os.path.getsize(d.files.path(seg)) == end and count > 0
        assert sorted(os.listdir(d.segdir)) == sorted(os.path.basename(d.files.path(s))
                                                      for s in d.segments())
        return n


def test_kill_9_during_commits_leaves_only_whole_pages(tmp_path):
    records = _records(48 * 8, seed=0)      # 8 batches of 48 pages (~100 KiB each)
    rng = random.Random(1)
    deadline = time.monotonic() + 40
    trials = 0
    seen: set[int] = set()
    for trial in range(TRIALS):
        if time.monotonic() > deadline:
            break
        path = tmp_path / f"t{trial}"
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:   # the writer: no torch work, only LMDB transactions
            os.close(r)
            try:
                d = DiskTier(path, map_size=1 << 26)
                for b in range(8):
                    d.put_batch(records[b * 48:(b + 1) * 48])
                    os.write(w, bytes([b]))
            finally:
                os._exit(0)
        os.close(w)
        committed = -1
        kill_after = rng.randrange(0, 6)
        while committed < kill_after:
            got = os.read(r, 1)
            if not got:
                break
            committed = got[0]
        time.sleep(rng.random() * 0.004)      # somewhere inside the next put/commit
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
        n = _verify_all(path)
        assert n % 48 == 0, f"trial {trial}: {n} pages visible, a batch was torn"
        assert n >= 48 * (committed + 1), f"trial {trial}: a reported commit was lost"
        trials += 1
        seen.add(n)
    assert trials >= min(TRIALS, 5)
    assert len(seen) >= 3, f"kills did not land at different points: {sorted(seen)}"


def _fill_disk(stack, prompts):
    for p in prompts:
        stack.run(p)
    stack.pool.evict(stack.pool.num_cached)
    stack.tiers.drain_host()


def _prompts(n, pages, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1000) for _ in range(pages * PAGE + 1)] for _ in range(n)]


def test_flipped_bytes_in_stored_records_are_all_detected(tmp_path):
    s = Stack(tmp_path, num_pages=8, host_pages=4)
    prompts = _prompts(8, 1, seed=3)          # 8 one-page prefixes: each checked on its own
    _fill_disk(s, prompts)
    rng = random.Random(4)
    keys = s.disk.keys_by_age()
    assert len(keys) == 8
    for i, k in enumerate(keys):
        # Alternate between the head and the payloads (one per group), all in a segment.
        _flip_part_bit(s.disk, k, i % 3, rng)
    for p in prompts:
        seq = s.run(p)
        assert seq.num_cached_tokens == 0
    st = s.tiers.stats()
    assert st["checksum_failures"] + st["mismatches"] == 8
    assert st["h2d_pages"] == 0 and len(s.disk) == 0
    s.tiers.close()


def _flip_part_bit(disk, h: bytes, part: int, rng) -> None:
    """Flip one bit of part ``part`` (0: the head, 1...: a group's payload) of record ``h`` in
    its segment file."""
    path, off, lens = disk.where(h)
    pos = off + sum(lens[:part]) + rng.randrange(lens[part])
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, pos)
        os.pwrite(fd, bytes([b[0] ^ (1 << rng.randrange(8))]), pos)
    finally:
        os.close(fd)


def test_map_too_small_for_the_traffic(tmp_path):
    s = Stack(tmp_path, num_pages=8, host_pages=2, map_size=1 << 16, disk_bytes=1 << 16)
    prompts = _prompts(30, 6, seed=5)
    for p in prompts + prompts:
        s.run(p)                               # data of every reused page checked inside
    st = s.tiers.stats()
    assert st["disk_write_errors"] + st["disk_evictions"] > 0
    s.tiers.close()
    assert _count_verified(tmp_path / "disk", s) == len(DiskTier(tmp_path / "disk", map_size=1 << 16))


def _count_verified(path, s) -> int:
    n = 0
    with DiskTier(path, map_size=1 << 16) as d:
        for _, buf in d.iter_records():
            rec = parse_record(buf)
            check_identity(rec, s.tiers.ns_digest, None)
            check_payloads(rec)
            n += 1
    return n


def _fill_as_version(tmp_path, monkeypatch, version, prompts) -> None:
    monkeypatch.setattr(record, "FORMAT_VERSION", version)
    old = Stack(tmp_path)
    _fill_disk(old, prompts)
    old.tiers.close()
    monkeypatch.undo()


def _all_miss(tmp_path, prompts) -> dict:
    s = Stack(tmp_path)
    for p in prompts:
        assert s.run(p).num_cached_tokens == 0
    st = s.tiers.stats()
    s.tiers.close()
    return st


def test_record_under_another_format_version_is_a_miss(tmp_path, monkeypatch):
    prompts = _prompts(3, 2, seed=6)
    _fill_as_version(tmp_path, monkeypatch, record.FORMAT_VERSION + 1, prompts)
    st = _all_miss(tmp_path, prompts)
    assert st["mismatches"] == 3 and st["disk_pages"] == 6 - 3


def test_record_written_under_another_namespace_is_a_miss(tmp_path):
    prompts = _prompts(2, 2, seed=7)
    s = Stack(tmp_path)
    _fill_disk(s, prompts)
    from kvstrata.pagepool import page_hashes
    # Plant another model's record under this model's key: same key, foreign header.
    head, *payloads = _records(1, seed=8)[0][1]
    h0 = page_hashes(s.ns, prompts[0])[0]
    s.disk.delete([h0])
    assert s.disk.put_batch([(h0, [head, *payloads])]) == 1
    assert s.run(prompts[0]).num_cached_tokens == 0
    assert s.run(prompts[1]).num_cached_tokens == 2 * PAGE
    assert s.tiers.stats()["mismatches"] == 1
    s.tiers.close()


def _rewrite_in_old_layout(path, version: int) -> int:
    """Turn a tier into what disk format ``version`` wrote (no recorded layout, no frames):
    1, whole records in ``pages``; 2, heads in ``pages``, payloads in ``payloads``; 3, heads in
    ``pages``, payloads (without frames) in segment files. Returns the number of records."""
    import lmdb
    with DiskTier(path, readonly=True) as r:
        with r.reader() as get:
            recs = {k: [bytes(p) for p in get(k)] for k in r.keys_by_age()}
    shutil.rmtree(path)
    env = lmdb.open(str(path), max_dbs=8)
    pages, index, meta = env.open_db(b"pages"), env.open_db(b"index"), env.open_db(b"meta")
    payloads = env.open_db(b"payloads") if version == 2 else None
    os.makedirs(path / "segments")
    with env.begin(write=True) as txn, open(path / "segments" / f"{1:016x}.seg", "wb") as f:
        for seq, (k, parts) in enumerate(recs.items()):
            txn.put(k, parts[0] if version > 1 else b"".join(parts), db=pages)
            size = sum(map(len, parts))
            if version == 2:
                for i, p in enumerate(parts[1:]):
                    txn.put(k + bytes((i,)), p, db=payloads)
            loc = b""
            if version == 3:
                loc = struct.pack(f"<QQ{len(parts) - 1}Q", 1, f.tell(), *map(len, parts[1:]))
                f.write(b"".join(parts[1:]))
            txn.put(k, struct.pack("<QQ", seq, size) + loc, db=index)
        txn.put(b"bytes", struct.pack("<Q", sum(sum(map(len, p)) for p in recs.values())), db=meta)
    env.close()
    return len(recs)


@pytest.mark.parametrize("version", [1, 2, 3])
def test_tiers_of_older_layouts_are_refused_by_readers_and_moved_aside_by_writers(
        tmp_path, caplog, version):
    """Disk formats 1-3 kept record heads (or whole records) in LMDB, where no scan can find
    them: readers say so in one line; a writer moves the old files aside (logged once) and
    starts empty, so every page is a plain miss (nothing is misread)."""
    prompts = _prompts(2, 2, seed=9)
    s = Stack(tmp_path)
    _fill_disk(s, prompts)
    s.tiers.close()
    assert _rewrite_in_old_layout(tmp_path / "disk", version) == 4
    with pytest.raises(ValueError, match="older kvstrata .disk layout 3 or earlier"):
        DiskTier(tmp_path / "disk", readonly=True)
    with caplog.at_level(logging.WARNING, "kvstrata.tiers.disk"):
        st = _all_miss(tmp_path, prompts)
    assert st["mismatches"] == st["checksum_failures"] == 0 and st["disk_pages"] == 0
    moved = [r.message for r in caplog.records if "moved its files to" in r.message]
    assert len(moved) == 1 and "old-layout-" in moved[0]
    aside = [n for n in os.listdir(tmp_path / "disk") if n.startswith("old-layout-")]
    assert len(aside) == 1 and "data.mdb" in os.listdir(tmp_path / "disk" / aside[0])


def test_head_without_its_payloads_is_a_counted_miss_and_deleted(tmp_path):
    prompts = _prompts(2, 2, seed=10)
    s = Stack(tmp_path)
    _fill_disk(s, prompts)
    from kvstrata.pagepool import page_hashes
    where = {}
    with s.disk.env.begin() as txn:
        for p, prompt in enumerate(prompts):
            for i, h in enumerate(page_hashes(s.ns, prompt)):
                where[diskindex.location(txn.get(h, db=s.disk._records))] = (p, i, h)
    (seg, _, _), (p, i, h) = max(where.items())     # the record at the end of a segment
    _, off, lens = s.disk.where(h)
    assert len(s.disk.segments()) == 1
    os.truncate(s.disk.files.path(seg), off + lens[0] + lens[1] + 1)   # its last payload cut short
    assert s.run(prompts[p]).cached_from["lower"] == i
    st = s.tiers.stats()
    assert st["checksum_failures"] == 1 and st["mismatches"] == 0
    assert s.disk.contains([h]) == [False]
    with s.disk.env.begin() as txn:                                   # its index entries are gone
        assert txn.get(h, db=s.disk._records) is None
        assert txn.get(seg.to_bytes(8, "big") + h, db=s.disk._byseg) is None
    s.tiers.close()


def test_missing_segment_is_a_counted_miss(tmp_path):
    prompts = _prompts(2, 2, seed=11)
    s = Stack(tmp_path)
    _fill_disk(s, prompts)
    for name in os.listdir(s.disk.segdir):                         # someone deleted the files
        os.unlink(os.path.join(s.disk.segdir, name))
    for p in prompts:
        assert s.run(p).num_cached_tokens == 0
    st = s.tiers.stats()
    assert st["checksum_failures"] == 2 and st["mismatches"] == 0 and st["disk_pages"] == 2
    s.tiers.close()


def test_kill_9_between_payload_write_and_commit_leaves_a_torn_tail_that_is_ignored(tmp_path):
    """The writer dies after its payloads reached the segment, before the heads' commit."""
    records = _records(3 * 8, seed=12)
    path = tmp_path / "d"
    pid = os.fork()
    if pid == 0:
        try:
            d = DiskTier(path, map_size=1 << 26)
            d.put_batch(records[:8])
            d.put_batch(records[8:16])

            def die():
                os.kill(os.getpid(), signal.SIGKILL)
            d.before_commit = die
            d.put_batch(records[16:])
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    with DiskTier(path, readonly=True) as r:
        (seg, (live, count, end)), = r.segments().items()
        assert count == 16 and live == end
        torn = os.path.getsize(r.files.path(seg)) - end
        assert torn == sum(diskindex.entry_bytes(len(h), [len(p) for p in parts])
                           for h, parts in records[16:])
        with r.reader() as get:
            assert [get(h) is not None for h, _ in records] == [True] * 16 + [False] * 8
    assert _verify_all(path) == 16          # a writer's open cuts the tail (checked inside)
    with DiskTier(path, map_size=1 << 26) as d:
        assert d.put_batch(records[16:]) == 8
    assert _verify_all(path) == 24
