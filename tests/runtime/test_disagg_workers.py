"""1P1D serving: a context worker prefills, a generation worker decodes.

Two processes over Gloo for the end-to-end equality; the rest run both workers in one process over
a loopback channel (the same four methods as ``PageChannel``), the context worker in a thread.
"""

from __future__ import annotations

import threading

import pytest
import torch

from kvstrata.pagepool import page_hashes
from kvstrata.runtime import LLM, CacheConfig, RequestOutput, SamplingParams
from kvstrata.runtime.disagg import NamespaceMismatchError
from kvstrata.runtime.disagg.launcher import launch_1p1d
from kvstrata.runtime.disagg.workers import (ContextWorker, GenerationWorker, LoopbackChannel,
                                             loopback_pair)
from kvstrata.runtime.scheduler import PREFILLED
from kvstrata.assets.corpus import heldout_prompts

PAIR = "kvstrata-tiny-py"
PROMPTS = heldout_prompts(3, 64, seed=0)
GREEDY = SamplingParams(max_tokens=32)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Bit-equal results across processes need the same CPU reduction order: one thread each.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _cache(**kw):
    return CacheConfig(**{"max_seq_len": 256, "max_batch_size": 4, **kw})


def _llm(drafter=PAIR, **kw):
    return LLM(PAIR, drafter, cache=_cache(**kw))


def _pair(ctx_llm, gen_llm, prompts=PROMPTS, params=GREEDY, ctx_channel=None, **ctx_kw):
    """Serve ``prompts`` in one process; returns (outputs, context worker, generation worker)."""
    a, b = loopback_pair(timeout_s=30)
    ctx = ContextWorker(ctx_llm, ctx_channel(a) if ctx_channel else a, **ctx_kw)
    gen = GenerationWorker(gen_llm, b)
    err = []

    def run():
        try:
            ctx.connect()
            ctx.serve(prompts, params)
        except Exception as e:  # noqa: BLE001 - checked by the caller
            err.append(e)

    t = threading.Thread(target=run)
    t.start()
    try:
        gen.connect()
        outs = gen.serve()
    finally:
        t.join(timeout=60)
    if err:
        raise err[0]
    return outs, ctx, gen


def _same(outs, ref):
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert [o.acceptance_lengths for o in outs] == [r.acceptance_lengths for r in ref]


def _mean_al(outs):
    steps = [a for o in outs for a in o.acceptance_lengths]
    return sum(steps) / len(steps)


# -- engine hooks ------------------------------------------------------------------------------
def test_prefill_holds_the_sequence_and_resume_finishes_it():
    llm = _llm()
    ref = llm.generate(PROMPTS[:2], GREEDY)
    items = llm.prefill(PROMPTS[:2] + [[]], GREEDY)
    assert isinstance(items[2], RequestOutput) and items[2].finish_reason == "rejected"
    reqs = items[:2]
    for r, p in zip(reqs, PROMPTS):
        assert r.state == PREFILLED and r.tokens[:-1] == p and r.num_computed == len(p)
        assert llm.mgr.seqs[r.seq_id].token_ids == p         # held, every prompt token committed
    with pytest.raises(ValueError, match="resume needs a DECODE request"):
        llm.resume(reqs)                                        # still PREFILLED
    for r in reqs:
        r.state = "decode"
    _same(llm.resume(reqs), ref)
    assert llm.stats()["pool"]["in_use"] == 0 and not llm.mgr.seqs
    # A request that ends at its first token is final at the context worker.
    one = llm.prefill(PROMPTS[:1], SamplingParams(max_tokens=1))[0]
    assert isinstance(one, RequestOutput) and one.token_ids == ref[0].token_ids[:1]


# -- two processes over Gloo -------------------------------------------------------------------
def test_1p1d_over_gloo_equals_aggregated_token_for_token():
    ref = _llm().generate(PROMPTS, GREEDY)
    res = launch_1p1d(PROMPTS, GREEDY, target=PAIR, drafter=PAIR, cache=_cache(), timeout_s=120)
    assert res.errors == []
    _same(res.outputs, ref)
    assert _mean_al(ref) > 2.5                      # the trained pair really speculates
    assert [t.pages_sent for t in res.transfers] == [4, 4, 4]   # 64 tokens = 4 pages, 2 groups
    # raw pages travel as the host slots holding them (record heads go in the message; slots
    # are the page bytes, 256-byte aligned per group)
    assert all(4 * 65536 <= t.bytes < 4 * (65536 + 512) for t in res.transfers)


# -- one process, loopback -----------------------------------------------------------------------
class _Recording(LoopbackChannel):
    def __init__(self, inner):
        super().__init__(inner._in, inner._out, inner.timeout_s)
        self.sent: list[torch.Tensor] = []

    def send_tensor(self, t):
        self.sent.append(t.clone())
        super().send_tensor(t)


@pytest.mark.parametrize("encode", ["never", "always"])
def test_draft_kv_received_equals_sent_bit_for_bit(encode):
    ctx_llm, gen_llm = _llm(), _llm()
    rec: list[_Recording] = []

    def wrap(ch):
        rec.append(_Recording(ch))
        return rec[0]

    a, b = loopback_pair(timeout_s=30)
    ctx, gen = ContextWorker(ctx_llm, wrap(a), encode=encode), GenerationWorker(gen_llm, b)
    t = threading.Thread(target=lambda: (ctx.connect(), ctx.serve(PROMPTS, GREEDY)))
    t.start()
    gen.connect()
    reqs, _ = gen.receive()                     # admitted, not decoded yet
    t.join(timeout=60)
    P = gen_llm.pool.page_size
    assert len(reqs) == len(PROMPTS) and all(s.pages_sent == 4 for s in gen.transfers)
    for r in reqs:
        seq = gen_llm.mgr.seqs[r.seq_id]
        # Every full page: the context worker still holds it (cached) under the same hash.
        for i, h in enumerate(seq.hashes):
            src = ctx_llm.pool.lookup(h)
            assert src is not None
            got = gen_llm.pool.kv["draft"][seq.page_ids[i]].view(torch.int16)
            assert torch.equal(got, ctx_llm.pool.kv["draft"][src].view(torch.int16))
            if encode == "never":
                tgt = gen_llm.pool.kv["target"]
                assert torch.equal(tgt[seq.page_ids[i]].view(torch.int16),
                                   ctx_llm.pool.kv["target"][src].view(torch.int16))
        assert len(seq.hashes) == len(r.prompt) // P
    if encode == "never":   # the raw records on the link carry the receiver's pages, byte for byte
        # (per chunk of pages, a tensor of record heads then the slot rows: in order, on one
        # link, so the requests' pages appear one after another)
        blob, at = b"".join(t.numpy().tobytes() for t in rec[0].sent), 0
        for r in reqs:
            for pid in gen_llm.mgr.seqs[r.seq_id].page_ids:
                for name in ("target", "draft"):
                    at = blob.find(gen_llm.pool.kv[name][pid].view(torch.uint8).numpy().tobytes(),
                                   at)
                    assert at >= 0, f"{name} page {pid} is not on the link as it is"
    else:                   # lossless draft codec: 2.7x fewer bytes on the link, same bits
        assert all(s.bytes < 4 * 65536 / 2 for s in gen.transfers)
    outs = gen_llm.resume(reqs)
    assert all(len(o.token_ids) == 32 for o in outs)


def test_arena_1p1d_drafts_without_the_prompt_paged_does_not():
    arena_agg = _llm(drafter_backend="arena").generate(PROMPTS, GREEDY)
    paged_agg = _llm().generate(PROMPTS, GREEDY)
    arena_1p1d, _, _ = _pair(_llm(drafter_backend="arena"), _llm(drafter_backend="arena"))
    paged_1p1d, _, _ = _pair(_llm(), _llm())
    _same(paged_1p1d, paged_agg)
    _same(arena_agg, paged_agg)                   # aggregated, the arena has the whole prompt
    # Verification keeps the tokens exact; only the acceptance falls (3 prompts x 32 tokens with
    # the long-context pair: 2.583 -> 2.325, -10%; the first pair lost more on short prompts).
    assert [o.token_ids for o in arena_1p1d] == [o.token_ids for o in paged_agg]
    assert _mean_al(arena_1p1d) < 0.95 * _mean_al(paged_agg)


def test_seeded_sampling_continues_the_same_rng():
    sp = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=11)
    ref = _llm().generate(PROMPTS, sp)
    outs, _, _ = _pair(_llm(), _llm(), params=sp)
    _same(outs, ref)


def test_generation_worker_with_drafter_refuses_context_without_one():
    with pytest.raises(NamespaceMismatchError) as exc:
        _pair(_llm(drafter=None), _llm())
    assert "drafter" in str(exc.value) and "no drafter" in str(exc.value)


def test_prefix_pages_the_generation_worker_holds_are_not_sent():
    gen_llm = _llm()
    gen_llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2))   # caches 4 pages of prompt 0
    outs, _, gen = _pair(_llm(), gen_llm)
    assert [(t.pages_skipped, t.pages_sent) for t in gen.transfers] == [(4, 0), (0, 4), (0, 4)]
    _same(outs, _llm().generate(PROMPTS, GREEDY))


class _Flaky(LoopbackChannel):
    """Flips a byte of the first ``damage`` tensors (a chunk's record heads first), or cuts the
    link at tensor ``cut``."""

    def __init__(self, inner, damage=0, cut=None):
        super().__init__(inner._in, inner._out, inner.timeout_s)
        self.damage, self.cut, self.n = damage, cut, 0

    def send_tensor(self, t):
        self.n += 1
        if self.cut is not None and self.n == self.cut:
            self.close()
            raise ConnectionError("context worker killed")
        if self.damage:
            self.damage -= 1
            t = t.clone()
            t.view(torch.uint8).view(-1)[7] ^= 0x40
        super().send_tensor(t)


@pytest.mark.parametrize("retries", [1, 0])
def test_damaged_handoff_is_retried_or_failed_cleanly(retries):
    gen_llm = _llm()
    outs, ctx, gen = _pair(_llm(), gen_llm, ctx_channel=lambda ch: _Flaky(ch, damage=1),
                           retries=retries)
    ref = _llm().generate(PROMPTS, GREEDY)
    assert "CRC" in gen.errors[0]
    if retries:
        _same(outs, ref)
    else:
        assert outs[0].finish_reason == "failed" and "CRC" in outs[0].error
        _same(outs[1:], ref[1:])
    gen_llm.pool.check_invariants()
    assert gen_llm.pool.num_in_use == 0


def test_killed_context_worker_leaves_generation_worker_consistent():
    gen_llm = _llm()
    # Tensors: 2 per handoff (one chunk of pages: its record heads, its slot rows); the 4th is
    # request 1's pages.
    with pytest.raises(ConnectionError):
        _pair(_llm(), gen_llm, ctx_channel=lambda ch: _Flaky(ch, cut=4))
    # _pair raised after the generation worker finished: check what it left.
    gen_llm.pool.check_invariants()
    assert gen_llm.pool.num_in_use == 0 and not gen_llm.mgr.seqs
    ns = gen_llm.mgr.namespace_for(None)
    assert all(gen_llm.pool.lookup(h) is None for h in page_hashes(ns, PROMPTS[1]))
    assert all(gen_llm.pool.lookup(h) is not None for h in page_hashes(ns, PROMPTS[0]))


def test_killed_context_worker_outputs_what_was_received():
    a, b = loopback_pair(timeout_s=30)
    ctx, gen = ContextWorker(_llm(), _Flaky(a, cut=4)), GenerationWorker(_llm(), b)
    t = threading.Thread(target=lambda: (ctx.connect(), pytest.raises(ConnectionError, ctx.serve,
                                                                      PROMPTS, GREEDY)))
    t.start()
    gen.connect()
    outs = gen.serve()
    t.join(timeout=60)
    assert [o.request_id for o in outs] == [0]
    _same(outs, _llm().generate(PROMPTS[:1], GREEDY))
    assert any("link lost" in e for e in gen.errors)
