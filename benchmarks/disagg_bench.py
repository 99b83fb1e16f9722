"""1P1D: page handoff bandwidth between the two workers, and AL 1P1D vs aggregated.

    python benchmarks/disagg_bench.py --device cuda --out /tmp/out.md  # 2 H200s, ~3 min
    python benchmarks/disagg_bench.py --device cpu --out /tmp/out.md   # Gloo, ~1 min

Two processes (rank 0 = context worker, rank 1 = generation worker; ``cuda:rank`` on CUDA, NCCL
there, Gloo on the CPU), started once; both parts run in them.

Transfer: synthetic pools of Qwen3-8B + DFlash-b16 shaped groups (target [36, 2, 8, 16, 128] bf16,
draft [5, 2, 8, 16, 128] bf16: 2.56 MiB per page), one sequence of ``--tokens`` tokens handed over
with ``send_sequence``/``recv_sequence`` (raw pages, no prefix on the receiver: a fresh cache salt
each rep). Time = the receiver's, from waiting for the header to the commit (negotiation, payload,
copy into its pool pages, hashing; CRC32 on the Gloo path). Ceilings measured in the same run:
one ``dist.send`` of the same bytes as a single tensor (link), and on CUDA a GPU0 -> GPU1
``copy_`` of the same bytes in the context process while the other waits (device-to-device).
Medians of ``--reps``.

AL: the shipped trained pair (``kvstrata-tiny-py``), ``--prompts`` held-out prompts of
``--prompt-len`` tokens, greedy, ``--max-tokens`` new tokens. Aggregated = one ``LLM.generate`` on
the generation worker's device; 1P1D = ContextWorker -> GenerationWorker. AL = committed tokens
per target step over every step of every request. Paged drafter backend (the goal: 1P1D/aggregated
>= 0.98) and the arena baseline (its context never moves, so it drops).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

# NVLink multicast must stay off on the benchmark machine (NVLS / symmetric-memory multicast).
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PAIR = "kvstrata-tiny-py"


def _groups():
    from kvstrata.pagepool import KVGroupSpec
    return [KVGroupSpec("target", 36, 8, 128, torch.bfloat16, "nvfp4"),
            KVGroupSpec("draft", 5, 8, 128, torch.bfloat16, "lossless")]


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _link_configs(a, n_pages):
    """``(name, chunk_pages, depth)`` of the handoffs timed side by side."""
    cfgs = [("pipelined", a.chunk_pages, a.depth),
            ("serialized (1 chunk, depth 1)", n_pages, 1)]
    for spec in a.sweep or ():
        c, d = (int(x) for x in spec.split("x"))
        cfgs.append((f"chunks of {c} pages, depth {d}", c, d))
    return cfgs


def _transfer(rank, dev, a, ch):
    from kvstrata.pagepool import KVCacheManager, Namespace, PagePool, PoolView
    from kvstrata.runtime.disagg import recv_sequence, send_sequence
    from kvstrata.tiers.peer import PeerLink
    P = 16
    n_pages = -(-a.tokens // P)
    pool = PagePool(_groups(), 2 * n_pages + 2, P, dev)
    mgr = KVCacheManager(pool, Namespace("bench-target", tuple(_groups()), P, drafter="bench-d"))
    g = torch.Generator(device=dev).manual_seed(rank)
    for t in pool.kv.values():
        t.normal_(generator=g)
    tokens = [i % 251 for i in range(a.tokens)]
    nbytes = n_pages * pool.bytes_per_page
    cfgs = _link_configs(a, n_pages)
    links = [{False: PeerLink(PoolView.of(pool), mgr.namespace, chunk_pages=c, depth=d)}
             for _, c, d in cfgs]
    times: list[list[float]] = [[] for _ in cfgs]
    link, d2d = [], []
    buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    # Side by side: every rep times each handoff variant and the link, so load on the shared
    # machine hits them alike. Rep 0 warms up (NCCL connect, allocator, page faults).
    for rep in range(a.reps + 1):
        # each rep in another order: no variant always runs first (right after the link's send)
        for j in range(len(links)):
            i = (j + rep) % len(links)
            lk = links[i]
            sid = f"r{rep}-{i}"
            dist.barrier()
            if rank == 0:
                mgr.admit(sid, tokens, cache_salt=sid)
                mgr.reserve(sid, len(tokens))
                mgr.commit(sid, tokens)
                send_sequence(ch, mgr, sid, links=lk)
            else:
                t0 = time.perf_counter()
                recv_sequence(ch, mgr, seq_id=sid, links=lk)
                _sync(dev)     # the copy into pool pages may still run on the GPU
                if rep:
                    times[i].append(time.perf_counter() - t0)
            mgr.free(sid)
        # Link ceiling: one tensor of the same bytes.
        dist.barrier()
        _sync(dev)
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
        else:
            dist.recv(buf, 0)
        _sync(dev)
        if rep and rank == 1:
            link.append(time.perf_counter() - t0)
    # Device-to-device ceiling: GPU0 -> GPU1 copy_ in the context process, the other idle.
    if dev.type == "cuda" and rank == 0:
        other = torch.device("cuda:1")
        dst = torch.empty(nbytes, dtype=torch.uint8, device=other)
        for rep in range(a.reps + 1):
            _sync(dev), _sync(other)
            t0 = time.perf_counter()
            dst.copy_(buf)
            _sync(dev), _sync(other)
            if rep:
                d2d.append(time.perf_counter() - t0)
        del dst
    dist.barrier()
    chunk = links[0][False].chunk
    # where the pipelined handoff's time goes on this side (per handoff, warm-up included)
    spent = {k: v / (a.reps + 1) for k, v in links[0][False].timings.items() if v}
    del pool, mgr, buf, links
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    med = (lambda xs: statistics.median(xs) if xs else None)
    return {"bytes": nbytes, "pages": n_pages, "link_s": med(link), "d2d_s": med(d2d),
            "spent": spent,
            "handoffs": [(name.replace("pipelined", f"pipelined (chunks of {chunk} pages, "
                                                    f"depth {d})"), med(ts))
                         for (name, _, d), ts in zip(cfgs, times)],
            # per-rep ratio handoff / link of the first variant: the noise on a shared machine
            "ratio_range": (min(l / t for l, t in zip(link, times[0])) if link else None,
                            max(l / t for l, t in zip(link, times[0])) if link else None)}


def _al(outs):
    steps = [x for o in outs for x in o.acceptance_lengths]
    return sum(steps) / len(steps) if steps else 0.0


def _serve_al(rank, dev, a, ch):
    from kvstrata.runtime import LLM, CacheConfig, SamplingParams
    from kvstrata.runtime.disagg.workers import ContextWorker, GenerationWorker
    from kvstrata.assets.corpus import heldout_prompts
    prompts = heldout_prompts(a.prompts, a.prompt_len, seed=0)
    sp = SamplingParams(max_tokens=a.max_tokens)
    out = {}
    for backend in ("paged", "arena"):
        cache = CacheConfig(max_seq_len=a.prompt_len + a.max_tokens + 32,
                            max_batch_size=a.prompts, drafter_backend=backend)
        llm = LLM(PAIR, PAIR, cache=cache, device=dev)
        dist.barrier()
        if rank == 0:
            w = ContextWorker(llm, ch)
            w.connect()
            w.serve(prompts, sp)
            continue
        w = GenerationWorker(llm, ch)
        w.connect()
        t0 = time.perf_counter()
        dis = w.serve()
        t_dis = time.perf_counter() - t0
        agg_llm = LLM(PAIR, PAIR, cache=cache, device=dev)
        agg_llm.generate(prompts[:1], SamplingParams(max_tokens=4), cache_salt="warmup")
        t0 = time.perf_counter()
        agg = agg_llm.generate(prompts, sp)
        t_agg = time.perf_counter() - t0
        out[backend] = {
            "al_1p1d": _al(dis), "al_agg": _al(agg), "errors": w.errors,
            "same_tokens": sum(x.token_ids == y.token_ids for x, y in zip(dis, agg)),
            "same_al_steps": sum(x.acceptance_lengths == y.acceptance_lengths
                                 for x, y in zip(dis, agg)),
            "n": len(prompts), "s_1p1d": t_dis, "s_agg": t_agg,
            "handoff_ms": 1e3 * statistics.median(t.seconds for t in w.transfers)}
    return out


def _worker(rank, a, port, q):
    try:
        cuda = a.device == "cuda"
        dev = torch.device(f"cuda:{rank}" if cuda else "cpu")
        if cuda:
            torch.cuda.set_device(dev)
        else:
            torch.set_num_threads(1)
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=2,
                                init_method=f"tcp://127.0.0.1:{port}",
                                timeout=datetime.timedelta(seconds=300))
        from kvstrata.runtime.disagg import PageChannel
        ch = PageChannel(1 - rank, device=dev)
        res = {"rank": rank}
        if not a.skip_transfer:
            res["transfer"] = _transfer(rank, dev, a, ch)
        if not a.skip_al:
            res["al"] = _serve_al(rank, dev, a, ch)
        q.put(res)
    except Exception:  # noqa: BLE001
        q.put({"rank": rank, "error": traceback.format_exc()})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _report(a, r0, r1) -> str:
    dev = torch.cuda.get_device_name(0) if a.device == "cuda" else platform.processor() or "cpu"
    lines = [f"# disagg_bench ({a.device}: {dev}, {'NCCL' if a.device == 'cuda' else 'Gloo'}, "
             f"torch {torch.__version__})", ""]
    if "transfer" in r1:
        t0, t1 = r0["transfer"], r1["transfer"]
        b = t1["bytes"]
        gb = (lambda s: b / s / 1e9 if s else float("nan"))
        lines += [f"Handoff of one {a.tokens}-token sequence: {t1['pages']} pages x 2.56 MiB "
                  f"(Qwen3-8B target 36L + DFlash draft 5L, 8 KV heads, d=128, bf16, page 16) = "
                  f"{b / 2**20:.0f} MiB raw; median of {a.reps}.", "",
                  "| path | ms | GB/s | % of link | % of GPU0->GPU1 copy |",
                  "|---|---|---|---|---|"]
        rows = [(f"handoff, {name}", secs) for name, secs in t1["handoffs"]]
        rows += [("link: one dist.send of the same bytes", t1["link_s"]),
                ("GPU0 -> GPU1 copy_ (device-to-device)", t0["d2d_s"])]
        for name, s in rows:
            if s is None:
                continue
            pl = 100 * t1["link_s"] / s if t1["link_s"] else float("nan")
            pd = 100 * t0["d2d_s"] / s if t0.get("d2d_s") else float("nan")
            lines.append(f"| {name} | {1e3 * s:.2f} | {gb(s):.1f} | {pl:.0f}% | "
                         + (f"{pd:.0f}% |" if t0.get("d2d_s") else "n/a |"))
        spent = ", ".join(f"{k[:-2]} {1e3 * v:.1f}" for k, v in
                          {**t0["spent"], **t1["spent"]}.items())
        lines.append(f"\nPipelined handoff, ms per handoff (sender: gather, wait_send; "
                     f"receiver: wait_recv, verify, scatter): {spent}")
        lo, hi = t1["ratio_range"]
        if lo is not None:
            lines.append(f"\nPipelined handoff / link, per rep: {100 * lo:.0f}% .. {100 * hi:.0f}%")
        lines.append("")
    if "al" in r1:
        lines += [f"AL, trained pair {PAIR}, {a.prompts} held-out prompts x {a.prompt_len} "
                  f"tokens, greedy, {a.max_tokens} new tokens:", "",
                  "| drafter backend | AL aggregated | AL 1P1D | ratio | same tokens | "
                  "same per-step AL | handoff ms (median) |", "|---|---|---|---|---|---|---|"]
        for backend, x in r1["al"].items():
            lines.append(f"| {backend} | {x['al_agg']:.3f} | {x['al_1p1d']:.3f} | "
                         f"{x['al_1p1d'] / x['al_agg']:.3f} | {x['same_tokens']}/{x['n']} | "
                         f"{x['same_al_steps']}/{x['n']} | {x['handoff_ms']:.2f} |")
            if x["errors"]:
                lines.append(f"| errors | {x['errors']} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=("cuda", "cpu"))
    ap.add_argument("--out", default=None, help="write the markdown here too")
    ap.add_argument("--tokens", type=int, default=None,
                    help="tokens of the handed-over sequence (default 8192 cuda, 1024 cpu)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--chunk-pages", type=int, default=None,
                    help="pages per chunk of the pipelined handoff (default: PeerLink's)")
    ap.add_argument("--depth", type=int, default=3, help="chunks in flight (pipelined)")
    ap.add_argument("--sweep", nargs="*", metavar="CHUNKxDEPTH",
                    help="more handoff variants timed side by side, e.g. 4x2 16x3")
    ap.add_argument("--skip-transfer", action="store_true")
    ap.add_argument("--skip-al", action="store_true")
    a = ap.parse_args()
    cuda = a.device == "cuda"
    if cuda and torch.cuda.device_count() < 2:
        raise SystemExit(f"--device cuda needs 2 GPUs, {torch.cuda.device_count()} visible")
    for k, gpu, cpu in (("tokens", 8192, 1024), ("reps", 10, 5), ("prompts", 16, 8),
                        ("prompt_len", 128, 64), ("max_tokens", 64, 32)):
        if getattr(a, k) is None:
            setattr(a, k, gpu if cuda else cpu)
    from kvstrata.runtime.disagg.launcher import collect_reports
    from kvstrata.testing.redis import free_port
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(r, a, port, q)) for r in (0, 1)]
    t0 = time.time()
    for p in procs:
        p.start()
    res = {r["rank"]: r for r in collect_reports(q, procs)}
    errs = [r["error"] for r in res.values() if "error" in r]
    if errs or len(res) < 2:
        print("\n".join(errs) or "a worker died without reporting", file=sys.stderr)
        return 1
    md = _report(a, res[0], res[1]) + f"\n(total {time.time() - t0:.0f} s)\n"
    print(md)
    if a.out:
        Path(a.out).write_text(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
