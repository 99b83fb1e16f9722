"""The disk tier: an LMDB environment in a directory, one self-describing record per page hash.

A record is stored as its parts ``[head, payload_0, payload_1, ...]`` (:mod:`kvstrata.tiers.record`),
each part its own value, so a payload is handed to LMDB straight from the caller's buffer (a host
slot) instead of being joined with its header first: LMDB copies it once into its dirty pages and
the commit writes them.

Sub-databases:

- ``pages``: page hash -> part 0 (the record head: prefix and header, or a whole record).
- ``payloads``: page hash || u8 i -> part i + 1 (group i's payload).
- ``index``: page hash -> ``(access seq u64, record bytes u64)``.
- ``lru``: big-endian access seq -> page hash, so a cursor walks pages oldest-access first. The
  order lives in the database, so a restarted process evicts in the same order.
- ``meta``: ``seq`` (next access number) and ``bytes`` (sum of record sizes).

A batch of pages (every part of every page) is written in one transaction, so a batch is
all-or-nothing: a writer killed in the middle of a commit leaves the previous committed state
(LMDB's copy-on-write B-tree), never a partial page. Parts without their head (left by a process
that deleted only heads, e.g. an older kvstrata) are swept when a writer opens the tier; a head
whose parts are missing reads back short, fails to parse and is deleted by its reader. LMDB lets
any number of processes read while one writes. A write that fails (map full, ENOSPC, I/O error)
aborts its transaction: nothing of it is visible, the error is counted and logged once per burst,
and the caller goes on.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import lmdb

from ..pagepool import format_bytes

log = logging.getLogger(__name__)

_SEQ = struct.Struct(">Q")          # big-endian so byte order == numeric order in the lru db
_IDX = struct.Struct("<QQ")
_U64 = struct.Struct("<Q")
MAX_PARTS = 257                     # head + 256 payloads: the part index is one byte


def tune_malloc_for_large_values(max_value_bytes: int = 32 << 20) -> bool:
    """Let glibc recycle LMDB's dirty-page buffers instead of mmapping fresh ones per value.

    Without LMDB's writemap, every value larger than a page gets a malloc'd buffer of its size; at
    glibc's default thresholds a multi-MiB buffer is a fresh ``mmap`` whose every 4 KiB page faults
    on first touch and which is unmapped again at commit: 2 MiB pages were written ~10x slower
    than a plain file. Raising the mmap and trim thresholds keeps those buffers on the heap. This
    is process-wide (glibc only) and only trades retained heap (up to a batch of values) for speed.
    Returns whether it was applied.
    """
    import ctypes
    import ctypes.util
    name = ctypes.util.find_library("c")
    if not name or sys.platform != "linux":
        return False
    try:
        libc = ctypes.CDLL(name)
        M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
        ok = libc.mallopt(M_MMAP_THRESHOLD, max_value_bytes)
        ok &= libc.mallopt(M_TRIM_THRESHOLD, 8 * max_value_bytes)
        ok &= libc.mallopt(M_TOP_PAD, 2 * max_value_bytes)
        return bool(ok)
    except (OSError, AttributeError):
        return False


class DiskTier:
    """LMDB page store with a byte capacity and persistent LRU order.

    Args:
        path: directory of the environment (created if missing, unless ``readonly``).
        map_size: the LMDB map size (upper bound of the file), bytes.
        capacity_bytes: records beyond this are evicted oldest-access first; default: half the map
            (LMDB needs room for copy-on-write pages and its free list).
        readonly: open for reading only (``kvstrata inspect``, other processes).
        tune_malloc: call :func:`tune_malloc_for_large_values` when opening for writing.
        sync: fsync every commit (survives power loss). Off by default: a cache may lose its
            newest pages on an OS crash, and records are checksummed, so nothing wrong is served.
    """

    def __init__(self, path: str | os.PathLike, map_size: int = 1 << 30,
                 capacity_bytes: int | None = None, readonly: bool = False, sync: bool = False,
                 tune_malloc: bool = True):
        if not isinstance(map_size, int) or map_size < (1 << 16):
            raise ValueError(f"map_size must be at least 64 KiB, got {map_size!r}")
        if capacity_bytes is None:
            capacity_bytes = map_size // 2
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"disk capacity must be a positive number of bytes, got {capacity_bytes!r}")
        if capacity_bytes > map_size:
            raise ValueError(f"disk capacity {format_bytes(capacity_bytes)} exceeds the LMDB map "
                             f"size {format_bytes(map_size)}; raise map_size to at least "
                             f"{capacity_bytes * 2} bytes (copy-on-write needs headroom)")
        self.path = os.fspath(path)
        self.readonly = readonly
        if readonly and not os.path.isdir(self.path):
            raise ValueError(f"{self.path!r} is not a kvstrata disk tier (no such directory)")
        if tune_malloc and not readonly:
            tune_malloc_for_large_values()
        self.env = lmdb.open(self.path, map_size=map_size, subdir=True, readonly=readonly,
                             max_dbs=5, max_readers=256, sync=sync, metasync=sync,
                             readahead=False, create=not readonly, lock=True)
        # Reader slots of processes that died (kill -9) would pin old pages forever.
        self.env.reader_check()
        try:
            self._pages = self.env.open_db(b"pages", create=not readonly)
            self._index = self.env.open_db(b"index", create=not readonly)
            self._lru = self.env.open_db(b"lru", create=not readonly)
            self._meta = self.env.open_db(b"meta", create=not readonly)
        except lmdb.NotFoundError:
            self.env.close()
            raise ValueError(f"{self.path!r} is an LMDB environment but not a kvstrata disk tier") from None
        try:
            self._payloads = self.env.open_db(b"payloads", create=not readonly)
        except lmdb.NotFoundError:
            # Written by a version that joined records: readers see whole records (which then
            # fail the format-version check as misses), a writer creates the database.
            self._payloads = None
        self.capacity_bytes = capacity_bytes
        if readonly:
            # Readers report the capacity the writer configured, not their own default.
            with self.env.begin(db=self._meta) as txn:
                v = txn.get(b"capacity")
            if v:
                self.capacity_bytes = _U64.unpack(v)[0]
        else:
            try:
                with self.env.begin(write=True, db=self._meta) as txn:
                    txn.put(b"capacity", _U64.pack(capacity_bytes))
            except lmdb.Error:
                pass    # a full map: only `inspect` reads this, it falls back to its default
        self._cap = capacity_bytes            # lowered when the map turns out to be smaller
        self._touched: dict[bytes, None] = {}  # read hits whose access order is not written yet
        self.stats = {"writes": 0, "write_bytes": 0, "write_errors": 0, "evictions": 0,
                      "deleted": 0, "orphans": 0}
        self._burst_errors = 0
        #: test hook: called inside every write transaction before commit (fault injection)
        self.before_commit: Callable[[], None] | None = None
        if not readonly:
            self.sweep_orphans()

    def close(self) -> None:
        if self.env is None:
            return
        if not self.readonly:
            self.flush()
        self.env.close()
        self.env = None

    def __enter__(self) -> "DiskTier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- reads --------------------------------------------------------------------------------
    @contextmanager
    def reader(self) -> Iterator[Callable[[bytes], list[memoryview] | None]]:
        """One read transaction; yields ``get(hash) -> parts | None``, the record's stored parts
        ``[head, payload_0, ...]`` in order (a part missing from the sequence ends it). The views
        are valid only inside the ``with`` block (they point into the map): copy what you keep."""
        with self.env.begin(buffers=True) as txn:
            yield self._getter(txn)

    def _getter(self, txn) -> Callable[[bytes], list | None]:
        cur = txn.cursor(db=self._payloads) if self._payloads is not None else None

        def get(h: bytes) -> list | None:
            head = txn.get(h, db=self._pages)
            if head is None:
                return None
            return [head, *_parts_of(cur, h)]
        return get

    def contains(self, hashes: Sequence[bytes]) -> list[bool]:
        with self.env.begin(db=self._index) as txn:
            return [txn.get(h) is not None for h in hashes]

    def prefix_count(self, hashes: Sequence[bytes]) -> int:
        """Consecutive pages present, starting at ``hashes[0]``."""
        n = 0
        with self.env.begin(db=self._index) as txn:
            for h in hashes:
                if txn.get(h) is None:
                    break
                n += 1
        return n

    def touch(self, hashes: Sequence[bytes]) -> None:
        """Record read hits; their new access order is written with the next write batch."""
        for h in hashes:
            self._touched[h] = None

    def keys_by_age(self) -> list[bytes]:
        """Page hashes, least recently accessed first."""
        with self.env.begin(db=self._lru) as txn:
            return [bytes(v) for _, v in txn.cursor()]

    def stored_bytes(self) -> int:
        with self.env.begin(db=self._meta) as txn:
            v = txn.get(b"bytes")
        return _U64.unpack(v)[0] if v else 0

    def __len__(self) -> int:
        with self.env.begin() as txn:
            return txn.stat(self._pages)["entries"]

    def iter_records(self) -> Iterator[tuple[bytes, bytes]]:
        """``(hash, record bytes)`` of every page, parts joined, in one read snapshot."""
        with self.env.begin() as txn:
            get = self._getter(txn)
            for k in list(txn.cursor(db=self._pages).iternext(values=False)):
                yield k, b"".join(get(k))

    def sweep_orphans(self) -> int:
        """Delete payload parts whose head is gone; returns how many. They are invisible (every
        lookup starts at the head) but hold space; a writer runs this when it opens the tier."""
        if self.readonly or self._payloads is None:
            return 0
        with self.env.begin() as txn:
            orphans = [k for k in txn.cursor(db=self._payloads).iternext(values=False)
                       if txn.get(k[:-1], db=self._pages) is None]
        if not orphans:
            return 0
        try:
            with self.env.begin(write=True) as txn:
                for k in orphans:
                    if txn.get(k[:-1], db=self._pages) is None:   # still headless (other writers)
                        txn.delete(k, db=self._payloads)
        except (lmdb.Error, OSError) as e:
            self._note_error(e)
            return 0
        self.stats["orphans"] += len(orphans)
        log.info("disk tier %s: deleted %d payloads without a record head", self.path, len(orphans))
        return len(orphans)

    # -- writes -------------------------------------------------------------------------------
    def put_batch(self, items: Sequence[tuple[bytes, Sequence[bytes | memoryview]]]) -> int:
        """Store ``(hash, record parts)`` pairs in one transaction; returns how many were stored.

        Each part is stored as its own value straight from the given buffer (no join), at most
        :data:`MAX_PARTS` per page; :meth:`reader` returns them in the same order.

        Pages already present only get their access refreshed. When the batch does not fit the
        capacity, the oldest pages are evicted first; a batch larger than the capacity keeps its
        leading pages. On any storage error the whole batch is dropped (0), never half-stored.
        """
        if self.readonly:
            raise ValueError("this DiskTier was opened readonly")
        for h, parts in items:
            if not 1 <= len(parts) <= MAX_PARTS:
                raise ValueError(f"a page is stored as 1 to {MAX_PARTS} parts, page {h.hex()} "
                                 f"has {len(parts)}")
        try:
            n = self._write(items)
        except lmdb.MapFullError as e:
            # The map holds less than the capacity says (B-tree + free-list overhead): shrink the
            # effective capacity so the next batches evict first, free space now, retry once.
            self._cap = max(1, int(self.stored_bytes() * 0.8))
            try:
                self._write([])
                n = self._write(items)
            except (lmdb.Error, OSError) as e2:
                return self._failed(e2)
            self._note_error(e)
        except (lmdb.Error, OSError) as e:
            return self._failed(e)
        if self._burst_errors:
            log.warning("disk tier %s: writes succeed again after %d failures", self.path,
                        self._burst_errors)
            self._burst_errors = 0
        return n

    def _failed(self, e: BaseException) -> int:
        self._note_error(e)
        return 0

    def _note_error(self, e: BaseException) -> None:
        self.stats["write_errors"] += 1
        if not self._burst_errors:
            what = "disk full" if isinstance(e, lmdb.MapFullError) or (
                isinstance(e, OSError) and e.errno == errno.ENOSPC) else "I/O error"
            log.warning("disk tier %s: write failed (%s: %s); pages are dropped, not stored; "
                        "further failures are counted silently until a write succeeds",
                        self.path, what, e)
        self._burst_errors += 1

    def _write(self, items: Sequence[tuple[bytes, Sequence[bytes | memoryview]]]) -> int:
        stored = 0
        with self.env.begin(write=True) as txn:
            seq = _U64.unpack(txn.get(b"seq", db=self._meta) or _U64.pack(0))[0]
            total = _U64.unpack(txn.get(b"bytes", db=self._meta) or _U64.pack(0))[0]
            touched, self._touched = self._touched, {}
            try:
                for h in touched:
                    seq = self._bump(txn, h, seq)
                new = []
                for h, parts in items:
                    if txn.get(h, db=self._index) is not None:
                        seq = self._bump(txn, h, seq)
                    else:
                        new.append((h, parts, sum(len(p) for p in parts)))
                total = self._evict(txn, total, sum(n for _, _, n in new))
                cur = txn.cursor(db=self._payloads)
                for h, parts, size in new:
                    if total + size > self._cap:
                        break       # does not fit even after evicting everything older
                    _drop_parts(cur, h)     # stale parts of a head deleted by another process
                    txn.put(h, parts[0], db=self._pages)
                    for i, p in enumerate(parts[1:]):
                        txn.put(h + bytes((i,)), p, db=self._payloads)
                    txn.put(h, _IDX.pack(seq, size), db=self._index)
                    txn.put(_SEQ.pack(seq), h, db=self._lru)
                    seq += 1
                    total += size
                    stored += 1
                    self.stats["write_bytes"] += size
                txn.put(b"seq", _U64.pack(seq), db=self._meta)
                txn.put(b"bytes", _U64.pack(total), db=self._meta)
                if self.before_commit is not None:
                    self.before_commit()
            except BaseException:
                self._touched.update(touched)   # not recorded: try again with the next write
                raise
        self.stats["writes"] += stored
        return stored

    def _bump(self, txn, h: bytes, seq: int) -> int:
        v = txn.get(h, db=self._index)
        if v is None:
            return seq
        old, size = _IDX.unpack(v)
        txn.delete(_SEQ.pack(old), db=self._lru)
        txn.put(_SEQ.pack(seq), h, db=self._lru)
        txn.put(h, _IDX.pack(seq, size), db=self._index)
        return seq + 1

    def _evict(self, txn, total: int, need: int) -> int:
        if total + need <= self._cap:
            return total
        cur = txn.cursor(db=self._lru)
        victims = []
        ok = cur.first()
        while ok and total + need > self._cap:
            h = bytes(cur.value())
            victims.append((bytes(cur.key()), h))
            v = txn.get(h, db=self._index)
            total -= _IDX.unpack(v)[1] if v else 0
            ok = cur.next()
        parts = txn.cursor(db=self._payloads)
        for k, h in victims:
            txn.delete(k, db=self._lru)
            txn.delete(h, db=self._index)
            txn.delete(h, db=self._pages)
            _drop_parts(parts, h)
        self.stats["evictions"] += len(victims)
        return total

    def delete(self, hashes: Sequence[bytes]) -> int:
        """Remove pages (found corrupt or mismatched); returns how many existed."""
        if not hashes or self.readonly:
            return 0
        n = 0
        try:
            with self.env.begin(write=True) as txn:
                total = _U64.unpack(txn.get(b"bytes", db=self._meta) or _U64.pack(0))[0]
                parts = txn.cursor(db=self._payloads)
                for h in hashes:
                    v = txn.get(h, db=self._index)
                    if v is not None:
                        seq, size = _IDX.unpack(v)
                        txn.delete(_SEQ.pack(seq), db=self._lru)
                        txn.delete(h, db=self._index)
                        total -= size
                        n += 1
                    txn.delete(h, db=self._pages)   # also a record without an index entry
                    _drop_parts(parts, h)
                txn.put(b"bytes", _U64.pack(max(total, 0)), db=self._meta)
        except (lmdb.Error, OSError) as e:
            self._note_error(e)
            return 0
        self.stats["deleted"] += n
        return n

    def flush(self) -> None:
        """Write pending access-order updates (called by :meth:`close`)."""
        if self._touched and not self.readonly:
            self.put_batch([])

    def info(self) -> dict:
        st = self.env.stat()
        return {"path": self.path, "pages": len(self), "stored_bytes": self.stored_bytes(),
                "capacity_bytes": self.capacity_bytes, "effective_capacity_bytes": self._cap,
                "map_size": self.env.info()["map_size"], "page_size_lmdb": st["psize"],
                "opened": time.time()}


def _parts_of(cur, h: bytes) -> list:
    """Payload parts ``h || 0``, ``h || 1``, ... in order, stopping at the first gap."""
    out: list = []
    if cur is None or not cur.set_range(h):
        return out
    n = len(h)
    while True:
        k = cur.key()
        if len(k) != n + 1 or k[n] != len(out) or bytes(k[:n]) != h:
            return out
        out.append(cur.value())
        if not cur.next():
            return out


def _drop_parts(cur, h: bytes) -> None:
    """Delete every payload part stored under ``h`` (a write cursor on ``payloads``)."""
    n = len(h)
    ok = cur.set_range(h)
    while ok:
        k = cur.key()
        if len(k) != n + 1 or bytes(k[:n]) != h:
            return
        ok = cur.delete()
