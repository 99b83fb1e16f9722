"""Model runner on the CPU: graph batch size choice, padding rows, persistent buffers reused across steps of
changing batch composition (decode path == general path), the graphs switch, incremental hashing."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

from kvstrata.kernels import step_inputs
from kvstrata.pagepool.hashing import Namespace, page_hashes
from kvstrata.pagepool.manager import KVCacheManager
from kvstrata.pagepool.pool import PagePool
from kvstrata.pagepool.spec import KVGroupSpec
from kvstrata.runtime import LLM, CacheConfig, RunnerConfig, SamplingParams
from kvstrata.runtime import runner as runner_mod
from kvstrata.runtime.config import GRAPHS_ENV, default_ladder, graph_batch_size, graphs_enabled
from kvstrata.runtime.runner import StepItem
from kvstrata.runtime.verify_width import WidthPolicy

PROMPTS = [[(7 * i + 3) % 290 for i in range(n)] for n in (6, 13, 21)] + [
    [(11 * i + 5) % 290 for i in range(n)] for n in (3, 17)]


def test_ladder_and_graph_batch_size():
    assert default_ladder(64) == (1, 2, 4, 8, 16, 32, 48, 64)
    assert default_ladder(20) == (1, 2, 4, 8, 16, 20)
    assert default_ladder(1) == (1,)
    lad = (1, 2, 4, 8, 16, 32)
    assert [graph_batch_size(lad, n) for n in (1, 2, 3, 5, 8, 9, 17, 32)] == \
        [1, 2, 4, 8, 8, 16, 32, 32]
    assert graph_batch_size(lad, 33) is None
    assert RunnerConfig(batch_sizes=(8, 1, 8, 4)).batch_sizes == (1, 4, 8)
    with pytest.raises(ValueError, match="positive integers"):
        RunnerConfig(batch_sizes=(0, 2))


def test_graph_switch_config_and_environment(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv(GRAPHS_ENV, raising=False)
    assert graphs_enabled(RunnerConfig(), cuda)
    assert not graphs_enabled(RunnerConfig(cuda_graphs=False), cuda)
    assert not graphs_enabled(RunnerConfig(), cpu)          # graphs are CUDA only
    monkeypatch.setenv(GRAPHS_ENV, "0")
    assert not graphs_enabled(RunnerConfig(), cuda)
    monkeypatch.setenv(GRAPHS_ENV, "on")
    assert graphs_enabled(RunnerConfig(cuda_graphs=False), cuda)
    monkeypatch.setenv(GRAPHS_ENV, "maybe")
    with pytest.raises(ValueError, match=GRAPHS_ENV):
        graphs_enabled(RunnerConfig(), cuda)


def _llm(ckpts, **kw):
    cache = CacheConfig(page_size=4, max_seq_len=96, max_batch_size=8, target_codec="identity",
                        draft_codec="identity")
    llm = LLM(ckpts["agree"][0], ckpts["drafter"][0], cache, **kw)
    for t in llm.pool.kv.values():     # the pool is uninitialised: no NaN in the comparisons
        t.zero_()
    return llm


def _decode_items(reqs, llm, ns=None):
    ns = ns or [llm.block_size] * len(reqs)
    return [StepItem(r.seq_id, r.num_computed, n, [r.tokens[-1]], True, r.params)
            for r, n in zip(reqs, ns)]


def _snapshot(llm):
    return {k: v.clone() for k, v in llm.pool.kv.items()}


def _twice(llm, reqs, first, second, ns=None):
    """Reserve the block (``ns``: its length per request, default full) of every request, run
    ``first(items)`` and, on the pool as it was before, ``second(items)``; returns both
    outputs, the K/V after ``first`` and the pool before both (the pool is left as ``second``
    wrote it)."""
    items = _decode_items(reqs, llm, ns)
    for r, it in zip(reqs, items):
        llm.mgr.reserve(r.seq_id, it.start + it.n)
    snap = _snapshot(llm)
    a = first(items)
    kv_a = _snapshot(llm)
    for k, v in snap.items():
        llm.pool.kv[k].copy_(v)
    return a, second(items), kv_a, snap


def test_padding_rows_change_nothing(ckpts):
    """A batch of 3 padded to 8 rows: the same tokens as unpadded, and the padding rows write
    no K/V anywhere (slot -1, length 0)."""
    llm = _llm(ckpts)
    reqs = llm.prefill(PROMPTS[:3], SamplingParams(max_tokens=30))
    exact, padded, kv_exact, snap = _twice(llm, reqs, llm.runner.decode,
                                           lambda items: llm.runner.decode(items, pad_to=8))
    assert padded == exact
    assert all(1 <= len(t) <= llm.block_size for t in exact)
    # Rows the three sequences own may differ in the last bits (different matmul shapes);
    # every other page is untouched.
    own = {p for r in reqs for p in llm.mgr.seqs[r.seq_id].page_ids}
    others = [p for p in range(llm.pool.num_pages) if p not in own]
    for g in llm.pool.kv:
        assert torch.equal(llm.pool.kv[g][others], snap[g][others])
        torch.testing.assert_close(llm.pool.kv[g], kv_exact[g], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="does not fit 2 rows"):
        llm.runner.decode(_decode_items(reqs, llm), pad_to=2)
    for r in reqs:
        llm.release(r)


def test_buffers_reused_across_changing_batches_equal_the_general_path(ckpts):
    """Steps of 3, then 2 (other order), then 1 sequence, padded to changing sizes, through the
    persistent buffers give the tokens and K/V of the packed general path on the same inputs,
    step by step; the staged block-table rows hold each row's pages; the copies' views are made
    once per (staging slot, padded size) over the persistent buffers."""
    llm = _llm(ckpts)
    run = llm.runner
    reqs = llm.prefill(PROMPTS[:3], SamplingParams(max_tokens=40))
    by = {r.request_id: r for r in reqs}
    for order, pad in (([0, 1, 2], 4), ([2, 0], 2), ([1], 1), ([0, 1, 2], 3), ([2], 4),
                       ([1, 0], 2)):
        rs = [by[i] for i in order]
        general, fast, kv_general, _ = _twice(llm, rs, run._general,
                                              lambda items: run.decode(items, pad_to=pad))
        assert fast == general, f"order {order}"
        for i, r in enumerate(rs):   # staged rows: written in part when a row keeps its sequence
            pages = llm.mgr.seqs[r.seq_id].page_ids
            staged = run.staging.last_tables[i, :len(pages)].tolist()
            assert staged == pages, f"order {order} row {i}"
        for g in llm.pool.kv:
            torch.testing.assert_close(llm.pool.kv[g], kv_general[g], atol=1e-5, rtol=1e-5)
        _commit(llm, rs, fast)
    assert run.stats()["decode_steps"] == 6
    # six steps alternate the two slots over four padded sizes: (0, 4), (1, 2), (0, 1), (1, 3),
    # (0, 4) again, (1, 2) again
    stg = run.staging
    assert sorted(stg.views) == [(0, 1), (0, 4), (1, 2), (1, 3)]
    for (slot, b), ((ins, tables), out) in stg.views.items():
        assert ins[0] is run._in and ins[1].data_ptr() == stg.h_in[slot].data_ptr()
        assert tables[0].shape[0] == b and tables[0].data_ptr() == run.block_tables.data_ptr()
        assert tables[1].data_ptr() == stg.h_bt[slot].data_ptr() and tables[1].shape[0] == b
        assert out[0].data_ptr() == stg.h_out[slot].data_ptr() and out[1].shape[0] == b
        assert out[1].data_ptr() == run.out.data_ptr()



@settings(max_examples=max(4, settings.default.max_examples // 5))
@given(steps=st.lists(st.tuples(st.permutations(range(4)), st.integers(1, 4), st.integers(0, 4),
                                st.lists(st.integers(1, 4), min_size=4, max_size=4)),
                      min_size=1, max_size=5))
def test_random_step_schedules_equal_the_general_path(ckpts, steps):
    """Random steps over four sequences (which of them, in which order, padded by 0-4 rows,
    each with its own block length) through the persistent buffers and both staging slots:
    every step's tokens and K/V equal the general path's on the same inputs, and the staged
    block-table rows hold each row's pages (a row that keeps its sequence gets only its new
    pages; one that changes sequence is written whole)."""
    llm = _llm(ckpts)
    run, B = llm.runner, llm.block_size
    reqs = llm.prefill(PROMPTS[:4], SamplingParams(max_tokens=40))
    for order, n, extra, lens in steps:
        rs = [reqs[i] for i in order[:n]]
        ns = [min(k, B, run.max_seq_len - r.num_computed - 1) for k, r in zip(lens, rs)]
        pad = min(n + extra, run.max_batch)
        note(f"rows {order[:n]} block lengths {ns} padded to {pad}")
        general, fast, kv_general, _ = _twice(llm, rs, run._general,
                                              lambda items: run.decode(items, pad_to=pad), ns)
        assert fast == general
        for i, r in enumerate(rs):
            pages = llm.mgr.seqs[r.seq_id].page_ids
            assert run.staging.last_tables[i, :len(pages)].tolist() == pages
        for g in llm.pool.kv:
            torch.testing.assert_close(llm.pool.kv[g], kv_general[g], atol=1e-5, rtol=1e-5)
        _commit(llm, rs, fast)
    for r in reqs:
        llm.release(r)

def _commit(llm, rs, produced):
    for r, new in zip(rs, produced):           # commit as the engine does
        commit = ([r.tokens[-1]] + new)[:len(new)]
        llm.mgr.commit(r.seq_id, commit)
        r.num_computed += len(commit)
        r.tokens.extend(new)


def test_shortened_blocks_take_the_decode_path_and_equal_the_general_path(ckpts):
    """Blocks shorter than B (a sequence's last, one at the length limit) beside full ones take
    the decode path (per-row block lengths in its plans; rows past a block are masked): the
    tokens and K/V of the general path, which runs each block at its own length, and never
    more tokens than the block has rows."""
    llm = _llm(ckpts)
    B = llm.block_size
    assert B >= 4
    # the third prompt sits 2 tokens below max_seq_len: its rows past 2 lie past its pages
    long = [(13 * i + 1) % 290 for i in range(llm.runner.max_seq_len - 2)]
    reqs = llm.prefill(PROMPTS[:2] + [long], SamplingParams(max_tokens=40))
    for ns in ([B, 3, 2], [1, B], [2, 3]):
        rs = reqs[:len(ns)]
        assert llm.runner.decode_ok(_decode_items(rs, llm, ns))
        general, fast, kv_general, _ = _twice(llm, rs, llm.runner._general,
                                              lambda items: llm.runner.decode(items, pad_to=4),
                                              ns=ns)
        assert fast == general, f"blocks {ns}"
        assert all(1 <= len(t) <= n for t, n in zip(fast, ns))
        for g in llm.pool.kv:
            torch.testing.assert_close(llm.pool.kv[g], kv_general[g], atol=1e-5, rtol=1e-5)
        _commit(llm, rs, fast)
    assert llm.runner.stats()["decode_steps"] == 3
    assert not llm.runner.decode_ok(_decode_items(reqs[:1], llm, [B + 1]))


def test_stage_kernels_inside_the_runner_equal_the_torch_path(ckpts, monkeypatch):
    """The decode path with its stage kernels (kernels.step_inputs: positions/slots/lengths and
    greedy acceptance, through the interpreter) gives the torch reference's tokens and K/V bit
    for bit: full and shortened blocks, padding rows, a row whose block lies past its pages, and
    the narrower verify widths (their draft blocks and accepted counts)."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels run on the CPU through the interpreter only")
    llm = _llm(ckpts, runner=RunnerConfig(verify_widths=(4, 2, 1)))
    B = llm.block_size
    assert llm.runner.widths == (4, 2, 1) == (B, 2, 1)
    long = [(13 * i + 1) % 290 for i in range(llm.runner.max_seq_len - 2)]
    kernels = {name: functools.partial(getattr(step_inputs, name), impl="triton")
               for name in ("step_positions", "greedy_accept")}

    def with_kernels(items):
        with monkeypatch.context() as m:
            for name, fn in kernels.items():
                m.setattr(runner_mod, name, fn)
            return llm.runner.decode(items, pad_to=4)

    for width in llm.runner.widths:
        llm.runner.width_policy = WidthPolicy(B, (width,))      # every step at this width
        reqs = llm.prefill(PROMPTS[:2] + [long], SamplingParams(max_tokens=40))
        for ns in ([B, 3, 2], [1, B]):
            rs = reqs[:len(ns)]
            ref, got, kv_ref, _ = _twice(llm, rs, lambda items: llm.runner.decode(items,
                                                                                 pad_to=4),
                                         with_kernels, ns=ns)
            assert got == ref, (width, ns)
            for g in llm.pool.kv:
                assert torch.equal(llm.pool.kv[g], kv_ref[g]), (width, ns, g)
            _commit(llm, rs, got)
        for r in reqs:
            llm.release(r)


def test_engine_takes_the_decode_path_and_times_only_on_request(ckpts):
    llm = _llm(ckpts)
    sp = SamplingParams(max_tokens=30)
    outs = llm.generate(PROMPTS[:2], sp)
    st_ = llm.stats()
    assert st_["runner"]["decode_steps"] > 0 and st_["runner"]["general_steps"] > 0
    assert st_["runner"]["cuda_graphs"] is False
    assert st_["engine"]["draft_s"] == 0.0 and st_["engine"]["step_s"] > 0
    ref = _llm(ckpts, runner=RunnerConfig(cuda_graphs=False)).generate(PROMPTS[:2], sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


def _manager(P=4):
    spec = KVGroupSpec("target", 1, 1, 16, torch.float32, "identity")
    pool = PagePool([spec], 64, P, "cpu")
    return KVCacheManager(pool, Namespace("t", (spec,), P))


@given(st.lists(st.integers(0, 9), min_size=1, max_size=30), st.integers(1, 12))
def test_incremental_hashing_equals_hashing_from_scratch(chunks, prompt_len):
    mgr = _manager()
    prompt = [(5 * i + 1) % 97 for i in range(prompt_len)]
    mgr.admit("s", prompt)
    mgr.reserve("s", 250)
    toks = list(prompt)
    mgr.commit("s", prompt)
    for c in chunks:
        new = [(3 * len(toks) + j) % 101 for j in range(c)]
        note(f"commit {new}")
        mgr.commit("s", new)
        toks += new
        seq = mgr.seqs["s"]
        assert seq.hashes == page_hashes(seq.namespace, toks)
        for i, h in enumerate(seq.hashes):
            assert mgr.pool.lookup(h) == seq.page_ids[i]


def test_commit_hashes_only_new_pages(monkeypatch):
    """A commit's hashing reads the unhashed tail only: its cost does not grow with the
    sequence."""
    import kvstrata.pagepool.hashing as hashing
    mgr = _manager()
    mgr.admit("s", [1] * 3)
    mgr.reserve("s", 250)
    mgr.commit("s", [1] * 3)
    seen = []
    real = hashing.tokens_to_bytes
    monkeypatch.setattr(hashing, "tokens_to_bytes", lambda t: seen.append(len(t)) or real(t))
    for i in range(200):
        mgr.commit("s", [i % 50])
    assert len(mgr.seqs["s"].hashes) == 203 // 4
    assert max(seen) <= 4        # never more than one page of tokens per one-token commit


def test_drafter_merged_weights_equal_the_separate_products(ckpts):
    """The drafter loads merged (q/k/v one matrix, gate/up one): one copy of the weights, the
    same state dict, and block forward and context K/V equal the separate products'."""
    import copy

    from kvstrata.drafter import DFlashDrafter
    d = DFlashDrafter.from_pretrained(ckpts["drafter"][0])
    a = d.layers[0].self_attn
    assert a._qkv.holds() and d.layers[0].mlp._gate_up.holds()
    assert a.v_proj.weight.untyped_storage().data_ptr() == \
        a.q_proj.weight.untyped_storage().data_ptr()
    plain = copy.deepcopy(d)
    with torch.no_grad():
        for layer in plain.layers:
            for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                        layer.mlp.gate_proj, layer.mlp.up_proj):
                lin.weight = torch.nn.Parameter(lin.weight.detach().clone())
    assert not plain.layers[0].self_attn._qkv.holds()
    assert list(plain.state_dict()) == list(d.state_dict())
    c = d.cfg
    g = torch.Generator().manual_seed(0)
    T = 2 * c.block_size
    noise = torch.randn(T, c.hidden_size, generator=g).to(d.dtype)
    pos = torch.arange(5, 5 + T)
    taps = torch.randn(T, len(c.target_layer_ids) * c.hidden_size, generator=g).to(d.dtype)

    def attn(layer, q, k, v):      # any function of q, k, v: the projections are compared
        rep = q.shape[1] // k.shape[1]
        return q + (k * v).repeat_interleave(rep, 1)

    with torch.no_grad():
        assert torch.equal(d(noise, pos, attn), plain(noise, pos, attn))
        for (k1, v1), (k2, v2) in zip(d.context_kv(taps, pos), plain.context_kv(taps, pos)):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_split_plans_follow_min_split_tokens(ckpts):
    """The graphs' split grids are sized for splits of ``min_split_tokens`` at max_seq_len,
    and each step spreads its longest context over all of them in multiples of 32 tokens (the
    Qwen3-8B batch-1 case: 8 KV heads, 8k + 512 tokens, 132 SMs); with a sliding-window layer
    the split lengths stay multiples of 128."""
    for m, want in ((256, 34), (512, 17), (128, 64)):
        llm = _llm(ckpts, runner=RunnerConfig(min_split_tokens=m))
        run = llm.runner
        run.max_seq_len = 8704
        for q in (1, 16):
            assert run._splits(1, q, num_kv_heads=8) == want
        assert run._splits(16, 1, num_kv_heads=8) == 4          # 16 x 8 programs: 4 waves
        assert run._split_len(8192 + 16, want) == 32 * -(-(8192 + 16) // (32 * want))
        assert run._split_len(1024 + 16, want) == 32 * -(-(1024 + 16) // (32 * want))
        assert run._split_len(100, want) == 32
        assert run.plans(2).verify[run.B].tokens_per_split >= m
    assert run._split_len(8192 + 16, 64) == 160 and run._split_len(1040, 34) == 32
    windowed = LLM(ckpts["agree"][0], ckpts["sliding"][0], CacheConfig(
        page_size=4, max_seq_len=96, max_batch_size=2, target_codec="identity",
        draft_codec="identity"))
    assert windowed.runner._split_len(100, 34) == 128
    assert windowed.runner._split_len(1040, 4) == 384
    with pytest.raises(ValueError, match="min_split_tokens"):
        RunnerConfig(min_split_tokens=200)
