"""``kvstrata inspect redis://HOST:PORT/DB[?prefix=NAME] [--list [N] | --page HASH | --verify] [--json]``.

Lists and verifies the page records of a remote tier (a Redis server or Cluster) like a disk
tier's: a summary (keys, memory, eviction policy, namespaces, groups and codecs), one row per
page, one page's header, or a check of every record (stored under its own hash and namespace,
hash link, CRCs, every group decodes). It only reads (``SCAN`` + ``GET``); the keys are
``<prefix>:<namespace digest>:<page hash>`` with the prefix ``kvstrata`` unless the URL says
``?prefix=NAME``. ``--verify`` exits with status 1 naming the bad pages.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter, defaultdict
from urllib.parse import parse_qs, urlsplit

from .inspect_output import (DAMAGED, OK, USAGE, bad_pages_table, error, groups_table,
                             one_page, page_prefix)

_BATCH = 64


def _split(url: str) -> tuple[str, str]:
    u = urlsplit(url)
    prefix = parse_qs(u.query).get("prefix", ["kvstrata"])[-1]
    return u._replace(query="").geturl(), prefix


def _records(tier):
    """``(rows, bad)``: rows ``(ns, hash, Record, bytes)`` of every parseable record."""
    from kvstrata.tiers.record import parse_record
    keys = list(tier.scan())
    rows, bad = [], []
    for i in range(0, len(keys), _BATCH):
        batch = keys[i:i + _BATCH]
        for (ns, h), val in zip(batch, tier.get_raw(batch)):
            if val is None:
                continue                    # evicted since the scan
            try:
                rows.append((ns, h, parse_record(val), len(val)))
            except Exception as e:  # a damaged record is reported, never fatal here
                bad.append({"hash": h.hex(), "namespace": ns.hex(), "error": str(e)})
    return rows, bad


def _summary(tier, rows, bad) -> dict:
    from kvstrata.dtypes import canonical_dtype
    groups: dict[str, dict] = defaultdict(lambda: {"codecs": Counter(), "raw": 0, "stored": 0})
    for _, _, rec, _ in rows:
        for g in rec.header["groups"]:
            s = groups[g["name"]]
            s["codecs"][f"{g['codec']} v{g['version']}"] += 1
            s["raw"] += math.prod(g["shape"]) * canonical_dtype(g["dtype"]).itemsize
            s["stored"] += g["nbytes"]
    return {**tier.server_info(), "prefix": tier.prefix, "pages": len(rows),
            "unreadable": len(bad), "record_bytes": sum(n for *_, n in rows),
            "namespaces": dict(Counter(ns.hex() for ns, *_ in rows)),
            "groups": {n: {"codecs": dict(s["codecs"]), "raw_bytes": s["raw"],
                           "stored_bytes": s["stored"],
                           "ratio": round(s["raw"] / s["stored"], 3) if s["stored"] else None}
                       for n, s in groups.items()}}


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from kvstrata.pagepool import format_bytes
    from kvstrata.tiers.record import check_stored
    from kvstrata.tiers.remote import RemoteTier, RemoteUnavailable, redact

    console = Console()
    if getattr(args, "repair", False):
        error("--repair rebuilds a disk tier's index; a remote tier has none (delete bad "
              "records with --verify's list)")
        return USAGE
    if args.list is not None and args.list < 0:
        error(f"--list takes a number of rows >= 1 (or nothing for all), got {args.list}")
        return USAGE
    page = page_prefix(args.page) if args.page is not None else None
    if args.page is not None and page is None:
        return USAGE
    url, prefix = _split(args.path)
    try:
        tier = RemoteTier(url, None, prefix=prefix)
    except (ValueError, RemoteUnavailable) as e:
        error(" ".join(str(e).split()))
        return USAGE
    try:
        rows, bad = _records(tier)
        if args.page:
            hits = [r for r in rows if r[1].hex().startswith(page)]
            if not one_page(hits, args.page, redact(url)):
                return USAGE
            ns, h, rec, n = hits[0]
            hd = rec.header
            doc = {"hash": h.hex(), "parent": hd["parent"].hex(), "namespace": ns.hex(),
                   "format_version": hd["v"], "created": hd.get("created"), "record_bytes": n,
                   "token_ids": hd["tokens"],
                   "groups": [{k: g[k] for k in ("name", "codec", "version", "dtype", "shape",
                                                 "nbytes", "checksum")} for g in hd["groups"]]}
            if args.json:
                print(json.dumps(doc))
                return OK
            t = Table(title=f"page {doc['hash']}", show_header=False)
            for k in ("parent", "namespace", "format_version", "created", "record_bytes"):
                t.add_row(k, str(doc[k]))
            t.add_row("token_ids", " ".join(map(str, doc["token_ids"])))
            for g in doc["groups"]:
                t.add_row(f"group {g['name']}", f"{g['codec']} v{g['version']} {g['dtype']} "
                          f"{g['shape']} {g['nbytes']} B crc {g['checksum']:#010x}")
            console.print(t)
            return OK
        if args.verify:
            failures = list(bad)
            for ns, h, rec, _ in rows:
                try:
                    check_stored(rec, h, ns)
                except Exception as e:
                    failures.append({"hash": h.hex(), "namespace": ns.hex(),
                                     "error": f"{type(e).__name__}: {e}"})
            doc = {"pages": len(rows) + len(bad), "bad": failures}
            if args.json:
                print(json.dumps(doc))
            elif failures:
                console.print(bad_pages_table(failures, doc["pages"]))
            else:
                console.print(f"all {doc['pages']} pages verify")
            return DAMAGED if failures else OK
        if args.list is not None:
            docs = [{"hash": h.hex(), "namespace": ns.hex()[:12], "created": r.header.get("created"),
                     "bytes": n, "codecs": ",".join(g["codec"] for g in r.header["groups"])}
                    for ns, h, r, n in sorted(rows, key=lambda r: r[2].header.get("created", 0))]
            if args.list > 0:
                docs = docs[:args.list]
            if args.json:
                print(json.dumps(docs))
                return OK
            t = Table(title=f"{len(docs)} pages, oldest written first")
            for c in ("hash", "namespace", "bytes", "codecs"):
                t.add_column(c, justify="right" if c == "bytes" else "left")
            for d in docs:
                t.add_row(d["hash"], d["namespace"], str(d["bytes"]), d["codecs"])
            console.print(t)
            return OK
        doc = _summary(tier, rows, bad)
    finally:
        tier.close()
    if args.json:
        print(json.dumps(doc))
        return OK
    kind = f"cluster of {doc['nodes']}" if doc["cluster"] else "standalone"
    t = Table(title=f"remote tier {doc['url']} ({kind})", show_header=False)
    t.add_row("pages", f"{doc['pages']}" + (f" ({doc['unreadable']} unreadable)" if bad else "")
              + f" under '{doc['prefix']}:', {format_bytes(doc['record_bytes'])}")
    t.add_row("server", f"{doc['keys']} keys, {format_bytes(doc['used_memory'])} used, maxmemory "
              f"{format_bytes(doc['maxmemory']) if doc['maxmemory'] else 'none'}, policy "
              f"{', '.join(doc['maxmemory_policy'])}")
    t.add_row("namespaces", ", ".join(f"{k[:12]}… ({v})" for k, v in doc["namespaces"].items())
              or "-")
    console.print(t)
    console.print(groups_table(doc["groups"]))
    return OK
