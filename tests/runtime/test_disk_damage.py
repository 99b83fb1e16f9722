"""A running engine whose disk tier's LMDB index is damaged keeps generating, and gets its
prefixes from disk again once the index is rebuilt (at open or on the way)."""

from __future__ import annotations

import random

import pytest

from kvstrata.runtime import LLM, CacheConfig, SamplingParams
from kvstrata.testing import damage
from kvstrata.tiers import DiskTier

PROMPTS = [[(7 * i + 3 + k) % 290 for i in range(21)] for k in range(4)]
SP = SamplingParams(max_tokens=6)
CACHED = (21 - 1) // 4 * 4          # whole pages of the prompt, the last token recomputed


def _llm(ckpts, path):
    cache = CacheConfig(page_size=4, max_seq_len=64, max_batch_size=4, target_codec="identity",
                        draft_codec="identity",
                        tiers=dict(host_bytes=1 << 20, disk=DiskTier(path, map_size=1 << 24)))
    return LLM(ckpts["agree"][0], ckpts["drafter"][0], cache)


def _to_disk(llm):
    llm.pool.evict(llm.pool.num_cached)
    llm.tiers.drain_host()


@pytest.mark.parametrize("kind", ["page type bits", "truncated", "meta pages"])
def test_engine_survives_a_damaged_index_and_serves_from_disk_after_the_rebuild(
        ckpts, tmp_path, kind):
    path = tmp_path / "disk"
    llm = _llm(ckpts, path)
    cold = llm.generate(PROMPTS, SP)
    _to_disk(llm)
    assert len(llm.tiers.disk) > 0
    if kind == "page type bits":
        damage.flip_page_type(path, damage.some_pages(path, 4, random.Random(0)))
    elif kind == "truncated":
        damage.truncate(path)
    else:
        damage.damage_meta(path)
    warm = llm.generate(PROMPTS, SP)            # never raises; same tokens
    assert [w.token_ids for w in warm] == [c.token_ids for c in cold]
    disk = llm.tiers.disk
    if kind != "meta pages":                    # found on the way: a miss, then a rebuild
        assert disk.counters()["index_errors"] >= 1
        assert warm[0].num_cached_tokens == 0 and disk.counters()["rebuilds"] == 1
        _to_disk(llm)
        again = llm.generate(PROMPTS, SP)
        assert [a.num_cached_tokens for a in again] == [CACHED] * len(PROMPTS)
        assert [a.token_ids for a in again] == [c.token_ids for c in cold]
    llm.tiers.close()
    # a new engine on the same directory: meta pages are caught before mapping and rebuilt
    llm2 = _llm(ckpts, path)
    assert llm2.tiers.disk.counters()["rebuilds"] == (kind == "meta pages")
    again = llm2.generate(PROMPTS, SP)
    assert [a.num_cached_tokens for a in again] == [CACHED] * len(PROMPTS)
    assert [a.token_ids for a in again] == [c.token_ids for c in cold]
    llm2.tiers.close()
