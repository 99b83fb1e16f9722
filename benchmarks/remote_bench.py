"""Remote tier throughput and lookup latency against a local redis-server (loopback).

    python benchmarks/remote_bench.py --out /tmp/remote.md            # ~2 min on 2 CPU cores

Pages are Qwen3-8B-shaped with the DFlash drafter's group: target [36, 2, 8, 16, 128] bf16
(2.25 MiB) + draft [5, 2, 8, 16, 128] bf16 (0.31 MiB) = 2.56 MiB raw per page, content from
``synthetic_kv("key")``. A redis-server is started on a free loopback port (no persistence,
maxmemory 4 GB, allkeys-lru) and stopped at the end.

- put: ``build_record`` (CRC-32 of every payload and the header) + ``RemoteTier.put`` (one SET
  pipeline per ``--batch`` pages); baseline: redis-py pipelined SET of the same record bytes
  (joined beforehand, outside the timing), same batches, same connection settings.
- get: ``RemoteTier.get`` + ``verify_record`` (header checks, hash link, payload CRCs) + a copy of
  every payload into a host buffer (what a promotion into a host slot does); baseline: redis-py
  pipelined GET of the same keys, same batches.
- NVFP4 target pages (``nvfp4`` target, ``lossless`` draft: what the engine stores by default):
  the same measures; bf16-equivalent GB/s = raw page bytes / time, against the raw baseline.
- lookup: ``TierManager.lookup_prefix`` of a 32k-token prefix (2048 pages of 16 tokens, all in
  the remote tier, host empty): one EXISTS pipeline; and ``RemoteTier.exists`` alone.

Each measure is the median of ``--reps`` runs; tier and baseline take turns within a run (the
server is flushed between them), so both see the same machine state.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstrata.codecs import get_codec, synthetic_kv  # noqa: E402
from kvstrata.pagepool import KVGroupSpec, Namespace, PagePool  # noqa: E402
from kvstrata.testing.redis import RedisServer  # noqa: E402
from kvstrata.testing.tiers import chain  # noqa: E402
from kvstrata.tiers import TierManager  # noqa: E402
from kvstrata.tiers.record import build_record, verify_record  # noqa: E402
from kvstrata.tiers.remote import RemoteTier  # noqa: E402

from _report import emit  # noqa: E402  (benchmarks/ is on sys.path when a script here runs)

P = 16


def groups(target_codec: str, draft_codec: str) -> list[KVGroupSpec]:
    return [KVGroupSpec("target", 36, 8, 128, torch.bfloat16, target_codec),
            KVGroupSpec("draft", 5, 8, 128, torch.bfloat16, draft_codec)]


def encoded_pages(gs: list[KVGroupSpec]) -> list:
    """One encoded page per group (real codec output of synthetic K/V), reused by every record."""
    out = []
    for g in gs:
        page = synthetic_kv("key", 1, g.num_layers, g.num_kv_heads, P, g.head_dim, g.dtype)[0]
        out.append(get_codec(g.codec).encode(page).to_host())
    return out


def bench(url: str, codecs: tuple[str, str], pages: int, batch: int, reps: int) -> dict:
    import redis
    gs = groups(*codecs)
    ns = Namespace("bench", gs, P)
    infos = chain(ns, pages, P)
    encs = encoded_pages(gs)
    payloads = [e.payload.numpy().data for e in encs]
    names = [g.name for g in gs]
    raw = sum(g.bytes_per_page(P) for g in gs)
    joined = [b"".join(build_record(ns.digest, i, names, encs, payloads)) for i in infos]
    # the arena holds one pipeline of `batch` records, as the baseline's pipelines
    tier = RemoteTier(url, ns.digest, put_batch_bytes=batch * max(len(j) for j in joined),
                      get_batch=batch, socket_timeout=30.0)
    client = redis.Redis.from_url(url, socket_timeout=30.0)
    specs, cds = gs, [get_codec(g.codec) for g in gs]
    rec_bytes = sum(len(j) for j in joined)
    keys = [tier.key(i.hash) for i in infos]
    sink = np.empty(max(len(p) for p in payloads), dtype=np.uint8)

    def tier_put():
        for k in range(0, pages, batch):
            items = [(i.hash, build_record(ns.digest, i, names, encs, payloads))
                     for i in infos[k:k + batch]]
            if not all(tier.put(items)):
                raise RuntimeError("remote put failed")

    def base_put():
        for k in range(0, pages, batch):
            pipe = client.pipeline(transaction=False)
            for key, v in zip(keys[k:k + batch], joined[k:k + batch]):
                pipe.set(key, v)
            pipe.execute()

    def tier_get():
        for k in range(0, pages, batch):
            chunk = infos[k:k + batch]
            for info, parts in zip(chunk, tier.get([i.hash for i in chunk])):
                rec = verify_record(parts, ns.digest, info, specs, cds, P)
                for p in rec.payloads:       # into a host slot, as a promotion does
                    np.copyto(sink[:len(p)], np.frombuffer(p, dtype=np.uint8))

    def base_get():
        for k in range(0, pages, batch):
            pipe = client.pipeline(transaction=False)
            for key in keys[k:k + batch]:
                pipe.get(key)
            if any(v is None for v in pipe.execute()):
                raise RuntimeError("baseline get missed")

    t = {n: [] for n in ("tier_put", "base_put", "tier_get", "base_get")}
    for rep in range(reps + 1):                  # rep 0 warms up
        order = [("base", base_put, base_get), ("tier", tier_put, tier_get)]
        if rep % 2:
            order.reverse()
        for name, put, get in order:
            client.flushall()
            t0 = time.perf_counter()
            put()
            t1 = time.perf_counter()
            get()
            t2 = time.perf_counter()
            if rep:
                t[f"{name}_put"].append(t1 - t0)
                t[f"{name}_get"].append(t2 - t1)
    client.flushall()
    tier.close()
    client.close()
    med = {k: statistics.median(v) for k, v in t.items()}
    return dict(codecs=codecs, pages=pages, batch=batch, raw=raw * pages, stored=rec_bytes,
                **{k: v for k, v in med.items()})


def lookup(url: str, reps: int, tokens: int = 32768) -> dict:
    gs = groups("nvfp4", "lossless")
    ns = Namespace("bench", gs, P)
    infos = chain(ns, tokens // P, P)
    tier = RemoteTier(url, ns.digest)
    # The values do not matter to a lookup (EXISTS); small ones keep the server's memory low.
    if not all(tier.put([(i.hash, [b"x"]) for i in infos])):
        raise RuntimeError("remote put failed")
    hashes = [i.hash for i in infos]
    pool = PagePool(gs, 1, P)
    tiers = TierManager(pool, ns, host_bytes=TierManager.slot_bytes_for(pool), remote=tier)
    ex, lk = [], []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        n1 = sum(tier.exists(hashes))
        t1 = time.perf_counter()
        n2 = tiers.lookup_prefix(ns, hashes)
        t2 = time.perf_counter()
        if n1 != len(hashes) or n2 != len(hashes):
            raise RuntimeError(f"lookup found {n1} / {n2} of {len(hashes)} pages")
        ex.append(t1 - t0)
        lk.append(t2 - t1)
    tiers.close()
    return dict(pages=len(hashes), exists_ms=statistics.median(ex[1:]) * 1e3,
                lookup_ms=statistics.median(lk[1:]) * 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    lines = []
    with RedisServer(config={"maxmemory": "4gb"}) as srv:
        import redis
        ver = redis.Redis.from_url(srv.url).info("server")["redis_version"]
        raw = bench(srv.url, ("identity", "identity"), args.pages, args.batch, args.reps)
        fp4 = bench(srv.url, ("nvfp4", "lossless"), args.pages, args.batch, args.reps)
        lk = lookup(srv.url, args.reps)
    gb = lambda n, s: n / s / 1e9  # noqa: E731
    lines.append(f"Conditions: {platform.machine()} {platform.processor() or ''}, "
                 f"{torch.get_num_threads()} torch thread, redis-server {ver} on loopback "
                 f"(no persistence), redis-py {redis.__version__}, {args.pages} pages per run, "
                 f"pipelines of {args.batch} pages, median of {args.reps} runs.")
    lines.append("")
    lines.append("| pages | side | put GB/s | get GB/s | put % of redis-py | get % of redis-py |")
    lines.append("|---|---|---|---|---|---|")
    for name, r in (("raw (identity)", raw), ("nvfp4 + lossless", fp4)):
        n = r["stored"]
        lines.append(f"| {name} | redis-py SET/GET | {gb(n, r['base_put']):.2f} | "
                     f"{gb(n, r['base_get']):.2f} | | |")
        lines.append(f"| {name} | remote tier | {gb(n, r['tier_put']):.2f} | "
                     f"{gb(n, r['tier_get']):.2f} | {100 * r['base_put'] / r['tier_put']:.0f}% | "
                     f"{100 * r['base_get'] / r['tier_get']:.0f}% |")
    lines.append("")
    lines.append(f"bf16-equivalent (raw page bytes / time) with nvfp4 target + lossless draft: put "
                 f"{gb(fp4['raw'], fp4['tier_put']):.2f} GB/s = "
                 f"{raw['base_put'] / fp4['tier_put'] * fp4['raw'] / raw['raw']:.2f}x the raw "
                 f"redis-py SET rate, get {gb(fp4['raw'], fp4['tier_get']):.2f} GB/s = "
                 f"{raw['base_get'] / fp4['tier_get'] * fp4['raw'] / raw['raw']:.2f}x the raw "
                 f"redis-py GET rate; stored {fp4['stored'] / fp4['pages'] / 2**20:.3f} MiB per "
                 f"page vs {raw['stored'] / raw['pages'] / 2**20:.3f} MiB raw records.")
    lines.append("")
    lines.append(f"Lookup of a 32k-token prefix ({lk['pages']} pages, all remote, host empty): "
                 f"TierManager.lookup_prefix {lk['lookup_ms']:.1f} ms, RemoteTier.exists alone "
                 f"{lk['exists_ms']:.1f} ms (one pipeline of {lk['pages']} EXISTS).")
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
