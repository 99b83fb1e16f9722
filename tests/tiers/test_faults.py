"""Fault injection: killed writers, flipped bytes, a map too small, foreign records."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch

from kvstrata.codecs import get_codec
from kvstrata.pagepool import PageInfo, hash_page
from kvstrata.tiers import DiskTier, record
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
    with s.disk.env.begin(write=True) as txn:
        for i, k in enumerate(keys):
            # Alternate between the head and the payload parts (one per group).
            key, db = (k, s.disk._pages) if i % 3 == 0 else (k + bytes((i % 3 - 1,)), s.disk._payloads)
            v = bytearray(txn.get(key, db=db))
            v[rng.randrange(len(v))] ^= 1 << rng.randrange(8)
            txn.put(key, bytes(v), db=db)
    for p in prompts:
        seq = s.run(p)
        assert seq.num_cached_tokens == 0
    st = s.tiers.stats()
    assert st["checksum_failures"] + st["mismatches"] == 8
    assert st["h2d_pages"] == 0 and len(s.disk) == 0
    s.tiers.close()


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
    with s.disk.env.begin(write=True) as txn:
        txn.put(h0, head, db=s.disk._pages)
        for i, p in enumerate(payloads):
            txn.put(h0 + bytes((i,)), p, db=s.disk._payloads)
    assert s.run(prompts[0]).num_cached_tokens == 0
    assert s.run(prompts[1]).num_cached_tokens == 2 * PAGE
    assert s.tiers.stats()["mismatches"] == 1
    s.tiers.close()


def test_version_1_joined_records_are_a_clean_miss(tmp_path, monkeypatch):
    """A tier written by format 1: the whole record as one value, no ``payloads`` database."""
    import lmdb
    prompts = _prompts(2, 2, seed=9)
    _fill_as_version(tmp_path, monkeypatch, 1, prompts)
    with DiskTier(tmp_path / "disk", readonly=True) as r:
        joined = dict(r.iter_records())
    env = lmdb.open(str(tmp_path / "disk"), max_dbs=5)         # rewrite it in the v1 layout
    pages, payloads = env.open_db(b"pages"), env.open_db(b"payloads")
    with env.begin(write=True) as txn:
        for k, v in joined.items():
            txn.put(k, v, db=pages)
        txn.drop(payloads, delete=True)
    env.close()
    with DiskTier(tmp_path / "disk", readonly=True) as r:       # readers cope without payloads
        assert r._payloads is None and len(r) == 4
        with pytest.raises(record.RecordMismatch, match="version 1"):
            parse_record(next(r.iter_records())[1])
    st = _all_miss(tmp_path, prompts)
    assert st["mismatches"] == 2 and st["disk_pages"] == 4 - 2


def test_head_without_its_payloads_is_a_counted_miss_and_deleted(tmp_path):
    prompts = _prompts(2, 2, seed=10)
    s = Stack(tmp_path)
    _fill_disk(s, prompts)
    from kvstrata.pagepool import page_hashes
    h = page_hashes(s.ns, prompts[0])[1]
    with s.disk.env.begin(write=True) as txn:
        assert txn.delete(h + bytes((1,)), db=s.disk._payloads)      # the second group's part
    assert s.run(prompts[0]).cached_from["lower"] == 1
    st = s.tiers.stats()
    assert st["checksum_failures"] == 1 and st["mismatches"] == 0
    assert s.disk.contains([h]) == [False]
    with s.disk.env.begin() as txn:                                   # every part is gone
        assert txn.get(h, db=s.disk._pages) is None
        assert txn.get(h + bytes((0,)), db=s.disk._payloads) is None
    s.tiers.close()
