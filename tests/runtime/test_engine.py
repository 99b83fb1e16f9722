"""Engine behaviour: speculative == plain greedy, warm == cold, continuous batching, salts, arena."""

from __future__ import annotations

import pytest

import tiny_dflash as td
from kvstrata.runtime import LLM, CacheConfig, SamplingParams

from tiny_dflash import PROMPTS
from tiny_dflash import cache_config as _cache


@pytest.mark.parametrize("target", ["target", "agree"])
def test_speculative_equals_plain_greedy(ckpts, target):
    spec = LLM(ckpts[target][0], ckpts["drafter"][0], _cache())
    plain = LLM(ckpts[target][0], None, _cache())
    sp = SamplingParams(max_tokens=17)
    a, b = spec.generate(PROMPTS, sp), plain.generate(PROMPTS, sp)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert all(al == 1 for al in y.acceptance_lengths)
        assert len(y.acceptance_lengths) == 16   # first token comes from the prefill
    # Plain decoding also equals Hugging Face greedy generation.
    assert b[1].token_ids == td.plain_generate(ckpts[target][1], PROMPTS[1], 17)
    assert plain.stats()["pool"]["groups"] == ["target"]


def test_warm_equals_cold_and_counts_cached_tokens(ckpts):
    llm = LLM(ckpts["agree"][0], ckpts["drafter"][0], _cache())
    sp = SamplingParams(max_tokens=15)
    cold = llm.generate(PROMPTS, sp)
    warm = llm.generate(PROMPTS, sp)
    for p, c, w in zip(PROMPTS, cold, warm):
        assert c.num_cached_tokens == 0
        # Whole pages only, and the last prompt token is always recomputed.
        assert w.num_cached_tokens == (len(p) - 1) // 4 * 4
        assert (w.token_ids, w.acceptance_lengths) == (c.token_ids, c.acceptance_lengths)
    assert any(len(set(c.acceptance_lengths)) > 1 for c in cold)
    st = llm.stats()
    assert st["prefix"]["hit_tokens"] == sum(w.num_cached_tokens for w in warm)
    assert st["pool"]["in_use"] == 0 and st["pool"]["cached"] > 0
    # Generated text is cached too: a prompt extended by its own output hits beyond the prompt.
    ext = PROMPTS[2] + cold[2].token_ids
    again = llm.generate([ext], SamplingParams(max_tokens=2))[0]
    assert again.num_cached_tokens > len(PROMPTS[2])


def test_cache_salt_isolates_prefixes(ckpts):
    llm = LLM(ckpts["target"][0], ckpts["drafter"][0], _cache())
    sp = SamplingParams(max_tokens=3)
    llm.generate(PROMPTS[:1], sp, cache_salt="alice")
    assert llm.generate(PROMPTS[:1], sp, cache_salt="bob")[0].num_cached_tokens == 0
    assert llm.generate(PROMPTS[:1], sp, cache_salt="alice")[0].num_cached_tokens == 4


def test_continuous_batching_with_small_budgets(ckpts):
    """More requests than slots, a token budget below batch x block (chunked prefills, fewer
    generating sequences per step): same tokens and acceptance as one-at-a-time runs."""
    many = PROMPTS * 3
    sp = SamplingParams(max_tokens=9)
    tight = LLM(ckpts["agree"][0], ckpts["drafter"][0],
                _cache(max_batch_size=4, max_num_batched_tokens=10))
    outs = tight.generate(many, sp)
    solo = LLM(ckpts["agree"][0], ckpts["drafter"][0], _cache(max_batch_size=1))
    for p, o in zip(many[:len(PROMPTS)], outs):
        s = solo.generate([p], sp)[0]
        assert (o.token_ids, o.acceptance_lengths) == (s.token_ids, s.acceptance_lengths)
    for i, o in enumerate(outs):
        ref = outs[i % len(PROMPTS)]
        assert o.token_ids == ref.token_ids
    # Fewer seats and a small budget take more steps than one sequence alone needs.
    assert tight.stats()["engine"]["steps"] > max(len(o.acceptance_lengths) for o in outs)


def test_arena_baseline_keeps_tokens_exact_after_a_prefix_hit(ckpts):
    """The arena drafts from the uncached tail only, yet verification keeps the tokens exact.
    This untrained pair's AL says nothing about context; the AL loss is asserted with the
    trained pair (:func:`test_arena_loses_acceptance_after_a_prefix_hit_and_paged_does_not`)."""
    llm = LLM(ckpts["agree"][0], ckpts["drafter"][0], _cache(drafter_backend="arena"))
    paged = LLM(ckpts["agree"][0], ckpts["drafter"][0], _cache())
    sp = SamplingParams(max_tokens=15)
    cold = llm.generate(PROMPTS, sp)
    ref = paged.generate(PROMPTS, sp)
    assert [o.acceptance_lengths for o in cold] == [o.acceptance_lengths for o in ref]
    warm = llm.generate(PROMPTS, sp)
    assert [o.token_ids for o in warm] == [o.token_ids for o in cold]
    assert all(w.num_cached_tokens > 0 for w, p in zip(warm, PROMPTS) if len(p) > 4)
    assert llm.stats()["pool"]["groups"] == ["target"]   # the arena lives outside the pool


def test_arena_loses_acceptance_after_a_prefix_hit_and_paged_does_not():
    """With the shipped trained pair (whose drafts depend on the context), a warm arena drafts
    from the uncached tail only and commits fewer tokens per step; the paged backend keeps AL."""
    from kvstrata.assets.corpus import heldout_prompts
    prompts = heldout_prompts(4, 256, seed=0)
    sp = SamplingParams(max_tokens=32, ignore_eos=True)

    def al(outs, steps=None):
        return sum(sum(o.acceptance_lengths[:steps]) for o in outs) / sum(
            len(o.acceptance_lengths[:steps]) for o in outs)

    runs = {}
    for backend in ("arena", "paged"):
        llm = LLM("kvstrata-tiny-py", "kvstrata-tiny-py",
                  CacheConfig(drafter_backend=backend, max_batch_size=4, max_seq_len=512,
                              target_codec="identity", draft_codec="identity"))
        cold, warm = llm.generate(prompts, sp), llm.generate(prompts, sp)
        assert all(w.num_cached_tokens == 240 for w in warm)
        assert [w.token_ids for w in warm] == [c.token_ids for c in cold]   # lossless verify
        runs[backend] = (cold, warm)
    (ac, aw), (pc, pw) = runs["arena"], runs["paged"]
    assert [o.acceptance_lengths for o in ac] == [o.acceptance_lengths for o in pc]
    assert [o.acceptance_lengths for o in pw] == [o.acceptance_lengths for o in pc]
    assert al(aw) < al(ac) and al(aw, 4) < al(ac, 4)
