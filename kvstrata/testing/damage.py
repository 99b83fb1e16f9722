"""Damage a disk tier's LMDB index the ways disks and people do (fault-injection tests, benches).

Each function edits ``PATH/data.mdb`` in place with plain file writes, so it works while a
:class:`~kvstrata.tiers.DiskTier` holds the file open (its read-only map sees the new bytes).
"""

from __future__ import annotations

import os
import random
import struct

from ..tiers.lmdbcheck import MDB

_P_BRANCH, _P_LEAF = 0x01, 0x02


def _psize(fd: int) -> int:
    return struct.unpack_from("<I", os.pread(fd, 256, 0), 16 + 24)[0] or 4096


def tree_pages(path) -> list[int]:
    """Numbers of the branch and leaf pages of ``path``'s data.mdb (meta pages excluded)."""
    fd = os.open(os.path.join(path, MDB), os.O_RDONLY)
    try:
        ps = _psize(fd)
        out = []
        for pg in range(2, os.fstat(fd).st_size // ps):
            pgno, _, flags = struct.unpack_from("<QHH", os.pread(fd, 12, pg * ps), 0)
            if pgno == pg and flags & (_P_BRANCH | _P_LEAF) and not flags & ~0x1F:
                out.append(pg)
        return out
    finally:
        os.close(fd)


def some_pages(path, n: int, rng: random.Random) -> list[int]:
    """``n`` tree pages: the root of the ``records`` database (on every read's path) and
    ``n - 1`` others (live or copy-on-write leftovers)."""
    root = root_page(path, b"records")
    return [root] + rng.sample([p for p in tree_pages(path) if p != root], n - 1)


def _edit(path, fn) -> None:
    fd = os.open(os.path.join(path, MDB), os.O_RDWR)
    try:
        fn(fd, _psize(fd))
        os.fsync(fd)
    finally:
        os.close(fd)


def flip_page_type(path, pages) -> None:
    """Swap the leaf/branch bits of ``pages`` (LMDB: "Located page was wrong type")."""
    def fn(fd, ps):
        for pg in pages:
            b = bytearray(os.pread(fd, 12, pg * ps))
            b[10] ^= _P_BRANCH | _P_LEAF
            os.pwrite(fd, bytes(b), pg * ps)
    _edit(path, fn)


def damage_meta(path, which=(0, 1)) -> None:
    """Overwrite the magic number of meta page(s) ``which``."""
    _edit(path, lambda fd, ps: [os.pwrite(fd, b"\xde\xad\xbe\xef", i * ps + 16) for i in which])


def root_page(path, name: bytes) -> int:
    """The root page number of the named database ``name``."""
    from ..tiers.lmdbcheck import named_dbs
    fd = os.open(os.path.join(path, MDB), os.O_RDONLY)
    try:
        ps = _psize(fd)
        meta = [os.pread(fd, 256, i * ps) for i in (0, 1)]
        txn = [struct.unpack_from("<Q", m, 144)[0] for m in meta]
        main_root = struct.unpack_from("<Q", meta[txn.index(max(txn))], 16 + 24 + 48 + 40)[0]
        return dict(named_dbs(os.pread(fd, ps, main_root * ps)))[name.decode()][7]
    finally:
        os.close(fd)


def damage_root(path, name: bytes) -> None:
    """Zero the header of the root page of the named database ``name``."""
    pg = root_page(path, name)
    _edit(path, lambda fd, ps: os.pwrite(fd, bytes(16), pg * ps))


def random_bytes(path, n: int, rng: random.Random, metas: bool = False) -> None:
    """Overwrite ``n`` random bytes past the meta pages (``metas``: anywhere) with random
    values."""
    def fn(fd, ps):
        size = os.fstat(fd).st_size
        for _ in range(n):
            os.pwrite(fd, bytes([rng.randrange(256)]), rng.randrange(0 if metas else 2 * ps, size))
    _edit(path, fn)


def truncate(path, fraction: float = 1 / 3) -> None:
    p = os.path.join(path, MDB)
    os.truncate(p, int(os.path.getsize(p) * fraction))


def delete(path) -> None:
    os.unlink(os.path.join(path, MDB))
