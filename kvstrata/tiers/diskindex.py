"""The disk tier's LMDB index (``PATH/data.mdb``): schema, checks, and rebuilding it from segments.

Schema (disk layout :data:`LAYOUT`; all in one LMDB environment):

- ``index``: key -> ``(access seq, record bytes, segment id, frame offset)`` + one u64 length per
  record part (head first). The entry (frame + parts) lies at that offset in that segment.
- ``lru``: big-endian access seq -> key (oldest access first; survives restarts).
- ``segs``: segment id -> ``(live entry bytes, live records, committed end)``.
  ``byseg``: segment id || key -> ``b""`` (the live records of a segment).
- ``meta``: ``layout``, ``seq``, ``bytes`` (sum of record sizes), ``capacity``, ``nextseg``.

The index holds no fact the segments do not (each entry's frame names its key and part lengths),
so it is a cache that can be thrown away and rebuilt (:func:`rebuild`). What the rebuild cannot
recover is the access order, replaced by the write order, and which entries were dead (evicted,
deleted, moved): every entry whose record verifies comes back, the newest copy of a key winning,
and capacity eviction applies again. A rebuild also cannot tell a batch that committed from one
killed between its segment write and its commit; both are whole, checksummed records.

Damage LMDB cannot survive is checked where it is cheap: :func:`check_file` reads the meta pages
and the root pages with ``pread`` before anything maps the file (a file shorter than its meta page
says would raise SIGBUS through the map; a bad meta or root page fails the open), and
:func:`walk` reads every page of every database in a child process, whose death (LMDB's own
``abort``, a bus error) only tells the parent the index is damaged.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import time

import lmdb

from .segments import Segments, frame_size, scan

log = logging.getLogger(__name__)

LAYOUT = 4                          # disk layout version (the records inside are format 3)
DBS = (b"index", b"lru", b"segs", b"byseg", b"meta")
SEQ = struct.Struct(">Q")           # big-endian so byte order == numeric order in lru / byseg
IDX = struct.Struct("<QQQQ")        # access seq, record bytes, segment id, frame offset
LOC = 16                            # index value bytes from here on: the location
SEGV = struct.Struct("<QQQ")        # live entry bytes, live records, committed end
U64 = struct.Struct("<Q")
MDB = "data.mdb"

# LMDB's on-disk structures (lmdb 0.9, 64-bit): a 16-byte page header, then on a meta page
# magic, version, address, map size, two 48-byte MDB_db (free list, main) and last page, txnid.
_PAGE = struct.Struct("<QHHHH")     # pgno, pad, flags, lower, upper
_META = struct.Struct("<IIQQ")
_DB = struct.Struct("<IHHQQQQQ")    # pad (psize in the free DB), flags, depth, 4 counts, root
_NODE = struct.Struct("<HHHH")      # lo, hi, flags, key size
_P_BRANCH, _P_LEAF, _P_META = 0x01, 0x02, 0x08
_F_SUBDATA = 0x02
_MAGIC, _VERSION, _P_INVALID = 0xBEEFC0DE, 1, (1 << 64) - 1


class TierDamaged(ValueError):
    """The index of a disk tier is damaged; a writer rebuilds it, a reader cannot."""


def index_value(seq: int, size: int, seg: int, off: int, lens) -> bytes:
    return IDX.pack(seq, size, seg, off) + struct.pack(f"<{len(lens)}Q", *lens)


def location(v) -> tuple[int, int, tuple[int, ...]]:
    """``(segment, frame offset, part lengths)`` of an index value."""
    _, _, seg, off = IDX.unpack_from(v, 0)
    n = (len(v) - IDX.size) // 8
    return seg, off, struct.unpack_from(f"<{n}Q", v, IDX.size)


def entry_bytes(key_len: int, lens) -> int:
    return frame_size(key_len, len(lens)) + sum(lens)


# -- cheap checks before mapping -------------------------------------------------------------
def check_file(path: str) -> str | None:
    """What is wrong with ``path`` (a ``data.mdb``) that would crash or fail an open, judged by
    reading its meta pages and root pages; None if nothing is. Never maps the file."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return "data.mdb is missing"
    try:
        return _check_fd(fd)
    finally:
        os.close(fd)


def _check_fd(fd: int) -> str | None:
    size = os.fstat(fd).st_size
    first = os.pread(fd, 256, 0)
    psize = _DB.unpack_from(first, 16 + _META.size)[0] if len(first) >= 256 else 0
    if psize not in (1 << k for k in range(9, 17)):
        psize = os.sysconf("SC_PAGESIZE")       # page 0 is damaged; find page 1 by the default
    if size < 2 * psize:
        return f"data.mdb is {size} bytes, shorter than its two {psize}-byte meta pages"
    metas = []
    for i in (0, 1):
        buf = os.pread(fd, 256, i * psize)
        _, _, flags, _, _ = _PAGE.unpack_from(buf, 0)
        magic, version, _, _ = _META.unpack_from(buf, _PAGE.size)
        if not flags & _P_META or magic != _MAGIC or version != _VERSION:
            return (f"meta page {i} is damaged (flags {flags:#x}, magic {magic:#x}, "
                    f"version {version})")
        o = _PAGE.size + _META.size
        free, main = _DB.unpack_from(buf, o), _DB.unpack_from(buf, o + _DB.size)
        last, txnid = struct.unpack_from("<QQ", buf, o + 2 * _DB.size)
        metas.append((txnid, last, free, main))
    _, last, free, main = max(metas)
    if size < (last + 1) * psize:
        return (f"data.mdb is {size} bytes but its meta page uses pages up to {last} "
                f"({(last + 1) * psize} bytes): the file was truncated")
    for name, db in (("free list", free), ("main", main)):
        bad = _check_root(fd, psize, last, db[7], name)
        if bad:
            return bad
    if main[7] == _P_INVALID:
        return None
    page = os.pread(fd, psize, main[7] * psize)
    if not _PAGE.unpack_from(page, 0)[2] & _P_LEAF:
        return None         # many databases: their roots are checked by the walk
    for name, db in _named_dbs(page):
        bad = _check_root(fd, psize, last, db[7], f"{name!r}")
        if bad:
            return bad
    return None


def _check_root(fd: int, psize: int, last: int, root: int, name: str) -> str | None:
    if root == _P_INVALID:
        return None
    if root > last:
        return f"the {name} database's root page {root} lies past the last page {last}"
    pgno, _, flags, _, _ = _PAGE.unpack_from(os.pread(fd, _PAGE.size, root * psize), 0)
    if pgno != root or not flags & (_P_BRANCH | _P_LEAF) or flags & _P_META:
        return f"the {name} database's root page {root} is damaged (number {pgno}, flags {flags:#x})"
    return None


def _named_dbs(page: bytes):
    """``(name, MDB_db)`` of the named databases recorded in the main database's leaf page."""
    _, _, _, lower, _ = _PAGE.unpack_from(page, 0)
    for i in range((lower - _PAGE.size) // 2):
        o = struct.unpack_from("<H", page, _PAGE.size + 2 * i)[0]
        if o + _NODE.size > len(page):
            return
        lo, hi, flags, ksize = _NODE.unpack_from(page, o)
        data = o + _NODE.size + ksize
        if flags & _F_SUBDATA and (lo | hi << 16) == _DB.size and data + _DB.size <= len(page):
            yield page[o + _NODE.size:data].decode("latin-1"), _DB.unpack_from(page, data)


# -- the walk in a child process -------------------------------------------------------------
_WALK = r"""
import json, struct, sys, lmdb
env = lmdb.open(sys.argv[1], readonly=True, lock=False, max_dbs=16, subdir=True)
out = {}
with env.begin() as txn:
    names = [bytes(k) for k, _ in txn.cursor()]
bad = []
for name in names:
    db = env.open_db(name, create=False)
    n = 0
    with env.begin(db=db) as txn:
        for k, v in txn.cursor():
            n += 1
            if name == b"index" and (len(v) < 32 or len(v) % 8):
                bad.append("an index value of %d bytes" % len(v))
            elif name in (b"lru", b"segs") and len(k) != 8:
                bad.append("a %s key of %d bytes" % (name.decode(), len(k)))
    out[name.decode("latin-1")] = n
print(json.dumps({"counts": out, "bad": bad[:3]}))
"""


def walk(path: str, timeout: float | None = None) -> tuple[str | None, dict]:
    """Read every page of every database of the index at ``path`` in a child process.

    Returns ``(problem, counts)``: ``problem`` is None when the walk finished and the databases
    agree (every index entry has its access-order and segment entries), else what went wrong
    (the child died by a signal, LMDB raised, the counts disagree)."""
    mdb = os.path.join(path, MDB)
    if timeout is None:     # ~100 MB/s of index, however slow the disk, plus interpreter start
        timeout = 60 + os.path.getsize(mdb) / 100e6
    try:
        out = subprocess.run([sys.executable, "-c", _WALK, path], capture_output=True,
                             text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"walking the index took longer than {timeout:.0f} s", {}
    if out.returncode < 0:
        return f"reading the index killed the reading process (signal {-out.returncode})", {}
    if out.returncode:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        return f"reading the index failed: {last}", {}
    doc = json.loads(out.stdout)
    counts = doc["counts"]
    if doc["bad"]:
        return f"the index holds malformed entries ({'; '.join(doc['bad'])})", counts
    if set(DBS) - {k.encode("latin-1") for k in counts}:
        return "the index lacks some of its databases", counts
    if not counts["index"] == counts["lru"] == counts["byseg"]:
        return (f"the index's databases disagree ({counts['index']} entries, "
                f"{counts['lru']} in access order, {counts['byseg']} in segments)"), counts
    return None, counts


# -- opening ---------------------------------------------------------------------------------
def open_env(path: str, map_size: int, readonly: bool, sync: bool) -> lmdb.Environment:
    return lmdb.open(path, map_size=map_size, subdir=True, readonly=readonly, max_dbs=8,
                     max_readers=256, sync=sync, metasync=sync, readahead=False,
                     create=not readonly, lock=True)


def open_dbs(env: lmdb.Environment, readonly: bool) -> dict[bytes, object]:
    """The five databases (created, with the layout recorded, in a fresh writable index)."""
    if not readonly:
        with env.begin(write=True) as txn:
            fresh = txn.stat()["entries"] == 0
            dbs = {n: env.open_db(n, txn=txn) for n in DBS}
            if fresh:
                txn.put(b"layout", U64.pack(LAYOUT), db=dbs[b"meta"])
        return dbs
    return {n: env.open_db(n, create=False) for n in DBS}


def layout_of(env: lmdb.Environment) -> int | str | None:
    """The disk layout an index was written by: a number, None (written before layouts were
    recorded: 1-3), or ``"foreign"`` (an LMDB environment that is no disk tier)."""
    with env.begin() as txn:
        names = {bytes(k) for k, _ in txn.cursor()}
    if not names:
        return LAYOUT       # a fresh index
    if b"meta" not in names:
        return None if b"pages" in names else "foreign"
    meta = env.open_db(b"meta", create=False)
    with env.begin(db=meta) as txn:
        v = txn.get(b"layout")
    return U64.unpack(v)[0] if v else None


# -- rebuilding ------------------------------------------------------------------------------
def scan_all(segments: Segments) -> tuple[list[tuple[bytes, int, int, tuple[int, ...]]], dict]:
    """Every verified entry of every segment file, newest copy of each key only, oldest write
    first: ``([(key, segment, frame offset, part lengths)], totals)``."""
    latest: dict[bytes, tuple[int, int, tuple[int, ...]]] = {}
    totals = {"segments": 0, "segment_bytes": 0, "entries": 0, "damaged": 0}
    for seg in segments.ids():
        try:
            found, damaged = scan(segments.path(seg))
            totals["segment_bytes"] += os.path.getsize(segments.path(seg))
        except FileNotFoundError:
            continue
        totals["segments"] += 1
        totals["entries"] += len(found)
        totals["damaged"] += damaged
        for key, off, lens in found:
            latest.pop(key, None)           # re-insert: dict order is write order
            latest[key] = (seg, off, lens)
    return [(k, *v) for k, v in latest.items()], totals


def build(path: str, entries, ends: dict[int, int], nextseg: int, capacity: int,
          map_size: int) -> tuple[int, int]:
    """Write a fresh index at ``path`` (a directory) holding ``entries`` (oldest access first),
    keeping the newest that fit ``capacity``; returns ``(records, record bytes)`` kept."""
    sizes = [sum(lens) for _, _, _, lens in entries]
    total, first = sum(sizes), 0
    while total > capacity:
        total -= sizes[first]
        first += 1
    env = lmdb.open(path, map_size=map_size, subdir=True, max_dbs=8, sync=True)
    try:
        dbs = open_dbs(env, readonly=False)
        segs: dict[int, list[int]] = {}
        with env.begin(write=True) as txn:
            for seq, (key, seg, off, lens) in enumerate(entries[first:]):
                txn.put(key, index_value(seq, sizes[first + seq], seg, off, lens),
                        db=dbs[b"index"])
                txn.put(SEQ.pack(seq), key, db=dbs[b"lru"])
                txn.put(SEQ.pack(seg) + key, b"", db=dbs[b"byseg"])
                s = segs.setdefault(seg, [0, 0])
                s[0] += entry_bytes(len(key), lens)
                s[1] += 1
            for seg, (live, count) in segs.items():
                txn.put(SEQ.pack(seg), SEGV.pack(live, count, ends[seg]), db=dbs[b"segs"])
            meta = dbs[b"meta"]
            txn.put(b"seq", U64.pack(len(entries) - first), db=meta)
            txn.put(b"bytes", U64.pack(total), db=meta)
            txn.put(b"capacity", U64.pack(capacity), db=meta)
            txn.put(b"nextseg", U64.pack(nextseg), db=meta)
    finally:
        env.close()
    return len(entries) - first, total


def rebuild(path: str, segments: Segments, capacity: int, map_size: int) -> dict:
    """Replace the index of the tier at ``path`` by one rebuilt from its segment files (the
    damaged ``data.mdb`` is kept as ``data.mdb.damaged``). Returns what it found and kept.

    Crash-safe: the new index is written beside the old one and renamed into place; a crash
    before the rename leaves the old state, after it the new one (a missing ``data.mdb`` with
    segments present is itself rebuilt on the next open)."""
    t0 = time.perf_counter()
    entries, totals = scan_all(segments)
    ids = segments.ids()
    ends = {s: os.path.getsize(segments.path(s)) for s in {e[1] for e in entries}}
    tmp = os.path.join(path, "rebuild.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    kept, nbytes = build(tmp, entries, ends, (ids[-1] + 1) if ids else 1, capacity, map_size)
    mdb = os.path.join(path, MDB)
    if os.path.exists(mdb):
        os.replace(mdb, mdb + ".damaged")
    try:
        os.unlink(os.path.join(path, "lock.mdb"))   # its reader table belongs to the old file
    except FileNotFoundError:
        pass
    os.replace(os.path.join(tmp, MDB), mdb)
    shutil.rmtree(tmp, ignore_errors=True)
    _fsync_dir(path)
    totals.update(kept=kept, kept_bytes=nbytes, seconds=time.perf_counter() - t0)
    return totals


def move_aside(path: str, why: str) -> str:
    """Move the index and the segment files into ``path/<why>-<UTC time>/`` (the tier then
    starts empty); returns that directory."""
    dest = os.path.join(path, time.strftime(f"{why}-%Y%m%dT%H%M%SZ", time.gmtime()))
    os.makedirs(dest, exist_ok=True)
    for name in (MDB, "lock.mdb", MDB + ".damaged", "segments", "rebuild.tmp"):
        src = os.path.join(path, name)
        if os.path.exists(src):
            os.replace(src, os.path.join(dest, name))
    _fsync_dir(path)
    return dest


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
