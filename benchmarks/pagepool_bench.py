"""CPU benchmark of the page pool: allocation/free rate and 128k-token prefix hash + lookup time.

    python benchmarks/pagepool_bench.py [--out FILE]

Prints a markdown table (median of repeated runs) with the conditions.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from kvstrata.pagepool import KVCacheManager, KVGroupSpec, Namespace, PagePool, page_hashes

from _report import emit  # benchmarks/ is on sys.path when a script here runs


def median_time(fn, repeat: int) -> float:
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()

    P = 16
    groups = [KVGroupSpec("target", 1, 1, 16, "bf16", "nvfp4"),
              KVGroupSpec("draft", 1, 1, 16, "bf16", "lossless")]
    ns = Namespace("bench-target", groups, P, drafter="bench-drafter")
    n_pages = 16384
    pool = PagePool(groups, n_pages, P)        # tiny groups: the bookkeeping is what is measured
    mgr = KVCacheManager(pool, ns)

    # 1) raw pool allocate + release, 64 pages a call
    def alloc_free():
        for _ in range(64):
            pages = pool.allocate(64)
            pool.release(pages)
    t = median_time(alloc_free, args.repeat)
    pool_rate = 64 * 64 / t

    # 2) manager admit -> reserve -> commit (hashing) -> free of 2k-token sequences
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 150000, (2048,), generator=gen).tolist() for _ in range(8)]
    counter = iter(range(10**9))

    def seq_cycle():
        for pr in prompts:
            sid = next(counter)
            mgr.admit(sid, pr, cache_salt=str(sid))   # distinct salt: always a miss
            mgr.reserve(sid, len(pr))
            mgr.commit(sid, pr)
            mgr.free(sid)
    t = median_time(seq_cycle, args.repeat)
    seq_pages_rate = 8 * 128 / t

    # 3) hash + lookup a 128k-token prompt (8192 pages of 16), fully cached
    long_prompt = torch.randint(0, 150000, (131072,), generator=gen).tolist()
    big = PagePool(groups, 8200, P)
    bmgr = KVCacheManager(big, ns)
    bmgr.admit("warm", long_prompt)
    bmgr.reserve("warm", len(long_prompt))
    bmgr.commit("warm", long_prompt)
    bmgr.free("warm")
    t_hash = median_time(lambda: page_hashes(ns, long_prompt), args.repeat)
    hit = bmgr.lookup(long_prompt)
    assert hit.num_tokens == 131072
    t_lookup = median_time(lambda: bmgr.lookup(long_prompt), args.repeat)

    def admit_free():
        bmgr.admit("x", long_prompt + [1])
        bmgr.free("x")
    t_admit = median_time(admit_free, args.repeat)

    lines = [
        "| measurement | result |",
        "|---|---|",
        f"| pool allocate+release, 64 pages per call | {pool_rate / 1e6:.2f} M pages/s |",
        f"| manager admit+reserve+commit(hash)+free, 2k-token misses | {seq_pages_rate / 1e3:.0f} k pages/s |",
        f"| hash a 128k-token prompt (8192 pages of 16) | {t_hash * 1e3:.2f} ms |",
        f"| lookup (hash + index walk) of a fully cached 128k-token prompt | {t_lookup * 1e3:.2f} ms |",
        f"| admit (lookup + take refs on 8192 pages) + free of it | {t_admit * 1e3:.2f} ms |",
    ]
    cond = (f"Conditions: CPU `{platform.processor() or platform.machine()}`, Python "
            f"{platform.python_version()}, torch {torch.__version__}, single thread, median of "
            f"{args.repeat} runs; BLAKE2b-128 over little-endian int64 token ids; page size {P}.")
    emit("\n".join(lines) + "\n\n" + cond, args.out)


if __name__ == "__main__":
    main()
