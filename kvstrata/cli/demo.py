"""Agent-style multi-turn workload over the page pool.

Several conversations grow turn by turn (each turn resends the conversation so far plus new text);
the device pool is deliberately smaller than the working set, so prefix pages are reused while they
stay cached and evicted (LRU, tail first) when they do not. Every token's K/V is a deterministic
function of (prefix hash chain, position), written into the pool through the manager's slots, and
every reused page is checked against a recomputation: a wrong reuse fails the demo.
"""

from __future__ import annotations

import argparse
import time

HELP = "run the main demo workload"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--pages", type=int, default=160, help="device pool size in pages")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from kvstrata.pagepool import KVCacheManager, KVGroupSpec, Namespace, PagePool

    console = Console()
    groups = [KVGroupSpec("target", 4, 2, 64, torch.bfloat16, "nvfp4"),
              KVGroupSpec("draft", 1, 2, 64, torch.bfloat16, "lossless")]
    ns = Namespace("demo-target", groups, args.page_size, drafter="demo-drafter")
    pool = PagePool(groups, args.pages, args.page_size)
    mgr = KVCacheManager(pool, ns)
    gen = torch.Generator().manual_seed(args.seed)

    def kv_for(tokens: torch.Tensor, positions: torch.Tensor, g: KVGroupSpec) -> torch.Tensor:
        # [n, L, 2, H, D]: a cheap deterministic function of each token and its position
        base = (tokens * 1009 + positions * 7919).double()
        idx = torch.arange(g.num_layers * 2 * g.num_kv_heads * g.head_dim, dtype=torch.float64)
        return torch.sin(base[:, None] * 1e-3 + idx[None, :]).to(g.dtype).view(
            -1, g.num_layers, 2, g.num_kv_heads, g.head_dim)

    def write(seq_id, tokens: list[int], start: int) -> None:
        P = args.page_size
        slots = torch.tensor(mgr.slots(seq_id, start, len(tokens)), dtype=torch.long)
        toks = torch.tensor(tokens[start:])
        pos = torch.arange(start, len(tokens))
        for g in groups:
            kv = kv_for(toks, pos, g)                       # [n, L, 2, H, D]
            view = pool.kv[g.name]                          # [N, L, 2, H, P, D]
            view[slots // P, :, :, :, slots % P, :] = kv

    def verify(seq_id, tokens: list[int], n: int) -> None:
        P = args.page_size
        slots = torch.tensor(mgr.slots(seq_id, 0, n), dtype=torch.long)
        for g in groups:
            want = kv_for(torch.tensor(tokens[:n]), torch.arange(n), g)
            got = pool.kv[g.name][slots // P, :, :, :, slots % P, :]
            if not torch.equal(got, want):
                raise SystemExit(f"demo: reused KV of {seq_id} differs from recomputation")

    convs = [torch.randint(0, 50000, (int(torch.randint(40, 200, (1,), generator=gen)),),
                           generator=gen).tolist() for _ in range(args.conversations)]
    rows = []
    t0 = time.perf_counter()
    for turn in range(args.turns):
        reused = total = 0
        for c in range(args.conversations):
            prompt = convs[c]
            seq = mgr.admit((c, turn), prompt)
            verify((c, turn), prompt, seq.num_cached_tokens)
            mgr.reserve((c, turn), len(prompt))
            write((c, turn), prompt, seq.num_cached_tokens)
            mgr.commit((c, turn), prompt[seq.num_cached_tokens:])
            answer = torch.randint(0, 50000, (int(torch.randint(20, 80, (1,), generator=gen)),),
                                   generator=gen).tolist()
            mgr.reserve((c, turn), len(prompt) + len(answer))
            write((c, turn), prompt + answer, len(prompt))
            mgr.commit((c, turn), answer)
            mgr.free((c, turn))
            pool.check_invariants()
            reused += seq.num_cached_tokens
            total += len(prompt)
            user = torch.randint(0, 50000, (int(torch.randint(10, 60, (1,), generator=gen)),),
                                 generator=gen).tolist()
            convs[c] = prompt + answer + user
        rows.append((turn + 1, total, reused, pool.num_evictions))
    dt = time.perf_counter() - t0

    table = Table(title=f"kvstrata demo: {args.conversations} conversations, pool {pool}")
    for col in ("turn", "prompt tokens", "reused from device", "reuse %", "evictions (cum.)"):
        table.add_column(col, justify="right")
    for turn, total, reused, ev in rows:
        table.add_row(str(turn), str(total), str(reused), f"{100 * reused / total:.1f}", str(ev))
    console.print(table)
    console.print(f"every reused page verified bit-exact against recomputation; {dt:.2f} s")
    return 0
