"""Rejection sampling is lossless: generated tokens follow the target's sampling distribution.

A tiny vocabulary (16) makes the exact distributions cheap: for a fixed prompt we compute the
target's per-position marginals of the 1st, 2nd and 3rd generated token exactly (enumerating the
earlier tokens) and compare them with 800 speculative samples through a chi-square test at
significance 1e-3 (the false-failure rate of each comparison; the seed is fixed, so the outcome
is deterministic).
"""

from __future__ import annotations

import math

import pytest
import torch

import tiny_dflash as td
from kvstrata.runtime import LLM, CacheConfig, SamplingParams
from kvstrata.runtime.sampling import greedy_accept, rejection_accept, sampling_probs

V, N = 16, 800
PROMPT = [3, 9, 1, 12, 7]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    d = tmp_path_factory.mktemp("small")
    hf = td.make_target(d / "t", vocab_size=V)
    td.make_drafter(d / "d", vocab_size=V, seed=3,
                    dflash_config={"mask_token_id": V - 1, "target_layer_ids": [0, 2]})
    return str(d / "t"), str(d / "d"), hf


def _exact_marginals(hf, sp):
    """P(t1), P(t2), P(t3) under the target's sampling distribution (enumerating t1, t2)."""
    def probs(prefixes):
        with torch.no_grad():
            logits = hf(torch.tensor(prefixes)).logits[:, -1].float()
        return sampling_probs(logits, sp.temperature, sp.top_p, sp.top_k)
    p1 = probs([PROMPT])[0]
    p2c = probs([PROMPT + [a] for a in range(V)])                     # [t1, t2]
    j12 = p1[:, None] * p2c
    p3c = probs([PROMPT + [a, b] for a in range(V) for b in range(V)]).view(V, V, V)
    p3 = (j12[:, :, None] * p3c).sum((0, 1))
    return [p1, j12.sum(0), p3]


def _chi2_critical(df, z=3.09):   # Wilson-Hilferty; z = 3.09 is the 1 - 1e-3 normal quantile
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(counts, p):
    exp = p * N
    keep = exp >= 5                 # pool sparse cells so the chi-square approximation holds
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    e = torch.cat([exp[keep], exp[~keep].sum()[None]])
    obs, e = obs[e > 0], e[e > 0]
    return float(((obs - e) ** 2 / e).sum()), len(e) - 1


@pytest.mark.parametrize("sp", [SamplingParams(max_tokens=3, temperature=1.0),
                                SamplingParams(max_tokens=3, temperature=0.8, top_k=6, top_p=0.9)],
                         ids=["t1", "t0.8-k6-p0.9"])
def test_rejection_sampling_matches_target_distribution(small, sp):
    tdir, ddir, hf = small
    llm = LLM(tdir, ddir, CacheConfig(page_size=4, max_seq_len=16, max_batch_size=256,
                                      max_num_batched_tokens=4096, target_codec="identity",
                                      draft_codec="identity"), seed=1234)
    outs = llm.generate([PROMPT] * N, sp)
    toks = torch.tensor([o.token_ids for o in outs])
    assert toks.shape == (N, 3)
    als = [a for o in outs for a in o.acceptance_lengths]
    assert max(als) >= 2            # drafts really get accepted (the accept path is exercised)
    for pos, p in enumerate(_exact_marginals(hf, sp)):
        counts = torch.bincount(toks[:, pos], minlength=V).float()
        assert counts[p == 0].sum() == 0, f"position {pos}: sampled a token of probability 0"
        stat, df = _chi2(counts, p)
        assert stat < _chi2_critical(df), (pos, stat, df)


def test_acceptance_rules_unit():
    assert greedy_accept([4, 5, 6], [4, 5, 9, 1]) == (2, 9)
    assert greedy_accept([4, 5], [4, 5, 7]) == (2, 7)
    assert greedy_accept([], [3]) == (0, 3)
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.5, 0.0]])
    q = torch.tensor([[1.0, 0.0, 0.0]])
    # Draft token 0 has target probability 0: always rejected, resampled from max(p - q, 0).
    assert rejection_accept(torch.tensor([0]), p, q, g) == (0, 1)
    # p == q: always accepted, the bonus comes from the last row.
    acc, tok = rejection_accept(torch.tensor([1]), p[[0, 1]], p[[0]], g)
    assert acc == 1 and tok in (0, 1)
    probs = sampling_probs(torch.tensor([[0.0, 1.0, 2.0, 3.0]]), 1.0, top_p=0.5, top_k=3)
    assert probs[0, 0] == 0 and probs[0, 1] == 0 and torch.isclose(probs.sum(), torch.tensor(1.0))
