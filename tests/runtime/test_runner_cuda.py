"""CUDA graphs of the model runner: replay equals the eager path bit for bit (tokens, acceptance
lengths, K/V of both groups) at every verify width, and graphs on/off engines generate the same
tokens; the verify widths are captured and timed."""

from __future__ import annotations

import pytest
import torch

from kvstrata.runtime import LLM, CacheConfig, RunnerConfig, SamplingParams
from kvstrata.runtime.runner import StepItem
from kvstrata.runtime.verify_width import WidthPolicy, default_widths

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[(7 * i + 3) % 290 for i in range(n)] for n in (6, 13, 21, 40, 9)]


def _llm(ckpts, drafter=True, dtype="bfloat16", **kw):
    cache = CacheConfig(page_size=16, max_seq_len=192, max_batch_size=8, target_codec="identity",
                        draft_codec="identity")
    llm = LLM(ckpts["agree"][0], ckpts["drafter"][0] if drafter else None, cache,
              device="cuda", dtype=dtype, **kw)
    for t in llm.pool.kv.values():     # the pool is uninitialised: no NaN in the comparisons
        t.zero_()
    return llm


def _pin(llm, width=None):
    """Every step of ``llm`` at one verify width (default: the block)."""
    llm.runner.width_policy = WidthPolicy(llm.runner.B, (width or llm.runner.B,))


@pytest.mark.parametrize("drafter,width", [(True, None), (True, 2), (True, 1), (False, None)])
def test_graph_replay_is_bit_identical_to_eager(ckpts, drafter, width):
    """Full and shortened blocks (per-row block lengths in the captured plans) alike, at the
    full verify width, the narrowest that drafts (2) and width 1 (no drafts)."""
    llm = _llm(ckpts, drafter)
    run = llm.runner
    assert run.graphs and run.ladder == (1, 2, 4, 8)
    B = llm.block_size
    W = width or B
    assert W in run.widths
    _pin(llm, W)
    short = {1: [3, 3], 4: [B, 2, 1, B, 3]}     # step -> block lengths (others: full)
    reqs = llm.prefill(PROMPTS, SamplingParams(max_tokens=100))
    for step, sel in enumerate(([0, 1, 2, 3, 4], [4, 2], [1], [0, 1, 2, 3, 4], [3, 0, 2])):
        rs = [reqs[i] for i in sel]
        ns = [min(n, B) for n in short.get(step, [B] * len(rs))]
        items = [StepItem(r.seq_id, r.num_computed, n, [r.tokens[-1]], True, r.params)
                 for r, n in zip(rs, ns)]
        assert run.decode_ok(items)
        for r, it in zip(rs, items):
            llm.mgr.reserve(r.seq_id, it.start + it.n)
        snap = {g: t.clone() for g, t in llm.pool.kv.items()}
        graph = run.decode(items)
        kv_graph = {g: t.clone() for g, t in llm.pool.kv.items()}
        for g, t in snap.items():
            llm.pool.kv[g].copy_(t)
        run.use_graphs = False
        try:
            eager = run.decode(items, pad_to={5: 8, 2: 2, 1: 1, 3: 4}[len(items)])
        finally:
            run.use_graphs = True
        assert graph == eager, f"step {step}"
        assert all(1 <= len(t) <= min(n, W) for t, n in zip(graph, ns))
        for g in llm.pool.kv:
            assert torch.equal(llm.pool.kv[g], kv_graph[g]), f"step {step}, group {g}"
        for r, new in zip(rs, graph):
            commit = ([r.tokens[-1]] + new)[:len(new)]
            llm.mgr.commit(r.seq_id, commit)
            r.num_computed += len(commit)
            r.tokens.extend(new)
    assert run.stats()["graph_steps"] == 5
    if drafter and W > 1:
        assert any(len(t) > 1 for t in graph)


def test_engine_with_graphs_equals_without(ckpts):
    """Graphs on (at the full verify width, and with the adaptive widths) and off generate the
    same tokens, and the same acceptance lengths at the same width; every ladder size's
    widths were captured and timed."""
    sp = SamplingParams(max_tokens=40)
    on = _llm(ckpts, dtype="float32")
    B = on.block_size
    _pin(on)
    adaptive = _llm(ckpts, dtype="float32")
    off = _llm(ckpts, dtype="float32", runner=RunnerConfig(cuda_graphs=False))
    a, b = on.generate(PROMPTS, sp), off.generate(PROMPTS, sp)
    assert [(o.token_ids, o.acceptance_lengths) for o in a] == \
        [(o.token_ids, o.acceptance_lengths) for o in b]
    c = adaptive.generate(PROMPTS, sp)
    assert [o.token_ids for o in c] == [o.token_ids for o in a]
    run = adaptive.runner
    assert run.widths == default_widths(B) and len(run.widths) > 1
    assert set(run.width_policy.capture_ms) == {(n, w) for n in run.ladder for w in run.widths}
    assert set(run.graphs) == {(g, n, w) for g in ("draft", "verify") for n in run.ladder
                               for w in run.widths if g == "verify" or w > 1}   # 1: no drafts
    st = adaptive.stats()["runner"]
    assert st["verify_widths"] == list(run.widths) and st["verify_width_by_batch"]
    assert run.width_policy.extra_ms                     # the steps' device times were read
    assert st["verify_step_ms"] and all(set(v) == set(run.widths)
                                        for v in st["verify_step_ms"].values())
    st = on.stats()["runner"]
    assert st["cuda_graphs"] and st["graph_steps"] > 0 and st["graph_pool_bytes"] >= 0
    assert off.stats()["runner"]["graph_steps"] == 0
    plain = _llm(ckpts, drafter=False, dtype="float32").generate(PROMPTS, sp)
    assert [o.token_ids for o in plain] == [o.token_ids for o in a]


@pytest.mark.parametrize("drafter", [True, False])
def test_continued_step_equals_host_staged_step(ckpts, drafter):
    """A step submitted from the previous step's output on the device (``submit_next``, before
    that output is read) equals the same step staged from the host after it: tokens and K/V
    of both groups bit for bit, in the graphs, over a row subset and reorder (eagerly: the CPU
    tests)."""
    results = {}
    for mode in ("host", "graph"):
        llm = _llm(ckpts, drafter)
        _pin(llm)
        run, B = llm.runner, llm.block_size
        reqs = llm.prefill(PROMPTS, SamplingParams(max_tokens=100))
        items = [StepItem(r.seq_id, r.num_computed, B, [r.tokens[-1]], True, r.params)
                 for r in reqs]
        for r in reqs:
            llm.mgr.reserve(r.seq_id, r.num_computed + 2 * B)
        sel = [3, 0, 4, 1]                          # rows of the first step, in a new order
        h0 = run.submit(items)
        if mode != "host":
            h1 = run.submit_next(h0, sel, [reqs[i].seq_id for i in sel],
                                 [llm.max_seq_len] * len(sel))
        first = run.collect(h0)
        for r, new in zip(reqs, first):
            commit = ([r.tokens[-1]] + new)[:len(new)]
            llm.mgr.commit(r.seq_id, commit)
            r.num_computed += len(commit)
            r.tokens.extend(new)
        if mode == "host":
            second = run.decode([StepItem(reqs[i].seq_id, reqs[i].num_computed, B,
                                          [reqs[i].tokens[-1]], True, reqs[i].params)
                                 for i in sel])
        else:
            second = run.collect(h1)
        results[mode] = (first, second, {g: t.clone() for g, t in llm.pool.kv.items()})
        del llm
    assert results["graph"][:2] == results["host"][:2]
    assert any(len(t) > 1 for t in results["graph"][1]) or not drafter
    for g, t in results["host"][2].items():
        assert torch.equal(results["graph"][2][g], t), g


def test_engine_overlapped_equals_synchronous(ckpts):
    sp = SamplingParams(max_tokens=40)
    outs = {}
    for ov in (True, False):
        llm = _llm(ckpts, dtype="float32", runner=RunnerConfig(overlap=ov))
        _pin(llm)
        outs[ov] = [(o.token_ids, o.acceptance_lengths) for o in llm.generate(PROMPTS, sp)]
        assert llm.stats()["pool"]["in_use"] == 0
    assert outs[True] == outs[False]

