"""Random page traffic through device -> host -> disk and back, checked against a shadow digest.

Requests are drawn from a population of prompts (a skewed draw, so some come back often and
others only after their pages have sunk to the disk); each one is admitted (prefix hits promote
pages from the tiers), its reused pages are compared with a shadow digest of what was written,
the rest is written with content derived from the page hash, committed and freed. A small device
pool and host tier keep pages moving; the disk tier is closed and reopened every
``--restart-every`` seconds. Any wrong page, checksum failure, header mismatch or a page the tiers
promised but did not deliver makes the command exit 1.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import tempfile
import time

HELP = "drive random page traffic through the tiers and check every page read"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=10.0, help="how long to run")
    p.add_argument("--dir", default=None, help="disk tier directory (default: a temporary one)")
    p.add_argument("--device", default="cpu", help="device of the page pool (cpu, cuda)")
    p.add_argument("--pages", type=int, default=64, help="device pool pages")
    p.add_argument("--host-pages", type=int, default=48, help="host tier slots")
    p.add_argument("--disk-mb", type=int, default=64, help="disk tier capacity (MiB)")
    p.add_argument("--prompts", type=int, default=200, help="distinct prompts in the population")
    p.add_argument("--codecs", default="nvfp4,lossless",
                   help="codec of the target and draft groups, comma-separated")
    p.add_argument("--restart-every", type=float, default=3.0,
                   help="reopen the disk tier this often (seconds; 0: never)")
    p.add_argument("--write-through", action="store_true",
                   help="also write every page to host and disk as soon as it is hashed")
    p.add_argument("--seed", type=int, default=0, help="seed of the request draw")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (1 avoids spin-waiting on small copies)")


class _Shadow:
    """What every page must read back as: per group, digests of the acceptable contents."""

    def __init__(self, groups, page_size, device):
        import torch
        from kvstrata.codecs import get_codec
        self.torch = torch
        self.groups, self.P, self.device = groups, page_size, device
        self.codecs = [get_codec(g.codec) for g in groups]
        self.digests: dict[bytes, list[set[bytes]]] = {}

    def digest(self, t) -> bytes:
        raw = t.contiguous().cpu().view(-1).view(self.torch.uint8)
        return hashlib.blake2b(raw.numpy().data, digest_size=16).digest()

    def content(self, h: bytes, g):
        gen = self.torch.Generator().manual_seed(int.from_bytes(h[:8], "little") & 0x7FFFFFFF)
        return self.torch.randn(g.page_shape(self.P), generator=gen).to(g.dtype)

    def write(self, h: bytes, page_id: int, pool) -> None:
        want = []
        for g, c in zip(self.groups, self.codecs):
            x = self.content(h, g)
            pool.kv[g.name][page_id] = x.to(self.device)
            ok = {self.digest(x)}
            if not c.lossless:      # a lossy page reads back as exactly the codec's round trip
                ok.add(self.digest(c.decode(c.encode(x))))
            want.append(ok)
        self.digests.setdefault(h, want)

    def check(self, h: bytes, page_id: int, pool) -> bool:
        want = self.digests.get(h)
        return want is not None and all(
            self.digest(pool.kv[g.name][page_id]) in ok for g, ok in zip(self.groups, want))


def run(args: argparse.Namespace) -> int:
    import random

    import torch
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
    from rich.table import Table

    from kvstrata.pagepool import KVCacheManager, KVGroupSpec, Namespace, PagePool, page_hashes
    from kvstrata.tiers import DiskTier, TierManager

    from kvstrata.codecs import available_codecs
    from kvstrata.devices import resolve_device

    if not args.seconds > 0:
        raise ValueError(f"--seconds must be positive, got {args.seconds:g}")
    for flag in ("pages", "host_pages", "disk_mb", "prompts", "threads"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got "
                             f"{getattr(args, flag)}")
    codecs = args.codecs.split(",")
    if len(codecs) != 2:
        raise ValueError(f"--codecs takes two names (target,draft), got {args.codecs!r}")
    unknown = [c for c in codecs if c not in available_codecs()]
    if unknown:
        raise ValueError(f"--codecs: unknown codec {unknown[0]!r}; known: "
                         f"{', '.join(available_codecs())}")
    device = resolve_device(args.device)
    if args.dir is not None:
        if os.path.exists(args.dir) and not os.path.isdir(args.dir):
            raise ValueError(f"--dir {args.dir!r} is not a directory")
        try:
            os.makedirs(args.dir, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--dir {args.dir!r}: cannot create it: {e.strerror or e}") from None
    torch.set_num_threads(args.threads)
    console = Console()
    P = 16
    groups = [KVGroupSpec("target", 4, 2, 64, torch.bfloat16, codecs[0]),
              KVGroupSpec("draft", 1, 2, 64, torch.bfloat16, codecs[1])]
    ns = Namespace("stress-target", groups, P, drafter="stress-drafter")
    pool = PagePool(groups, args.pages, P, device)
    tmp = None
    path = args.dir
    if path is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvstrata-stress-")
        path = tmp.name
    disk_bytes = args.disk_mb << 20

    def open_tiers() -> TierManager:
        disk = DiskTier(path, map_size=4 * disk_bytes, capacity_bytes=disk_bytes)
        return TierManager(pool, ns, host_bytes=args.host_pages * TierManager.slot_bytes_for(pool),
                           disk=disk, write_through=args.write_through)

    tiers = open_tiers()
    mgr = KVCacheManager(pool, ns, tiers=tiers)
    shadow = _Shadow(groups, P, pool.device)
    rng = random.Random(args.seed)
    max_pages = max(2, min(12, args.pages // 2))
    population = [[rng.randrange(32000) for _ in range(rng.randrange(P, max_pages * P))]
                  for _ in range(args.prompts)]
    totals = {"requests": 0, "pages_checked": 0, "wrong": 0, "broken_promises": 0, "restarts": 0}
    wrong: list[str] = []
    moved = {k: 0 for k in ("d2h_bytes", "h2d_bytes", "host_to_disk_bytes", "disk_to_host_bytes")}

    def harvest(t: TierManager) -> dict:
        st = t.stats()
        for k in moved:
            moved[k] += st[k]
        return st

    errors = {"checksum_failures": 0, "mismatches": 0}
    t0 = time.perf_counter()
    last_restart = t0
    with Progress(TextColumn("{task.description}"), BarColumn(), TimeRemainingColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task("stress", total=args.seconds)
        while (now := time.perf_counter()) - t0 < args.seconds:
            i = min(int(rng.expovariate(1 / (args.prompts / 6))), args.prompts - 1)
            prompt = population[i]
            sid = totals["requests"]
            hashes = page_hashes(ns, prompt)
            promised = mgr.lookup(prompt[:len(prompt) - 1]).num_tokens // P
            seq = mgr.admit(sid, prompt)
            k = seq.num_cached_tokens // P
            if k < promised:
                totals["broken_promises"] += 1
            for j in range(k):
                totals["pages_checked"] += 1
                if not shadow.check(hashes[j], seq.page_ids[j], pool):
                    totals["wrong"] += 1
                    wrong.append(hashes[j].hex())
            mgr.reserve(sid, len(prompt))
            for j in range(k, len(seq.page_ids)):
                if j < len(hashes):
                    shadow.write(hashes[j], seq.page_ids[j], pool)
            mgr.commit(sid, prompt[seq.num_cached_tokens:])
            mgr.free(sid)
            totals["requests"] += 1
            if args.restart_every and now - last_restart > args.restart_every:
                st = harvest(tiers)
                for e in errors:
                    errors[e] += st[e]
                tiers.close()
                tiers = open_tiers()
                mgr.tiers = tiers
                totals["restarts"] += 1
                last_restart = now
            if totals["requests"] % 16 == 0:
                progress.update(task, completed=now - t0,
                                description=f"{totals['requests']} requests, "
                                            f"{totals['pages_checked']} pages checked")
    elapsed = time.perf_counter() - t0
    st = harvest(tiers)
    for e in errors:
        errors[e] += st[e]
    tiers.close()
    if tmp is not None:
        tmp.cleanup()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    table = Table(title=f"kvstrata stress: {elapsed:.1f} s on {pool.device}, codecs {args.codecs}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, val in totals.items():
        table.add_row(key, str(val))
    for key, val in errors.items():
        table.add_row(key, str(val))
    for key, val in moved.items():
        table.add_row(f"{key.removesuffix('_bytes')} MB/s", f"{val / elapsed / 1e6:.1f}")
    table.add_row("requests/s", f"{totals['requests'] / elapsed:.0f}")
    table.add_row("peak RSS", f"{peak_rss / 2**20:.0f} MiB")
    console.print(table)
    bad = totals["wrong"] + totals["broken_promises"] + sum(errors.values())
    if bad:
        console.print(f"[red]FAILED: {totals['wrong']} wrong pages, {totals['broken_promises']} "
                      f"broken promises, {errors}; first wrong: {wrong[:5]}[/red]")
        return 1
    if totals["pages_checked"] == 0:
        console.print("[red]FAILED: no page was ever reused; the run checked nothing[/red]")
        return 1
    console.print(f"OK: {totals['pages_checked']} reused pages verified, none lost or wrong")
    return 0
