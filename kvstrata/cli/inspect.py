"""Inspect a disk tier offline: ``kvstrata inspect PATH [--list | --page HASH | --verify] [--json]``.

Opens the tier read-only (record heads from one LMDB snapshot, payloads from the segment files),
so it works while an engine keeps writing to it; a payload the writer moves or reclaims meanwhile
is followed to its new place or left out. ``--verify`` decodes every page with its codec and exits with status 1,
naming the bad pages, if any record is damaged or does not decode.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import Counter, defaultdict

HELP = "summarize, list, show or verify the pages of a disk tier"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", metavar="PATH",
                   help="directory of the disk tier, or a redis:// URL (kvstrata.cli.inspect_remote)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--list", action="store_true", help="one row per page, oldest access first")
    mode.add_argument("--page", metavar="HASH", help="header and token ids of one page (hex hash)")
    mode.add_argument("--verify", action="store_true",
                      help="check and decode every page; exit 1 if any is bad")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _scan(disk):
    """Parse every record of one snapshot: ``(order, rows, bad)``."""
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
    return out


def _page_doc(key: bytes, rec, size: int) -> dict:
    h = rec.header
    return {"hash": key.hex(), "parent": h["parent"].hex(), "namespace": h["ns"].hex(),
            "format_version": h["v"], "created": h.get("created"), "record_bytes": size,
            "token_ids": h["tokens"],
            "groups": [{k: g[k] for k in ("name", "codec", "version", "dtype", "shape", "nbytes",
                                          "checksum")} for g in h["groups"]]}


def run(args: argparse.Namespace) -> int:
    if args.path.startswith(("redis://", "rediss://")):
        from kvstrata.cli.inspect_remote import run as run_remote
        return run_remote(args)
    from rich.console import Console
    from rich.table import Table

    from kvstrata.pagepool import format_bytes
    from kvstrata.tiers import DiskTier

    console = Console()
    try:
        disk = DiskTier(args.path, readonly=True)
    except ValueError as e:
        console.print(f"[red]kvstrata inspect: {e}[/red]")
        return 2
    with disk:
        rows, bad = _scan(disk)
        if args.page:
            matches = [r for r in rows if r[0].hex().startswith(args.page.lower())]
            if len(matches) != 1:
                console.print(f"[red]{len(matches)} pages match {args.page!r}; give more hex digits[/red]"
                              if matches else f"[red]no page {args.page!r} in {args.path}[/red]")
                return 1
            doc = _page_doc(*matches[0])
            if args.json:
                print(json.dumps(doc))
                return 0
            t = Table(title=f"page {doc['hash']}", show_header=False)
            for k in ("parent", "namespace", "format_version", "created", "record_bytes"):
                t.add_row(k, str(doc[k]))
            t.add_row("token_ids", " ".join(map(str, doc["token_ids"])))
            for g in doc["groups"]:
                t.add_row(f"group {g['name']}", f"{g['codec']} v{g['version']} {g['dtype']} "
                          f"{g['shape']} {g['nbytes']} B crc {g['checksum']:#010x}")
            console.print(t)
            return 0
        if args.verify:
            failures = _verify(rows, bad)
            doc = {"pages": len(rows) + len(bad), "bad": failures}
            if args.json:
                print(json.dumps(doc))
            elif failures:
                t = Table(title=f"{len(failures)} bad pages of {doc['pages']}")
                t.add_column("hash")
                t.add_column("problem")
                for f in failures:
                    t.add_row(f["hash"], f["error"])
                console.print(t)
            else:
                console.print(f"all {doc['pages']} pages verify")
            return 1 if failures else 0
        if args.list:
            docs = [{"hash": k.hex(), "namespace": r.header["ns"].hex()[:12],
                     "created": r.header.get("created"), "bytes": n,
                     "codecs": ",".join(g["codec"] for g in r.header["groups"])}
                    for k, r, n in rows]
            if args.json:
                print(json.dumps(docs))
                return 0
            t = Table(title=f"{len(docs)} pages, least recently used first")
            for c in ("hash", "namespace", "age", "bytes", "codecs"):
                t.add_column(c, justify="right" if c in ("age", "bytes") else "left")
            now = time.time()
            for d in docs:
                t.add_row(d["hash"], d["namespace"], f"{now - (d['created'] or now):.0f} s",
                          str(d["bytes"]), d["codecs"])
            console.print(t)
            return 0
        doc = _summary(disk, rows, bad)
    if args.json:
        print(json.dumps(doc))
        return 0
    t = Table(title=f"disk tier {doc['path']}", show_header=False)
    t.add_row("pages", str(doc["pages"]) + (f" ({doc['unreadable']} unreadable)" if bad else ""))
    t.add_row("stored", f"{format_bytes(doc['stored_bytes'])} of {format_bytes(doc['capacity_bytes'])}"
              f" capacity (map {format_bytes(doc['map_size'])})")
    t.add_row("segments", f"{doc['segments']} files, {format_bytes(doc['segment_file_bytes'])}")
    t.add_row("namespaces", ", ".join(f"{k[:12]}… ({v})" for k, v in doc["namespaces"].items()) or "-")
    if doc["pages"]:
        t.add_row("age", f"{doc['newest_age_s']} s … {doc['oldest_age_s']} s")
    console.print(t)
    g = Table(title="groups")
    for c in ("group", "codec", "raw", "stored", "ratio"):
        g.add_column(c, justify="left" if c in ("group", "codec") else "right")
    for name, s in doc["groups"].items():
        g.add_row(name, ", ".join(s["codecs"]), format_bytes(s["raw_bytes"]),
                  format_bytes(s["stored_bytes"]), f"{s['ratio']:.2f}x" if s["ratio"] else "-")
    console.print(g)
    return 0
