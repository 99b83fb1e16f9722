"""The verify width (runtime/verify_width.py, the runner's decode path): the policy's censored
acceptance counts, its expected tokens, its choice against step times, its exploration; and in
the engine, a narrower verify width produces the tokens of the full one (greedy acceptance
keeps every token the target's), never more per step than it verifies."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstrata.runtime import LLM, CacheConfig, RunnerConfig, SamplingParams
from kvstrata.runtime.config import DRAFT_BLOCK_ENV, draft_block_mode
from kvstrata.runtime.verify_width import (WIDTHS_ENV, WidthPolicy, default_widths,
                                           parse_widths)

PROMPTS = [[(7 * i + 3) % 290 for i in range(n)] for n in (6, 13, 21)]


def test_default_and_parsed_widths():
    assert default_widths(16) == (16, 8, 4, 2, 1) and default_widths(8) == (8, 4, 2, 1)
    assert default_widths(4) == (4, 2, 1)
    assert default_widths(2) == (2, 1) and default_widths(1) == (1,)
    assert parse_widths("4, 16,8,16", 16, WIDTHS_ENV) == (16, 8, 4)
    assert parse_widths([2], 4, "cfg") == (2,)
    assert parse_widths("1,16", 16, WIDTHS_ENV) == (16, 1)     # 1: no drafts
    assert parse_widths([1], 1, "cfg") == (1,)                 # no drafter: one position
    for bad, match in (("16,x", "comma-separated integers"), ("0", r"1\.\.16"),
                       ("17", r"1\.\.16"), ("", r"1\.\.16")):
        with pytest.raises(ValueError, match=match):
            parse_widths(bad, 16, WIDTHS_ENV)
    with pytest.raises(ValueError, match="integers"):
        parse_widths([4.0], 16, "cfg")
    with pytest.raises(ValueError, match="positive integers"):
        RunnerConfig(verify_widths=(0, 4))
    assert RunnerConfig(verify_widths=[8, 4]).verify_widths == (8, 4)


def test_draft_block_setting_and_environment(monkeypatch):
    monkeypatch.delenv(DRAFT_BLOCK_ENV, raising=False)
    assert draft_block_mode(RunnerConfig()) == "width"
    assert draft_block_mode(RunnerConfig(draft_block="full")) == "full"
    with pytest.raises(ValueError, match="draft_block must be one of"):
        RunnerConfig(draft_block="half")
    monkeypatch.setenv(DRAFT_BLOCK_ENV, "FULL")
    assert draft_block_mode(RunnerConfig()) == "full"            # the environment wins
    monkeypatch.setenv(DRAFT_BLOCK_ENV, "narrow")
    with pytest.raises(ValueError, match=f"{DRAFT_BLOCK_ENV}='narrow': use one of width, full"):
        draft_block_mode(RunnerConfig())


def test_censored_counts():
    """A step's rows count as trials only at the positions they verified: a row that produced
    everything it verified observed no rejection (censored), one that produced fewer observed
    one at the next position; padding rows (0 verified) count nothing."""
    pol = WidthPolicy(8, (8, 4))
    pol.observe(np.array([3, 4, 1, 2]), np.array([8, 4, 8, 0]))
    # row 0: drafts 1, 2 accepted, 3 rejected; row 1: 1..3 accepted (all it verified);
    # row 2: draft 1 rejected; row 3: padding
    assert pol.trials[1:].tolist() == [3, 2, 2, 0, 0, 0, 0]
    assert pol.accepts[1:].tolist() == [2, 2, 1, 0, 0, 0, 0]
    p = pol.acceptance()
    q = (5 + 1) / (7 + 1)                                      # pooled over the positions
    assert p[:3].tolist() == pytest.approx([(2 + q) / 4, (2 + q) / 3, (1 + q) / 3])
    assert p[3:].tolist() == pytest.approx([q] * 4)           # untried: the pooled rate
    assert pol.expected_tokens(2) == pytest.approx(1 + p[0])
    assert pol.expected_tokens(4) == pytest.approx(1 + p[0] + p[0] * p[1] + p[0] * p[1] * p[2])
    assert WidthPolicy(8, (8, 4)).acceptance().tolist() == [1.0] * 7     # no counts yet


@given(st.lists(st.tuples(st.integers(1, 16), st.integers(0, 16)), min_size=1, max_size=40))
def test_counts_match_a_row_by_row_count(rows):
    pol = WidthPolicy(16, (16, 8, 4))
    produced = np.array([min(p, max(v, 1)) for p, v in rows])
    verified = np.array([v for _, v in rows])
    pol.observe(produced, verified)
    t, a = np.zeros(16), np.zeros(16)
    for L, v in zip(produced, verified):
        for j in range(1, v):                       # drafts 1 .. v-1 were verified
            if L >= j:                              # reached draft j
                t[j] += 1
                a[j] += L >= j + 1
    assert pol.trials.tolist() == t.tolist() and pol.accepts.tolist() == a.tolist()


def _geometric(pol: WidthPolicy, p: float, n: int = 4000) -> None:
    """Counts as if every draft were accepted with probability ``p``, independently: ``n``
    rows verified every draft; ``n p^j`` of them accepted drafts 1 .. j."""
    B = pol.block
    reach = np.array([n * p ** j for j in range(B)])      # rows that accepted drafts 1 .. j
    pol._last_accepted[:] = -np.diff(np.append(reach, 0.0))
    pol._last_tried[:] = 0.0                              # rejected at j, or reached B - 1
    pol._last_tried[1:B - 1] = reach[:B - 2] - reach[1:B - 1]
    pol._last_tried[B - 1] = reach[B - 2]
    assert pol.trials[1:].tolist() == pytest.approx(reach[:B - 1].tolist())
    assert pol.accepts[1:].tolist() == pytest.approx(reach[1:].tolist())


def test_a_drafter_never_accepted_gets_the_cheapest_width():
    """Deep positions no step reaches take the pooled rate, not an optimistic 1: a drafter
    whose first draft is (almost) never accepted runs the cheapest width even at batch 1."""
    pol = WidthPolicy(16, (16, 8, 4))
    pol.capture_ms.update({(1, 16): 5.72, (1, 8): 5.57, (1, 4): 5.47})
    for _ in range(40):
        pol.observe(np.array([1] * 15 + [2]), np.array([16] * 16))
    assert pol.trials[2] == 40 and pol.trials[3] == 0
    assert pol.expected_tokens(16) < 1.1 and pol.best(1) == 4
    # with width 1 captured (no drafts), not drafting at all is the cheapest
    pol1 = WidthPolicy(16, (16, 8, 4, 2, 1))
    pol1.capture_ms.update({(64, 16): 35.2, (64, 8): 20.1, (64, 4): 12.6, (64, 2): 9.9,
                            (64, 1): 7.7})
    for _ in range(40):
        pol1.observe(np.array([1] * 64), np.array([2] * 64))
    assert pol1.expected_tokens(1) == 1.0 and pol1.best(64) == 1


def test_choice_follows_expected_tokens_per_millisecond():
    pol = WidthPolicy(16, (16, 8, 4))
    assert pol.best(64) == 16                         # no timing yet: the widest
    # batch 64: compute-bound verify (ms roughly with the rows); batch 1: flat
    pol.capture_ms.update({(64, 16): 35.0, (64, 8): 20.0, (64, 4): 12.0,
                           (1, 16): 6.0, (1, 8): 5.9, (1, 4): 5.85})
    assert pol.best(64) == 16                         # untried drafts count as accepted
    _geometric(pol, 0.8)
    e = [pol.expected_tokens(w) for w in (16, 8, 4)]
    assert e == pytest.approx([(1 - 0.8 ** w) / 0.2 for w in (16, 8, 4)], rel=1e-3)
    assert pol.best(64) == 4 and pol.best(1) == 16
    _geometric(pol, 0.93)
    assert pol.best(64) == 8 and pol.best(1) == 16
    # measured steps 30 ms beyond the capture time (long contexts): the products matter less
    for _ in range(200):
        pol.observe_time(64, 8, 50.0)
    assert pol.extra_ms[64] == pytest.approx(30.0, rel=1e-3)
    assert pol.step_ms(64, 16) == pytest.approx(65.0, rel=1e-3)     # no offsets learned yet
    assert pol.best(64) == 16
    pol.choose(64)
    st = pol.stats()
    assert st["verify_widths"] == [16, 8, 4]
    # the estimates behind the choice, for batch sizes that have chosen
    assert st["verify_step_ms"] == {64: {16: 65.0, 8: 50.0, 4: 42.0}}


def test_exploration_and_halving():
    pol = WidthPolicy(16, (16, 4), explore_every=4, halve_at=100)
    pol.capture_ms.update({(8, 16): 10.0, (8, 4): 2.0})
    _geometric(pol, 0.5, n=60)
    chosen = [pol.choose(8) for _ in range(8)]
    assert chosen == [4, 4, 4, 16, 4, 4, 4, 4]    # 16 costs ~80% of a step: every 128 steps
    assert pol.stats()["verify_width_by_batch"] == {8: 4}
    pol.observe(np.array([16] * 50), np.array([16] * 50))    # trials of draft 1 reach 110
    assert pol.trials[1] == pytest.approx(55.0)
    assert WidthPolicy(4, (4,)).choose(1) == 4                # one width: never explores


def test_exploration_visits_every_other_width_at_a_bounded_cost():
    pol = WidthPolicy(16, (16, 8, 4), explore_every=4, explore_cost=0.04)
    pol.capture_ms.update({(8, 16): 10.0, (8, 8): 5.0, (8, 4): 2.0})
    _geometric(pol, 0.3, n=60)
    chosen = [pol.choose(8) for _ in range(8)]
    assert pol.chosen[8] == 4
    assert chosen == [4, 4, 4, 16, 8, 4, 4, 4]                # due together: widest first
    # A step at width 16 takes 5x the chosen width's time for E(16) / E(4) of its tokens: it
    # costs 5 - E(16) / E(4) steps of the chosen width's throughput, so at 4% of throughput
    # per width it runs once in 25 times that many steps (at least every 4, at most 128).
    p = pol.acceptance()
    e = {w: pol.expected_tokens(w, p) for w in (16, 8, 4)}
    t = {w: pol.step_ms(8, w) for w in (16, 8, 4)}
    assert pol.explore_period(8, 16, 4) == int((t[16] / t[4] - e[16] / e[4]) / 0.04) == 99
    runs = [pol.choose(8) for _ in range(2400)]
    assert runs.count(16) == pytest.approx(2400 / pol.explore_period(8, 16, 4), abs=1)
    assert runs.count(8) == pytest.approx(2400 / pol.explore_period(8, 8, 4), abs=1)
    # throughput: expected tokens over time, against the chosen width's alone
    lost = 1 - (sum(e[w] for w in runs) / sum(t[w] for w in runs)) / (e[4] / t[4])
    assert 0.04 < lost < 2 * 0.04      # two widths explored, ~4% each
    # no measured times: the shortest period
    assert WidthPolicy(16, (16, 4), explore_every=4).explore_period(1, 16, 4) == 4


def test_time_model_learns_each_width_from_the_steps():
    """Steps whose attention grows with the context and with the width (long contexts at batch
    16): the estimates follow every width, not only the chosen one, and the choice follows the
    true tokens per millisecond as it moves from the widest to a narrower width."""
    capture = {16: 6.0, 8: 5.0, 4: 4.5}
    attn_per_row_ktok = 0.002         # ms per verified row and 1k tokens of context

    def true_ms(width, ctx):
        return capture[width] + 0.3 * ctx / 1024 + attn_per_row_ktok * 16 * width * ctx / 1024

    pol = WidthPolicy(16, (16, 8, 4), explore_every=8, decide_every=4)
    pol.capture_ms.update({(16, w): t for w, t in capture.items()})
    _geometric(pol, 0.85)
    p = pol.acceptance()
    picks = []
    for step in range(4000):
        ctx = 1024 + 3 * step
        w = pol.choose(16)
        pol.observe_time(16, w, true_ms(w, ctx))
        if step % 500 == 499:
            est = {v: pol.step_ms(16, v) for v in (16, 8, 4)}
            for v in (16, 8, 4):
                assert est[v] == pytest.approx(true_ms(v, ctx), rel=0.08), (step, v, est)
            rate = {v: pol.expected_tokens(v, p) / true_ms(v, ctx) for v in (16, 8, 4)}
            picks.append((max(rate, key=rate.get), pol.best(16)))
            assert rate[pol.best(16)] >= 0.98 * max(rate.values()), (step, rate, est)
    assert picks[0] == (16, 16) and picks[-1] == (8, 8)        # the best width did move


def _llm(ckpts, widths=None):
    cache = CacheConfig(page_size=4, max_seq_len=96, max_batch_size=8, target_codec="identity",
                        draft_codec="identity")
    llm = LLM(ckpts["agree"][0], ckpts["drafter"][0], cache,
              runner=RunnerConfig(verify_widths=widths))
    for t in llm.pool.kv.values():
        t.zero_()
    return llm


def test_narrow_widths_produce_the_full_widths_tokens(ckpts, monkeypatch):
    """Greedy: the tokens do not depend on the verify width; a step produces at most as many
    tokens as it verifies; the runner reports its widths and the drafts' acceptance."""
    monkeypatch.delenv(WIDTHS_ENV, raising=False)
    sp = SamplingParams(max_tokens=40)
    full = _llm(ckpts)
    B = full.block_size
    assert B >= 4 and full.runner.widths == (B,)       # the CPU default: the block
    ref = full.generate(PROMPTS, sp)
    for w in (2, B // 2):
        llm = _llm(ckpts, (w,))
        outs = llm.generate(PROMPTS, sp)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref], f"width {w}"
        steps = [a for o in outs for a in o.acceptance_lengths]
        assert max(steps) <= w and max(a for o in ref for a in o.acceptance_lengths) > w
        st_ = llm.stats()["runner"]
        assert st_["verify_widths"] == [w] and st_["decode_steps"] > 0
    monkeypatch.setenv(WIDTHS_ENV, "2")
    assert _llm(ckpts, (B,)).runner.widths == (2,)       # the environment wins
    monkeypatch.setenv(WIDTHS_ENV, str(B + 1))
    with pytest.raises(ValueError, match=WIDTHS_ENV):
        _llm(ckpts)


def test_adaptive_widths_on_the_decode_path(ckpts):
    """Several widths without graphs (nothing timed): the policy keeps the widest, counts the
    drafts' acceptance from the steps, and the tokens are the single width's."""
    sp = SamplingParams(max_tokens=40)
    B = _llm(ckpts).block_size
    llm = _llm(ckpts, (B, 2))
    outs = llm.generate(PROMPTS, sp)
    ref = _llm(ckpts, (B,)).generate(PROMPTS, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    st_ = llm.stats()["runner"]
    assert st_["verify_widths"] == [B, 2] and set(st_["verify_width_by_batch"].values()) == {B}
    acc = st_["draft_acceptance"]
    assert len(acc) == B - 1 and all(0.0 < p <= 1.0 for p in acc)
    assert llm.runner.width_policy.trials[1] > 0
