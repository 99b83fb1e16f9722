"""Runner benchmark (issue 13): engine steps against the read floor measured in the same run.

Qwen3-8B-shaped random bf16 target (36 layers) and DFlash-b16-shaped drafter (5 layers), pool
of page size 16, identity codecs. Sequences are admitted with random committed context (random
K/V in the pool) and stepped exactly as the engine steps them: reserve, ``ModelRunner.execute``
(stage, draft, verify, greedy acceptance, draft context write, one device->host copy), commit.

- ``step`` rows: host wall time per step over ``--steps`` steps (the runner waits for its one
  copy each step, so the wall time is the step's time), CUDA graphs on and off.
- ``verify``/``draft`` rows: device time of the captured verify / draft graph alone (CUDA
  events, median of replays).
- floor: bytes a step must read / the device-to-device copy rate (bytes read + written per
  second, measured first): target weights without the embedding table (only the step's rows of
  it are read), plus for a speculative step the drafter's weights and the LM head again (the
  draft logits), plus the K/V of every context token of every sequence (both groups). The
  verify graph's own floor also counts what the draft context write reads (the drafter's
  ``fc``, its norm and every layer's k/v products); the draft graph's leaves ``fc`` out.

    python benchmarks/runner_bench.py --out $OUT/runner.md
"""

from __future__ import annotations

import argparse
import atexit
import gc
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_bench import PRESETS, build_models  # noqa: E402

from kvstrata.runtime import LLM, CacheConfig, RunnerConfig, SamplingParams  # noqa: E402
from kvstrata.runtime.runner import StepItem  # noqa: E402
from kvstrata.runtime.verify_width import WidthPolicy  # noqa: E402

GREEDY = SamplingParams(max_tokens=1 << 20)


def copy_rate() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        b.copy_(a)
    torch.cuda.synchronize()
    bw = 2 * a.numel() * 20 / (time.perf_counter() - t)
    del a, b
    return bw


def matmul_rate() -> float:
    """bf16 matrix-product rate (FLOP/s) of an 8192^3 product on random data, mean of 10."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn_like(a)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    rate = 2 * 8192 ** 3 * 10 / (time.perf_counter() - t)
    del a, b
    return rate


def nbytes(m, skip=()) -> int:
    return sum(p.numel() * p.element_size() for n, p in m.named_parameters()
               if not any(n.startswith(s) for s in skip))


def context_write_bytes(drafter) -> tuple[int, int]:
    """Drafter bytes the verify graph reads to write the draft context of the verified rows
    (``DFlashDrafter.write_context``: ``fc``, ``hidden_norm``, each layer's k/v products and
    k-norm), and the part of those that the draft graph never reads (``fc``,
    ``hidden_norm``)."""
    only = nbytes(drafter.fc) + nbytes(drafter.hidden_norm)
    kv = sum(nbytes(l.self_attn.k_proj) + nbytes(l.self_attn.v_proj)
             + nbytes(l.self_attn.k_norm) for l in drafter.layers)
    return only + kv, only


class Bench:
    def __init__(self, llm: LLM, batch: int, ctx: int, tag: str):
        self.llm, self.B = llm, llm.block_size
        V = llm.target.config.vocab_size
        self.keys, self.start, self.tok = [], {}, {}
        g = torch.Generator().manual_seed(ctx + batch)
        for i in range(batch):
            k = (tag, batch, ctx, i)
            toks = torch.randint(0, V - 1, (ctx,), generator=g).tolist()
            llm.mgr.admit(k, toks, cache_salt=f"{tag}-{batch}-{ctx}-{i}")
            llm.mgr.reserve(k, ctx)
            llm.mgr.commit(k, toks)
            self.keys.append(k)
            self.start[k], self.tok[k] = ctx, toks[-1]

    def items(self):
        out = []
        for k in self.keys:
            self.llm.mgr.reserve(k, self.start[k] + self.B)
            out.append(StepItem(k, self.start[k], self.B, [self.tok[k]], True, GREEDY))
        return out

    def step(self):
        produced = self.llm.runner.execute(self.items())
        self.commit(produced)
        return produced

    def commit(self, produced: list[list[int]]) -> None:
        """Commit each sequence's produced tokens as the engine does."""
        for k, new in zip(self.keys, produced):
            commit = ([self.tok[k]] + new)[:len(new)]
            self.llm.mgr.commit(k, commit)
            self.start[k] += len(commit)
            self.tok[k] = new[-1]

    def step_ms(self, n: int) -> float:
        self.step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            self.step()
        return (time.perf_counter() - t) / n * 1e3

    def overlapped_ms(self, n: int) -> float:
        """Steps as the engine overlaps them: step N + 1 submitted from step N's output on the
        device (pages reserved two blocks ahead) before step N's tokens are collected and
        committed."""
        run, B, keys = self.llm.runner, self.B, self.keys
        rows, lim = list(range(len(keys))), [self.llm.max_seq_len] * len(keys)

        def one(h):
            for k in keys:
                self.llm.mgr.reserve(k, self.start[k] + 2 * B)
            nxt = run.submit_next(h, rows, keys, lim)
            self.commit(run.collect(h))
            return nxt

        h = one(run.submit(self.items()))
        torch.cuda.synchronize()
        # From an idle device: n steps submitted, the last one collected inside the window.
        t = time.perf_counter()
        for _ in range(n):
            h = one(h)
        self.commit(run.collect(h))
        dt = time.perf_counter() - t
        return dt / n * 1e3

    def graph_ms(self, name: str, reps: int, width: int | None = None) -> float:
        run = self.llm.runner
        items = self.items()
        run._stage(items, len(items))
        return replay_ms(run.graphs[(name, len(items), width or run.widths[0])], reps)

    def close(self):
        for k in self.keys:
            self.llm.mgr.free(k)


def replay_ms(g: torch.cuda.CUDAGraph, reps: int) -> float:
    """Device time of one replay of ``g`` (CUDA events), median of ``reps`` after two."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    times = []
    for _ in range(reps + 2):
        ev[0].record()
        g.replay()
        ev[1].record()
        ev[1].synchronize()
        times.append(ev[0].elapsed_time(ev[1]))
    return statistics.median(times[2:])


def _graph_us(fn, layers: int, reps: int = 20) -> float:
    """Per-layer device time of ``fn`` (all layers) captured in one graph, median of replays."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return replay_ms(g, reps) * 1e3 / layers


def decode_attention_b1(ctx: int, bw: float, layers: int = 36, grid: int = 34) -> dict:
    """Batch-1 decode attention over ``layers`` layers of ``ctx`` tokens (8 KV heads, GQA 4,
    d 128, bf16), captured in a graph as the runner's decode graph runs it (``grid`` split
    programs, the split length read from device memory: ``ctx`` spread over them in multiples
    of 32 tokens): per-layer device time with split + merge launches and with the fused
    single-launch merge for several merge chunks (``RED_CHUNK`` splits per load), against
    bytes / copy rate."""
    import dataclasses
    from kvstrata.kernels import attention_triton as at
    from kvstrata.kernels.attention_plan import plan_attention
    pages = ctx // 16
    kv = torch.randn((pages, layers, 2, 8, 16, 128), dtype=torch.bfloat16, device="cuda")
    bt = torch.arange(pages, dtype=torch.int32, device="cuda")[None]
    per = -(-(-(-ctx // grid)) // 32) * 32
    meta = dataclasses.replace(
        plan_attention(bt, [ctx], [1], page_size=16, num_kv_heads=8, num_splits=grid),
        tokens_per_split=per, split_tokens=torch.tensor([per], device="cuda"))
    q = torch.randn((1, 32, 128), dtype=torch.bfloat16, device="cuda")
    out = {"splits": meta.num_splits, "tokens_per_split": per, "tiles": {}}

    def us(cfg, kv_layer):
        def fn():
            for layer in range(layers):
                cache, lay = kv_layer(layer)
                at.paged_attention_triton(q, cache, lay, meta, sm_scale=0.088, config=cfg)
        return _graph_us(fn, layers)

    pool = lambda layer: (kv, layer)  # noqa: E731 - the pool's page-major layout
    for name, cfg in (("split_merge_us", dict(FUSED_REDUCE=False)),
                      ("fused_us", dict(FUSED_REDUCE=True)),
                      ("fused8_us", dict(FUSED_REDUCE=True, RED_CHUNK=8)),
                      ("fused32_us", dict(FUSED_REDUCE=True, RED_CHUNK=32))):
        out[name] = us(cfg, pool)
    for block_n, stages, warps in itertools.product((32, 64), (2, 3, 4), (4, 8)):
        out["tiles"][f"{block_n}/{stages}/{warps}"] = us(
            dict(FUSED_REDUCE=True, BLOCK_N=block_n, num_stages=stages, num_warps=warps), pool)
    # The same bytes with each layer's pages in a tensor of its own (a page's K/V of one layer
    # is then 64 KB from the next page's, not num_layers x 64 KB): what the pool's page-major
    # layout costs the decode kernel.
    kv = None   # freed before the per-layer copies
    kvs = [torch.randn((pages, 1, 2, 8, 16, 128), dtype=torch.bfloat16, device="cuda")
           for _ in range(layers)]
    out["layer_major_us"] = us(dict(FUSED_REDUCE=True), lambda layer: (kvs[layer], 0))
    out["floor_us"] = ctx * 8 * 128 * 2 * 2 / bw * 1e6
    kvs = None
    return out


def split_sweep(ctx: int, q_len: int, bw: float, layers: int = 36, align: int = 128
                ) -> list[dict]:
    """Batch-1 causal attention of ``q_len`` queries (decode 1, verify 16) over ``ctx`` tokens,
    36 layers in one graph, per layer: every split count (``tokens_per_split = ctx / splits``)
    x KV tile (BLOCK_N) x pipeline stages x grid as the runner builds it (64 split programs,
    the step's split length read from device memory, the idle ones exit) or exactly
    ``splits`` wide. Split lengths are rounded up to ``align`` tokens (a multiple of 32)."""
    import dataclasses
    from kvstrata.kernels import attention_triton as at
    from kvstrata.kernels.attention_plan import plan_attention
    pages = ctx // 16 + 1
    kv = torch.randn((pages, layers, 2, 8, 16, 128), dtype=torch.bfloat16, device="cuda")
    bt = torch.arange(pages, dtype=torch.int32, device="cuda")[None]
    q = torch.randn((q_len, 32, 128), dtype=torch.bfloat16, device="cuda")
    floor = ctx * 8 * 128 * 2 * 2 / bw * 1e6
    rows = []
    for splits in (4, 8, 16, 32, 64):
        per = -(-ctx // splits)
        per = -(-per // align) * align
        for block_n, stages, grid in itertools.product((32, 64), (2, 3), ("exact", "runner")):
            base = plan_attention(bt, [ctx], [q_len], page_size=16, num_kv_heads=8,
                                  num_splits=splits if grid == "exact" else 64)
            dev = (torch.tensor([per], dtype=torch.int64, device="cuda") if grid == "runner"
                   else None)
            meta = dataclasses.replace(base, tokens_per_split=per, split_tokens=dev)
            cfg = dict(BLOCK_N=block_n, num_stages=stages)

            def fn():
                for layer in range(layers):
                    at.paged_attention_triton(q, kv, layer, meta, sm_scale=0.088, config=cfg)
            us = _graph_us(fn, layers)
            rows.append(dict(ctx=ctx, q=q_len, splits=splits, tokens_per_split=per,
                             block_n=block_n, stages=stages, grid=grid, us=us, floor_us=floor))
            print(f"sweep ctx {ctx} q {q_len} splits {splits:2d} ({per:5d} tok) BLOCK_N "
                  f"{block_n} stages {stages} grid {grid:6s}: {us:6.1f} us/layer, x floor "
                  f"{us / floor:.2f}", flush=True)
    return rows


def verify_b1_sweep(ctx: int, bw: float, layers: int = 36, q_len: int = 16) -> list[dict]:
    """Batch-1 verify attention (``q_len`` queries over ``ctx`` tokens), 36 layers in one graph
    in the runner's grid (64 split programs, the split length read from device memory), per
    layer: query tokens per program (``BLOCK_Q``; the default takes all 16 in one program) x
    the split merge in the same launch (``FUSED_REDUCE``: the last split program of each q block
    merges its rows) or as a second launch x split length x KV tile."""
    import dataclasses
    from kvstrata.kernels import attention_triton as at
    from kvstrata.kernels.attention_plan import plan_attention
    pages = -(-(ctx + q_len) // 16)
    kv = torch.randn((pages, layers, 2, 8, 16, 128), dtype=torch.bfloat16, device="cuda")
    bt = torch.arange(pages, dtype=torch.int32, device="cuda")[None]
    q = torch.randn((q_len, 32, 128), dtype=torch.bfloat16, device="cuda")
    floor = ctx * 8 * 128 * 2 * 2 / bw * 1e6
    base = plan_attention(bt, [ctx + q_len], [q_len], page_size=16, num_kv_heads=8,
                          num_splits=64)
    ref = None
    rows = []
    for per, block_q, fused, block_n in itertools.product((128, 256, 512), (16, 8, 4),
                                                          (False, True), (32, 64)):
        if -(-(ctx + q_len) // per) > 64:
            continue
        dev = torch.tensor([per], dtype=torch.int64, device="cuda")
        meta = dataclasses.replace(base, tokens_per_split=per, split_tokens=dev)
        cfg = dict(BLOCK_Q=block_q, FUSED_REDUCE=fused, BLOCK_N=block_n)
        out = at.paged_attention_triton(q, kv, 0, meta, sm_scale=0.088, config=cfg)
        ref = out if ref is None else ref
        err = (out.float() - ref.float()).abs().max().item()

        def fn():
            for layer in range(layers):
                at.paged_attention_triton(q, kv, layer, meta, sm_scale=0.088, config=cfg)
        us = _graph_us(fn, layers)
        rows.append(dict(ctx=ctx, tokens_per_split=per, block_q=block_q, fused=fused,
                         block_n=block_n, us=us, floor_us=floor, max_diff=err))
        print(f"verify b1 ctx {ctx} split {per:4d} BLOCK_Q {block_q:2d} fused {fused:d} "
              f"BLOCK_N {block_n}: {us:6.1f} us/layer (x floor {us / floor:.2f}, max diff "
              f"{err:.1e})", flush=True)
    return rows


def batch_attn_sweep(b: int, ctx: int, bw: float, q_len: int = 16, layers: int = 36,
                     max_seq_len: int = 8704) -> list[dict]:
    """Verify attention of ``b`` sequences (``q_len`` queries each over ``ctx`` tokens), 36
    layers in one graph, as the runner's graph runs it (the split length read from device
    memory, spread over the grid's splits), per layer, for split counts x KV tile x register
    cap, against the runner's own choice (``RunnerConfig.min_split_tokens`` policy over
    ``max_seq_len``) and bytes / copy rate."""
    import dataclasses
    from kvstrata.kernels import attention_triton as at
    from kvstrata.kernels.attention_plan import DEFAULT_SPLIT_POLICY, choose_num_splits, \
        plan_attention
    from kvstrata.runtime.config import MIN_SPLIT_TOKENS
    pages = -(-(ctx + q_len) // 16)
    kv = torch.randn((b * pages, layers, 2, 8, 16, 128), dtype=torch.bfloat16, device="cuda")
    bt = torch.arange(b * pages, dtype=torch.int32, device="cuda").view(b, pages)
    q = torch.randn((b * q_len, 32, 128), dtype=torch.bfloat16, device="cuda")
    floor = b * ctx * 8 * 128 * 2 * 2 / bw * 1e6
    pol = dataclasses.replace(DEFAULT_SPLIT_POLICY, min_tokens=MIN_SPLIT_TOKENS)
    chosen = choose_num_splits(b, max_seq_len, num_kv_heads=8, num_q_blocks=1, policy=pol,
                               max_query_len=q_len)
    rows = []
    for splits in sorted({1, 2, 3, 4, 6, 8, chosen}):
        per = -(-(ctx + q_len) // splits)
        per = -(-per // 32) * 32
        base = plan_attention(bt, [ctx + q_len] * b, [q_len] * b, page_size=16,
                              num_kv_heads=8, num_splits=splits)
        dev = torch.tensor([per], dtype=torch.int64, device="cuda")
        meta = dataclasses.replace(base, tokens_per_split=per, split_tokens=dev)
        for block_n, cap in itertools.product((32, 64), (None, 128)):
            cfg = dict(BLOCK_N=block_n, maxnreg=cap)

            def fn():
                for layer in range(layers):
                    at.paged_attention_triton(q, kv, layer, meta, sm_scale=0.088, config=cfg)
            us = _graph_us(fn, layers)
            rows.append(dict(batch=b, ctx=ctx, q=q_len, splits=splits, chosen=chosen,
                             block_n=block_n, maxnreg=cap, us=us, floor_us=floor))
            print(f"batch sweep b{b} ctx {ctx} splits {splits} (runner: {chosen}) BLOCK_N "
                  f"{block_n} maxnreg {cap}: {us:6.1f} us/layer, x floor {us / floor:.2f}",
                  flush=True)
        def_us = _graph_us(lambda: [at.paged_attention_triton(q, kv, layer, meta, sm_scale=0.088)
                                    for layer in range(layers)], layers)
        rows.append(dict(batch=b, ctx=ctx, q=q_len, splits=splits, chosen=chosen,
                         block_n="default", maxnreg="default", us=def_us, floor_us=floor))
        print(f"batch sweep b{b} ctx {ctx} splits {splits}: kernel_config default "
              f"{def_us:6.1f} us/layer", flush=True)
    return rows


def shipped_e2e(lines: list[str], res: dict, rounds: int = 2) -> None:
    """Tokens/s of the shipped trained pair, speculative vs plain, graphs on (overlapped steps
    on and off) and off; ``rounds`` rounds of every setting, alternating, in this process."""
    from kvstrata.assets.corpus import heldout_prompts
    lines += ["", "| shipped pair | batch | graphs | overlap | round | new tokens | tokens/s | AL "
              "| graph / decode / general steps (both runs) |", "|---" * 9 + "|"]
    # (graphs, overlap, pinned verify width: None = the adaptive widths)
    settings = [(True, True, None), (True, True, "block"), (True, False, None),
                (False, True, None)]
    for b in (1, 16):
        prompts = heldout_prompts(b, 256, seed=0)
        sp = SamplingParams(max_tokens=256)
        for rnd in range(rounds):
            for mode in ("plain", "speculative"):
                for graphs, overlap, pin in settings:
                    if pin and mode == "plain":
                        continue
                    cache = CacheConfig(page_size=16, max_seq_len=1024, max_batch_size=b,
                                        target_codec="identity", draft_codec="identity")
                    llm = LLM("kvstrata-tiny-py", "kvstrata-tiny-py" if mode != "plain" else None,
                              cache, device="cuda",
                              runner=RunnerConfig(cuda_graphs=graphs, overlap=overlap))
                    # The same workload once untimed: every kernel shape it meets (prefill
                    # chunks, shortened last blocks) is compiled before the timed run.
                    if pin:
                        pin_width(llm, llm.block_size)
                    llm.generate(prompts, sp, cache_salt="warm")
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    outs = llm.generate(prompts, sp, cache_salt=f"{mode}-{graphs}-{overlap}")
                    dt = time.perf_counter() - t
                    n = sum(len(o.token_ids) for o in outs)
                    als = [a for o in outs for a in o.acceptance_lengths]
                    al = sum(als) / len(als)
                    st = llm.runner.stats()
                    res.setdefault("e2e", []).append(dict(mode=mode, batch=b, graphs=graphs,
                                                          overlap=overlap, round=rnd, tokens=n,
                                                          tok_s=n / dt, al=al, pinned=bool(pin),
                                                          **st))
                    g = ("on" if graphs else "off") + (f", verify-{llm.block_size}" if pin
                                                       else "")
                    if mode != "plain":
                        print(f"  verify widths by batch {st.get('verify_width_by_batch')}, "
                              f"draft acceptance by position {st.get('draft_acceptance')}",
                              flush=True)
                    lines.append(f"| {mode} | {b} | {g} | "
                                 f"{'on' if overlap else 'off'} | {rnd + 1} | {n} | "
                                 f"{n / dt:.0f} | {al:.2f} | {st['graph_steps']} / "
                                 f"{st['decode_steps']} / {st['general_steps']} |")
                    print(lines[-1], flush=True)
                    del llm


def pin_width(llm: LLM, width: int) -> None:
    """Every step of ``llm`` at this verify width (a captured one)."""
    llm.runner.width_policy = WidthPolicy(llm.runner.B, (width,))


def make_llm(target, drafter, batch, max_ctx, graphs=True) -> LLM:
    B = drafter.cfg.block_size if drafter is not None else 1
    cache = CacheConfig(page_size=16, max_seq_len=max_ctx + 512, max_batch_size=batch,
                        max_num_batched_tokens=max(2048, batch * B), target_codec="identity",
                        draft_codec="identity")
    llm = LLM(target, drafter, cache, device="cuda",
              runner=RunnerConfig(cuda_graphs=graphs, batch_sizes=(batch,)))
    for t in llm.pool.kv.values():
        t.normal_(0, 0.5)
    return llm


def engine_steps(args, bw: float, flops: float, row) -> None:
    """Plain and speculative engine steps of the 8B-shaped pair, each batch and context."""
    p = PRESETS["8b"]
    target, drafter = build_models(p, "cuda", torch.bfloat16, target_layers=args.target_layers)
    target._fingerprint = "bench-target-8b"
    w_t = nbytes(target, skip=("embed_tokens",))
    w_head = target.lm_head.weight.numel() * 2
    w_d = nbytes(drafter)
    w_ctx, w_ctx_only = context_write_bytes(drafter)
    c, dc = target.config, drafter.cfg
    kv_t = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 2
    kv_d = dc.num_hidden_layers * 2 * dc.num_key_value_heads * dc.head_dim * 2
    print(f"target {w_t / 1e9:.2f} GB read per step, drafter {w_d / 1e9:.2f} GB (its context "
          f"write {w_ctx / 1e9:.3f}), LM head {w_head / 1e9:.2f} GB", flush=True)
    max_ctx = max(args.contexts)
    for mode, d in (("plain", None), ("spec", drafter)):
        if mode not in args.modes:
            continue
        for b in args.batches:
            t0 = time.perf_counter()
            llm = make_llm(target, d, b, max_ctx)
            print(f"{mode} b{b}: LLM + capture {time.perf_counter() - t0:.1f} s, graph pool "
                  f"{llm.runner.graph_pool_bytes / 2**20:.0f} MiB, splits "
                  f"{llm.runner.plans(b).splits}, min split {llm.runner.min_split_tokens}",
                  flush=True)
            for ctx in args.contexts:
                bench = Bench(llm, b, ctx, mode)
                kv = b * ctx * (kv_t + (kv_d if d is not None else 0))
                floor = ((w_t + (w_d + w_head if d is not None else 0) + kv) / bw) * 1e3
                # linear layers only: verify rows x target, draft rows x (drafter + head)
                B = llm.block_size if d is not None else 1
                mm = 2 * b * B * (w_t + (w_d + w_head if d is not None else 0)) / 2
                compute = mm / flops * 1e3
                policy = llm.runner.width_policy
                pin_width(llm, llm.runner.widths[0])      # the table's rows: the full block
                ms = bench.step_ms(args.steps)
                llm.runner.use_graphs = False
                eager = bench.step_ms(max(3, args.steps // 5))
                llm.runner.use_graphs = True
                name = f"{mode} decode step" if d is None else "speculative step"
                row(name, b, ctx, ms, eager, floor, compute)
                pinned = {llm.runner.widths[0]: bench.overlapped_ms(args.steps)}
                row(f"{name}, overlapped", b, ctx, pinned[llm.runner.widths[0]], None, floor,
                    compute)
                if b == 1:
                    default = llm.runner.min_split_tokens
                    for m in args.min_split:
                        llm.runner.min_split_tokens = m
                        row(f"{name}, min split {m}", b, ctx, bench.step_ms(args.steps), None,
                            floor, compute)
                    llm.runner.min_split_tokens = default
                if d is not None:   # narrower verify widths (runtime/verify_width.py)
                    for w in llm.runner.widths[1:]:
                        pin_width(llm, w)
                        # products: w target rows, the draft block's rows (w, or B with
                        # draft_block="full"), w - 1 draft-head rows
                        r = llm.runner.draft_rows.get(w, 0)     # width 1: no draft
                        mm_w = b * (w * w_t + r * w_d + (w - 1) * w_head)
                        pinned[w] = bench.overlapped_ms(args.steps)
                        row(f"{name}, overlapped, verify-{w}", b, ctx, pinned[w], None, floor,
                            mm_w / flops * 1e3)
                        if not r:
                            continue
                        row(f"draft (graph replay), verify-{w}, a block of {r}", b, ctx,
                            bench.graph_ms("draft", 50, width=w), None,
                            (w_d - w_ctx_only + w_head + b * ctx * kv_d) / bw * 1e3,
                            b * (r * w_d + (w - 1) * w_head) / flops * 1e3)
                    # The adaptive policy as the engine runs it (this pair's random drafter is
                    # almost never accepted: it should settle on the cheapest width), then the
                    # width it chose pinned, over the same number of steps from the same
                    # context (fresh sequences: contexts grow by a step's tokens, and attention
                    # with them).
                    n_a = 192
                    bench.close()
                    bench = Bench(llm, b, ctx, f"{mode}-warm")
                    llm.runner.width_policy = policy
                    bench.overlapped_ms(128)    # decisions settle, every width is explored
                    bench.close()
                    bench = Bench(llm, b, ctx, f"{mode}-adaptive")
                    ms_a = bench.overlapped_ms(n_a)
                    ch = policy.chosen.get(b)
                    est = {w: round(policy.step_ms(b, w) or -1, 2) for w in policy.widths}
                    cap = [round(policy.capture_ms[(b, w)], 2) for w in policy.widths]
                    meas = {w: round(v, 2) for w, v in pinned.items()}
                    print(f"adaptive b{b} ctx {ctx}: chose {ch}, estimated step ms {est}, "
                          f"measured pinned (overlapped wall) {meas}, capture ms {cap}, "
                          f"acceptance of draft 1 {policy.acceptance()[0]:.3f}", flush=True)
                    bench.close()
                    bench = Bench(llm, b, ctx, f"{mode}-chosen")
                    pin_width(llm, ch)
                    ms_c = bench.overlapped_ms(n_a)
                    row(f"{name}, overlapped, adaptive (verify-{ch}), {n_a} steps", b, ctx, ms_a,
                        None, floor, compute)
                    row(f"{name}, overlapped, verify-{ch} pinned, {n_a} steps", b, ctx, ms_c,
                        None, floor, compute)
                    pin_width(llm, llm.runner.widths[0])
                if d is not None:   # the step's two graphs, each against its own floors
                    # verify: the target and the draft context write; draft: the drafter
                    # but what only the context write reads, and the LM head
                    fl_v = (w_t + w_ctx + b * ctx * kv_t) / bw * 1e3
                    row(f"verify-{llm.block_size} (graph replay)", b, ctx,
                        bench.graph_ms("verify", 50), None, fl_v, b * B * w_t / flops * 1e3)
                    fl_d = (w_d - w_ctx_only + w_head + b * ctx * kv_d) / bw * 1e3
                    row("draft (graph replay)", b, ctx, bench.graph_ms("draft", 50), None, fl_d,
                        b * B * (w_d + w_head) / flops * 1e3)
                llm.runner.width_policy = policy
                bench.close()
                del bench      # it holds the LLM: the pool must go before the next one
            del llm
            gc.collect()
            torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 16, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--target-layers", type=int, default=None)
    ap.add_argument("--attn-contexts", type=int, nargs="*", default=[8192, 32768])
    ap.add_argument("--e2e", action="store_true", help="also the shipped pair end to end")
    ap.add_argument("--modes", nargs="+", choices=("plain", "spec"), default=["plain", "spec"],
                    help="the engine steps to time: plain decoding, speculative, or both")
    ap.add_argument("--sweep", action="store_true",
                    help="batch-1 split sweep of the attention kernel (decode and verify-16)")
    ap.add_argument("--sweep-contexts", type=int, nargs="*", default=[1024, 8192, 32768])
    ap.add_argument("--batch-sweep-q", type=int, nargs="+", default=[16],
                    help="--batch-sweep: query tokens per sequence (verify widths)")
    ap.add_argument("--batch-sweep", type=int, nargs="*", default=[],
                    help="verify-16 attention of these batches over --sweep-contexts: split "
                         "counts x tiles, in the runner's grid")
    ap.add_argument("--verify-sweep", action="store_true",
                    help="batch-1 verify-16 attention over --sweep-contexts: q block x fused "
                         "merge x split length x KV tile, in the runner's grid")
    ap.add_argument("--sweep-align", type=int, default=128,
                    help="split lengths of the sweep are multiples of this (>= 32)")
    ap.add_argument("--min-split", type=int, nargs="*", default=[],
                    help="batch-1 steps again with these RunnerConfig.min_split_tokens "
                         "(set per step on the captured graphs)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    bw = copy_rate()
    print(f"copy rate {bw / 1e12:.3f} TB/s (read + write)", flush=True)
    monitor = GpuMonitor()
    res = {"copy_rate_Bps": bw, "rows": []}
    lines: list[str] = []

    def row(name, b, ctx, ms, eager, floor, compute=None):
        res["rows"].append(dict(step=name, batch=b, ctx=ctx, ms=ms, eager_ms=eager,
                                floor_ms=floor, compute_ms=compute))
        e = f"{eager:.2f}" if eager is not None else "-"
        c = f"{compute:.2f}" if compute is not None else "-"
        lines.append(f"| {name} | {b} | {ctx} | {ms:.2f} | {e} | {floor:.2f} | "
                     f"{ms / floor:.2f} | {c} |")
        print(lines[-1], flush=True)

    for ctx in args.attn_contexts:
        a = decode_attention_b1(ctx, bw)
        res.setdefault("attention_b1", {})[ctx] = a
        print(f"decode attention b1 {ctx}: {a['splits']} splits of {a['tokens_per_split']}, "
              f"fused {a['fused_us']:.1f} us (chunk 8: {a['fused8_us']:.1f}, 32: "
              f"{a['fused32_us']:.1f}), split+merge {a['split_merge_us']:.1f} us per layer, "
              f"fused with a tensor per layer {a['layer_major_us']:.1f}, "
              f"floor {a['floor_us']:.1f} us (fused x floor "
              f"{a['fused_us'] / a['floor_us']:.2f}); fused by BLOCK_N/stages/warps: "
              + ", ".join(f"{k} {v:.1f}" for k, v in a["tiles"].items()), flush=True)
    def table(key, header, rows, cells):
        """A sweep's markdown table: ``header`` cells, then ``cells(r)`` of each row (also kept
        in the JSON under ``key``)."""
        lines.extend(["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)])
        for r in rows:
            res.setdefault(key, []).append(r)
            lines.append("| " + " | ".join(str(c) for c in cells(r)) + " |")

    if args.sweep:
        table("split_sweep", ["sweep ctx", "q", "splits", "tokens/split", "BLOCK_N", "stages",
                              "grid", "us/layer", "x floor"],
              (r for ctx in args.sweep_contexts for q_len in (1, 16)
               for r in split_sweep(ctx, q_len, bw, align=args.sweep_align)),
              lambda r: (r["ctx"], r["q"], r["splits"], r["tokens_per_split"], r["block_n"],
                         r["stages"], r["grid"], f"{r['us']:.1f}",
                         f"{r['us'] / r['floor_us']:.2f}"))
    if args.verify_sweep:
        table("verify_sweep", ["verify b1 ctx", "tokens/split", "BLOCK_Q", "fused merge",
                               "BLOCK_N", "us/layer", "x floor"],
              (r for ctx in args.sweep_contexts for r in verify_b1_sweep(ctx, bw)),
              lambda r: (r["ctx"], r["tokens_per_split"], r["block_q"], r["fused"],
                         r["block_n"], f"{r['us']:.1f}", f"{r['us'] / r['floor_us']:.2f}"))
    if args.batch_sweep:
        table("batch_sweep", ["batch", "ctx", "splits (runner's)", "BLOCK_N", "maxnreg",
                              "us/layer", "x floor"],
              (r for b in args.batch_sweep for ctx in args.sweep_contexts
               for q in args.batch_sweep_q for r in batch_attn_sweep(b, ctx, bw, q_len=q)),
              lambda r: (f"{r['batch']} (q {r['q']})", r["ctx"],
                         f"{r['splits']} ({r['chosen']})", r["block_n"],
                         r["maxnreg"], f"{r['us']:.1f}", f"{r['us'] / r['floor_us']:.2f}"))

    if args.batches:
        flops = matmul_rate()
        res["matmul_flops"] = flops
        print(f"bf16 matmul {flops / 1e12:.0f} TFLOP/s", flush=True)
        lines += ["", f"bf16 matmul {flops / 1e12:.0f} TFLOP/s (8192^3, random)", "",
                  "| step | batch | context | graphs ms | eager ms | floor ms | graphs x floor | "
                  "matmul floor ms |", "|---|---|---|---|---|---|---|---|"]
        engine_steps(args, bw, flops, row)
    if args.e2e:
        shipped_e2e(lines, res)
    lines.append("")
    lines.append(f"copy rate {bw / 1e12:.3f} TB/s (read + write), {torch.cuda.get_device_name()}")
    lines.append(monitor.summary())
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
        with open(args.out + ".json", "w") as f:
            json.dump(res, f, indent=1)


class GpuMonitor:
    """``nvidia-smi`` sampling the GPU every 500 ms while the steps run: the SM clock (median,
    minimum), power and temperature (maxima) and every throttle reason seen. Ratios against the
    floor differ by a few per cent between machines of one kind with the same tree
    (twenty-fifth runner session), and the SM clock under load is the first suspect."""

    FIELDS = "clocks.sm,clocks.max.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"

    def __init__(self) -> None:
        self._p: subprocess.Popen | None = None
        # samples into a file (a pipe nobody reads would fill and stall the sampler)
        self._out = tempfile.TemporaryFile(mode="w+")
        smi = shutil.which("nvidia-smi")
        if smi is not None:
            self._p = subprocess.Popen(
                [smi, f"--query-gpu={self.FIELDS}", "--format=csv,noheader,nounits", "-lms",
                 "500", "-i", str(torch.cuda.current_device())],
                stdout=self._out, stderr=subprocess.DEVNULL, text=True)
            # stopped on every exit, a failed benchmark's too
            atexit.register(self.stop)

    def stop(self) -> None:
        """Ends the sampler (idempotent)."""
        if self._p is not None and self._p.poll() is None:
            self._p.terminate()
            try:
                self._p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._p.kill()
                self._p.wait()

    def summary(self) -> str:
        """Stops the sampler and summarises its samples."""
        if self._p is None:
            return "GPU clocks: nvidia-smi not found"
        self.stop()
        self._out.seek(0)
        out = self._out.read()
        self._out.close()
        rows = []
        for line in out.splitlines():
            v = [x.strip() for x in line.split(",")]
            try:
                rows.append((float(v[0]), float(v[1]), float(v[2]), float(v[3]), v[4]))
            except (ValueError, IndexError):
                continue
        if not rows:
            return "GPU clocks: no samples"
        sm = sorted(r[0] for r in rows)
        reasons = sorted({r[4] for r in rows})
        return (f"GPU while the steps ran ({len(rows)} samples of nvidia-smi): SM clock median "
                f"{statistics.median(sm):.0f} MHz, min {sm[0]:.0f} (max {rows[0][1]:.0f}), "
                f"power max {max(r[2] for r in rows):.0f} W, temperature max "
                f"{max(r[3] for r in rows):.0f} C, throttle reasons {' '.join(reasons)}")


if __name__ == "__main__":
    main()
