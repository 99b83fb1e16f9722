"""The disk tier's LMDB index as a living thing: opened with checks, guarded, kept, rebuilt.

:class:`DiskIndex` opens ``PATH/data.mdb`` (schema in :mod:`kvstrata.tiers.diskschema`) for a
tier. Damage LMDB cannot survive is checked where it is cheap (:mod:`kvstrata.tiers.lmdbcheck`):
the meta and root pages and the file size before every open, a walk of the whole file in a child
process after an unclean shutdown, when the file changed since the last clean close (its size,
mtime and inode are stamped then), or when asked. A writer that finds damage (at open, or when a
read meets it) rebuilds the index from the segments (:mod:`kvstrata.tiers.rebuild`), or, if that
fails, moves the files aside and starts empty; the engine always starts, and each of these steps
is logged once. Before every read the file's size is compared with its last page, so a file cut
under a running tier is a miss, not a SIGBUS. The write-side bookkeeping (index a batch, bump,
drop, evict, per-segment accounting) runs inside the caller's transaction.
"""

from __future__ import annotations

import logging
import os
import struct

import lmdb

from .diskschema import (DAMAGE, DBS, LAYOUT, RULES, SEGV, SEQ, U64, TierDamaged, entry_bytes,
                         index_value, key_of, layout_of, location, open_dbs, open_env,
                         record_value, seg_id, seg_value, u64)
from .lmdbcheck import MDB, check_file, walk
from .rebuild import move_aside, rebuild
from .segments import Segments

log = logging.getLogger(__name__)

_ACTIVE = "writer.active"           # present while a writer has the tier open
_STAMP = "index.stamp"              # data.mdb's size, mtime and inode at the last clean close


def _stamp(mdb: str) -> str:
    st = os.stat(mdb)
    return f"{st.st_size} {st.st_mtime_ns} {st.st_ino}"


def walk_index(path: str) -> str | None:
    """Walk the index at ``path`` in a child process (:func:`~kvstrata.tiers.lmdbcheck.walk`)
    and check that its databases agree; what is wrong, or None."""
    problem, counts = walk(path, RULES)
    if problem:
        return problem
    if "records" not in counts and ("pages" in counts or not counts):
        return None     # written by an older layout (or empty): the open decides what to do
    if {n.decode() for n in DBS} - set(counts):
        return "the index lacks some of its databases"
    if not counts["records"] == counts["lru"] == counts["byseg"]:
        return (f"the index's databases disagree ({counts['records']} records, "
                f"{counts['lru']} in access order, {counts['byseg']} in segments)")
    return None


class LayoutError(ValueError):
    """The index was written by another disk layout (``kind``: a number, ``"old"`` or
    ``"foreign"``)."""

    def __init__(self, kind, message: str):
        super().__init__(message)
        self.kind = kind


class DiskIndex:
    """The LMDB index of one disk tier: opened with checks, guarded on every read, rebuilt.

    ``counts`` is the tier's counter dict (``index_errors``, ``rebuilds``, ``rebuilt_records``,
    ``moved_aside`` are counted here; the tier reports it through ``counters()``). ``dbs`` maps each name of :data:`DBS` to its handle;
    both ``env`` and ``dbs`` change when the index is rebuilt.
    """

    def __init__(self, path: str, files: Segments, map_size: int, sync: bool, readonly: bool,
                 counts: dict):
        self.path, self.files, self.map_size = path, files, map_size
        self.sync, self.readonly, self.counts = sync, readonly, counts
        self.env: lmdb.Environment | None = None
        self.dbs: dict[bytes, object] = {}
        self.capacity = 0
        #: why the index is not to be trusted now (a writer rebuilds it before its next use)
        self.damaged: str | None = None
        #: what the last rebuild (or move aside) was for; None if there was none
        self.repaired: str | None = None
        self._fd = -1               # data.mdb, for the size check before every read
        #: read transactions open now; a rebuild waits until none is (it closes the environment)
        self.busy = 0
        self.psize = 4096

    @property
    def mdb(self) -> str:
        return os.path.join(self.path, MDB)

    def _layout_message(self, kind) -> str:
        if kind is None:
            return (f"{self.path!r} was written by an older kvstrata (disk layout 3 or earlier, "
                    f"whose segments are not self-describing); this version reads layout "
                    f"{LAYOUT}. A writer moves it aside into {self.path}/old-layout-*/ and "
                    f"starts empty")
        if kind == "foreign":
            return f"{self.path!r} is an LMDB environment but not a kvstrata disk tier"
        return (f"{self.path!r} was written by a newer kvstrata (disk layout {kind}); this "
                f"version reads layout {LAYOUT}: use that version, or another directory")

    # -- readers ------------------------------------------------------------------------------
    def open_reader(self) -> int | None:
        """Open read-only; returns the capacity the writer recorded. Raises :class:`TierDamaged`
        (what is damaged) or ValueError (not a tier, another layout)."""
        if os.path.isfile(self.path):
            raise ValueError(f"{self.path!r} is a file, not a kvstrata disk tier (a directory)")
        if not os.path.isdir(self.path):
            raise ValueError(f"{self.path!r} is not a kvstrata disk tier (no such directory)")
        if not os.path.exists(self.mdb):
            if self.files.ids():
                raise TierDamaged(f"{self.path!r}: data.mdb is missing ({len(self.files.ids())} "
                                  f"segment files remain; a writer rebuilds the index)")
            raise ValueError(f"{self.path!r} is not a kvstrata disk tier (no data.mdb)")
        problem = check_file(self.mdb)
        if problem:
            raise TierDamaged(f"{self.path!r}: {problem}")
        try:
            self.env = open_env(self.path, self.map_size, True, False)
            kind = layout_of(self.env)
            if kind != LAYOUT:
                raise LayoutError(kind, self._layout_message(kind))
            self.dbs = open_dbs(self.env, readonly=True)
            with self.env.begin(db=self.dbs[b"meta"], buffers=True) as txn:
                capacity = u64(txn.get(b"capacity"))
        except (LayoutError, TierDamaged):
            self.close()
            raise
        except lmdb.NotFoundError:
            self.close()
            raise ValueError(f"{self.path!r} is an LMDB environment but not a kvstrata disk tier") from None
        except lmdb.Error as e:
            self.close()
            raise TierDamaged(f"{self.path!r}: opening the index failed ({type(e).__name__}: {e})") from None
        self._opened()
        return capacity

    # -- the writer ---------------------------------------------------------------------------
    def open_writer(self, capacity: int, check: bool) -> None:
        """Open for writing (the caller holds the writer lock). Checks the file before mapping
        it, walks it in a child after an unclean shutdown (or with ``check``), and rebuilds it
        from the segments when any of that finds damage. Raises only for another layout."""
        self.capacity = capacity
        fresh = not os.path.exists(self.mdb) and not self.files.ids()
        problem = None if fresh else check_file(self.mdb)
        if problem is None and not fresh and (check or self._needs_walk()):
            problem = walk_index(self.path)
        if problem is None:
            try:
                self._open_writable()
            except LayoutError as e:
                if e.kind != "old":
                    raise
                dest = move_aside(self.path, "old-layout")
                log.warning("disk tier %s was written by an older kvstrata (disk layout 3 or "
                            "earlier, not self-describing); moved its files to %s and started "
                            "empty (delete them once no older kvstrata needs them)", self.path, dest)
                self._open_writable()
            except (lmdb.Error, TierDamaged) as e:
                self.close()
                problem = f"opening the index failed ({type(e).__name__}: {e})"
        if problem is not None:
            self.recover(problem)
        with open(os.path.join(self.path, _ACTIVE), "w") as f:
            f.write(str(os.getpid()))

    def _needs_walk(self) -> bool:
        """After an unclean shutdown (a writer died: its ``writer.active`` is still there), or
        when ``data.mdb`` changed since the last clean close (written by something else)."""
        if os.path.exists(os.path.join(self.path, _ACTIVE)):
            return True
        try:
            with open(os.path.join(self.path, _STAMP)) as f:
                return f.read() != _stamp(self.mdb)
        except OSError:
            return True

    def _open_writable(self) -> None:
        os.makedirs(self.files.dir, exist_ok=True)
        self.env = open_env(self.path, self.map_size, False, self.sync)
        kind = layout_of(self.env)
        if kind != LAYOUT:
            self.close()
            raise LayoutError("old" if kind is None else kind, self._layout_message(kind))
        # Reader slots of processes that died (kill -9) would pin old pages forever.
        self.env.reader_check()
        self.dbs = open_dbs(self.env, readonly=False)
        with self.env.begin(write=True) as txn:
            for n in DBS:
                txn.stat(self.dbs[n])
            txn.put(b"capacity", U64.pack(self.capacity), db=self.dbs[b"meta"])
        self._opened()

    def _opened(self) -> None:
        self.psize = self.env.stat()["psize"]
        self._fd = os.open(self.mdb, os.O_RDONLY)

    def recover(self, problem: str) -> None:
        """Rebuild the index from the segments; if that fails, move everything aside and start
        empty. Logs once what it found and did."""
        self.close()
        self.files.seal()
        self.repaired = problem
        try:
            got = rebuild(self.path, self.files, self.capacity, self.map_size)
            self._open_writable()
        except (lmdb.Error, OSError, LayoutError) as e:
            self.close()
            dest = move_aside(self.path, "damaged")
            self._open_writable()
            self.counts["moved_aside"] += 1
            log.error("disk tier %s: the index is damaged (%s) and rebuilding it failed (%s); "
                      "moved the tier's files to %s and started empty", self.path, problem, e,
                      dest)
            return
        self.counts["rebuilds"] += 1
        self.counts["rebuilt_records"] += got["kept"]
        log.warning("disk tier %s: the index is damaged (%s); rebuilt it from %d segment files "
                    "(%.1f MB) in %.2f s: %d records kept, %d damaged stretches skipped%s",
                    self.path, problem, got["segments"], got["segment_bytes"] / 1e6,
                    got["seconds"], got["kept"], got["damaged"],
                    "; the damaged file is kept as data.mdb.damaged" if got["kept_old"] else "")

    def check(self) -> str | None:
        """Check the file and walk the whole index in a child process; what is damaged, or None."""
        return check_file(self.mdb) or walk_index(self.path)

    def close(self, clean: bool = False) -> None:
        """Close the environment; ``clean``: the writer is done (no walk at the next open)."""
        was_open = self.env is not None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self.env is not None:
            self.env.close()
            self.env = None
        if clean and was_open and not self.readonly and os.path.exists(self.mdb):
            with open(os.path.join(self.path, _STAMP), "w") as f:
                f.write(_stamp(self.mdb))
            os.unlink(os.path.join(self.path, _ACTIVE))

    # -- bookkeeping inside a write transaction ---------------------------------------------
    def add(self, txn, entries, seqs, deltas) -> None:
        """Append ``(key, parts)`` to the current segment and index them under access order
        ``seqs`` (inside ``txn``, before its commit)."""
        nxt = u64(txn.get(b"nextseg", db=self.dbs[b"meta"]), 1)
        created = self.files.created
        seg, offs = self.files.append(entries, nxt)
        self.counts["segments_created"] += self.files.created - created
        txn.put(b"nextseg", U64.pack(max(nxt, seg + 1)), db=self.dbs[b"meta"])
        d = deltas.setdefault(seg, [0, 0])
        for (h, parts), off, seq in zip(entries, offs, seqs):
            lens = [len(p) for p in parts]
            txn.put(h, index_value(seq, sum(lens), seg, off, lens), db=self.dbs[b"records"])
            txn.put(SEQ.pack(seq), h, db=self.dbs[b"lru"])
            txn.put(SEQ.pack(seg) + h, b"", db=self.dbs[b"byseg"])
            d[0] += entry_bytes(len(h), lens)
            d[1] += 1

    def settle(self, txn, deltas: dict[int, list[int]]) -> list[int]:
        """Add ``[bytes, records]`` deltas to the segments' entries (the current segment's end
        follows the write offset); returns the sealed segments left without a record, whose
        entries are deleted here and whose files are unlinked after the commit."""
        cur = self.files.current
        if cur is not None:
            deltas.setdefault(cur, [0, 0])
        for s in self.files.sealed:
            deltas.setdefault(s, [0, 0])
        freed = []
        for s, (db, dn) in deltas.items():
            k = SEQ.pack(s)
            v = txn.get(k, db=self.dbs[b"segs"])
            live, count, end = seg_value(v) if v is not None else (0, 0, 0)
            live, count = max(0, live + db), max(0, count + dn)
            if s == cur:
                end = self.files.offset
            elif v is None:
                freed.append(s)     # a sealed segment whose first batch never committed
                continue
            elif count == 0:
                txn.delete(k, db=self.dbs[b"segs"])
                freed.append(s)
                continue
            txn.put(k, SEGV.pack(live, count, end), db=self.dbs[b"segs"])
        return freed

    def unlink(self, segs: list[int]) -> None:
        """After a commit: unlink the segments it emptied (their entries are gone)."""
        self.files.sealed.clear()
        for s in segs:
            self.files.unlink(s)
            self.counts["segments_deleted"] += 1

    def bump(self, txn, h: bytes, seq: int) -> int:
        v = txn.get(h, db=self.dbs[b"records"])
        if v is None:
            return seq
        v = record_value(v)             # (raises TierDamaged on a malformed value)
        old = U64.unpack_from(v, 0)[0]
        txn.delete(SEQ.pack(old), db=self.dbs[b"lru"])
        txn.put(SEQ.pack(seq), h, db=self.dbs[b"lru"])
        txn.put(h, U64.pack(seq) + v[8:], db=self.dbs[b"records"])
        return seq + 1

    def drop(self, txn, h: bytes, v, deltas: dict[int, list[int]]) -> int:
        """Delete record ``h`` (index value ``v``) everywhere; returns its size."""
        seg, _, lens = location(v)     # (raises TierDamaged on a malformed value)
        seq, size = struct.unpack_from("<QQ", v, 0)
        txn.delete(SEQ.pack(seq), db=self.dbs[b"lru"])
        txn.delete(h, db=self.dbs[b"records"])
        txn.delete(SEQ.pack(seg) + h, db=self.dbs[b"byseg"])
        d = deltas.setdefault(seg, [0, 0])
        d[0] -= entry_bytes(len(h), lens)
        d[1] -= 1
        return size

    def evict(self, txn, total: int, need: int, cap: int, deltas) -> tuple[int, int]:
        """Drop least recently accessed records until ``total + need`` fits ``cap``; returns
        the new total and how many went."""
        if total + need <= cap:
            return total, 0
        cur = txn.cursor(db=self.dbs[b"lru"])
        victims = []
        ok = cur.first()
        while ok and total + need > cap:
            h = key_of(cur.value())
            v = txn.get(h, db=self.dbs[b"records"])
            if v is None:
                victims.append((h, None, SEQ.pack(seg_id(cur.key()))))
            else:
                v = record_value(v)     # (raises TierDamaged on a malformed value)
                victims.append((h, v, None))
                total -= struct.unpack_from("<Q", v, 8)[0]
            ok = cur.next()
        for h, v, lru_key in victims:
            if v is None:
                txn.delete(lru_key, db=self.dbs[b"lru"])
            else:
                self.drop(txn, h, v, deltas)
        return total, len(victims)

    # -- damage on the way --------------------------------------------------------------------
    def usable(self) -> bool:
        """Whether reads may touch the index now. A writer rebuilds a damaged index first; a
        file shorter than its last page is refused (reading through the map would raise
        SIGBUS)."""
        if self.env is None:
            return False
        if self.damaged and not self.readonly and not self.busy:
            problem, self.damaged = self.damaged, None
            self.recover(problem)
        size = os.fstat(self._fd).st_size
        if size >= 2 * self.psize and size >= (self.env.info()["last_pgno"] + 1) * self.psize:
            return True
        self.error(f"data.mdb was cut to {size} bytes")
        return False

    def error(self, e) -> None:
        """A read met an error: count it, log the first of a burst, mark damage for a rebuild."""
        self.counts["index_errors"] += 1
        damage = not isinstance(e, lmdb.Error) or isinstance(e, DAMAGE)
        if damage and self.damaged is None:
            self.damaged = str(e)
            log.warning("disk tier %s: the index is damaged (%s); reads are misses until %s",
                        self.path, e, "the index is rebuilt (before the next operation)"
                        if not self.readonly else "a writer rebuilds it and this reader reopens")
        elif not damage:
            log.warning("disk tier %s: index read failed (%s); counted as a miss", self.path, e)
