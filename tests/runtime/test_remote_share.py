"""Two engines share a prefix through a real Redis: engine A (its own process) computes prompts,
engine B (this process, same namespace) gets their pages from the remote tier, both groups:
identical tokens with lossless codecs and AL equal to cold. Another salt or model gets nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from kvstrata.runtime import LLM, CacheConfig, SamplingParams
from kvstrata.testing.redis import RedisServer

PROMPTS = [[(7 * i + 3) % 290 for i in range(n)] for n in (13, 21, 30)]


def _cache(url, **kw):
    return CacheConfig(page_size=4, max_seq_len=96, max_batch_size=8, target_codec="identity",
                       draft_codec="lossless", tiers=dict(host_bytes=1 << 20, remote=url, **kw))


ENGINE_A = textwrap.dedent("""
    import json, sys
    from kvstrata.runtime import LLM, CacheConfig, SamplingParams
    target, drafter, url, prompts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    llm = LLM(target, drafter, CacheConfig(
        page_size=4, max_seq_len=96, max_batch_size=8, target_codec="identity",
        draft_codec="lossless", tiers=dict(host_bytes=1 << 20, remote=url, write_through=True)))
    out = llm.generate(prompts, SamplingParams(max_tokens=15))
    llm.tiers.write_back()
    print(json.dumps({"out": [[o.token_ids, o.acceptance_lengths, o.num_cached_tokens]
                              for o in out],
                      "stored": llm.tiers.stats()["host_to_remote_pages"]}))
""")


def test_engine_b_gets_engine_a_prefix_from_redis(ckpts):
    with RedisServer() as srv:
        r = subprocess.run([sys.executable, "-c", ENGINE_A, ckpts["agree"][0],
                            ckpts["drafter"][0], srv.url, json.dumps(PROMPTS)],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        a = json.loads(r.stdout.strip().splitlines()[-1])
        assert a["stored"] > 0 and all(c == 0 for _, _, c in a["out"])
        b = LLM(ckpts["agree"][0], ckpts["drafter"][0], _cache(srv.url))
        warm = b.generate(PROMPTS, SamplingParams(max_tokens=15))
        for p, (tokens, als, _), w in zip(PROMPTS, a["out"], warm):
            assert w.num_cached_tokens == (len(p) - 1) // 4 * 4
            assert (w.token_ids, w.acceptance_lengths) == (tokens, als)
        st = b.stats()["tiers"]
        # the prompts are prefixes of one another: the longest one's pages, each read once
        assert st["remote_to_host_pages"] == (len(PROMPTS[-1]) - 1) // 4
        assert st["mismatches"] == 0 and st["checksum_failures"] == 0
        # Another salt, another model: nothing from A.
        salted = b.generate(PROMPTS[:1], SamplingParams(max_tokens=2), cache_salt="other")
        assert salted[0].num_cached_tokens == 0
        other = LLM(ckpts["target"][0], ckpts["drafter"][0], _cache(srv.url))
        assert other.generate(PROMPTS[:1], SamplingParams(max_tokens=2))[0].num_cached_tokens == 0
        assert other.stats()["tiers"]["remote_to_host_pages"] == 0


def test_engine_runs_without_an_unreachable_remote_and_says_so_once(ckpts, caplog):
    from kvstrata.testing.redis import free_port
    url = f"redis://127.0.0.1:{free_port()}/0"
    with caplog.at_level("WARNING", logger="kvstrata.tiers.remote"):
        llm = LLM(ckpts["agree"][0], ckpts["drafter"][0], _cache(url))
        out = llm.generate(PROMPTS, SamplingParams(max_tokens=4))
    assert all(len(o.token_ids) == 4 for o in out) and llm.tiers.remote is None
    assert len([r for r in caplog.records if "without the remote tier" in r.message]) == 1
    with pytest.raises(ValueError, match="scheme"):
        LLM(ckpts["agree"][0], ckpts["drafter"][0], _cache("http://127.0.0.1:1/0"))
