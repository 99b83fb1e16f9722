"""Disk tier: rebuilding the LMDB index from the segment files, time per GB (CPU).

    python benchmarks/rebuild_bench.py --mb 1024 --reps 3
    python benchmarks/rebuild_bench.py --mb 256 --reps 3 --tiny     # small pages

Fills a tier with identity-codec records (Qwen3-8B-shaped target pages, [36, 2, 8, 16, 128] bf16
= 2.25 MiB; ``--tiny``: [2, 2, 2, 16, 64] bf16 = 16 KiB), closes it, deletes ``data.mdb`` and
times the next writer's open, which finds the index missing and rebuilds it: a scan of every
segment (frame CRC, record header CRC, every payload's CRC) and one LMDB transaction with the
kept entries. Baselines in the same run, over the same segment files: reading them with
``readinto`` into one preallocated buffer (the I/O alone), and mapping them + one CRC-32 pass
(ISA-L when installed, as the tier uses) over every byte (the least a verifying scan does). Warm: the files in the page cache (just
written); cold: evicted from it first (fsync + ``posix_fadvise(DONTNEED)`` per file; every side
the same way). Medians of ``--reps`` runs.
"""

from __future__ import annotations

import argparse
import mmap
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstrata.codecs import get_codec  # noqa: E402
from kvstrata.pagepool import KVGroupSpec, Namespace, PageInfo, hash_page  # noqa: E402
from kvstrata.tiers import DiskTier  # noqa: E402
from kvstrata.tiers.record import build_record, crc32  # noqa: E402

P = 16


def fill(path: Path, total_mb: int, tiny: bool, batch: int = 64) -> tuple[int, int, int]:
    """Write ``total_mb`` of records; returns ``(records, record bytes, page bytes)``."""
    L, H, D = (2, 2, 64) if tiny else (36, 8, 128)
    g = KVGroupSpec("target", L, H, D, torch.bfloat16, "identity")
    ns = Namespace("rebuild-bench", [g], P)
    enc = get_codec("identity").encode(torch.randn(g.page_shape(P)).to(torch.bfloat16))
    payload = enc.payload.numpy().data
    per = g.bytes_per_page(P)
    n = max(batch, (total_mb << 20) // per)
    nbytes = 0
    with DiskTier(path, map_size=1 << 30, capacity_bytes=1 << 40) as disk:
        parent = ns.digest
        for k in range(0, n, batch):
            items = []
            for i in range(k, min(n, k + batch)):
                toks = tuple(range(i * P, (i + 1) * P))
                h = hash_page(parent, toks)
                parts = build_record(ns.digest, PageInfo(i, h, parent, toks), [g.name], [enc],
                                     [payload])
                items.append((h, parts))
                nbytes += sum(len(p) for p in parts)
                parent = h
            if disk.put_batch(items) != len(items):
                raise RuntimeError("the disk tier dropped pages")
    return n, nbytes, per


def segment_files(path: Path) -> list[Path]:
    return sorted((path / "segments").glob("*.seg"))


def evict_from_cache(files) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_files(files, buf: bytearray) -> None:
    """The I/O alone: every file into one preallocated buffer."""
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            fh.readinto(buf)


def crc_files(files) -> None:
    """The least a verifying scan does: map each file and CRC-32 all of its bytes."""
    for f in files:
        with open(f, "rb") as fh:
            m = mmap.mmap(fh.fileno(), 0, mmap.MAP_SHARED, mmap.PROT_READ)
        with memoryview(m) as mv:
            crc32(mv)
        m.close()


def rebuild(path: Path, n: int) -> None:
    os.unlink(path / "data.mdb")
    with DiskTier(path, map_size=1 << 30, capacity_bytes=1 << 40) as d:
        if d.counters()["rebuilt_records"] != n:
            raise RuntimeError(f"the rebuild kept {d.counters()['rebuilt_records']} of {n} records")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=1024, help="MiB of records")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="16 KiB pages instead of 2.25 MiB")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="kvstrata-rebuild-", dir=os.environ.get("TMPDIR")))
    try:
        path = root / "tier"
        n, nbytes, per = fill(path, args.mb, args.tiny)
        files = segment_files(path)
        seg_bytes = sum(os.path.getsize(f) for f in files)
        buf = bytearray(max(os.path.getsize(f) for f in files))
        sides = {"rebuild": lambda: rebuild(path, n),
                 "read (readinto)": lambda: read_files(files, buf),
                 "map + CRC-32": lambda: crc_files(files)}
        times = {(s, c): [] for s in sides for c in ("warm", "cold")}
        for _ in range(args.reps):
            for cache in ("warm", "cold"):
                for name, fn in sides.items():
                    if cache == "cold":
                        evict_from_cache(files)
                    else:
                        read_files(files, buf)      # make sure they are cached
                    t = time.perf_counter()
                    fn()
                    times[name, cache].append(time.perf_counter() - t)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gb = seg_bytes / 1e9
    lines = [f"Conditions: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
             f"{n} identity records of {per} B pages ({nbytes / 2**20:.0f} MiB of records, "
             f"{seg_bytes / 2**20:.0f} MiB of segment files in {len(files)} files), "
             f"median of {args.reps} runs, lmdb "
             f"{'.'.join(map(str, __import__('lmdb').version()))}.", "",
             "| page cache | side | s | s per GB | GB/s | rebuild vs side |", "|---|---|---|---|---|---|"]
    for cache in ("warm", "cold"):
        reb = statistics.median(times["rebuild", cache])
        for name in sides:
            s = statistics.median(times[name, cache])
            lines.append(f"| {cache} | {name} | {s:.3f} | {s / gb:.3f} | {gb / s:.2f} | "
                         f"{reb / s:.2f}x |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
