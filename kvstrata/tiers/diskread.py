"""The disk tier's read path: a snapshot of the index, views of the entries, the retry that
follows a record moved by compaction.

A read runs in one LMDB read transaction (a snapshot of the index) and hands out views into the
segment maps (:mod:`kvstrata.tiers.segments`); the bytes at a committed location never change,
so a view stays valid as long as it is held. A snapshot may be older than a compaction that moved
a record and unlinked its segment: the reader then looks the record up again in a fresh snapshot
and follows it, up to three times, before calling it damaged. Damage (a bad index value, a frame
that names another record) is a counted miss through :meth:`DiskIndex.error
<kvstrata.tiers.diskindex.DiskIndex.error>`, never an exception in the caller's request.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import lmdb

from .diskindex import DiskIndex
from .diskschema import LOC, SEQ, TierDamaged, location, record_value
from .segments import MAGIC, Segments, frame_size, read_frame

#: fresh snapshots a read takes to follow a record that compaction moved
_RETRIES = 3


class DiskReader:
    """Reads of one disk tier (its :class:`DiskIndex` and :class:`Segments`).

    ``served`` remembers, for a writer, where each record read in the last snapshot lay (with
    the index generation), so that ``DiskTier.delete`` of a record found bad keeps one that was
    rewritten or moved since: the bytes found bad were not the ones stored now.
    """

    def __init__(self, index: DiskIndex, files: Segments, readonly: bool, counts: dict):
        self.index, self.files, self.readonly = index, files, readonly
        self.counts = counts                        # the tier's counters ("relocated")
        self.served: dict[bytes, tuple] = {}        # key -> (index generation, location)

    @contextmanager
    def reader(self) -> Iterator[Callable[[bytes], list[memoryview] | None]]:
        """One read transaction; yields ``get(key) -> parts | None`` (see ``DiskTier.reader``)."""
        self.served.clear()
        if not self.index.usable():
            yield lambda h: None
            return
        env = self.index.env
        try:
            txn = env.begin(buffers=True)
        except lmdb.Error as e:
            self.index.error(e)
            yield lambda h: None
            return
        self.index.busy += 1
        try:
            if self.readonly:
                segs = self.index.dbs[b"segs"]
                for s in self.files.mapped():
                    if self._get(txn, SEQ.pack(s), segs) is None:
                        self.files.forget(s)     # unlinked by the writer since it was mapped
            yield self._getter(txn)
        finally:
            self.index.busy -= 1
            txn.abort()

    def _get(self, txn, key: bytes, db):
        try:
            return txn.get(key, db=db)
        except lmdb.Error as e:
            self.index.error(e)
            return None

    def record(self, txn, h: bytes) -> bytes | None:
        """Record ``h``'s index value, checked and copied; None if absent or damaged."""
        v = self._get(txn, h, self.index.dbs[b"records"])
        if v is None:
            return None
        try:
            return record_value(v)
        except TierDamaged as e:
            self.index.error(e)
            return None

    def parts_at(self, h: bytes, v) -> list | None:
        """Views of the parts of the entry that index value ``v`` points at, if its frame is
        ``h``'s; None if its bytes are missing, short or damaged."""
        try:
            seg, off, lens = location(v)
        except TierDamaged as e:
            self.index.error(e)
            return None
        head = frame_size(len(h), len(lens))
        views = self.files.views(seg, off, [head + sum(lens)])
        if views is None:
            return None
        (entry,) = views
        got = read_frame(entry, 0)
        if got is None and entry[:4] == MAGIC:
            return None     # the entry's own frame is damaged
        if got is None or got[0] != h or got[1] != lens:
            self.index.error(TierDamaged(f"the index places {h.hex()} on another record"))
            return None
        parts = []
        for n in lens:
            parts.append(entry[head:head + n])
            head += n
        return parts

    def _getter(self, txn) -> Callable[[bytes], list | None]:
        def get(h: bytes) -> list | None:
            v = self.record(txn, h)
            if v is None:
                return None
            views = self.parts_at(h, v)
            for _ in range(_RETRIES):
                if views is not None:
                    break
                # The snapshot may be older than a compaction that moved the record and
                # unlinked the segment: look again in a fresh one before calling it damaged.
                try:
                    with self.index.env.begin(buffers=True) as now:
                        v2 = self.record(now, h)
                except lmdb.Error as e:
                    self.index.error(e)
                    return None
                if v2 is None:
                    return None
                if bytes(v2[LOC:]) == bytes(v[LOC:]):
                    break
                v = v2
                views = self.parts_at(h, v)
                self.counts["relocated"] += 1
            if not self.readonly:       # for delete()'s check; readers never delete
                self.served[h] = (self.counts["rebuilds"], bytes(v[LOC:]))
            return [] if views is None else views
        return get

    def where(self, h: bytes) -> tuple[str, int, tuple[int, ...]] | None:
        """``(segment file, offset of the record's head, part lengths)`` of record ``h``."""
        if not self.index.usable():
            return None
        with self.index.env.begin(buffers=True) as txn:
            v = self.record(txn, h)
        if v is None:
            return None
        seg, off, lens = location(v)
        return self.files.path(seg), off + frame_size(len(h), len(lens)), lens
