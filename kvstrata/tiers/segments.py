"""Segment files of the disk tier: self-describing, append-only, written once.

A segment (``PATH/segments/<16 hex digits>.seg``) is a run of *entries*, each a frame followed by
the record it describes, back to back::

    frame  = b"KVSG" | u32 crc32(rest of frame) | u16 key_len | u16 parts | key | u64 len * parts
    entry  = frame | part_0 (the record head) | part_1 | ... (the payloads)

The frame names the key the record is stored under and the length of each of its parts, so a scan
of the files alone finds every record (:func:`scan`): the LMDB index is a cache of what the
segments say and can be rebuilt from them, as log-structured stores rebuild their key directory.
The frame's CRC makes a stray ``KVSG`` inside a payload useless as a frame; after a damaged frame
a scan resynchronizes at the next magic that carries a valid frame. The record itself carries the
CRC of its header and of each payload (:mod:`kvstrata.tiers.record`), so a scan keeps exactly
the records whose bytes verify.

A batch's entries are appended with one ``os.pwritev`` straight from the caller's buffers (the
host slots) plus the small frames: the kernel's copy into the page cache is the only copy. Segment
ids are never reused and a written byte never changes until its file is unlinked, so a location
``(segment, offset)`` always holds the same bytes. This module owns the files (names, appends,
read-only maps, scans, sweeping); which entries are live is the index's business.
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
from typing import Callable, Iterable, Sequence

from ..codecs import CorruptPageError
from .record import check_payloads, crc32, parse_record

SEGDIR = "segments"
SUFFIX = ".seg"
MAGIC = b"KVSG"
_FRAME = struct.Struct("<4sIHH")    # magic, crc of the rest, key length, part count
DEFAULT_SEGMENT_BYTES = 256 << 20
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


def frame(key: bytes, lens: Sequence[int]) -> bytes:
    """The frame written in front of record parts of lengths ``lens`` stored under ``key``."""
    rest = struct.pack(f"<HH{len(key)}s{len(lens)}Q", len(key), len(lens), key, *lens)
    return MAGIC + struct.pack("<I", crc32(rest)) + rest


def frame_size(key_len: int, parts: int) -> int:
    return _FRAME.size + key_len + 8 * parts


def read_frame(buf, pos: int) -> tuple[bytes, tuple[int, ...], int] | None:
    """``(key, part lengths, offset of part 0)`` of a valid frame at ``pos``, else None."""
    if pos + _FRAME.size > len(buf):
        return None
    magic, crc, klen, n = _FRAME.unpack_from(buf, pos)
    end = pos + frame_size(klen, n)
    if magic != MAGIC or end > len(buf) or crc32(buf[pos + 8:end]) != crc:
        return None
    key = bytes(buf[pos + _FRAME.size:pos + _FRAME.size + klen])
    return key, struct.unpack_from(f"<{n}Q", buf, pos + _FRAME.size + klen), end


def record_verifies(parts: Sequence) -> bool:
    """The parts form a record whose header and payload CRCs hold (what a scan keeps)."""
    try:
        check_payloads(parse_record(list(parts)))
    except CorruptPageError:
        return False
    return True


def scan(path: str, verify: Callable[[Sequence], bool] = record_verifies
         ) -> tuple[list[tuple[bytes, int, tuple[int, ...]]], int]:
    """Entries of one segment file whose frame and record verify: ``[(key, frame offset, part
    lengths)]`` in file order, and the count of damaged stretches skipped (a bad frame, a record
    that fails ``verify``, a tail cut short)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return [], 0
        m = mmap.mmap(f.fileno(), size, mmap.MAP_SHARED, mmap.PROT_READ)
    if hasattr(mmap, "MADV_SEQUENTIAL"):
        m.madvise(mmap.MADV_SEQUENTIAL)     # one pass front to back: read ahead, drop behind
    out, damaged, pos = [], 0, 0
    try:
        mv = memoryview(m)
        while pos < size:
            got = read_frame(mv, pos)
            end = got[2] + sum(got[1]) if got else 0
            if got is None or end > size:
                damaged += 1
                nxt = m.find(MAGIC, pos + 1)
                if nxt < 0:
                    break
                pos = nxt
                continue
            key, lens, off = got
            parts = []
            for n in lens:
                parts.append(mv[off:off + n])
                off += n
            if verify(parts):
                out.append((key, pos, lens))
            else:
                damaged += 1
            for p in parts:
                p.release()
            pos = end
        mv.release()
    finally:
        m.close()
    return out, damaged


def pwritev_all(fd: int, bufs: list, offset: int) -> int:
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


class Segments:
    """The segment directory of one tier: the writer's current file and read-only maps.

    Args:
        root: the tier's directory (segments live in ``root/segments``).
        segment_bytes: a segment is sealed once it reaches this size (a batch is never split).
        sync: fsync appends (and the directory when a file is created).
    """

    def __init__(self, root: str, segment_bytes: int, sync: bool = False):
        self.dir = os.path.join(root, SEGDIR)
        self.segment_bytes = segment_bytes
        self.sync = sync
        self._maps: dict[int, mmap.mmap] = {}  # segment id -> read-only map
        self._fds: dict[int, int] = {}         # segment id -> its file, for the size check
        self._retired: list[mmap.mmap] = []    # maps still exported to a caller's views
        self.current: int | None = None        # the segment this writer appends to
        self._fd = -1
        self.offset = 0                        # the current segment's size
        self.sealed: list[int] = []            # sealed since the index last looked
        self.created = 0

    def path(self, seg: int) -> str:
        return os.path.join(self.dir, f"{seg:016x}{SUFFIX}")

    def ids(self) -> list[int]:
        """Ids of the segment files present, ascending (other names are ignored)."""
        out = []
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        for name in names:
            if name.endswith(SUFFIX):
                try:
                    out.append(int(name[:-len(SUFFIX)], 16))
                except ValueError:
                    pass
        return sorted(out)

    # -- reads --------------------------------------------------------------------------------
    def _map(self, seg: int, end: int) -> mmap.mmap | None:
        """A read-only map of segment ``seg`` covering ``[0, end)``; None if the file is missing
        or shorter (reclaimed, or damaged)."""
        m = self._maps.get(seg)
        if m is not None and len(m) >= end:
            # NOTE: a map read past the end of its file raises SIGBUS: the file must still hold
            # what the map covers (one fstat; a cut file is a miss, never a dead process).
            try:
                if os.fstat(self._fds[seg]).st_size >= end:
                    return m
            except OSError:
                pass
            return None
        try:
            fd = os.open(self.path(seg), os.O_RDONLY)
        except OSError:         # gone (reclaimed), or unreadable: a miss either way
            return None
        try:
            size = os.fstat(fd).st_size
            if size < end or size == 0:
                os.close(fd)
                return None
            new = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        except (OSError, ValueError):
            os.close(fd)
            return None
        if m is not None:
            self._drop_map(m)
            os.close(self._fds.pop(seg))
        self._maps[seg] = new
        self._fds[seg] = fd
        return new

    def views(self, seg: int, off: int, lens: Sequence[int]) -> list | None:
        """Views of ``lens`` bytes back to back from ``off`` in ``seg``; None if they are not
        all there. Valid until :meth:`forget` of that segment is followed by the caller
        dropping them."""
        total = sum(lens)
        if not total:
            return [b""] * len(lens)
        m = self._map(seg, off + total)
        if m is None:
            return None
        mv = memoryview(m)
        out = []
        for n in lens:
            out.append(mv[off:off + n])
            off += n
        return out

    def mapped(self) -> list[int]:
        return list(self._maps)

    def _drop_map(self, m: mmap.mmap) -> None:
        try:
            m.close()
        except BufferError:
            self._retired.append(m)

    def forget(self, seg: int) -> None:
        """Drop the map of ``seg`` (it is being unlinked, or was by another process)."""
        m = self._maps.pop(seg, None)
        if m is not None:
            self._drop_map(m)
            os.close(self._fds.pop(seg))
        if self._retired:
            keep = []
            for m in self._retired:
                try:
                    m.close()
                except BufferError:
                    keep.append(m)
            self._retired = keep

    # -- writes -------------------------------------------------------------------------------
    def seal(self) -> None:
        """Close the current segment; the next append starts a new one."""
        if self._fd >= 0:
            os.close(self._fd)
            self.sealed.append(self.current)
        self.current, self._fd, self.offset = None, -1, 0

    def _next(self, first_free: int) -> None:
        self.seal()
        nxt = first_free
        while True:
            try:
                fd = os.open(self.path(nxt), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                break
            except FileExistsError:
                nxt += 1
        if self.sync:
            self.fsync_dir()
        self.current, self._fd, self.offset = nxt, fd, 0
        self.created += 1

    def fsync_dir(self) -> None:
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def append(self, entries: Iterable[tuple[bytes, Sequence]], first_free: int
               ) -> tuple[int, list[int]]:
        """Append ``(key, parts)`` entries (frame + parts each) back to back to the current
        segment, rolling to a new one (id >= ``first_free``) first when it is full or absent.
        Returns ``(segment, frame offsets)``; durable before return when ``sync`` is on."""
        if self.current is None or self.offset >= self.segment_bytes:
            self._next(first_free)
        bufs, offs, off = [], [], self.offset
        for key, parts in entries:
            fr = frame(key, [len(p) for p in parts])
            offs.append(off)
            bufs.append(fr)
            bufs.extend(parts)
            off += len(fr) + sum(len(p) for p in parts)
        start = self.offset
        try:
            self.offset = start + pwritev_all(self._fd, bufs, start)
            if self.sync:
                os.fdatasync(self._fd)
        except BaseException:
            # append past whatever reached the file (dead bytes until the segment goes)
            self.offset = max(start, os.fstat(self._fd).st_size)
            raise
        return self.current, offs

    def unlink(self, seg: int) -> None:
        self.forget(seg)
        try:
            os.unlink(self.path(seg))
        except FileNotFoundError:
            pass

    def sweep(self, committed: dict[int, int]) -> int:
        """Unlink files the index does not know and cut bytes past a known segment's committed
        end (a batch killed before its commit); returns how many files it changed."""
        n = 0
        for seg in self.ids():
            if seg == self.current:
                continue
            p = self.path(seg)
            if seg not in committed:
                self.unlink(seg)
                n += 1
            elif os.path.getsize(p) > committed[seg]:
                self.forget(seg)
                os.truncate(p, committed[seg])
                n += 1
        return n

    def close(self) -> None:
        self.seal()
        for m in [*self._maps.values(), *self._retired]:
            try:
                m.close()
            except BufferError:
                pass        # a caller still holds a view; the map goes with it
        for fd in self._fds.values():
            os.close(fd)
        self._maps.clear()
        self._fds.clear()
        self._retired.clear()
