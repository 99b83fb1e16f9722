"""The disk tier: self-describing records in append-only segment files, an LMDB index over them.

A record is stored as its parts ``[head, payload_0, ...]`` (:mod:`kvstrata.tiers.record`). The
records of a batch are appended to the current segment, each behind a small frame naming its key
and part lengths (:mod:`kvstrata.tiers.segments`), with one ``os.pwritev`` straight from the
caller's buffers (the host slots). LMDB (``PATH/data.mdb``, :mod:`kvstrata.tiers.diskindex`)
holds only the index: where each record lies, the access order, per-segment accounting. The
segments say everything the index does, so the index can be rebuilt from them.

Crash safety: a batch's entries are written (and fsynced with ``sync=True``) *before* the LMDB
transaction that makes them visible commits, and the whole batch is one transaction, so a
writer killed at any point leaves the previous committed state: bytes past a segment's committed
``end`` are a torn tail, never referenced, and cut off when a writer next opens the tier.

Damage to the index (a flipped page in ``data.mdb``, a bad meta or root page, a truncated or
deleted file): a read that meets it is a counted miss (``counters()["index_errors"]``, logged
once), never an exception; the writer then rebuilds the index from the segments before its next
operation. At open, the writer checks the file's meta and root pages and its size before mapping
it (LMDB would raise SIGBUS through the map of a truncated file), walks the whole index in a child
process after an unclean shutdown (LMDB aborts on some damage; a dead child only tells us), and
rebuilds or, when even that fails, moves the files aside and starts empty. The engine always
starts; every step is logged once. Readers (``readonly=True``) never repair: a damaged index
raises :class:`TierDamaged` at open and reads as misses afterwards.

Space: ``capacity_bytes`` bounds the sum of record sizes; over it, records are evicted least
recently accessed first. A segment is unlinked once it holds no live record; when the segment
files exceed ``capacity + reclaim_slack``, the sealed segment with the most dead bytes has its live
records re-appended to the current one and is unlinked (compaction keeps every record and its
access order; it never evicts).

Concurrency: one writer process at a time (an exclusive ``flock`` on ``PATH/writer.lock``); any
number of readers (``readonly=True``, e.g. ``kvstrata inspect``) map segments read-only. A reader
whose snapshot points into a segment that was compacted away re-reads the location in a fresh
snapshot and follows it (or reports a miss). The bytes at a committed location never change.

A write that fails (map full, ENOSPC, I/O error) aborts its transaction: nothing of it is visible,
the error is counted and logged once per burst, and the caller goes on.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
from typing import Callable, ContextManager, Iterator, Sequence

import lmdb

from .compaction import reclaim
from .diskindex import DiskIndex
from .diskread import DiskReader
from .diskschema import (DAMAGE, LAYOUT, LOC, MAX_KEY, MAX_PARTS, SEQ, U64, TierDamaged, key_of,
                         record_value, seg_id, seg_value, u64)
from .segments import DEFAULT_SEGMENT_BYTES, Segments
from .protocol import check_key, leading, new_counters, record_nbytes

log = logging.getLogger(__name__)



class DiskTier:
    """Page store: records in segment files, an LMDB index; byte capacity, persistent LRU.

    Args:
        path: directory of the tier (created if missing, unless ``readonly``).
        map_size: the LMDB map size (upper bound of ``data.mdb``, which holds the index only:
            ~150 bytes per record), bytes.
        capacity_bytes: records (heads + payloads) beyond this are evicted oldest-access first;
            default: half the map (kept from earlier layouts).
        readonly: open for reading only (``kvstrata inspect``, other processes).
        sync: fsync segments before, and LMDB at, every commit (survives power loss). Off by
            default: a cache may lose its newest pages on an OS crash, and records are
            checksummed, so nothing wrong is served.
        segment_bytes: a segment is sealed once it reaches this size (a batch is never split, so a
            segment may exceed it by one batch). Default: ``capacity / 8`` clamped to
            [1 MiB, 256 MiB].
        reclaim_slack: segment files may hold this many bytes beyond the capacity (dead bytes of
            segments that still hold live records) before a write compacts. Default:
            ``max(2 * segment_bytes, capacity / 8)``.
        check: walk the whole index in a child process at open (always done after an unclean
            shutdown) and rebuild it if the walk fails. Writers only.
    """

    def __init__(self, path: str | os.PathLike, map_size: int = 1 << 30,
                 capacity_bytes: int | None = None, readonly: bool = False, sync: bool = False,
                 segment_bytes: int | None = None, reclaim_slack: int | None = None,
                 check: bool = False):
        if not isinstance(map_size, int) or map_size < (1 << 16):
            raise ValueError(f"map_size must be at least 64 KiB, got {map_size!r}")
        if capacity_bytes is None:
            capacity_bytes = map_size // 2
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"disk capacity must be a positive number of bytes, got {capacity_bytes!r}")
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
        self.sync = sync
        self.map_size = map_size
        self.segment_bytes = segment_bytes
        self.files = Segments(self.path, segment_bytes, sync)
        self.segdir = self.files.dir
        self.capacity_bytes = capacity_bytes
        self._cap = capacity_bytes            # lowered when the map turns out to be smaller
        self._lock = None
        self._touched: dict[bytes, None] = {}  # read hits whose access order is not written yet
        # The tier's own counters (its parts add to them), read through counters() with the
        # Tier protocol's (self._tier).
        self._counts = {"writes": 0, "write_bytes": 0, "write_errors": 0, "evictions": 0,
                        "deleted": 0, "orphans": 0, "segments_created": 0, "segments_deleted": 0,
                        "compactions": 0, "moved_records": 0, "moved_bytes": 0,
                        "relocated": 0, "index_errors": 0, "rebuilds": 0, "rebuilt_records": 0,
                        "moved_aside": 0}
        self._burst_errors = 0
        #: test hook: called inside every write transaction before commit (fault injection)
        self.before_commit: Callable[[], None] | None = None
        self._tier = new_counters()
        self.index = DiskIndex(self.path, self.files, map_size, sync, readonly, self._counts)
        self.reads = DiskReader(self.index, self.files, readonly, self._counts)
        if readonly:
            recorded = self.index.open_reader()
            if recorded:    # readers report the capacity the writer configured
                self.capacity_bytes = self._cap = recorded
        else:
            self._take_lock()
            try:
                self.index.open_writer(capacity_bytes, check)
            except BaseException:
                self.index.close()
                self._release_lock()
                raise
            self.sweep_orphans()

    # -- opening and closing ------------------------------------------------------------------
    def _take_lock(self) -> None:
        os.makedirs(self.segdir, exist_ok=True)
        self._lock = open(os.path.join(self.path, "writer.lock"), "a+b")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            self._lock = None
            raise ValueError(f"{self.path!r} is open for writing by another DiskTier (one "
                             f"writer at a time; open it with readonly=True)") from None

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.close()      # closing the descriptor drops the flock
            self._lock = None

    @property
    def env(self):
        return self.index.env

    # the index's databases (their handles change when the index is rebuilt)
    _records = property(lambda self: self.index.dbs[b"records"])
    _lru = property(lambda self: self.index.dbs[b"lru"])
    _segs = property(lambda self: self.index.dbs[b"segs"])
    _byseg = property(lambda self: self.index.dbs[b"byseg"])
    _meta = property(lambda self: self.index.dbs[b"meta"])

    @property
    def repaired(self) -> str | None:
        """What the last rebuild (or move aside) of the index was for; None if there was none."""
        return self.index.repaired

    def check(self) -> str | None:
        """Walk the whole index in a child process; what is damaged, or None."""
        return self.index.check()

    def repair(self, force: bool = False) -> str | None:
        """Rebuild the index from the segments if :meth:`check` finds it damaged (or always,
        with ``force``); returns the problem found (None: nothing was wrong)."""
        if self.readonly:
            raise ValueError("this DiskTier was opened readonly; open it for writing to repair")
        self.flush()
        problem = self.index.damaged or self.check()
        if problem or force:
            self.index.damaged = None
            self.index.recover(problem or "rebuild asked for")
        return problem

    def close(self) -> None:
        if self.env is not None and not self.readonly:
            self.flush()
        self.files.close()
        self.index.close(clean=True)
        self._release_lock()

    def __enter__(self) -> "DiskTier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- reads (the read path is :class:`~kvstrata.tiers.diskread.DiskReader`) ---------------
    def reader(self) -> ContextManager[Callable[[bytes], list[memoryview] | None]]:
        """One read transaction; yields ``get(key) -> parts | None``, the record's stored parts
        ``[head, payload_0, ...]`` in order. A record whose bytes are missing or short comes back
        as ``[]`` (no parts: it fails to parse and its reader deletes it). The views are valid
        only inside the ``with`` block (they point into the segments' maps): copy what you keep.
        A damaged index makes every ``get`` a miss (None), never an exception; a record that
        compaction moved after the snapshot was taken is followed to its new place."""
        return self.reads.reader()

    def where(self, h: bytes) -> tuple[str, int, tuple[int, ...]] | None:
        """``(segment file, offset of the record's head, part lengths)`` of record ``h``."""
        return self.reads.where(h)

    def contains(self, hashes: Sequence[bytes]) -> list[bool]:
        if not self.index.usable():
            return [False] * len(hashes)
        try:
            with self.env.begin(db=self._records, buffers=True) as txn:
                return [txn.get(h) is not None for h in hashes]
        except lmdb.Error as e:
            self.index.error(e)
            return [False] * len(hashes)

    def prefix_count(self, hashes: Sequence[bytes]) -> int:
        """Consecutive pages present, starting at ``hashes[0]``."""
        return leading(self.contains(hashes))

    def touch(self, hashes: Sequence[bytes]) -> None:
        """Record read hits; their new access order is written with the next write batch."""
        for h in hashes:
            self._touched[h] = None

    def _read_all(self, db, fn, default):
        if not self.index.usable():
            return default
        try:
            with self.env.begin(db=db, buffers=True) as txn:
                return fn(txn)
        except (lmdb.Error, TierDamaged) as e:
            self.index.error(e)
            return default

    def keys_by_age(self) -> list[bytes]:
        """Page hashes, least recently accessed first."""
        return self._read_all(self._lru, lambda txn: [key_of(v) for _, v in txn.cursor()], [])

    def stored_bytes(self) -> int:
        return self._read_all(self._meta, lambda txn: u64(txn.get(b"bytes"), 0), 0)

    def __len__(self) -> int:
        return self._read_all(self._records, lambda txn: txn.stat(self._records)["entries"], 0)

    def iter_records(self) -> Iterator[tuple[bytes, bytes]]:
        """``(hash, record bytes)`` of every page, parts joined (the keys of one snapshot, read
        in the next: a record deleted in between is left out)."""
        keys = self._read_all(self._records, lambda txn: [key_of(k) for k in
                              txn.cursor().iternext(values=False)], [])
        with self.reader() as get:
            for k in keys:
                parts = get(k)
                if parts is not None:
                    yield k, b"".join(parts)

    def segments(self) -> dict[int, tuple[int, int, int]]:
        """``segment id -> (live entry bytes, live records, committed end)``."""
        return self._read_all(self._segs, lambda txn: {seg_id(k): seg_value(v)
                                                       for k, v in txn.cursor()}, {})

    def sweep_orphans(self) -> int:
        """Writer recovery, run when a writer opens the tier; returns how many things it removed.

        Removes what a killed writer leaves behind: segment files no record can reference (no
        ``segs`` entry: written by a batch that never committed, or emptied by a commit whose
        unlink did not happen), segments without live records; cuts torn tails (bytes past a
        segment's committed end)."""
        if self.readonly:
            return 0
        try:
            with self.env.begin(write=True, buffers=True) as txn:
                segs = {seg_id(k): seg_value(v) for k, v in txn.cursor(db=self._segs)}
                dead = [s for s, (_, count, _) in segs.items() if count == 0]
                for s in dead:
                    txn.delete(SEQ.pack(s), db=self._segs)
                    del segs[s]
        except (lmdb.Error, TierDamaged) as e:
            self._note_error(e)
            return 0
        n = self.files.sweep({s: end for s, (_, _, end) in segs.items()})
        self._counts["segments_deleted"] += len(dead)
        if n:
            self._counts["orphans"] += n
            log.info("disk tier %s: removed %d orphans (segments, torn tails)", self.path, n)
        return n

    # -- writes -------------------------------------------------------------------------------
    def put_batch(self, items: Sequence[tuple[bytes, Sequence[bytes | memoryview]]]) -> int:
        """Store ``(hash, record parts)`` pairs in one transaction; returns how many were stored.

        The parts of every new page of the batch are appended to the current segment (behind
        their frames) with one ``pwritev`` straight from the given buffers, before the
        transaction that indexes them commits. :meth:`reader` returns the parts in order.

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
            if not 1 <= len(h) <= MAX_KEY:
                raise ValueError(f"a key is 1 to {MAX_KEY} bytes, page {h.hex()[:16]}... has {len(h)}")
        if not self.index.usable():
            return self._failed(OSError(errno.EIO, "the index is damaged"))
        try:
            n = self._write(items)
        except lmdb.MapFullError as e:
            # The map holds less than the capacity says (B-tree + free-list overhead): shrink the
            # effective capacity so the next batches evict first, free space now, retry once.
            self._cap = max(1, int(self.stored_bytes() * 0.8))
            try:
                self._write([])
                n = self._write(items)
            except (lmdb.Error, OSError, TierDamaged) as e2:
                return self._failed(e2)
            self._note_error(e)
        except (lmdb.Error, OSError, TierDamaged) as e:
            return self._failed(e)
        if self._burst_errors:
            log.warning("disk tier %s: writes succeed again after %d failures", self.path,
                        self._burst_errors)
            self._burst_errors = 0
        try:
            reclaim(self)
        except (lmdb.Error, OSError, TierDamaged) as e:
            self._note_error(e)      # the batch is stored; compaction tries again next time
        return n

    def _failed(self, e: BaseException) -> int:
        self._note_error(e)
        return 0

    def _note_error(self, e: BaseException) -> None:
        self._counts["write_errors"] += 1
        if isinstance(e, (TierDamaged, *DAMAGE)) and self.index.damaged is None:
            self.index.damaged = f"{type(e).__name__}: {e}"     # rebuilt before the next operation
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
        with self.env.begin(write=True, buffers=True) as txn:
            seq = u64(txn.get(b"seq", db=self._meta), 0)
            total = u64(txn.get(b"bytes", db=self._meta), 0)
            touched, self._touched = self._touched, {}
            try:
                for h in touched:
                    seq = self.index.bump(txn, h, seq)
                new, seen = [], set()
                for h, parts in items:
                    if h in seen:
                        continue
                    seen.add(h)
                    if txn.get(h, db=self._records) is not None:
                        seq = self.index.bump(txn, h, seq)
                    else:
                        new.append((h, parts, sum(len(p) for p in parts)))
                deltas: dict[int, list[int]] = {}
                total, evicted = self.index.evict(txn, total, sum(n for _, _, n in new), self._cap,
                                                 deltas)
                keep = []
                for h, parts, size in new:
                    if total + size > self._cap:
                        break       # does not fit even after evicting everything older
                    keep.append((h, parts, size))
                    total += size
                if keep:
                    self.index.add(txn, [(h, p) for h, p, _ in keep],
                                        range(seq, seq + len(keep)), deltas)
                    seq += len(keep)
                    stored = len(keep)
                freed = self.index.settle(txn, deltas)
                txn.put(b"seq", U64.pack(seq), db=self._meta)
                txn.put(b"bytes", U64.pack(total), db=self._meta)
                if self.before_commit is not None:
                    self.before_commit()
            except BaseException:
                self._touched.update(touched)   # not recorded: try again with the next write
                raise
        self.index.unlink(freed)
        self._counts["evictions"] += evicted
        self._counts["writes"] += stored
        self._counts["write_bytes"] += sum(size for _, _, size in keep)
        return stored

    def delete(self, hashes: Sequence[bytes]) -> int:
        """Remove pages (found corrupt or mismatched); returns how many existed.

        A page this tier served from a location that has changed since (rewritten or moved
        by compaction) is kept: the bytes found bad were not the ones stored now."""
        if not hashes or self.readonly or not self.index.usable():
            return 0
        n = 0
        freed: list[int] = []
        try:
            with self.env.begin(write=True, buffers=True) as txn:
                total = u64(txn.get(b"bytes", db=self._meta), 0)
                deltas: dict[int, list[int]] = {}
                for h in hashes:
                    v = txn.get(h, db=self._records)
                    if v is not None:
                        v = record_value(v)
                        served = self.reads.served.get(h)
                        if served is not None and served != (self._counts["rebuilds"],
                                                              bytes(v[LOC:])):
                            continue    # moved, rewritten or re-indexed since it was read
                        total -= self.index.drop(txn, h, v, deltas)
                        n += 1
                freed = self.index.settle(txn, deltas)
                txn.put(b"bytes", U64.pack(max(total, 0)), db=self._meta)
        except (lmdb.Error, OSError, TierDamaged) as e:
            self._note_error(e)
            return 0
        self.index.unlink(freed)
        self._counts["deleted"] += n
        return n

    # -- space reclamation --------------------------------------------------------------------
    def file_limit(self) -> int:
        """Live record bytes + dead segment bytes above which :meth:`put_batch` compacts:
        capacity + slack (frames are not counted)."""
        return self.capacity_bytes + self.reclaim_slack

    def flush(self) -> None:
        """Write pending access-order updates (called by :meth:`close`)."""
        if self._touched and not self.readonly:
            self.put_batch([])

    # -- the Tier protocol (kvstrata.tiers.protocol): thin wrappers over the methods above ------
    # ``delete(keys) -> int`` and ``touch(keys)`` already have the protocol's meaning.
    name = "disk"

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        try:
            return self.contains([check_key(k) for k in keys])
        except lmdb.Error as e:
            self._read_fault(e)
            return [False] * len(keys)

    def get(self, keys: Sequence[bytes]) -> list[list | None]:
        """Stored parts per key (the head copied; payloads are views of the read-only segment
        maps: a map stays open while a view of it is held, and a segment's bytes never change),
        ``None`` for a miss, ``[]`` for a damaged record. A read fault is a miss."""
        tc = self._tier
        keys = [check_key(k) for k in keys]
        try:
            with self.reader() as get:
                out = []
                for k in keys:
                    parts = get(k)
                    # a damaged record comes back without parts ([]): it fails verification
                    out.append(parts if not parts else [bytes(parts[0]), *parts[1:]])
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
        tc = self._tier
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
        tc = dict(self._tier)
        tc["deletes"] = self._counts["deleted"]
        tc["errors"] += self._counts["write_errors"]
        return {**self._counts, **tc}

    def _read_fault(self, e: BaseException) -> None:
        tc = self._tier
        if not tc["errors"]:
            log.warning("disk tier %s: read failed (%s); answered as misses, counted in "
                        "counters()['errors']", self.path, e)
        tc["errors"] += 1

    def info(self) -> dict:
        segs = self.segments()
        ok = self.index.usable()
        return {"path": self.path, "pages": len(self), "stored_bytes": self.stored_bytes(),
                "capacity_bytes": self.capacity_bytes, "effective_capacity_bytes": self._cap,
                "map_size": self.env.info()["map_size"] if ok else None,
                "page_size_lmdb": self.index.psize, "layout": LAYOUT,
                "segments": len(segs), "segment_file_bytes": sum(e for _, _, e in segs.values()),
                "segment_live_bytes": sum(b for b, _, _ in segs.values()),
                "index_damaged": self.index.damaged, "opened": time.time()}
