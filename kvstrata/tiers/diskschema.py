"""The schema of the disk tier's LMDB index (``PATH/data.mdb``, disk layout :data:`LAYOUT`).

- ``records``: key -> ``(access seq, record bytes, segment id, frame offset)`` + one u64 length
  per record part (head first). The entry (frame + parts) lies at that offset in that segment.
- ``lru``: big-endian access seq -> key (oldest access first; survives restarts).
- ``segs``: segment id -> ``(live entry bytes, live records, committed end)``.
  ``byseg``: segment id || key -> ``b""`` (the live records of a segment).
- ``meta``: ``layout``, ``seq``, ``bytes`` (sum of record sizes), ``capacity``, ``nextseg``.

The index holds no fact the segments do not (each entry's frame names its key and part lengths),
so it is a cache that can be thrown away and rebuilt (:mod:`kvstrata.tiers.rebuild`).
"""

from __future__ import annotations

import struct

import lmdb

from .segments import frame_size

LAYOUT = 4                          # disk layout version (the records inside are format 3)
DBS = (b"records", b"lru", b"segs", b"byseg", b"meta")
SEQ = struct.Struct(">Q")           # big-endian so byte order == numeric order in lru / byseg
IDX = struct.Struct("<QQQQ")        # access seq, record bytes, segment id, frame offset
LOC = 16                            # index value bytes from here on: the location
SEGV = struct.Struct("<QQQ")        # live entry bytes, live records, committed end
U64 = struct.Struct("<Q")
#: what each database's entries look like (for the walk)
RULES = {"records": {"value_min": IDX.size + 8, "value_step": 8}, "lru": {"key": 8},
         "segs": {"key": 8, "value": SEGV.size}, "byseg": {"value": 0}}
#: LMDB errors that mean the index itself is damaged (others: a full map, too many readers ...)
DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError,
          lmdb.VersionMismatchError, lmdb.PanicError, lmdb.BadTxnError, lmdb.BadValsizeError)


class TierDamaged(ValueError):
    """The index of a disk tier is damaged; a writer rebuilds it, a reader cannot."""


def index_value(seq: int, size: int, seg: int, off: int, lens) -> bytes:
    return IDX.pack(seq, size, seg, off) + struct.pack(f"<{len(lens)}Q", *lens)


# NOTE: values are read as views into LMDB's map (``buffers=True``) and their length is checked
# before any byte is touched: a damaged node may claim a length that runs past the end of the
# file, and touching that through the map raises SIGBUS.
MAX_PARTS = 257                     # head + 256 payloads
MAX_KEY = 255                       # bytes of a key (LMDB keys are at most 511 bytes)


def u64(v, default: int | None = None) -> int | None:
    """An 8-byte counter (``default`` if absent)."""
    if v is None:
        return default
    if len(v) != 8:
        raise TierDamaged(f"a {len(v)}-byte value where 8 bytes belong")
    return U64.unpack(v)[0]


def seg_id(k) -> int:
    if len(k) != 8:
        raise TierDamaged(f"a {len(k)}-byte segment id")
    return SEQ.unpack(k)[0]


def seg_value(v) -> tuple[int, int, int]:
    """``(live entry bytes, live records, committed end)`` of a ``segs`` value."""
    if len(v) != SEGV.size:
        raise TierDamaged(f"a segment entry of {len(v)} bytes")
    return SEGV.unpack(v)


def key_of(v) -> bytes:
    """A key stored as a value (``lru``) or inside a key (``byseg``), copied out."""
    if not 1 <= len(v) <= MAX_KEY + 8:
        raise TierDamaged(f"a key of {len(v)} bytes")
    return bytes(v)


def record_value(v) -> bytes:
    """A ``records`` value, checked and copied out."""
    location(v)
    return bytes(v)


def location(v) -> tuple[int, int, tuple[int, ...]]:
    """``(segment, frame offset, part lengths)`` of an index value; :class:`TierDamaged` if the
    value is malformed (damage the walk did not see)."""
    n, rest = divmod(len(v) - IDX.size, 8)
    if not 1 <= n <= MAX_PARTS or rest:
        raise TierDamaged(f"an index value of {len(v)} bytes")
    _, _, seg, off = IDX.unpack_from(v, 0)
    return seg, off, struct.unpack_from(f"<{n}Q", v, IDX.size)


def entry_bytes(key_len: int, lens) -> int:
    return frame_size(key_len, len(lens)) + sum(lens)


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
    with env.begin(buffers=True) as txn:
        names = {key_of(k) for k in txn.cursor().iternext(values=False)}
    if not names:
        return LAYOUT       # a fresh index
    if b"meta" not in names:
        return None if b"pages" in names else "foreign"
    meta = env.open_db(b"meta", create=False)
    with env.begin(db=meta, buffers=True) as txn:
        return u64(txn.get(b"layout"))


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
                        db=dbs[b"records"])
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
