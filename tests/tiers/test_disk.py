"""DiskTier: batched commits, capacity + persistent LRU, restarts, readers, failed writes."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys

import lmdb
import pytest

from kvstrata.tiers import DiskTier
from kvstrata.tiers import diskindex


def _items(keys, size=1000):
    return [(k, [k * (size // len(k))]) for k in keys]


def _key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_put_contains_read(tmp_path):
    with DiskTier(tmp_path / "d", map_size=1 << 22) as d:
        assert d.put_batch(_items([_key(1), _key(2)])) == 2
        assert d.contains([_key(1), _key(3), _key(2)]) == [True, False, True]
        assert d.prefix_count([_key(1), _key(2), _key(3), _key(1)]) == 2
        with d.reader() as get:
            assert [bytes(p) for p in get(_key(2))] == [_key(2) * 62]
            assert get(_key(3)) is None
        assert d.stored_bytes() == 2 * 992
        assert len(d) == 2


def test_capacity_evicts_least_recently_accessed_and_order_survives_restart(tmp_path):
    path = tmp_path / "d"
    with DiskTier(path, map_size=1 << 22, capacity_bytes=3 * 992) as d:
        d.put_batch(_items([_key(i) for i in range(3)]))
        d.touch([_key(0)])                       # 0 becomes the most recent
        d.flush()
        assert d.keys_by_age() == [_key(1), _key(2), _key(0)]
    with DiskTier(path, map_size=1 << 22, capacity_bytes=3 * 992) as d:   # a new process's view
        assert d.keys_by_age() == [_key(1), _key(2), _key(0)]
        assert d.put_batch(_items([_key(3)])) == 1
        assert d.contains([_key(i) for i in range(4)]) == [True, False, True, True]
        assert d.counters()["evictions"] == 1
        assert d.keys_by_age() == [_key(2), _key(0), _key(3)]


def test_present_pages_only_refresh_access(tmp_path):
    with DiskTier(tmp_path / "d", map_size=1 << 22) as d:
        d.put_batch(_items([_key(0), _key(1)]))
        assert d.put_batch(_items([_key(0)])) == 0
        assert d.keys_by_age() == [_key(1), _key(0)]


def test_batch_larger_than_capacity_keeps_leading_pages(tmp_path):
    with DiskTier(tmp_path / "d", map_size=1 << 22, capacity_bytes=2 * 992) as d:
        assert d.put_batch(_items([_key(i) for i in range(5)])) == 2
        assert d.contains([_key(i) for i in range(5)]) == [True, True, False, False, False]


def test_readonly_open_refuses_writes(tmp_path):
    path = tmp_path / "d"
    with DiskTier(path, map_size=1 << 22) as w:
        w.put_batch(_items([_key(1)]))
    with DiskTier(path, readonly=True) as r:
        assert r.contains([_key(1), _key(2)]) == [True, False]
        with pytest.raises(ValueError, match="readonly"):
            r.put_batch(_items([_key(2)]))


def test_other_process_reads_while_this_one_writes(tmp_path):
    path = tmp_path / "d"
    with DiskTier(path, map_size=1 << 22) as w:
        w.put_batch(_items([_key(i) for i in range(10)]))
        code = ("import sys; from kvstrata.tiers import DiskTier; "
                f"d = DiskTier({str(path)!r}, readonly=True); print(len(d))")
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        w.put_batch(_items([_key(i) for i in range(10, 20)]))
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0 and int(out) in (10, 20)
    code = ("from kvstrata.tiers import DiskTier; "
            f"d = DiskTier({str(path)!r}, readonly=True); print(len(d))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60).stdout.strip() == "20"


def test_map_full_fails_cleanly_and_shrinks_capacity(tmp_path, caplog):
    # The map holds only the index (~150 bytes a record): 64 KiB fill up long before 1 MiB of
    # 32-byte records does.
    with DiskTier(tmp_path / "d", map_size=1 << 16, capacity_bytes=1 << 20) as d:
        stored = 0
        with caplog.at_level(logging.WARNING, "kvstrata.tiers.disk"):
            for b in range(200):
                stored += d.put_batch(_items([_key(b * 4 + i) for i in range(4)], size=32))
        n = len(d)
        assert 0 < n < 800 and stored >= n
        assert d.counters()["write_errors"] > 0
        with d.reader() as get:          # everything visible is whole
            for k in d.keys_by_age():
                assert b"".join(get(k)) == k * 2
        assert d._cap < (1 << 20)


def test_io_error_drops_batch_counts_and_logs_once_per_burst(tmp_path, caplog):
    with DiskTier(tmp_path / "d", map_size=1 << 22) as d:
        d.put_batch(_items([_key(0)]))

        def enospc():
            raise OSError(errno.ENOSPC, "No space left on device")
        d.before_commit = enospc
        with caplog.at_level(logging.WARNING, "kvstrata.tiers.disk"):
            for i in range(1, 6):
                assert d.put_batch(_items([_key(i)])) == 0
            assert d.counters()["write_errors"] == 5
            assert len([r for r in caplog.records if "write failed" in r.message]) == 1
            assert "disk full" in caplog.records[0].message
            d.before_commit = None
            assert d.put_batch(_items([_key(9)])) == 1
            assert any("succeed again after 5" in r.message for r in caplog.records)
        assert d.contains([_key(i) for i in (0, 1, 5, 9)]) == [True, False, False, True]


def test_bad_arguments_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="map_size"):
        DiskTier(tmp_path / "a", map_size=10)
    with DiskTier(tmp_path / "b", map_size=1 << 20, capacity_bytes=1 << 30) as d:
        assert d.capacity_bytes == 1 << 30     # the map holds the index only, not the records
    with pytest.raises(ValueError, match="no such directory"):
        DiskTier(tmp_path / "missing", readonly=True)
    env = lmdb.open(str(tmp_path / "plain"), max_dbs=1)
    env.close()
    with pytest.raises(ValueError, match="not a kvstrata disk tier"):
        DiskTier(tmp_path / "plain", readonly=True)


def _segment_bytes(d, h):
    """The parts of record ``h`` as they sit in its segment file (behind their frame)."""
    path, off, lens = d.where(h)
    with open(path, "rb") as f:
        f.seek(off)
        return path, [f.read(n) for n in lens]


def test_parts_are_stored_apart_and_read_back_in_order(tmp_path):
    parts = [b"head", memoryview(b"payload-0" * 100), b"", b"payload-2"]
    with DiskTier(tmp_path / "d", map_size=1 << 22) as d:
        assert d.put_batch([(_key(1), parts)]) == 1
        with d.reader() as get:
            assert [bytes(p) for p in get(_key(1))] == [bytes(p) for p in parts]
        path, stored = _segment_bytes(d, _key(1))   # the parts back to back in a segment
        assert stored == [bytes(p) for p in parts]
        entry = 12 + 16 + 4 * 8 + 913              # frame (key + 4 lengths) + parts
        seg = int(os.path.basename(path)[:-4], 16)
        assert d.segments() == {seg: (entry, 1, entry)}
        assert os.path.getsize(path) == entry
        assert dict(d.iter_records()) == {_key(1): b"".join(parts)}
        assert d.stored_bytes() == sum(len(p) for p in parts)
        d.delete([_key(1)])
        with d.env.begin() as txn:
            assert txn.stat(d._records)["entries"] == txn.stat(d._byseg)["entries"] == 0
        assert d.segments() == {seg: (0, 0, entry)}  # the current segment stays while open
    with DiskTier(tmp_path / "d", map_size=1 << 22) as d:   # ... and goes when a writer opens
        assert d.segments() == {} and os.listdir(d.segdir) == []


def test_eviction_removes_every_part_and_empty_segments(tmp_path):
    with DiskTier(tmp_path / "d", map_size=1 << 22, capacity_bytes=2 * 300,
                  segment_bytes=200) as d:
        for i in range(4):
            d.put_batch([(_key(i), [b"h" * 100, b"a" * 100, b"b" * 100])])
        assert d.keys_by_age() == [_key(2), _key(3)] and d.counters()["evictions"] == 2
        with d.env.begin() as txn:
            assert txn.stat(d._byseg)["entries"] == 2
        # one record per segment (its 200 payload bytes fill it): the segments of the evicted
        # records are unlinked, the two live ones stay
        segs = d.segments()
        e = 12 + 16 + 3 * 8 + 300                   # frame + parts: one entry per segment
        assert segs == {3: (e, 1, e), 4: (e, 1, e)}
        assert sorted(os.listdir(d.segdir)) == sorted(os.path.basename(d.files.path(s)) for s in segs)
        assert d.counters()["segments_deleted"] == 2


def test_writer_open_removes_orphans_and_torn_tails(tmp_path):
    path = tmp_path / "d"
    with DiskTier(path, map_size=1 << 22) as d:
        d.put_batch([(_key(1), [b"h1", b"p1" * 10]), (_key(2), [b"h2", b"p2", b"q2"])])
        (seg, (_, _, end)), = d.segments().items()
        stray = d.files.path(seg + 7)
    with open(stray, "wb") as f:            # a segment whose batch never committed
        f.write(b"x" * 100)
    with open(os.path.join(path, "segments", os.path.basename(d.files.path(seg))), "ab") as f:
        f.write(b"torn" * 50)               # bytes of a batch killed before its commit
    with DiskTier(path, readonly=True) as r:    # readers never look past committed bytes
        with r.reader() as get:
            assert [bytes(p) for p in get(_key(2))] == [b"h2", b"p2", b"q2"]
        assert r.sweep_orphans() == 0
    with DiskTier(path, map_size=1 << 22) as d:
        assert d.counters()["orphans"] == 2
        assert not os.path.exists(stray) and os.path.getsize(d.files.path(seg)) == end
        with d.reader() as get:
            assert [bytes(p) for p in get(_key(1))] == [b"h1", b"p1" * 10]
        assert d.put_batch([(_key(3), [b"h3", b"p3"])]) == 1   # into a new segment
        assert len(d.segments()) == 2


def test_one_writer_at_a_time(tmp_path):
    with DiskTier(tmp_path / "d", map_size=1 << 22) as d:
        with pytest.raises(ValueError, match="open for writing"):
            DiskTier(tmp_path / "d", map_size=1 << 22)
        d.put_batch(_items([_key(1)]))
    with DiskTier(tmp_path / "d", map_size=1 << 22) as d:     # released on close
        assert len(d) == 1


def _rec(i: int, n: int = 1000) -> tuple[bytes, list[bytes]]:
    """A record whose every byte is derived from its key (so a mix-up shows)."""
    k = _key(i)
    return k, [b"H" + k, (k * (n // 16 + 1))[:n]]


def _ids(keys) -> list[int]:
    return [int.from_bytes(k, "little") for k in keys]


def _where(d, i: int) -> tuple[int, int]:
    with d.env.begin() as txn:
        seg, off, _ = diskindex.location(txn.get(_key(i), db=d._records))
    return seg, off


def test_segments_are_reclaimed_under_capacity_pressure(tmp_path):
    # 1000-byte payloads + 17-byte heads (+ a 44-byte frame: 1061-byte entries); room for 6
    # records; a segment rolls once it holds 2000 bytes; no slack: dead bytes + live records may
    # not exceed the capacity after a write.
    cap = 6 * 1017
    e = 1061
    with DiskTier(tmp_path / "d", map_size=1 << 22, capacity_bytes=cap, segment_bytes=2000,
                  reclaim_slack=0) as d:
        assert d.file_limit() == cap
        for b in range(3):
            assert d.put_batch([_rec(2 * b), _rec(2 * b + 1)]) == 2
        assert d.segments() == {1: (2 * e, 2, 2 * e), 2: (2 * e, 2, 2 * e), 3: (2 * e, 2, 2 * e)}
        d.touch([_key(0), _key(2), _key(4)])         # one hot record in each segment
        # Record 6 evicts the coldest (1), which leaves segment 1 half dead: 1061 dead bytes +
        # 6102 of records > 6102, so the write compacts segment 1 (the most dead bytes): record 0 is re-appended
        # next to record 6 in segment 4 and segment 1 is unlinked.
        assert d.put_batch([_rec(6)]) == 1
        assert d.segments() == {2: (2 * e, 2, 2 * e), 3: (2 * e, 2, 2 * e), 4: (2 * e, 2, 2 * e)}
        assert _where(d, 6) == (4, 0) and _where(d, 0) == (4, e)
        assert _ids(d.keys_by_age()) == [3, 5, 0, 2, 4, 6]     # compaction keeps the LRU order
        assert not os.path.exists(d.files.path(1))
        # Each further record evicts one cold record and moves one hot one.
        for i in range(7, 12):
            assert d.put_batch([_rec(i)]) == 1
        assert d.segments() == {7: (2 * e, 2, 2 * e), 8: (2 * e, 2, 2 * e), 9: (2 * e, 2, 2 * e)}
        assert _ids(d.keys_by_age()) == [6, 7, 8, 9, 10, 11]
        st = d.counters()
        assert (st["evictions"], st["compactions"], st["moved_records"], st["moved_bytes"],
                st["segments_deleted"]) == (6, 6, 6, 6 * 1017, 6)
        assert sorted(os.listdir(d.segdir)) == [os.path.basename(d.files.path(s)) for s in (7, 8, 9)]
        with d.reader() as get:                        # every record intact after its moves
            for i in range(6, 12):
                assert [bytes(p) for p in get(_key(i))] == _rec(i)[1]
    with DiskTier(tmp_path / "d", map_size=1 << 22, capacity_bytes=cap) as d:  # and after a restart
        assert _ids(d.keys_by_age()) == [6, 7, 8, 9, 10, 11] and d.stored_bytes() == cap


_READER = """
import json, sys, time
from kvstrata.tiers import DiskTier
d = DiskTier(sys.argv[1], readonly=True)
hits = misses = 0
wrong, short = [], []
t0 = time.monotonic()
while time.monotonic() - t0 < float(sys.argv[2]):
    keys = d.keys_by_age()
    with d.reader() as get:        # a snapshot kept open while the writer moves and unlinks
        for k in keys:
            parts = get(k)
            if parts is None:
                misses += 1
                continue
            i = int.from_bytes(k, "little")
            want = [b"H" + k, (k * (4096 // 16 + 1))[:4096]]
            got = [bytes(p) for p in parts]
            if len(got) != 2:
                short.append(i)
            elif got != want:
                wrong.append(i)
            else:
                hits += 1
            time.sleep(0.0002)
print(json.dumps({"hits": hits, "misses": misses, "wrong": wrong, "short": short,
                  "relocated": d.counters()["relocated"]}))
"""


def test_reader_process_never_gets_a_wrong_page_while_segments_are_reclaimed(tmp_path):
    path = tmp_path / "d"
    cap = 12 * (4096 + 17)
    # (a map with room for the pages the reader's snapshots pin while the writer churns)
    with DiskTier(path, map_size=1 << 26, capacity_bytes=cap, segment_bytes=4 * 4096,
                  reclaim_slack=0) as d:
        for i in range(12):
            d.put_batch([_rec(i, 4096)])
        p = subprocess.Popen([sys.executable, "-c", _READER, str(path), "4"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        i = 12
        while p.poll() is None:
            d.touch([_key(j) for j in range(max(0, i - 12), i, 3)])   # every third record hot
            d.put_batch([_rec(i, 4096), _rec(i + 1, 4096)])
            i += 2
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        res = json.loads(out)
        assert res["wrong"] == [] and res["short"] == [], res
        assert res["hits"] > 100 and res["relocated"] > 0, res
        assert d.counters()["write_errors"] == 0, d.counters()
        assert d.counters()["compactions"] > 10 and d.counters()["segments_deleted"] > 10, d.counters()
        with d.reader() as get:
            for k in d.keys_by_age():
                assert [bytes(p) for p in get(k)] == _rec(int.from_bytes(k, "little"), 4096)[1]


def test_default_segment_size_and_slack(tmp_path):
    with DiskTier(tmp_path / "a", map_size=1 << 22) as d:             # capacity 2 MiB
        assert d.segment_bytes == 1 << 20 and d.reclaim_slack == 2 << 20
    with DiskTier(tmp_path / "b", map_size=8 << 30, capacity_bytes=4 << 30) as d:
        assert d.segment_bytes == 256 << 20 and d.reclaim_slack == 512 << 20
    with pytest.raises(ValueError, match="segment_bytes"):
        DiskTier(tmp_path / "c", map_size=1 << 22, segment_bytes=0)


def test_part_count_is_checked(tmp_path):
    with DiskTier(tmp_path / "d", map_size=1 << 22) as d:
        with pytest.raises(ValueError, match="1 to 257 parts"):
            d.put_batch([(_key(1), [])])
        with pytest.raises(ValueError, match="1 to 257 parts"):
            d.put_batch([(_key(1), [b"x"] * 258)])
        assert len(d) == 0
