"""Tier throughput: device<->host page moves vs pinned PCIe, and the disk tier vs a plain file.

    python benchmarks/tiers_bench.py --device cuda --out /tmp/out.md   # H200, ~2 min
    python benchmarks/tiers_bench.py --device cpu --out /tmp/out.md    # disk + smoke

Transfers (``--device``), for each ``--chunks`` size (pipelined: chunk k's copy overlaps chunk
k+1's encode/decode) and serialized (one chunk per batch): a pool of Qwen3-8B-shaped target
pages ([36, 2, 8, 16, 128] bf16, 2.25 MiB per page; ``--tiny`` shrinks them for a smoke test) and
a TierManager with a host tier of one batch. Down = ``TierManager.on_evict`` of a batch of pages
(gather + encode on the device, D2H into pinned slots) and ``host.settle()`` (until the pages are
visible on the host); up = ``load_prefix`` of the same batch from the host (H2D + decode into
pool pages). Times are CUDA-event medians of ``--reps`` runs, from before the call to
the compute stream being able to use the pages. The ceiling is one ``copy_`` of the batch's bytes
between a device buffer and a pinned host buffer, each direction, in the same run. Identity pages
report GB/s of the bytes moved and % of the ceiling (goal >= 90%); NVFP4 pages report
bf16-equivalent GB/s (raw page bytes / time) and its ratio to the raw ceiling (goal >= 3.2x).

Disk (always on the CPU): records of the same pages (identity codec) written through
``build_record`` + ``DiskTier.put_batch`` in batches (CRC32 per payload and header; the payloads
appended to a segment file with one ``pwritev``, then one LMDB transaction for the heads) and read
back with ``verify_record`` + a copy into a host buffer (what a promotion does), against writing
the same record bytes to a plain file sequentially and reading them back with ``readinto``; and,
as the layout's floor, the same payloads written by bare ``os.pwritev`` to one file (same
batches, no CRC, no heads, no LMDB). Every side goes through the page cache (no fsync; the tier's
default); medians of ``--disk-reps`` runs, each into a fresh directory; within a run the sides
take turns in a rotating order (the first to run after a fresh directory is not always the same
one). Goal: >= 80% of the plain file.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _timing import median_ms  # noqa: E402  (benchmarks/ is on sys.path when a script here runs)
from _report import emit  # noqa: E402

from kvstrata.codecs import get_codec  # noqa: E402
from kvstrata.pagepool import KVGroupSpec, Namespace, PageInfo, PagePool, hash_page  # noqa: E402
from kvstrata.tiers import DiskTier, TierManager  # noqa: E402
from kvstrata.tiers.record import build_record, verify_record  # noqa: E402

P = 16


def geometry(tiny: bool) -> tuple[int, int, int]:
    return (2, 2, 64) if tiny else (36, 8, 128)     # layers, kv heads, head_dim


def timed(device: torch.device, fn, reps: int, setup=None) -> float:
    """Median ms of ``fn`` (the tiers use side streams: every stream is drained before each run;
    ``setup``, if given, runs untimed before each run)."""
    return median_ms(fn, device, reps, sync_all=True, setup=setup)


def ceiling(device: torch.device, nbytes: int, reps: int) -> tuple[float, float]:
    """GB/s of one copy_ of ``nbytes`` device->pinned host and back (plain memcpy on the CPU)."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    d2h = timed(device, lambda: host.copy_(dev, non_blocking=True), reps)
    h2d = timed(device, lambda: dev.copy_(host, non_blocking=True), reps)
    return nbytes / d2h / 1e6, nbytes / h2d / 1e6


def infos_for(ns: Namespace, n: int, first_page_id: int = 0) -> list[PageInfo]:
    out, parent = [], ns.digest
    for i in range(n):
        toks = tuple(range(i * P, (i + 1) * P))
        h = hash_page(parent, toks)
        out.append(PageInfo(first_page_id + i, h, parent, toks))
        parent = h
    return out


def bench_transfer(device: torch.device, codec: str, batch: int, tiny: bool, reps: int,
                   chunk: int, pages: int | None = None) -> dict:
    """One call moves ``pages`` pages (default: one batch) in batches of ``batch``: with more
    pages than a batch, the batches stream back to back (no wait between them)."""
    L, H, D = geometry(tiny)
    g = KVGroupSpec("target", L, H, D, torch.bfloat16, codec)
    ns = Namespace("bench", [g], P)
    batch_pages, batch = batch, pages or batch
    pool = PagePool([g], 2 * batch, P, device)
    pool.kv["target"].normal_()
    tiers = TierManager(pool, ns, host_bytes=batch * TierManager.slot_bytes_for(pool),
                        batch_pages=batch_pages, chunk_pages=chunk)
    src = infos_for(ns, batch)

    def down():
        tiers.on_evict(src)
        tiers.host.settle()     # until the pages are visible on the host (the compute stream
        #                         itself only waits for the encode)
    # the host tier is emptied before each run, outside the timed region
    ms_down = timed(device, down, reps, setup=tiers.host.clear)
    tiers.host.settle()
    dst = list(range(batch, 2 * batch))
    n = tiers.load_prefix(ns, src, dst)
    if n != batch:
        raise RuntimeError(f"load_prefix loaded {n} of {batch} pages")
    ms_up = timed(device, lambda: tiers.load_prefix(ns, src, dst), reps)
    # Correctness of what was timed: the round trip equals the codec's own round trip.
    c = get_codec(codec)
    want = pool.kv["target"][0] if c.lossless else c.decode(c.encode(pool.kv["target"][0]), device)
    exact = torch.equal(pool.kv["target"][batch], want)
    raw = g.bytes_per_page(P) * batch
    moved = sum(e.nbytes for e in (tiers.host.entry(i.hash) for i in src))
    return dict(codec=codec, batch=batch_pages, chunk=min(chunk, batch_pages), raw=raw,
                moved=moved,
                ms_down=ms_down, ms_up=ms_up,
                exact=exact, page_shape=g.page_shape(P))


def _records(n: int, tiny: bool) -> list[tuple[PageInfo, list]]:
    L, H, D = geometry(tiny)
    g = KVGroupSpec("target", L, H, D, torch.bfloat16, "identity")
    ns = Namespace("bench", [g], P)
    codec = get_codec("identity")
    page = torch.randn(g.page_shape(P)).to(torch.bfloat16)
    enc = codec.encode(page)
    return ns, g, codec, [(info, enc) for info in infos_for(ns, n)]


def bench_disk(total_mb: int, tiny: bool, reps: int, batch: int) -> dict:
    ns, g, codec, pages = _records(1, tiny)
    per = g.bytes_per_page(P)
    n = max(batch, (total_mb << 20) // per)
    ns, g, codec, pages = _records(n, tiny)
    specs, codecs = [g], [codec]
    payload = pages[0][1].payload.numpy().data
    results = {"write": [], "read": [], "file_write": [], "file_read": [], "floor_write": []}
    nbytes = 0
    recs: list = []

    def tier(root: Path) -> None:
        nonlocal nbytes
        disk = DiskTier(root / "tier", map_size=4 * n * (per + 4096) + (64 << 20))
        t = time.perf_counter()
        recs.clear()
        for k in range(0, n, batch):
            items = []
            for info, enc in pages[k:k + batch]:
                # the checksum is computed here, as the tier does for pages from host slots
                parts = build_record(ns.digest, info, [g.name], [enc.__class__(
                    enc.codec, enc.version, enc.shape, enc.dtype, enc.payload)], [payload])
                items.append((info.hash, parts))
                recs.append(parts)
            if disk.put_batch(items) != len(items):
                raise RuntimeError("the disk tier dropped pages")
        results["write"].append(time.perf_counter() - t)
        nbytes = sum(sum(len(p) for p in parts) for parts in recs)
        host = np.empty(per, dtype=np.uint8)
        t = time.perf_counter()
        with disk.reader() as get:
            for info, _ in pages:
                rec = verify_record(get(info.hash), ns.digest, info, specs, codecs, P)
                np.copyto(host, np.frombuffer(rec.payloads[0], dtype=np.uint8))
        results["read"].append(time.perf_counter() - t)
        disk.close()

    def plain(root: Path) -> None:
        f = root / "plain.bin"
        t = time.perf_counter()
        with open(f, "wb") as fh:
            for parts in recs:
                for p in parts:
                    fh.write(p)
        results["file_write"].append(time.perf_counter() - t)
        buf = bytearray(nbytes)
        t = time.perf_counter()
        with open(f, "rb", buffering=0) as fh:
            fh.readinto(buf)
        results["file_read"].append(time.perf_counter() - t)

    def floor(root: Path) -> None:
        # The layout's floor: the same payloads by bare pwritev into one file, same batches (no
        # CRC, no heads, no LMDB): what any tier that appends payloads with pwritev can reach.
        fd = os.open(root / "floor.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        t = time.perf_counter()
        off = 0
        for k in range(0, n, batch):
            bufs = [p for parts in recs[k:k + batch] for p in parts[1:]]
            off += os.pwritev(fd, bufs, off)
        results["floor_write"].append(time.perf_counter() - t)
        os.close(fd)

    root = Path(tempfile.mkdtemp(prefix="kvstrata-bench-", dir=os.environ.get("TMPDIR")))
    try:
        tier(root)                      # builds the record parts the others write (untimed run)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for v in results.values():
        v.clear()
    sides = [tier, plain, floor]
    for r in range(reps):
        root = Path(tempfile.mkdtemp(prefix="kvstrata-bench-", dir=os.environ.get("TMPDIR")))
        try:
            for side in sides[r % 3:] + sides[:r % 3]:
                side(root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    return dict(pages=n, nbytes=nbytes, page_bytes=per,
                **{k: nbytes / s / 1e9 for k, s in med.items()})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="write the markdown here too")
    ap.add_argument("--batch", type=int, default=256,
                    help="pages per transfer batch (TierManager's default)")
    ap.add_argument("--pages", type=int, default=None,
                    help="pages per timed call (default: one batch; more streams batches)")
    ap.add_argument("--disk-batch", type=int, default=64, help="records per disk tier batch")
    ap.add_argument("--chunks", default="8,26",
                    help="pipelined chunk sizes (pages) to time; the serialized variant (one "
                         "chunk per batch) is always timed too")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--disk-mb", type=int, default=256)
    ap.add_argument("--disk-reps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="small pages (smoke test)")
    ap.add_argument("--skip-disk", action="store_true")
    ap.add_argument("--skip-transfers", action="store_true")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)     # small copies: avoid OpenMP spin-waits on shared machines
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    L, H, D = geometry(args.tiny)
    lines: list[str] = []
    if not args.skip_transfers:
        lines = [f"### Tier transfers on {dev_name} ({device.type})", "",
                 f"Conditions: target group [{L}, 2, {H}, {P}, {D}] bf16 per page, batch of "
                 f"{args.batch} pages ({args.pages or args.batch} pages per timed call), "
                 f"pool/host/staging allocated once, median of {args.reps} runs "
                 f"({'CUDA events' if device.type == 'cuda' else 'perf_counter'}), torch "
                 f"{torch.__version__}.", ""]
        chunks = sorted({int(c) for c in args.chunks.split(",") if c} | {args.batch})
        res = [bench_transfer(device, c, args.batch, args.tiny, args.reps, k, args.pages)
               for c in ("identity", "nvfp4") for k in chunks]
        c_d2h, c_h2d = ceiling(device, res[0]["raw"], args.reps)
        lines += ["| path | codec | chunk | bytes/batch moved | ms | GB/s moved | bf16-equiv GB/s | vs ceiling | exact |",
                  "|---|---|---|---|---|---|---|---|---|",
                  f"| D2H ceiling (pinned copy_) | - | - | {res[0]['raw']} | {res[0]['raw'] / c_d2h / 1e6:.3f} "
                  f"| {c_d2h:.1f} | - | 100% | - |",
                  f"| H2D ceiling (pinned copy_) | - | - | {res[0]['raw']} | {res[0]['raw'] / c_h2d / 1e6:.3f} "
                  f"| {c_h2d:.1f} | - | 100% | - |"]
        for r in res:
            for way, ms, ceil in (("down (device->host)", r["ms_down"], c_d2h),
                                  ("up (host->device)", r["ms_up"], c_h2d)):
                gbs = r["moved"] / ms / 1e6
                eq = r["raw"] / ms / 1e6
                vs = f"{100 * gbs / ceil:.0f}%" if r["codec"] == "identity" else f"{eq / ceil:.2f}x"
                chunk = "serialized" if r["chunk"] >= r["batch"] else f"{r['chunk']} pages"
                lines.append(f"| {way} | {r['codec']} | {chunk} | {r['moved']} | {ms:.3f} | "
                             f"{gbs:.1f} | {eq:.1f} | {vs} | {r['exact']} |")
        lines += ["", "Goals: identity >= 90% of the ceiling; NVFP4 bf16-equivalent >= 3.2x the raw "
                  "ceiling (exact = the pages read back equal the codec's own round trip).", ""]
    if not args.skip_disk:
        d = bench_disk(args.disk_mb if not args.tiny else 8, args.tiny, args.disk_reps,
                       args.disk_batch)
        lines += [f"### Disk tier on the CPU ({platform.processor() or platform.machine()}, "
                  f"{os.cpu_count()} cores)", "",
                  f"Conditions: {d['pages']} identity records of {d['page_bytes']} B pages "
                  f"({d['nbytes'] / 2**20:.0f} MiB), batches of {args.disk_batch} (one pwritev of the "
                  f"payloads to a segment file + one LMDB transaction of the heads), no fsync on "
                  f"either side, median of {args.disk_reps} runs, lmdb "
                  f"{'.'.join(map(str, __import__('lmdb').version()))}.", "",
                  "| operation | GB/s | plain file GB/s | % of plain file |", "|---|---|---|---|",
                  f"| write (build record + CRC + pwritev + commit) | {d['write']:.2f} | {d['file_write']:.2f} "
                  f"| {100 * d['write'] / d['file_write']:.0f}% |",
                  f"| read (verify CRC + copy to host) | {d['read']:.2f} | {d['file_read']:.2f} "
                  f"| {100 * d['read'] / d['file_read']:.0f}% |",
                  f"| bare pwritev of the same payloads (floor) | {d['floor_write']:.2f} | "
                  f"{d['file_write']:.2f} | {100 * d['floor_write'] / d['file_write']:.0f}% |", "",
                  "Goal: >= 80% of the plain file in both directions.", ""]
    emit("\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
