"""External parity: kvstrata's batched engine vs ``dflash.model.dflash_generate`` (temperature 0).

Identical output tokens and identical per-step acceptance lengths, for prompt lengths that are not
multiples of the page size, several block sizes, a drafter with sliding-window layers, many
requests in one batch, and a target/drafter pair that agrees often (multi-token acceptances).
"""

from __future__ import annotations

import pytest
import torch

import tiny_dflash as td
from kvstrata.runtime import LLM, CacheConfig, RunnerConfig, SamplingParams
from kvstrata.runtime.config import DRAFT_BLOCK_ENV
from kvstrata.runtime.verify_width import WIDTHS_ENV

PROMPTS = [[(7 * i + 3) % 290 for i in range(n)] for n in (5, 11, 18)] + [
    [(13 * i + 1) % 290 for i in range(n)] for n in (2, 9, 23)]


def _llm(ckpts, target, drafter, **kw):
    cache = CacheConfig(page_size=4, max_seq_len=128, max_batch_size=8,
                        target_codec="identity", draft_codec="identity")
    return LLM(ckpts[target][0], ckpts[drafter][0], cache, **kw)


@pytest.mark.parametrize("target,drafter,block", [
    ("target", "drafter", None), ("agree", "drafter", None), ("agree", "drafter", 6),
    ("agree", "sliding", None), ("agree", "sliding", 2)])
def test_tokens_and_acceptance_match_reference(ckpts, target, drafter, block):
    llm = _llm(ckpts, target, drafter, block_size=block)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=19))
    ref, hf = ckpts[drafter][1], ckpts[target][1]
    all_al = []
    for p, o in zip(PROMPTS, outs):
        toks, al = td.reference_generate(ref, hf, p, 19, block_size=block)
        assert o.token_ids == toks, p
        assert o.acceptance_lengths == al, p
        assert o.finish_reason == "length" and len(o.token_ids) == 19
        all_al += al
    if target == "agree":
        # The crafted pair really exercises multi-token acceptance (full blocks included).
        assert max(all_al) == (block or 4) and sum(a > 1 for a in all_al) >= 5


@pytest.mark.parametrize("drafter,width", [("drafter", 2), ("drafter", 3), ("sliding", 2)])
def test_narrow_verify_width_drafts_the_references_block_of_that_width(ckpts, drafter, width,
                                                                       monkeypatch):
    """At a verify width V below the block (``draft_block="width"``, the default) the step is
    the reference's with block size V: same tokens, same acceptance lengths."""
    monkeypatch.delenv(DRAFT_BLOCK_ENV, raising=False)
    llm = _llm(ckpts, "agree", drafter, runner=RunnerConfig(verify_widths=(width,)))
    assert llm.block_size == 4 and llm.stats()["runner"]["draft_rows"] == {width: width}
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=19))
    ref, hf = ckpts[drafter][1], ckpts["agree"][1]
    all_al = []
    for p, o in zip(PROMPTS, outs):
        toks, al = td.reference_generate(ref, hf, p, 19, block_size=width)
        assert o.token_ids == toks and o.acceptance_lengths == al, p
        all_al += al
    assert max(all_al) == width
    # the whole block drafted instead: the same tokens (greedy), the block's drafts
    monkeypatch.setenv(DRAFT_BLOCK_ENV, "full")
    full = _llm(ckpts, "agree", drafter, runner=RunnerConfig(verify_widths=(width,)))
    assert full.runner.draft_rows == {width: 4}
    assert [o.token_ids for o in full.generate(PROMPTS, SamplingParams(max_tokens=19))] == [
        o.token_ids for o in outs]


def test_width_one_steps_keep_the_draft_context(ckpts, monkeypatch):
    """Width 1 drafts nothing, verifies the pending token alone and still writes the drafter's
    context: after k width-1 steps the full-width steps are the reference's on the prompt
    extended by those k tokens (same tokens, same acceptance lengths)."""
    monkeypatch.delenv(WIDTHS_ENV, raising=False)
    llm = _llm(ckpts, "agree", "drafter", runner=RunnerConfig(verify_widths=(4, 1)))
    B, k = llm.block_size, 3
    assert llm.runner.widths == (B, 1) and llm.stats()["runner"]["draft_rows"] == {B: B}
    calls = []

    def forced(b):          # the policy's choice, forced: k steps at width 1, then the block
        calls.append(b)
        return 1 if len(calls) <= k else B

    monkeypatch.setattr(llm.runner.width_policy, "choose", forced)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=19))
    ref, hf = ckpts["drafter"][1], ckpts["agree"][1]
    later = []
    for p, o in zip(PROMPTS, outs):
        assert o.acceptance_lengths[:k] == [1] * k, p
        toks, al = td.reference_generate(ref, hf, p + o.token_ids[:k], 19 - k)
        assert o.token_ids[k:] == toks and o.acceptance_lengths[k:] == al, p
        later += al
    assert max(later) == B          # full blocks accepted after the width-1 steps
    # The draft context itself (this pair's drafts hardly depend on it): every cached full
    # page's draft K/V equals that of an engine pinned to the block.
    full = _llm(ckpts, "agree", "drafter", runner=RunnerConfig(verify_widths=(B,)))
    assert [o.token_ids for o in full.generate(PROMPTS, SamplingParams(max_tokens=19))] == [
        o.token_ids for o in outs]
    for p, o in zip(PROMPTS, outs):
        a, c = full.mgr.lookup(p + o.token_ids), llm.mgr.lookup(p + o.token_ids)
        assert a.num_tokens == c.num_tokens >= len(p) + k
        torch.testing.assert_close(llm.pool.kv["draft"][c.page_ids],
                                   full.pool.kv["draft"][a.page_ids])


def test_stop_tokens_match_reference(ckpts):
    llm = _llm(ckpts, "agree", "drafter")
    stops = [17, 42]
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=30, stop_token_ids=stops))
    ref, hf = ckpts["drafter"][1], ckpts["agree"][1]
    n_stopped = 0
    for p, o in zip(PROMPTS, outs):
        toks, al = td.reference_generate(ref, hf, p, 30, stop=stops)
        assert o.token_ids == toks and o.acceptance_lengths == al
        if o.finish_reason == "stop":
            n_stopped += 1
            assert o.token_ids[-1] in stops
    assert n_stopped >= 1
