"""Config validation at engine build time and per-request rejection."""

from __future__ import annotations

import pytest

import tiny_dflash as td
from kvstrata.runtime import LLM, CacheConfig, SamplingParams


def _cache(**kw):
    base = dict(page_size=4, max_seq_len=64, max_batch_size=4, target_codec="identity",
                draft_codec="identity")
    base.update(kw)
    return CacheConfig(**base)


def test_kv_budget_error_says_what_fits(ckpts):
    # target: 4 layers x 2 x 2 heads x 16 x 4 B = 1 KiB/token; draft: 2 layers -> 512 B/token.
    per_page = (1024 + 512) * 4
    # max_seq_len=64 is 16 pages: a pool of 12 cannot hold one sequence.
    with pytest.raises(ValueError, match=r"one sequence of max_seq_len=64 needs 16 pages .* "
                                         r"holds 12 pages. The largest max_seq_len that fits is 48"):
        LLM(ckpts["target"][0], ckpts["drafter"][0], _cache(kv_cache_bytes=per_page * 12))
    # Below max_batch_size x max_seq_len is fine (admission by need, preemption).
    small = LLM(ckpts["target"][0], ckpts["drafter"][0], _cache(kv_cache_bytes=per_page * 40))
    assert small.pool.num_pages == 40
    llm = LLM(ckpts["target"][0], ckpts["drafter"][0], _cache(kv_cache_bytes=per_page * 64))
    assert llm.pool.num_pages == 64 and llm.pool.bytes_per_page == per_page


def test_max_seq_len_against_position_limits(ckpts):
    with pytest.raises(ValueError, match="max_position_embeddings=256; the largest that fits is 256"):
        LLM(ckpts["target"][0], ckpts["drafter"][0], _cache(max_seq_len=300))
    assert LLM(ckpts["target"][0], None, _cache(max_seq_len=None)).max_seq_len == 256


def test_token_budget(ckpts):
    with pytest.raises(ValueError, match="use at least 4"):
        LLM(ckpts["target"][0], ckpts["drafter"][0], _cache(max_num_batched_tokens=3))
    # Below max_batch_size x block_size is fine (fewer generating sequences per step).
    LLM(ckpts["target"][0], ckpts["drafter"][0], _cache(max_num_batched_tokens=5))


def test_drafter_target_compatibility(ckpts, tmp_path):
    td.make_drafter(tmp_path / "wide", hidden_size=32, intermediate_size=64,
                    num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(ValueError, match="hidden_size=32 != target hidden_size=64"):
        LLM(ckpts["target"][0], str(tmp_path / "wide"), _cache())
    td.make_drafter(tmp_path / "deep", num_target_layers=8,
                    dflash_config={"mask_token_id": 299, "target_layer_ids": [1, 6]})
    with pytest.raises(ValueError, match=r"include \[6\].*num_target_layers=8"):
        LLM(ckpts["target"][0], str(tmp_path / "deep"), _cache())
    td.make_drafter(tmp_path / "vocab", vocab_size=320)
    with pytest.raises(ValueError, match="vocab_size=320 != target vocab_size=300"):
        LLM(ckpts["target"][0], str(tmp_path / "vocab"), _cache())


@pytest.mark.parametrize("kw,msg", [
    (dict(page_size=6), "power of two"), (dict(max_batch_size=0), "max_batch_size"),
    (dict(drafter_backend="dense"), "drafter_backend"), (dict(kv_cache_bytes=-1), "kv_cache_bytes"),
    (dict(max_seq_len=1), "max_seq_len"),
    (dict(target_codec="fp8"), "target_codec: unknown codec 'fp8'; known: identity, lossless"),
    (dict(draft_codec="zstd"), "draft_codec: unknown codec 'zstd'")])
def test_cache_config_fields(kw, msg):
    with pytest.raises(ValueError, match=msg):
        _cache(**kw)


@pytest.mark.parametrize("kw,msg", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k"), (dict(stop_token_ids=[-1]), "stop")])
def test_sampling_params_fields(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


def test_bad_requests_are_rejected_one_by_one(ckpts):
    llm = LLM(ckpts["target"][0], ckpts["drafter"][0], _cache())
    good = [1, 2, 3, 4, 5]
    outs = llm.generate([good, [], [1, 300, 2], list(range(64)), "hello", good],
                        SamplingParams(max_tokens=4))
    assert [o.finish_reason for o in outs] == ["length", "rejected", "rejected", "rejected",
                                               "rejected", "length"]
    assert "empty prompt" in outs[1].error
    assert "[300] are outside the vocabulary [0, 300)" in outs[2].error
    assert "at most 63 prompt tokens fit" in outs[3].error
    assert "a text prompt needs a tokenizer" in outs[4].error   # the test pair has none
    assert outs[0].token_ids == outs[5].token_ids and len(outs[0].token_ids) == 4
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate([good], [SamplingParams(), SamplingParams()])
    # Generation stops at max_seq_len even when max_tokens asks for more.
    long = llm.generate([list(range(60))], SamplingParams(max_tokens=50))[0]
    assert len(long.token_ids) == 4 and long.finish_reason == "length"
