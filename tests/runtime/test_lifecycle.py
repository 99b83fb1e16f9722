"""Request lifecycle: errors free everything, stopping (EOS, stop ids/strings, min_tokens), the
engine core (add_request / step / abort), preemption under pool pressure, close() and restart."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kvstrata.pagepool.manager import UnknownSequenceError
from kvstrata.runtime import LLM, CacheConfig, SamplingParams

from tiny_dflash import PROMPTS
from tiny_dflash import assert_clean as _clean
from tiny_dflash import cache_config as _cache


def _nan_params(max_tokens=4) -> SamplingParams:
    """A request that fails inside the step (validation now rejects NaN, so bypass it)."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=1.0)
    object.__setattr__(sp, "temperature", float("nan"))
    return sp


@pytest.mark.parametrize("field,value", [("temperature", float("nan")),
                                         ("temperature", float("inf")),
                                         ("top_p", float("nan")), ("min_tokens", 9),
                                         ("stop", [""]), ("ignore_eos", 1)])
def test_bad_sampling_params_are_rejected_when_built(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(max_tokens=8, **{field: value})


def test_a_failing_request_is_its_own_error_and_nothing_leaks(ckpts):
    llm = LLM(ckpts["agree"][0], ckpts["drafter"][0], _cache())
    p = PROMPTS[2]
    ref = llm.generate([p], SamplingParams(max_tokens=4))[0]
    for _ in range(6):
        good, bad = llm.generate([p, p], [SamplingParams(max_tokens=4), _nan_params()])
        assert good.finish_reason == "length" and good.token_ids == ref.token_ids
        assert bad.finish_reason == "error" and "RuntimeError" in bad.error
        _clean(llm)
    assert llm.stats()["engine"]["failed_requests"] == 6
    assert llm.stats()["pool"]["free"] + llm.stats()["pool"]["cached"] == llm.pool.num_pages


def test_keyboard_interrupt_inside_generate_frees_everything(ckpts, monkeypatch):
    llm = LLM(ckpts["agree"][0], ckpts["drafter"][0], _cache())
    real, calls = llm.runner.execute, []

    def boom(items):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(items)

    monkeypatch.setattr(llm.runner, "execute", boom)     # the device side of a step
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, SamplingParams(max_tokens=12))
    _clean(llm)
    monkeypatch.setattr(llm.runner, "execute", real)
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_eos_stops_by_default_and_ignore_eos_goes_on(ckpts):
    base = LLM(ckpts["agree"][0], ckpts["drafter"][0], _cache())
    ref = base.generate(PROMPTS[1:2], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    k = 6
    eos = ref.token_ids[k]
    first = ref.token_ids.index(eos)       # EOS stops at its first occurrence
    llm = LLM(ckpts["agree"][0], ckpts["drafter"][0], _cache(), eos_token_ids=[eos])
    out = llm.generate(PROMPTS[1:2], SamplingParams(max_tokens=20))[0]
    assert out.token_ids == ref.token_ids[:first + 1] and out.finish_reason == "stop"
    full = llm.generate(PROMPTS[1:2], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert full.token_ids == ref.token_ids and full.finish_reason == "length"
    # min_tokens masks EOS until enough tokens were generated: speculative == plain there too.
    plain = LLM(ckpts["agree"][0], None, _cache(), eos_token_ids=[eos])
    sp = SamplingParams(max_tokens=20, min_tokens=first + 1)
    a, b = llm.generate(PROMPTS[1:2], sp)[0], plain.generate(PROMPTS[1:2], sp)[0]
    assert a.token_ids == b.token_ids
    assert eos not in a.token_ids[:first + 1] and len(a.token_ids) > first + 1
    _clean(llm)


def test_shipped_pair_reads_eos_and_speaks_text():
    llm = LLM("kvstrata-tiny-py", "kvstrata-tiny-py",
              CacheConfig(max_batch_size=2, max_seq_len=512, target_codec="identity"))
    assert llm.eos_token_ids == (257,) and llm.model_name == "kvstrata-tiny-py"
    assert torch.get_num_threads() == 1 or os.environ.get("OMP_NUM_THREADS")
    prompt = "def fibonacci(n):\n"
    out = llm.generate(prompt, SamplingParams(max_tokens=40))[0]
    assert out.prompt_token_ids == list(prompt.encode())
    assert out.text == bytes(t for t in out.token_ids if t < 256).decode("utf-8", "replace")
    # A flat list of ids is one prompt.
    again = llm.generate(list(prompt.encode()), SamplingParams(max_tokens=40))
    assert len(again) == 1 and again[0].token_ids == out.token_ids
    # A stop string: the text ends right before it, the token that completed it is the last.
    stop = out.text[10:13]
    cut = llm.generate([prompt], SamplingParams(max_tokens=40, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.text == out.text[:out.text.index(stop)]
    assert cut.token_ids == out.token_ids[:len(cut.token_ids)]
    # ... unless min_tokens says it is too early.
    late = llm.generate([prompt], SamplingParams(max_tokens=40, stop=[stop], min_tokens=39))[0]
    assert late.finish_reason == "length"
    _clean(llm)


def test_engine_core_steps_equal_generate_and_abort_frees(ckpts):
    llm = LLM(ckpts["agree"][0], ckpts["drafter"][0], _cache(max_batch_size=3))
    sp = SamplingParams(max_tokens=11)
    ref = llm.generate(PROMPTS, sp)
    ids = [llm.add_request(p, sp, request_id=f"r{i}") for i, p in enumerate(PROMPTS[:3])]
    with pytest.raises(ValueError, match="already in use"):
        llm.add_request(PROMPTS[0], sp, request_id="r0")
    got = {i: [] for i in ids}
    als = {i: [] for i in ids}
    finished = {}
    steps = 0
    while llm.has_unfinished():
        for d in llm.step():
            got[d.request_id] += d.new_token_ids
            if d.acceptance_length is not None:
                als[d.request_id].append(d.acceptance_length)
            if d.finished:
                finished[d.request_id] = d.finish_reason
        steps += 1
        if steps == 2:       # requests arrive while others run
            ids.append(llm.add_request(PROMPTS[3], sp, request_id="late"))
            got["late"], als["late"] = [], []
    for i, request_id in enumerate(ids):
        assert got[request_id] == ref[i].token_ids and als[request_id] == ref[i].acceptance_lengths
        assert finished[request_id] == "length"
    # Abort mid-flight: pages are freed at once, a final delta says so.
    request_id = llm.add_request(PROMPTS[4], SamplingParams(max_tokens=40))
    llm.step()
    llm.step()
    assert llm.stats()["pool"]["in_use"] > 0
    assert llm.abort(request_id) is True and llm.abort(request_id) is False
    assert llm.abort("nope") is False
    assert llm.stats()["pool"]["in_use"] == 0
    (d,) = llm.step()
    assert d.request_id == request_id and d.finished and d.finish_reason == "abort"
    _clean(llm)


@pytest.mark.parametrize("with_tiers", [False, True])
def test_preemption_under_pool_pressure_gives_identical_outputs(ckpts, with_tiers):
    """A pool of 30 pages (one sequence of 96 tokens needs 24) and 8 seats: requests are
    admitted by need and preempted when the pool runs dry; outputs equal an undisturbed run."""
    prompts = [[(5 * i + 7 * j) % 290 for i in range(30 + 3 * j)] for j in range(6)]
    sp = SamplingParams(max_tokens=40)
    roomy = LLM(ckpts["agree"][0], ckpts["drafter"][0], _cache())
    ref = roomy.generate(prompts, sp)
    per_page = roomy.pool.bytes_per_page
    tiers = dict(host_bytes=64 * per_page * 4) if with_tiers else None
    tight = LLM(ckpts["agree"][0], ckpts["drafter"][0],
                _cache(kv_cache_bytes=30 * per_page, tiers=tiers))
    outs = tight.generate(prompts, sp)
    for o, r in zip(outs, ref):
        assert o.finish_reason == "length"
        assert (o.token_ids, o.acceptance_lengths) == (r.token_ids, r.acceptance_lengths)
    st = tight.stats()
    assert st["engine"]["preemptions"] > 0
    assert sum(o.metrics["num_preemptions"] for o in outs) == st["engine"]["preemptions"]
    if with_tiers:
        assert st["tiers"]["d2h_pages"] > 0
    _clean(tight)


def test_manager_names_unknown_and_freed_sequences(ckpts):
    llm = LLM(ckpts["target"][0], None, _cache())
    llm.mgr.admit("a", [1, 2, 3])
    llm.mgr.free("a")
    with pytest.raises(UnknownSequenceError, match="free: sequence 'a' was already freed"):
        llm.mgr.free("a")
    with pytest.raises(KeyError, match="reserve: sequence 'b' was never admitted"):
        llm.mgr.reserve("b", 4)
    with pytest.raises(KeyError, match="commit: sequence 'a' was already freed"):
        llm.mgr.commit("a", [4])


def test_tiers_config_takes_a_disk_path_and_rejects_other_things(ckpts, tmp_path):
    llm = LLM(ckpts["target"][0], None, _cache(tiers=dict(host_bytes=1 << 20,
                                                          disk=str(tmp_path / "t"))))
    assert os.fspath(llm.tiers.disk.path) == str(tmp_path / "t")
    llm.close()
    with pytest.raises(ValueError, match=r"tiers\['disk'\] must be a directory path or a DiskTier"):
        LLM(ckpts["target"][0], None, _cache(tiers=dict(disk=42)))
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['dsik'\]"):
        LLM(ckpts["target"][0], None, _cache(tiers=dict(dsik=str(tmp_path))))


_RESTART = textwrap.dedent("""
    import json, sys
    from kvstrata.runtime import LLM, CacheConfig, SamplingParams
    target, drafter, disk = sys.argv[1:4]
    cache = CacheConfig(page_size=4, max_seq_len=96, max_batch_size=4, target_codec="identity",
                        draft_codec="lossless", tiers=dict(host_bytes=1 << 20, disk=disk))
    prompt = [(7 * i + 3) % 290 for i in range(41)]
    with LLM(target, drafter, cache) as llm:
        o = llm.generate([prompt], SamplingParams(max_tokens=9))[0]
    print(json.dumps([o.num_cached_tokens, o.token_ids, o.acceptance_lengths]))
""")


def test_close_persists_to_disk_and_a_restarted_process_reuses_it(ckpts, tmp_path):
    script = tmp_path / "run.py"
    script.write_text(_RESTART)
    disk = tmp_path / "tier"
    runs = []
    for _ in range(2):
        res = subprocess.run([sys.executable, str(script), ckpts["agree"][0],
                              ckpts["drafter"][0], str(disk)],
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        runs.append(eval(res.stdout.strip().splitlines()[-1]))
    (c0, t0, a0), (c1, t1, a1) = runs
    assert c0 == 0 and c1 == 40          # every full page of the prompt, from disk
    assert (t1, a1) == (t0, a0)
    assert math.isclose(sum(a1) / len(a1), sum(a0) / len(a0))


def test_deltas_say_which_tier_served_the_prefix(ckpts):
    llm = LLM(ckpts["agree"][0], ckpts["drafter"][0],
              _cache(tiers=dict(host_bytes=1 << 20)))
    p = [(7 * i + 3) % 290 for i in range(41)]
    llm.generate([p], SamplingParams(max_tokens=3))
    llm.pool.evict(llm.pool.num_cached)            # every cached page goes to the host tier
    llm.add_request(p[:33] + [5, 6, 7, 8, 9, 10, 11, 12], SamplingParams(max_tokens=3),
                    request_id="x")
    llm.add_request(p, SamplingParams(max_tokens=3), request_id="y")
    first = {}
    while llm.has_unfinished():
        for d in llm.step():
            first.setdefault(d.request_id, d)
    assert first["x"].cached_by_tier == {"host": 32} and first["x"].num_cached_tokens == 32
    # y's first 32 tokens are device pages again (x promoted them); the rest came from host.
    assert first["y"].cached_by_tier == {"device": 32, "host": 8}
    assert first["y"].ttft_s is not None and first["y"].ttft_s > 0
