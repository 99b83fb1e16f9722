"""The disk tier: record heads in LMDB, payloads in append-only segment files.

A record is stored as its parts ``[head, payload_0, payload_1, ...]`` (:mod:`kvstrata.tiers.record`).
The payloads of a batch are appended to the current *segment* (``PATH/segments/<id>.seg``) with one
``os.pwritev`` straight from the caller's buffers (the host slots): the kernel's copy into the
page cache is the only copy, as for a plain file. LMDB (``PATH/data.mdb``) holds the small parts:

- ``pages``: page hash -> part 0 (the record head: prefix and msgpack header; the header carries
  every payload's CRC-32).
- ``index``: page hash -> ``(access seq, record bytes, segment id, offset)`` + one u64 length per
  payload. The payloads of a record lie back to back in one segment; segment id 0 = no payloads.
- ``lru``: big-endian access seq -> page hash (oldest access first; survives restarts).
- ``segs``: segment id -> ``(live payload bytes, live records, end)``; ``end`` is the committed
  size of the file. ``byseg``: segment id || page hash -> ``b""`` (the records of a segment).
- ``meta``: ``seq``, ``bytes`` (sum of record sizes), ``capacity``, ``nextseg``.

Crash safety: a batch's payloads are written (and fsynced with ``sync=True``) *before* the LMDB
transaction that makes their heads visible commits, and the whole batch is one transaction, so a
writer killed at any point leaves the previous committed state: bytes past a segment's committed
``end`` are a torn tail, never referenced, and cut off when a writer next opens the tier. A
segment is written once and never overwritten, and segment ids are never reused, so a committed
``(segment, offset)`` always holds the same bytes until the file is unlinked.

Space: ``capacity_bytes`` bounds the sum of record sizes (heads + payloads); over it, records are
evicted least recently accessed first (as before). A segment is unlinked once it holds no live
record. Dead bytes inside segments that still hold live records are reclaimed by *compaction*:
when the segment files exceed ``capacity + reclaim_slack`` (default: max(2 segments,
capacity / 8)), the sealed segment
with the most dead bytes has its live records re-appended to the current segment (bytes copied as
they are; the record's CRCs still cover them) and is unlinked. Compaction keeps every record and
its access order; it never evicts.

Concurrency: one writer process at a time (an exclusive ``flock`` on ``PATH/writer.lock``); any
number of readers (``readonly=True``, e.g. ``kvstrata inspect``) map segments read-only. A reader
whose snapshot points into a segment that was compacted away re-reads the head's location in a
fresh snapshot and follows it (or reports a miss); only a head whose own location holds missing or
short bytes comes back short (``[head]``), which fails to parse and is deleted by its reader. A
reader never gets wrong bytes from reuse: the payload bytes at a committed location never change.

A write that fails (map full, ENOSPC, I/O error) aborts its transaction: nothing of it is visible,
the error is counted and logged once per burst, and the caller goes on.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import struct
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import lmdb

from ..pagepool import format_bytes
from .protocol import check_key, new_counters, record_nbytes

log = logging.getLogger(__name__)

_SEQ = struct.Struct(">Q")          # big-endian so byte order == numeric order in lru / byseg
_IDX = struct.Struct("<QQQQ")       # access seq, record bytes, segment id, payload offset
_LOC = 16                           # index value bytes from here on: the location
_SEGV = struct.Struct("<QQQ")       # live payload bytes, live records, committed end
_U64 = struct.Struct("<Q")
MAX_PARTS = 257                     # head + 256 payloads (kept from the LMDB layout)
DEFAULT_SEGMENT_BYTES = 256 << 20
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
_SEGDIR = "segments"
_SUFFIX = ".seg"


def _loc(v) -> tuple[int, int, tuple[int, ...]] | None:
    """``(segment, offset, payload lengths)`` of an index value; None for a format-2 value."""
    if v is None or len(v) < _IDX.size:
        return None
    _, _, seg, off = _IDX.unpack_from(v, 0)
    n = (len(v) - _IDX.size) // 8
    return seg, off, struct.unpack_from(f"<{n}Q", v, _IDX.size)


def _seg_key(seg: int, h: bytes = b"") -> bytes:
    return _SEQ.pack(seg) + h


def _pwritev_all(fd: int, bufs: list, offset: int) -> int:
    """Write every buffer at ``offset`` (``pwritev`` in IOV_MAX chunks, resuming short writes)."""
    views = [memoryview(b).cast("B") for b in bufs if len(b)]
    start = offset
    i = 0
    while i < len(views):
        chunk = views[i:i + _IOV_MAX]
        n = os.pwritev(fd, chunk, offset)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += n
        # skip the buffers written whole; a short write resumes inside the next one
        while n and i < len(views):
            if n >= len(views[i]):
                n -= len(views[i])
                i += 1
            else:
                views[i] = views[i][n:]
                n = 0
    return offset - start


class DiskTier:
    """Page store: heads in LMDB, payloads in segment files; byte capacity, persistent LRU.

    Args:
        path: directory of the tier (created if missing, unless ``readonly``).
        map_size: the LMDB map size (upper bound of ``data.mdb``, which now holds heads and
            bookkeeping only), bytes.
        capacity_bytes: records (heads + payloads) beyond this are evicted oldest-access first;
            default: half the map (kept from the all-in-LMDB layout).
        readonly: open for reading only (``kvstrata inspect``, other processes).
        sync: fsync payloads before, and LMDB at, every commit (survives power loss). Off by
            default: a cache may lose its newest pages on an OS crash, and records are
            checksummed, so nothing wrong is served.
        segment_bytes: a segment is sealed once it reaches this size (a batch is never split, so a
            segment may exceed it by one batch). Default: ``capacity / 8`` clamped to
            [1 MiB, 256 MiB].
        reclaim_slack: segment files may hold this many bytes beyond the capacity (dead bytes of
            segments that still hold live records) before a write compacts. Default:
            ``max(2 * segment_bytes, capacity / 8)``.
    """

    def __init__(self, path: str | os.PathLike, map_size: int = 1 << 30,
                 capacity_bytes: int | None = None, readonly: bool = False, sync: bool = False,
                 segment_bytes: int | None = None,
                 reclaim_slack: int | None = None):
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
        if segment_bytes is None:
            segment_bytes = min(DEFAULT_SEGMENT_BYTES, max(1 << 20, capacity_bytes // 8))
        if not isinstance(segment_bytes, int) or segment_bytes <= 0:
            raise ValueError(f"segment_bytes must be a positive number of bytes, got {segment_bytes!r}")
        if reclaim_slack is None:
            reclaim_slack = max(2 * segment_bytes, capacity_bytes // 8)
        if not isinstance(reclaim_slack, int) or reclaim_slack < 0:
            raise ValueError(f"reclaim_slack must be a number of bytes >= 0, got {reclaim_slack!r}")
        self.reclaim_slack = reclaim_slack
        self.path = os.fspath(path)
        self.readonly = readonly
        self.segdir = os.path.join(self.path, _SEGDIR)
        self.segment_bytes = segment_bytes
        self.env = None
        self._lock = None
        if readonly and not os.path.isdir(self.path):
            raise ValueError(f"{self.path!r} is not a kvstrata disk tier (no such directory)")
        if not readonly:
            os.makedirs(self.segdir, exist_ok=True)
            self._lock = open(os.path.join(self.path, "writer.lock"), "a+b")
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._lock.close()
                raise ValueError(f"{self.path!r} is open for writing by another DiskTier (one "
                                 f"writer at a time; open it with readonly=True)") from None
        try:
            self.env = lmdb.open(self.path, map_size=map_size, subdir=True, readonly=readonly,
                                 max_dbs=8, max_readers=256, sync=sync, metasync=sync,
                                 readahead=False, create=not readonly, lock=True)
        except BaseException:
            self._release_lock()
            raise
        self.sync = sync
        # Reader slots of processes that died (kill -9) would pin old pages forever.
        self.env.reader_check()
        try:
            self._pages = self.env.open_db(b"pages", create=not readonly)
            self._index = self.env.open_db(b"index", create=not readonly)
            self._lru = self.env.open_db(b"lru", create=not readonly)
            self._meta = self.env.open_db(b"meta", create=not readonly)
        except lmdb.NotFoundError:
            self.env.close()
            self._release_lock()
            raise ValueError(f"{self.path!r} is an LMDB environment but not a kvstrata disk tier") from None
        # Absent in a tier written by format 1/2 and opened read-only: its heads carry no
        # location and read back alone (a format-version miss).
        self._segs = self._open_optional(b"segs")
        self._byseg = self._open_optional(b"byseg")
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
        self._served: dict[bytes, bytes] = {}  # hash -> location the last reads returned
        self._maps: dict[int, mmap.mmap] = {}  # segment id -> read-only map
        self._retired: list[mmap.mmap] = []    # maps still exported to a caller's views
        self._cur: int | None = None           # the segment this writer appends to
        self._cur_fd = -1
        self._cur_off = 0
        self._sealed: list[int] = []           # sealed segments not yet checked for emptiness
        self.stats = {"writes": 0, "write_bytes": 0, "write_errors": 0, "evictions": 0,
                      "deleted": 0, "orphans": 0, "segments_created": 0, "segments_deleted": 0,
                      "compactions": 0, "moved_records": 0, "moved_bytes": 0,
                      "relocated": 0}
        self._burst_errors = 0
        #: test hook: called inside every write transaction before commit (fault injection)
        self.before_commit: Callable[[], None] | None = None
        if not readonly:
            self.sweep_orphans()

    def _open_optional(self, name: bytes):
        try:
            return self.env.open_db(name, create=not self.readonly)
        except lmdb.NotFoundError:
            return None

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.close()      # closing the descriptor drops the flock
            self._lock = None

    def close(self) -> None:
        if self.env is None:
            return
        if not self.readonly:
            self.flush()
        self._close_segment()
        for m in [*self._maps.values(), *self._retired]:
            try:
                m.close()
            except BufferError:
                pass        # a caller still holds a view; the map goes with it
        self._maps.clear()
        self._retired.clear()
        self.env.close()
        self.env = None
        self._release_lock()

    def __enter__(self) -> "DiskTier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- segment files -----------------------------------------------------------------------
    def _seg_path(self, seg: int) -> str:
        return os.path.join(self.segdir, f"{seg:016x}{_SUFFIX}")

    def _map(self, seg: int, end: int) -> mmap.mmap | None:
        """A read-only map of segment ``seg`` covering ``[0, end)``; None if the file is missing
        or shorter (reclaimed, or damaged)."""
        m = self._maps.get(seg)
        if m is not None and len(m) >= end:
            return m
        try:
            fd = os.open(self._seg_path(seg), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size < end or size == 0:
                return None
            new = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        if m is not None:
            self._drop_map(m)
        self._maps[seg] = new
        return new

    def _drop_map(self, m: mmap.mmap) -> None:
        try:
            m.close()
        except BufferError:
            self._retired.append(m)

    def _forget_segment(self, seg: int) -> None:
        m = self._maps.pop(seg, None)
        if m is not None:
            self._drop_map(m)
        if self._retired:
            keep = []
            for m in self._retired:
                try:
                    m.close()
                except BufferError:
                    keep.append(m)
            self._retired = keep

    def _views(self, seg: int, off: int, lens: Sequence[int]) -> list | None:
        total = sum(lens)
        m = self._map(seg, off + total) if total else None
        if total and m is None:
            return None
        if not total:
            return [b""] * len(lens)
        mv = memoryview(m)
        out = []
        for n in lens:
            out.append(mv[off:off + n])
            off += n
        return out

    def _close_segment(self) -> None:
        if self._cur_fd >= 0:
            os.close(self._cur_fd)
            self._sealed.append(self._cur)
        self._cur, self._cur_fd, self._cur_off = None, -1, 0

    def _next_segment(self, txn) -> None:
        """Seal the current segment (if any) and create the next one (its id is committed with
        the batch that first writes to it)."""
        self._close_segment()
        nxt = _U64.unpack(txn.get(b"nextseg", db=self._meta) or _U64.pack(1))[0]
        while True:
            try:
                fd = os.open(self._seg_path(nxt), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                break
            except FileExistsError:
                nxt += 1
        if self.sync:
            dfd = os.open(self.segdir, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        self._cur, self._cur_fd, self._cur_off = nxt, fd, 0
        self.stats["segments_created"] += 1

    def _append(self, txn, bufs: list) -> tuple[int, int]:
        """Append ``bufs`` back to back to the current segment (rolling it first when full);
        returns ``(segment, offset)``. Durable before return when ``sync`` is on."""
        if self._cur is None or self._cur_off >= self.segment_bytes:
            self._next_segment(txn)
        txn.put(b"nextseg", _U64.pack(self._cur + 1), db=self._meta)
        off = self._cur_off
        try:
            self._cur_off = off + _pwritev_all(self._cur_fd, bufs, off)
            if self.sync:
                os.fdatasync(self._cur_fd)
        except BaseException:
            # append past whatever reached the file (dead bytes until the segment goes)
            self._cur_off = max(off, os.fstat(self._cur_fd).st_size)
            raise
        return self._cur, off

    # -- reads --------------------------------------------------------------------------------
    @contextmanager
    def reader(self) -> Iterator[Callable[[bytes], list[memoryview] | None]]:
        """One read transaction; yields ``get(hash) -> parts | None``, the record's stored parts
        ``[head, payload_0, ...]`` in order. A head whose payloads are missing or short comes back
        alone. The views are valid only inside the ``with`` block (they point into LMDB's map and
        the segments' maps): copy what you keep."""
        self._served.clear()
        with self.env.begin(buffers=True) as txn:
            if self.readonly and self._maps and self._segs is not None:
                for s in [s for s in self._maps if txn.get(_SEQ.pack(s), db=self._segs) is None]:
                    self._forget_segment(s)     # unlinked by the writer since it was mapped
            yield self._getter(txn)

    def _getter(self, txn) -> Callable[[bytes], list | None]:
        def get(h: bytes) -> list | None:
            head = txn.get(h, db=self._pages)
            if head is None:
                return None
            v = txn.get(h, db=self._index)
            loc = _loc(v)
            if loc is None or not loc[2]:
                return [head]           # format 1/2 (no location) or a head-only record
            views = self._views(*loc)
            for _ in range(3):
                if views is not None:
                    break
                # The snapshot may be older than a compaction that moved the payloads and
                # unlinked the segment: look again in a fresh one before calling it damaged.
                with self.env.begin() as now:
                    head2, v2 = now.get(h, db=self._pages), now.get(h, db=self._index)
                if head2 is None:
                    return None
                loc2 = _loc(v2)
                if loc2 is None or bytes(v2[_LOC:]) == bytes(v[_LOC:]):
                    break
                head, v = head2, v2
                views = self._views(*loc2) if loc2[2] else []
                self.stats["relocated"] += 1
            if not self.readonly:       # for delete()'s check; readers never delete
                self._served[h] = bytes(v[_LOC:])
            if views is None:
                return [head]           # its own location is missing or short: damaged
            return [head, *views]
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
                parts = get(k)
                if parts is not None:
                    yield k, b"".join(parts)

    def segments(self) -> dict[int, tuple[int, int, int]]:
        """``segment id -> (live payload bytes, live records, committed end)``."""
        if self._segs is None:
            return {}
        with self.env.begin(db=self._segs) as txn:
            return {_SEQ.unpack(k)[0]: _SEGV.unpack(v) for k, v in txn.cursor()}

    def sweep_orphans(self) -> int:
        """Writer recovery, run when a writer opens the tier; returns how many things it removed.

        Removes what a killed writer or an older format leaves behind: segment files no record
        can reference (no ``segs`` entry: written by a batch that never committed, or emptied by
        a commit whose unlink did not happen), segments without live records, and format 2's
        ``payloads`` database; cuts torn tails (bytes past a segment's committed end)."""
        if self.readonly:
            return 0
        n = 0
        try:
            old = self.env.open_db(b"payloads", create=False)
        except lmdb.NotFoundError:
            old = None
        try:
            with self.env.begin(write=True) as txn:
                if old is not None:
                    n += txn.stat(old)["entries"]
                    txn.drop(old, delete=True)
                segs = {_SEQ.unpack(k)[0]: _SEGV.unpack(v)
                        for k, v in txn.cursor(db=self._segs)}
                dead = [s for s, (_, count, _) in segs.items() if count == 0]
                for s in dead:
                    txn.delete(_SEQ.pack(s), db=self._segs)
        except (lmdb.Error, OSError) as e:
            self._note_error(e)
            return 0
        for s in dead:
            segs.pop(s)
        for name in os.listdir(self.segdir):
            p = os.path.join(self.segdir, name)
            try:
                seg = int(name[:-len(_SUFFIX)], 16) if name.endswith(_SUFFIX) else None
            except ValueError:
                seg = None
            if seg is None:
                continue
            if seg not in segs:
                os.unlink(p)
                n += 1
                self.stats["segments_deleted"] += seg in dead
            elif os.path.getsize(p) > segs[seg][2]:
                os.truncate(p, segs[seg][2])      # torn tail of a batch that never committed
                n += 1
        if n:
            self.stats["orphans"] += n
            log.info("disk tier %s: removed %d orphans (segments, torn tails, old payloads)",
                     self.path, n)
        return n

    # -- writes -------------------------------------------------------------------------------
    def put_batch(self, items: Sequence[tuple[bytes, Sequence[bytes | memoryview]]]) -> int:
        """Store ``(hash, record parts)`` pairs in one transaction; returns how many were stored.

        The head (part 0) goes into LMDB; the payloads (parts 1...) of every new page of the batch
        are appended to the current segment with one ``pwritev`` straight from the given buffers,
        before the transaction commits. :meth:`reader` returns the parts in the same order.

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
        try:
            self._reclaim()
        except (lmdb.Error, OSError) as e:
            self._note_error(e)      # the batch is stored; compaction tries again next time
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
        freed: list[int] = []
        evicted = 0
        with self.env.begin(write=True) as txn:
            seq = _U64.unpack(txn.get(b"seq", db=self._meta) or _U64.pack(0))[0]
            total = _U64.unpack(txn.get(b"bytes", db=self._meta) or _U64.pack(0))[0]
            touched, self._touched = self._touched, {}
            try:
                for h in touched:
                    seq = self._bump(txn, h, seq)
                new, seen = [], set()
                for h, parts in items:
                    if h in seen:
                        continue
                    seen.add(h)
                    if txn.get(h, db=self._index) is not None:
                        seq = self._bump(txn, h, seq)
                    else:
                        new.append((h, parts, sum(len(p) for p in parts)))
                deltas: dict[int, list[int]] = {}
                total, evicted = self._evict(txn, total, sum(n for _, _, n in new), deltas)
                keep = []
                for h, parts, size in new:
                    if total + size > self._cap:
                        break       # does not fit even after evicting everything older
                    keep.append((h, parts, size))
                    total += size
                bufs = [p for _, parts, _ in keep for p in parts[1:]]
                seg, off = self._append(txn, bufs) if any(len(p) > 1 for _, p, _ in keep) \
                    else (0, 0)
                for h, parts, size in keep:
                    lens = [len(p) for p in parts[1:]]
                    s = seg if lens else 0
                    txn.put(h, parts[0], db=self._pages)
                    txn.put(h, _IDX.pack(seq, size, s, off if s else 0)
                            + struct.pack(f"<{len(lens)}Q", *lens), db=self._index)
                    txn.put(_SEQ.pack(seq), h, db=self._lru)
                    if s:
                        txn.put(_seg_key(s, h), b"", db=self._byseg)
                        d = deltas.setdefault(s, [0, 0])
                        d[0] += sum(lens)
                        d[1] += 1
                        off += sum(lens)
                    seq += 1
                    stored += 1
                freed = self._apply_seg_deltas(txn, deltas)
                txn.put(b"seq", _U64.pack(seq), db=self._meta)
                txn.put(b"bytes", _U64.pack(total), db=self._meta)
                if self.before_commit is not None:
                    self.before_commit()
            except BaseException:
                self._touched.update(touched)   # not recorded: try again with the next write
                raise
        self._unlink(freed)
        self.stats["evictions"] += evicted
        self.stats["writes"] += stored
        self.stats["write_bytes"] += sum(size for _, _, size in keep)
        return stored

    def _apply_seg_deltas(self, txn, deltas: dict[int, list[int]]) -> list[int]:
        """Add ``[bytes, records]`` deltas to the segments' entries (the current segment's end
        follows the write offset); returns the sealed segments left without a record, whose
        entries are deleted here and whose files are unlinked after the commit."""
        if self._cur is not None:
            deltas.setdefault(self._cur, [0, 0])
        for s in self._sealed:
            deltas.setdefault(s, [0, 0])
        freed = []
        for s, (db, dn) in deltas.items():
            k = _SEQ.pack(s)
            v = txn.get(k, db=self._segs)
            live, count, end = _SEGV.unpack(v) if v else (0, 0, 0)
            live, count = max(0, live + db), max(0, count + dn)
            if s == self._cur:
                end = self._cur_off
            elif v is None:
                freed.append(s)     # a sealed segment whose first batch never committed
                continue
            elif count == 0:
                txn.delete(k, db=self._segs)
                freed.append(s)
                continue
            txn.put(k, _SEGV.pack(live, count, end), db=self._segs)
        return freed

    def _unlink(self, segs: list[int]) -> None:
        """After a commit: unlink the segments it emptied (their entries are gone)."""
        self._sealed.clear()
        for s in segs:
            self._forget_segment(s)
            try:
                os.unlink(self._seg_path(s))
            except FileNotFoundError:
                pass
            self.stats["segments_deleted"] += 1

    def _bump(self, txn, h: bytes, seq: int) -> int:
        v = txn.get(h, db=self._index)
        if v is None:
            return seq
        old = _U64.unpack_from(v, 0)[0]
        txn.delete(_SEQ.pack(old), db=self._lru)
        txn.put(_SEQ.pack(seq), h, db=self._lru)
        txn.put(h, _U64.pack(seq) + v[8:], db=self._index)
        return seq + 1

    def _drop(self, txn, h: bytes, v, deltas: dict[int, list[int]]) -> int:
        """Delete record ``h`` (index value ``v``) everywhere; returns its size."""
        seq, size = struct.unpack_from("<QQ", v, 0)
        loc = _loc(v)
        txn.delete(_SEQ.pack(seq), db=self._lru)
        txn.delete(h, db=self._index)
        txn.delete(h, db=self._pages)
        if loc is not None and loc[0]:
            txn.delete(_seg_key(loc[0], h), db=self._byseg)
            d = deltas.setdefault(loc[0], [0, 0])
            d[0] -= sum(loc[2])
            d[1] -= 1
        return size

    def _evict(self, txn, total: int, need: int, deltas) -> tuple[int, int]:
        if total + need <= self._cap:
            return total, 0
        cur = txn.cursor(db=self._lru)
        victims = []
        ok = cur.first()
        while ok and total + need > self._cap:
            h = bytes(cur.value())
            v = txn.get(h, db=self._index)
            if v is None:
                victims.append((h, None, bytes(cur.key())))
            else:
                victims.append((h, bytes(v), None))
                total -= struct.unpack_from("<Q", v, 8)[0]
            ok = cur.next()
        for h, v, lru_key in victims:
            if v is None:
                txn.delete(lru_key, db=self._lru)
            else:
                self._drop(txn, h, v, deltas)
        return total, len(victims)

    def delete(self, hashes: Sequence[bytes]) -> int:
        """Remove pages (found corrupt or mismatched); returns how many existed.

        A page this tier served from a location that has changed since (rewritten or moved
        by compaction) is kept: the bytes found bad were not the ones stored now."""
        if not hashes or self.readonly:
            return 0
        n = 0
        freed: list[int] = []
        try:
            with self.env.begin(write=True) as txn:
                total = _U64.unpack(txn.get(b"bytes", db=self._meta) or _U64.pack(0))[0]
                deltas: dict[int, list[int]] = {}
                for h in hashes:
                    v = txn.get(h, db=self._index)
                    if v is not None:
                        served = self._served.get(h)
                        if served is not None and bytes(v[_LOC:]) != served:
                            continue
                        total -= self._drop(txn, h, bytes(v), deltas)
                        n += 1
                    else:
                        txn.delete(h, db=self._pages)   # a head without an index entry
                freed = self._apply_seg_deltas(txn, deltas)
                txn.put(b"bytes", _U64.pack(max(total, 0)), db=self._meta)
        except (lmdb.Error, OSError) as e:
            self._note_error(e)
            return 0
        self._unlink(freed)
        self.stats["deleted"] += n
        return n

    # -- space reclamation --------------------------------------------------------------------
    def file_limit(self) -> int:
        """Segment file bytes above which :meth:`put_batch` compacts: capacity + slack."""
        return self.capacity_bytes + self.reclaim_slack

    def _reclaim(self, max_rounds: int = 4) -> None:
        """Compact while the segment files exceed :meth:`file_limit`: the sealed segment with the
        most dead bytes has its live records re-appended to the current segment, then goes."""
        for _ in range(max_rounds):
            segs = self.segments()
            if sum(end for _, _, end in segs.values()) <= self.file_limit():
                return
            sealed = [(end - live, s) for s, (live, _, end) in segs.items()
                      if s != self._cur and end > live]
            if not sealed:
                return
            self._compact(max(sealed)[1])

    def _compact(self, victim: int) -> None:
        with self.env.begin(buffers=True) as txn:
            cur = txn.cursor(db=self._byseg)
            prefix = _SEQ.pack(victim)
            moves = []
            ok = cur.set_range(prefix)
            while ok:
                k = bytes(cur.key())
                if not k.startswith(prefix):
                    break
                h = k[len(prefix):]
                v = txn.get(h, db=self._index)
                if v is not None:
                    moves.append((h, bytes(v)))
                ok = cur.next()
        lost, bufs, keep = [], [], []
        for h, v in moves:
            _, off, lens = _loc(v)
            views = self._views(victim, off, lens)
            if views is None:
                lost.append((h, v))    # its bytes are gone: drop it (a read would miss anyway)
            else:
                bufs.extend(views)
                keep.append((h, v))
            views = None
        freed: list[int] = []
        with self.env.begin(write=True) as txn:
            deltas: dict[int, list[int]] = {}
            total = _U64.unpack(txn.get(b"bytes", db=self._meta) or _U64.pack(0))[0]
            seg, off = self._append(txn, bufs) if bufs else (0, 0)
            bufs.clear()
            for h, v in keep:
                lens = _loc(v)[2]
                n = sum(lens)
                now = txn.get(h, db=self._index)
                if now is None or bytes(now[8:]) != v[8:]:
                    off += n
                    continue        # changed meanwhile (cannot happen with one writer)
                txn.put(h, bytes(now[:16]) + _IDX.pack(0, 0, seg, off)[16:] + v[_IDX.size:],
                        db=self._index)
                txn.delete(_seg_key(victim, h), db=self._byseg)
                txn.put(_seg_key(seg, h), b"", db=self._byseg)
                for s, sign in ((victim, -1), (seg, 1)):
                    d = deltas.setdefault(s, [0, 0])
                    d[0] += sign * n
                    d[1] += sign
                off += n
                self.stats["moved_records"] += 1
                self.stats["moved_bytes"] += n
            for h, v in lost:
                if txn.get(h, db=self._index) == v:
                    total -= self._drop(txn, h, v, deltas)
                    self.stats["deleted"] += 1
            txn.put(b"bytes", _U64.pack(max(total, 0)), db=self._meta)
            deltas.setdefault(victim, [0, 0])
            freed = self._apply_seg_deltas(txn, deltas)
        self._forget_segment(victim)
        self._unlink(freed)
        self.stats["compactions"] += 1

    def flush(self) -> None:
        """Write pending access-order updates (called by :meth:`close`)."""
        if self._touched and not self.readonly:
            self.put_batch([])

    # -- the Tier protocol (kvstrata.tiers.protocol): thin wrappers over the methods above ------
    # ``delete(keys) -> int`` and ``touch(keys)`` already have the protocol's meaning.
    name = "disk"

    def _tier_counters(self) -> dict[str, int]:
        tc = self.__dict__.get("_tc")
        if tc is None:
            tc = self.__dict__["_tc"] = new_counters()
        return tc

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        try:
            return self.contains([check_key(k) for k in keys])
        except lmdb.Error as e:
            self._read_fault(e)
            return [False] * len(keys)

    def get(self, keys: Sequence[bytes]) -> list[list | None]:
        """Stored parts per key (heads copied out of LMDB; payloads are views of the read-only
        segment maps, valid while held), ``None`` for a miss. A read fault is a miss."""
        tc = self._tier_counters()
        keys = [check_key(k) for k in keys]
        try:
            with self.reader() as get:
                out = []
                for k in keys:
                    parts = get(k)
                    out.append(None if parts is None else [bytes(parts[0]), *parts[1:]])
        except lmdb.Error as e:
            self._read_fault(e)
            out = [None] * len(keys)
        hits = [p for p in out if p is not None]
        tc["hits"] += len(hits)
        tc["misses"] += len(out) - len(hits)
        tc["read_bytes"] += sum(record_nbytes(p) for p in hits)
        return out

    def put(self, items: Sequence[tuple[bytes, Sequence[bytes | memoryview]]]) -> list[bool]:
        """:meth:`put_batch` answered per item: a page already present is refreshed (True);
        of the new ones it stores a leading run (all unless the batch exceeds the capacity or
        a fault drops the batch)."""
        tc = self._tier_counters()
        items = [(check_key(k), parts) for k, parts in items]
        present = self.exists([k for k, _ in items])
        n = self.put_batch(items)
        ok, seen = [], {}
        for (k, parts), had in zip(items, present):
            if k not in seen:
                seen[k] = had or n > 0
                if not had and n > 0:
                    n -= 1
                    tc["written_bytes"] += record_nbytes(parts)
            ok.append(seen[k])
        tc["puts"] += sum(ok)
        tc["put_failures"] += len(ok) - sum(ok)
        return ok

    def counters(self) -> dict[str, int | float]:
        tc = dict(self._tier_counters())
        tc["deletes"] = self.stats["deleted"]
        tc["errors"] += self.stats["write_errors"]
        return {**self.stats, **tc}

    def _read_fault(self, e: BaseException) -> None:
        tc = self._tier_counters()
        if not tc["errors"]:
            log.warning("disk tier %s: read failed (%s); answered as misses, counted in "
                        "counters()['errors']", self.path, e)
        tc["errors"] += 1

    def info(self) -> dict:
        st = self.env.stat()
        segs = self.segments()
        return {"path": self.path, "pages": len(self), "stored_bytes": self.stored_bytes(),
                "capacity_bytes": self.capacity_bytes, "effective_capacity_bytes": self._cap,
                "map_size": self.env.info()["map_size"], "page_size_lmdb": st["psize"],
                "segments": len(segs), "segment_file_bytes": sum(e for _, _, e in segs.values()),
                "segment_live_bytes": sum(b for b, _, _ in segs.values()),
                "opened": time.time()}
