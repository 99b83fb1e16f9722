"""Inspect a disk tier offline: ``kvstrata inspect PATH [--list [N] | --page HASH | --verify |
--repair] [--json]``.

Opens the tier read-only (the LMDB index from one snapshot, records from the segment files), so
it works while an engine keeps writing to it; a record the writer moves or reclaims meanwhile is
followed to its new place or left out. ``--verify`` also walks the whole index in a child process
and decodes every page with its codec. ``--repair`` opens the tier for writing (no engine may
hold it), rebuilds a damaged index from the segment files and removes records that do not verify.

Exit status: 0 fine; 1 damage found (a damaged index, bad pages; what is damaged is printed);
2 a usage error (no such tier, a bad argument, the tier busy with a writer). Errors go to stderr,
one line each.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
import time
from collections import Counter, defaultdict

from .inspect_output import (DAMAGED, OK, USAGE, bad_pages_table, error, groups_table,
                             one_page, page_prefix)

HELP = "summarize, list, show, verify or repair the pages of a disk tier"
PROGRESS_EVERY_S = 5.0          # without a terminal: one progress line on stderr this often


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", metavar="PATH",
                   help="directory of the disk tier, or a redis:// URL (kvstrata.cli.inspect_remote)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--list", nargs="?", type=int, const=0, default=None, metavar="N",
                      help="one row per page, least recently used first (at most N rows; "
                           "default: all)")
    mode.add_argument("--page", metavar="HASH", help="header and token ids of one page "
                      "(a unique prefix of its hex hash)")
    mode.add_argument("--verify", action="store_true",
                      help="walk the index, check and decode every page; exit 1 if any is bad")
    mode.add_argument("--repair", action="store_true",
                      help="rebuild a damaged index from the segment files and remove pages "
                           "that do not verify (no engine may have the tier open)")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")


def _date(t: float | None) -> str:
    if not t:
        return "-"
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


class _Progress:
    """``advance()`` per item: a rich bar on a terminal, else a line every PROGRESS_EVERY_S."""

    def __init__(self, what: str, total: int):
        from rich.console import Console
        from rich.progress import Progress
        self.what, self.total, self.done = what, total, 0
        self.console = Console(stderr=True)
        self.bar = None
        if self.console.is_terminal:
            self.bar = Progress(console=self.console, transient=True)
            self.task = self.bar.add_task(what, total=total)
            self.bar.start()
        self.last = time.monotonic()

    def advance(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.advance(self.task)
        elif time.monotonic() - self.last >= PROGRESS_EVERY_S:
            self.last = time.monotonic()
            print(f"kvstrata inspect: {self.what} {self.done}/{self.total}", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _scan(disk):
    """Parse every record of one snapshot: ``(rows, bad)``, rows least recently used first."""
    from kvstrata.tiers.record import parse_record
    order = {h: i for i, h in enumerate(disk.keys_by_age())}
    rows, bad = [], []
    for key, buf in disk.iter_records():
        try:
            rec = parse_record(buf)
        except Exception as e:  # a damaged record is reported, never fatal here
            bad.append({"hash": key.hex(), "error": str(e)})
            continue
        rows.append((key, rec, len(buf)))
    rows.sort(key=lambda r: order.get(r[0], -1))
    return rows, bad


def _itemsize(dtype: str) -> int:
    from kvstrata.dtypes import canonical_dtype
    return canonical_dtype(dtype).itemsize


def _summary(disk, rows, bad) -> dict:
    groups: dict[str, dict] = defaultdict(lambda: {"codecs": Counter(), "raw": 0, "stored": 0})
    namespaces = Counter()
    created = []
    for _, rec, _ in rows:
        namespaces[rec.header["ns"].hex()] += 1
        created.append(rec.header.get("created", 0.0))
        for g in rec.header["groups"]:
            s = groups[g["name"]]
            s["codecs"][f"{g['codec']} v{g['version']}"] += 1
            s["raw"] += math.prod(g["shape"]) * _itemsize(g["dtype"])
            s["stored"] += g["nbytes"]
    info = disk.info()
    now = time.time()
    return {
        "path": info["path"], "pages": len(rows), "unreadable": len(bad),
        "stored_bytes": info["stored_bytes"], "capacity_bytes": info["capacity_bytes"],
        "map_size": info["map_size"], "segments": info["segments"],
        "segment_file_bytes": info["segment_file_bytes"],
        "groups": {n: {"codecs": dict(s["codecs"]), "raw_bytes": s["raw"],
                       "stored_bytes": s["stored"],
                       "ratio": round(s["raw"] / s["stored"], 3) if s["stored"] else None}
                   for n, s in groups.items()},
        "namespaces": dict(namespaces),
        "oldest_age_s": round(now - min(created), 1) if created else None,
        "newest_age_s": round(now - max(created), 1) if created else None,
    }


def _verify(rows, bad) -> list[dict]:
    from kvstrata.codecs import get_codec
    from kvstrata.tiers.record import check_identity, check_payloads
    out = list(bad)
    progress = _Progress("verified", len(rows))
    try:
        for key, rec, _ in rows:
            try:
                if rec.page_hash != key:
                    raise ValueError("stored under another key than its hash")
                check_identity(rec, rec.header["ns"], None)
                check_payloads(rec)
                for g, enc in zip(rec.header["groups"], rec.encoded()):
                    page = get_codec(g["codec"]).decode(enc)
                    if tuple(page.shape) != tuple(g["shape"]):
                        raise ValueError(f"group {g['name']!r} decodes to {tuple(page.shape)}")
            except Exception as e:
                out.append({"hash": key.hex(), "error": f"{type(e).__name__}: {e}"})
            progress.advance()
    finally:
        progress.close()
    return out


def _page_doc(key: bytes, rec, size: int) -> dict:
    h = rec.header
    return {"hash": key.hex(), "parent": h["parent"].hex(), "namespace": h["ns"].hex(),
            "format_version": h["v"], "created": h.get("created"),
            "created_utc": _date(h.get("created")), "record_bytes": size,
            "token_ids": h["tokens"],
            "groups": [{k: g[k] for k in ("name", "codec", "version", "dtype", "shape", "nbytes",
                                          "checksum")} for g in h["groups"]]}


def _damage_doc(path: str, problem: str) -> dict:
    """What a damaged tier still holds: the records a rebuild would keep."""
    from kvstrata.tiers.rebuild import scan_all
    from kvstrata.tiers.segments import Segments
    entries, totals = scan_all(Segments(path, 1))
    return {"path": path, "damaged": problem, "recoverable_pages": len(entries),
            "recoverable_bytes": sum(sum(lens) for *_, lens in entries),
            "segments": totals["segments"], "segment_file_bytes": totals["segment_bytes"],
            "damaged_segment_stretches": totals["damaged"],
            "repair": f"kvstrata inspect {path} --repair (or open it with an engine)"}


def _print_damage(doc: dict, as_json: bool) -> int:
    from kvstrata.pagepool import format_bytes
    error(f"{doc['path']}: the index is damaged: {doc['damaged']}")
    if as_json:
        print(json.dumps(doc))
    else:
        print(f"index damaged: {doc['damaged']}\n"
              f"segment files: {doc['segments']} ({format_bytes(doc['segment_file_bytes'])}); "
              f"{doc['recoverable_pages']} pages ({format_bytes(doc['recoverable_bytes'])}) "
              f"verify and would be kept by a rebuild; "
              f"{doc['damaged_segment_stretches']} damaged stretches\n"
              f"repair: {doc['repair']}")
    return DAMAGED


def _open(path: str, as_json: bool):
    """The tier opened read-only, or the exit status after printing why it cannot be."""
    from kvstrata.tiers import DiskTier, TierDamaged
    try:
        return DiskTier(path, readonly=True)
    except TierDamaged as e:
        return _print_damage(_damage_doc(path, str(e).split(": ", 1)[-1]), as_json)
    except ValueError as e:
        error(str(e))
        return USAGE


def _cmd_page(disk, rows, args, console) -> int:
    from rich.table import Table
    prefix = page_prefix(args.page)
    if prefix is None:
        return USAGE
    matches = [r for r in rows if r[0].hex().startswith(prefix)]
    if not one_page(matches, args.page, args.path):
        return USAGE
    doc = _page_doc(*matches[0])
    if args.json:
        print(json.dumps(doc))
        return OK
    t = Table(title=f"page {doc['hash']}", show_header=False)
    for k in ("parent", "namespace", "format_version", "record_bytes"):
        t.add_row(k, str(doc[k]))
    t.add_row("created", doc["created_utc"])
    t.add_row("token_ids", " ".join(map(str, doc["token_ids"])))
    for g in doc["groups"]:
        t.add_row(f"group {g['name']}", f"{g['codec']} v{g['version']} {g['dtype']} "
                  f"{g['shape']} {g['nbytes']} B crc {g['checksum']:#010x}")
    console.print(t)
    return OK


def _cmd_verify(disk, rows, bad, args, console) -> int:
    index = disk.info()["index_damaged"] or disk.check()
    failures = _verify(rows, bad)
    doc = {"pages": len(rows) + len(bad), "bad": failures, "index": index or "ok"}
    if index:
        error(f"{args.path}: the index is damaged: {index}")
    if args.json:
        print(json.dumps(doc))
    elif failures:
        console.print(bad_pages_table(failures, doc["pages"]))
    elif not index:
        console.print(f"all {doc['pages']} pages verify; the index is sound")
    return DAMAGED if failures or index else OK


def _cmd_list(rows, args, console) -> int:
    from rich.table import Table
    if args.list < 0:
        error(f"--list takes a number of rows >= 1 (or nothing for all), got {args.list}")
        return USAGE
    shown = rows[:args.list] if args.list else rows
    docs = [{"hash": k.hex(), "namespace": r.header["ns"].hex()[:12],
             "created": r.header.get("created"), "bytes": n,
             "codecs": ",".join(g["codec"] for g in r.header["groups"])} for k, r, n in shown]
    if args.json:
        print(json.dumps(docs))
        return OK
    title = f"{len(docs)} of {len(rows)} pages" if len(docs) < len(rows) else f"{len(docs)} pages"
    t = Table(title=f"{title}, least recently used first")
    for c in ("hash", "namespace", "created", "bytes", "codecs"):
        t.add_column(c, justify="right" if c == "bytes" else "left")
    for d in docs:
        t.add_row(d["hash"], d["namespace"], _date(d["created"]), str(d["bytes"]), d["codecs"])
    console.print(t)
    return OK


def _cmd_summary(doc: dict, args, console) -> int:
    from rich.table import Table
    from kvstrata.pagepool import format_bytes
    if args.json:
        print(json.dumps(doc))
        return OK
    t = Table(title=f"disk tier {doc['path']}", show_header=False)
    t.add_row("pages", str(doc["pages"]) + (f" ({doc['unreadable']} unreadable)"
                                            if doc["unreadable"] else ""))
    t.add_row("stored", f"{format_bytes(doc['stored_bytes'])} of "
              f"{format_bytes(doc['capacity_bytes'])} capacity (map {format_bytes(doc['map_size'])})")
    t.add_row("segments", f"{doc['segments']} files, {format_bytes(doc['segment_file_bytes'])}")
    t.add_row("namespaces", ", ".join(f"{k[:12]}… ({v})" for k, v in doc["namespaces"].items()) or "-")
    if doc["pages"]:
        t.add_row("age", f"{doc['newest_age_s']} s … {doc['oldest_age_s']} s")
    console.print(t)
    console.print(groups_table(doc["groups"]))
    return OK


def _cmd_repair(args, console) -> int:
    """Open for writing, rebuild a damaged index, delete pages that do not verify."""
    import os
    from kvstrata.tiers import DiskTier, TierDamaged
    if not os.path.isdir(args.path) or not (os.path.exists(os.path.join(args.path, "data.mdb"))
                                            or os.path.isdir(os.path.join(args.path, "segments"))):
        error(f"{args.path!r} is not a kvstrata disk tier")
        return USAGE
    capacity = None
    try:        # keep the capacity the engine configured, or (index unreadable) every page
        with DiskTier(args.path, readonly=True) as r:
            capacity = r.capacity_bytes
    except TierDamaged:
        capacity = max(1 << 20, sum(e.stat().st_size for e in os.scandir(
            os.path.join(args.path, "segments")) if e.is_file()))
    except ValueError:
        pass
    try:
        disk = DiskTier(args.path, capacity_bytes=capacity, check=True)
    except ValueError as e:
        error(str(e))
        return USAGE
    with disk:      # the open checked the index (walk included) and rebuilt it if damaged
        problem = disk.repaired
        rows, bad = _scan(disk)
        failures = _verify(rows, bad)
        removed = disk.delete([bytes.fromhex(f["hash"]) for f in failures])
        doc = {"path": args.path, "index": "rebuilt" if problem else "sound",
               "index_problem": problem, "moved_aside": bool(disk.counters()["moved_aside"]),
               "pages": len(disk), "removed_bad_pages": removed}
    if args.json:
        print(json.dumps(doc))
    else:
        console.print(f"index {doc['index']}{' (' + problem + ')' if problem else ''}; "
                      f"{doc['pages']} pages kept, {removed} bad pages removed"
                      + ("; the damaged files were moved aside" if doc["moved_aside"] else ""))
    return OK


def run(args: argparse.Namespace) -> int:
    if args.path.startswith(("redis://", "rediss://")):
        from kvstrata.cli.inspect_remote import run as run_remote
        return run_remote(args)
    from rich.console import Console

    console = Console()
    if args.repair:
        return _cmd_repair(args, console)
    disk = _open(args.path, args.json)
    if isinstance(disk, int):
        return disk
    with disk:
        rows, bad = _scan(disk)
        damaged = disk.info()["index_damaged"]
        if damaged and not args.verify:     # met while reading: what was read is incomplete
            return _print_damage(_damage_doc(args.path, damaged), args.json)
        if args.page is not None:
            return _cmd_page(disk, rows, args, console)
        if args.verify:
            return _cmd_verify(disk, rows, bad, args, console)
        if args.list is not None:
            return _cmd_list(rows, args, console)
        doc = _summary(disk, rows, bad)
    return _cmd_summary(doc, args, console)
