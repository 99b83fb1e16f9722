"""Rebuilding the disk tier's index from its segment files, or moving a hopeless tier aside.

A rebuild scans every segment (:func:`~kvstrata.tiers.segments.scan`) and keeps every entry whose
frame and record verify, the newest copy of a key winning. What it cannot recover is the access
order, replaced by the write order, and which entries were dead (evicted, deleted, moved): they
come back, and capacity eviction applies again. Nor can it tell a batch that committed from one
killed between its segment write and its commit; both are whole, checksummed records, so nothing
wrong is ever served.
"""

from __future__ import annotations

import os
import shutil
import time

from .diskschema import build
from .lmdbcheck import MDB
from .segments import Segments, scan


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
    kept_old = os.path.exists(mdb)
    if kept_old:
        os.replace(mdb, mdb + ".damaged")
    try:
        os.unlink(os.path.join(path, "lock.mdb"))   # its reader table belongs to the old file
    except FileNotFoundError:
        pass
    os.replace(os.path.join(tmp, MDB), mdb)
    shutil.rmtree(tmp, ignore_errors=True)
    _fsync_dir(path)
    totals.update(kept=kept, kept_bytes=nbytes, kept_old=kept_old, seconds=time.perf_counter() - t0)
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
