"""Is an LMDB file sound? Checks that never trust it: ``pread`` before mapping, a walk in a child.

LMDB trusts its file: a file shorter than its meta page says raises SIGBUS through the map, a
damaged meta or root page fails the open, and some damage deeper in a tree trips LMDB's own
assertions (``abort``). None of these can be caught in the process that maps the file, so:

- :func:`check_file` reads the two meta pages and the root pages of the free list, the main
  database and every named database with plain reads, and compares the file's size with the
  last page the newer meta page uses (a handful of ``pread`` calls: cheap enough for every open);
- :func:`walk` reads every page of every named database in a child process, whose death only
  tells the parent that the file is damaged.

The structures read here are LMDB 0.9's (the data format py-lmdb bundles), 64-bit: a 16-byte
page header, then on a meta page magic, version, address, map size, two 48-byte ``MDB_db``
(free list, main), last page, txnid.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

MDB = "data.mdb"

_PAGE = struct.Struct("<QHHHH")     # pgno, pad, flags, lower, upper
_META = struct.Struct("<IIQQ")
_DB = struct.Struct("<IHHQQQQQ")    # pad (psize in the free DB), flags, depth, 4 counts, root
_NODE = struct.Struct("<HHHH")      # lo, hi, flags, key size
_P_BRANCH, _P_LEAF, _P_META = 0x01, 0x02, 0x08
_F_SUBDATA = 0x02
_MAGIC, _VERSION, _P_INVALID = 0xBEEFC0DE, 1, (1 << 64) - 1



def check_file(path: str) -> str | None:
    """What is wrong with ``path`` (a ``data.mdb``) that would crash or fail an open, judged by
    reading its meta pages and root pages; None if nothing is. Never maps the file."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return "data.mdb is missing"
    except OSError as e:
        return f"data.mdb cannot be opened ({e})"
    try:
        return _check_fd(fd)
    except (OSError, struct.error) as e:     # garbage where a page should be
        return f"data.mdb is unreadable ({type(e).__name__}: {e})"
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
    for name, db in named_dbs(page):
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


def named_dbs(page: bytes):
    """``(name, MDB_db)`` of the named databases recorded in the main database's leaf page."""
    _, _, _, lower, _ = _PAGE.unpack_from(page, 0)
    for i in range(min(lower - _PAGE.size, len(page) - _PAGE.size) // 2):
        o = struct.unpack_from("<H", page, _PAGE.size + 2 * i)[0]
        if o + _NODE.size > len(page):
            return
        lo, hi, flags, ksize = _NODE.unpack_from(page, o)
        data = o + _NODE.size + ksize
        if flags & _F_SUBDATA and (lo | hi << 16) == _DB.size and data + _DB.size <= len(page):
            yield page[o + _NODE.size:data].decode("latin-1"), _DB.unpack_from(page, data)


# -- the walk in a child process -------------------------------------------------------------
_WALK = r"""
import json, sys, lmdb
rules = json.loads(sys.argv[2])
env = lmdb.open(sys.argv[1], readonly=True, lock=False, max_dbs=64, subdir=True)
with env.begin() as txn:
    names = [bytes(k) for k, _ in txn.cursor()]
counts, bad = {}, []
for name in names:
    db = env.open_db(name, create=False)
    key = name.decode("latin-1")
    r = rules.get(key, {})
    n = 0
    with env.begin(db=db) as txn:
        for k, v in txn.cursor():
            n += 1
            if ("key" in r and len(k) != r["key"]) or len(v) < r.get("value_min", 0) or \
                    len(v) % r.get("value_step", 1) or ("value" in r and len(v) != r["value"]):
                bad.append("%s: a %d-byte key with a %d-byte value" % (key, len(k), len(v)))
    counts[key] = n
print(json.dumps({"counts": counts, "bad": bad[:3]}))
"""


def walk(path: str, rules: dict[str, dict], timeout: float | None = None
         ) -> tuple[str | None, dict]:
    """Read every page of every named database of the LMDB environment at ``path`` in a child
    process, checking each entry's sizes against ``rules`` (database -> ``key``, ``value``,
    ``value_min``, ``value_step`` in bytes).

    Returns ``(problem, entry counts per database)``; ``problem`` is None when the walk finished
    and every entry fits its rules, else what went wrong (the child died by a signal, LMDB
    raised, an entry is malformed)."""
    mdb = os.path.join(path, MDB)
    if timeout is None:     # ~100 MB/s of index, however slow the disk, plus interpreter start
        timeout = 60 + os.path.getsize(mdb) / 100e6
    try:
        out = subprocess.run([sys.executable, "-c", _WALK, path, json.dumps(rules)],
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"walking the index took longer than {timeout:.0f} s", {}
    if out.returncode < 0:
        return f"reading the index killed the reading process (signal {-out.returncode})", {}
    if out.returncode:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        return f"reading the index failed: {last}", {}
    doc = json.loads(out.stdout)
    if doc["bad"]:
        return f"the index holds malformed entries ({'; '.join(doc['bad'])})", doc["counts"]
    return None, doc["counts"]
