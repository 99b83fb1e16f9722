"""DiskTier: batched commits, capacity + persistent LRU, restarts, readers, failed writes."""

from __future__ import annotations

import errno
import logging
import subprocess
import sys

import lmdb
import pytest

from kvstrata.tiers import DiskTier


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
        assert d.stats["evictions"] == 1
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
    with DiskTier(tmp_path / "d", map_size=1 << 18, capacity_bytes=1 << 18) as d:
        stored = 0
        with caplog.at_level(logging.WARNING, "kvstrata.tiers.disk"):
            for b in range(40):
                stored += d.put_batch(_items([_key(b * 4 + i) for i in range(4)], size=8000))
        n = len(d)
        assert 0 < n < 160 and stored >= n
        with d.reader() as get:          # everything visible is whole
            for k in d.keys_by_age():
                assert b"".join(get(k)) == k * 500
        assert d._cap < (1 << 18)


def test_io_error_drops_batch_counts_and_logs_once_per_burst(tmp_path, caplog):
    with DiskTier(tmp_path / "d", map_size=1 << 22) as d:
        d.put_batch(_items([_key(0)]))

        def enospc():
            raise OSError(errno.ENOSPC, "No space left on device")
        d.before_commit = enospc
        with caplog.at_level(logging.WARNING, "kvstrata.tiers.disk"):
            for i in range(1, 6):
                assert d.put_batch(_items([_key(i)])) == 0
            assert d.stats["write_errors"] == 5
            assert len([r for r in caplog.records if "write failed" in r.message]) == 1
            assert "disk full" in caplog.records[0].message
            d.before_commit = None
            assert d.put_batch(_items([_key(9)])) == 1
            assert any("succeed again after 5" in r.message for r in caplog.records)
        assert d.contains([_key(i) for i in (0, 1, 5, 9)]) == [True, False, False, True]


def test_bad_arguments_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="map_size"):
        DiskTier(tmp_path / "a", map_size=10)
    with pytest.raises(ValueError, match="exceeds the LMDB map"):
        DiskTier(tmp_path / "b", map_size=1 << 20, capacity_bytes=1 << 21)
    with pytest.raises(ValueError, match="no such directory"):
        DiskTier(tmp_path / "missing", readonly=True)
    env = lmdb.open(str(tmp_path / "plain"), max_dbs=1)
    env.close()
    with pytest.raises(ValueError, match="not a kvstrata disk tier"):
        DiskTier(tmp_path / "plain", readonly=True)


def test_parts_are_stored_apart_and_read_back_in_order(tmp_path):
    parts = [b"head", memoryview(b"payload-0" * 100), b"", b"payload-2"]
    with DiskTier(tmp_path / "d", map_size=1 << 22) as d:
        assert d.put_batch([(_key(1), parts)]) == 1
        with d.reader() as get:
            assert [bytes(p) for p in get(_key(1))] == [bytes(p) for p in parts]
        with d.env.begin() as txn:
            assert txn.get(_key(1), db=d._pages) == b"head"
            assert txn.get(_key(1) + b"\x02", db=d._payloads) == b"payload-2"
        assert dict(d.iter_records()) == {_key(1): b"".join(parts)}
        assert d.stored_bytes() == sum(len(p) for p in parts)
        d.delete([_key(1)])
        with d.env.begin() as txn:
            assert txn.stat(d._payloads)["entries"] == 0 and txn.stat(d._pages)["entries"] == 0


def test_eviction_removes_every_part(tmp_path):
    with DiskTier(tmp_path / "d", map_size=1 << 22, capacity_bytes=2 * 300) as d:
        for i in range(4):
            d.put_batch([(_key(i), [b"h" * 100, b"a" * 100, b"b" * 100])])
        assert d.keys_by_age() == [_key(2), _key(3)] and d.stats["evictions"] == 2
        with d.env.begin() as txn:
            assert txn.stat(d._payloads)["entries"] == 4


def test_payloads_without_a_head_are_invisible_and_swept(tmp_path):
    path = tmp_path / "d"
    with DiskTier(path, map_size=1 << 22) as d:
        d.put_batch([(_key(1), [b"h1", b"p1"]), (_key(2), [b"h2", b"p2", b"q2"])])
        with d.env.begin(write=True) as txn:     # what a version-1 writer's delete leaves behind
            txn.delete(_key(2), db=d._pages)
            txn.put(_key(3) + b"\x00", b"stray", db=d._payloads)
        with d.reader() as get:
            assert get(_key(2)) is None and get(_key(3)) is None
        # A new record under a hash with stale parts keeps only its own parts.
        d.put_batch([(_key(3), [b"h3", b"p3"])])
        with d.reader() as get:
            assert [bytes(p) for p in get(_key(3))] == [b"h3", b"p3"]
    with DiskTier(path, map_size=1 << 22) as d:   # a writer opening the tier sweeps the rest
        assert d.stats["orphans"] == 2
        with d.env.begin() as txn:
            assert [k for k, _ in txn.cursor(db=d._payloads)] == [_key(1) + b"\x00",
                                                                  _key(3) + b"\x00"]
    with DiskTier(path, readonly=True) as r:
        assert r.sweep_orphans() == 0


def test_part_count_is_checked(tmp_path):
    with DiskTier(tmp_path / "d", map_size=1 << 22) as d:
        with pytest.raises(ValueError, match="1 to 257 parts"):
            d.put_batch([(_key(1), [])])
        with pytest.raises(ValueError, match="1 to 257 parts"):
            d.put_batch([(_key(1), [b"x"] * 258)])
        assert len(d) == 0
