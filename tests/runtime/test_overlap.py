"""Overlapped decode steps (``RunnerConfig.overlap``) on the CPU: the step submitted before the
previous step's tokens are read gives exactly the synchronous engine's outputs (tokens, text,
acceptance lengths, finish reasons, per-call deltas), through stops, length limits, aborts,
admissions, preemption, prefill/resume and failures, and frees every page; the device-side
step inputs equal their torch reference."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.kernels.step_inputs import assemble_step_inputs_ref
from kvstrata.runtime import LLM, RunnerConfig, SamplingParams
from kvstrata.runtime.config import OVERLAP_ENV, overlap_enabled

from tiny_dflash import PROMPTS
from tiny_dflash import assert_clean as _clean
from tiny_dflash import cache_config as _cache


def _llm(ckpts, overlap: bool, spec: bool = True, **cache):
    return LLM(ckpts["agree"][0], ckpts["drafter"][0] if spec else None, _cache(**cache),
               runner=RunnerConfig(overlap=overlap))


def _result(outs):
    return [(o.token_ids, o.acceptance_lengths, o.finish_reason, o.text) for o in outs]


def test_overlap_switch_config_device_and_environment(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv(OVERLAP_ENV, raising=False)
    assert overlap_enabled(RunnerConfig(), cuda) and not overlap_enabled(RunnerConfig(), cpu)
    assert overlap_enabled(RunnerConfig(overlap=True), cpu)
    assert not overlap_enabled(RunnerConfig(overlap=False), cuda)
    monkeypatch.setenv(OVERLAP_ENV, "0")
    assert not overlap_enabled(RunnerConfig(overlap=True), cuda)
    monkeypatch.setenv(OVERLAP_ENV, "1")
    assert overlap_enabled(RunnerConfig(), cpu)
    monkeypatch.setenv(OVERLAP_ENV, "sometimes")
    with pytest.raises(ValueError, match=OVERLAP_ENV):
        overlap_enabled(RunnerConfig(), cuda)
    with pytest.raises(ValueError, match="overlap must be"):
        RunnerConfig(overlap="yes")


@settings(max_examples=max(8, settings.default.max_examples // 5))
@given(spec=st.booleans(), n=st.integers(1, 5), seats=st.integers(1, 8),
       lens=st.lists(st.integers(1, 30), min_size=5, max_size=5),
       stop=st.sampled_from([None, 5, 17, 42]), min_tokens=st.integers(0, 6))
def test_overlapped_generate_equals_synchronous(ckpts, spec, n, seats, lens, stop, min_tokens):
    """Random batches, lengths, stop ids (the agreeing pair's favourite tokens) and min_tokens:
    the same outputs with and without overlap, and nothing left allocated."""
    params = [SamplingParams(max_tokens=lens[i], min_tokens=min(min_tokens, lens[i]),
                             stop_token_ids=[stop] if stop is not None else None)
              for i in range(n)]
    res = {}
    for ov in (False, True):
        llm = _llm(ckpts, ov, spec, max_batch_size=seats)
        assert llm.stats()["runner"]["overlap"] is ov
        res[ov] = _result(llm.generate(PROMPTS[:n], params))
        _clean(llm)
    assert res[True] == res[False]


def test_width_one_overlapped_equals_synchronous_and_plain(ckpts):
    """Verify width 1 (no drafts; the step's first kernel runs in the verify step): overlapped
    and synchronous steps give the plain engine's tokens, one token per step."""
    sp = SamplingParams(max_tokens=17)
    plain = _llm(ckpts, False, spec=False).generate(PROMPTS, sp)
    for ov in (False, True):
        llm = LLM(ckpts["agree"][0], ckpts["drafter"][0], _cache(),
                  runner=RunnerConfig(overlap=ov, verify_widths=(1,)))
        outs = llm.generate(PROMPTS, sp)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain], ov
        assert {a for o in outs for a in o.acceptance_lengths} == {1}
        assert llm.stats()["runner"]["decode_steps"] > 0
        _clean(llm)


def test_stop_strings_and_eos_with_overlap(ckpts):
    base = _llm(ckpts, False)
    ref = base.generate(PROMPTS[1:2], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    eos = ref.token_ids[6]
    outs = {}
    for ov in (False, True):
        llm = LLM(ckpts["agree"][0], ckpts["drafter"][0], _cache(), eos_token_ids=[eos],
                  runner=RunnerConfig(overlap=ov))
        outs[ov] = _result(llm.generate(PROMPTS[:4], [SamplingParams(max_tokens=24)] * 4))
        _clean(llm)
    assert outs[True] == outs[False]
    assert any(r[2] == "stop" for r in outs[True])


def _stream(per: dict, deltas) -> None:
    """Append each delta's tokens to its request's stream; keep the last finish reason."""
    for d in deltas:
        toks, _ = per.get(d.request_id, ([], None))
        per[d.request_id] = (toks + list(d.new_token_ids), d.finish_reason)


def _drive(llm: LLM, script) -> tuple[dict, list]:
    """Per request: its streamed tokens and finish reason; and per step() call, the deltas
    (``script[k]`` runs before call k)."""
    per, log, k = {}, [], 0
    while llm.has_unfinished() or k in script:
        if k in script:
            script[k](llm)
        deltas = llm.step()
        log.append(sorted((d.request_id, tuple(d.new_token_ids), d.finished) for d in deltas))
        _stream(per, deltas)
        k += 1
        assert k < 400
    return per, log


def test_step_deltas_abort_and_late_admission_match_synchronous(ckpts):
    """The engine-core API: the same streamed tokens and finish reasons per request, and the
    same deltas per step() call until the schedule changes (a call that would admit a request
    lands the step in flight first, so admission comes one call later); an abort while the
    request's next step is in flight frees its pages once that step lands."""
    def add(i, max_tokens):
        return lambda llm: llm.add_request(PROMPTS[i], SamplingParams(max_tokens=max_tokens),
                                           request_id=f"r{i}")

    def both(*fs):
        return lambda llm: [f(llm) for f in fs]

    def r0_in_flight(llm):
        f = llm._flight
        return f is not None and any(r.request_id == "r0" for r in f.rows)

    # The first call from 5 on where r0's next step is in flight (overlap on).
    k = 0
    probe = _llm(ckpts, True, max_batch_size=2)
    script = {0: both(add(0, 30), add(1, 9)), 3: add(2, 12)}
    for k in range(40):
        if k in script:
            script[k](probe)
        if k >= 5 and r0_in_flight(probe):
            break
        probe.step()
    probe.close()
    assert k < 39
    in_flight = []

    def abort_r0(llm):
        in_flight.append(r0_in_flight(llm))
        assert llm.abort("r0")

    script[k] = both(abort_r0, add(3, 5))
    logs = {}
    for ov in (False, True):
        llm = _llm(ckpts, ov, max_batch_size=2)
        logs[ov] = _drive(llm, script)
        _clean(llm)
    assert logs[True][0] == logs[False][0]
    assert logs[True][1][:3] == logs[False][1][:3]
    assert logs[True][0]["r0"][1] == "abort"
    assert in_flight == [False, True]      # r0's next step in flight when overlapped


def test_preemption_under_pressure_with_overlap(ckpts):
    """A pool too small for every sequence's next two blocks: the chained step is not
    submitted (no preemption while a step is in flight); the synchronous path preempts."""
    prompts = [[(5 * i + 7 * j) % 290 for i in range(30 + 3 * j)] for j in range(6)]
    params = SamplingParams(max_tokens=40)
    per_page = _llm(ckpts, False).pool.bytes_per_page
    outs = {}
    for ov in (False, True):
        llm = _llm(ckpts, ov, kv_cache_bytes=30 * per_page)
        outs[ov] = _result(llm.generate(prompts, params))
        _clean(llm)
        if ov:
            assert llm.stats()["engine"]["preemptions"] > 0
    assert outs[True] == outs[False]


def test_prefill_and_resume_drain_the_flight(ckpts):
    """A handoff (prefill on this engine, then resume) between steps of a running request:
    the flight lands first, and every output equals the synchronous engine's."""
    res = {}
    for ov in (False, True):
        llm = _llm(ckpts, ov)
        llm.add_request(PROMPTS[0], SamplingParams(max_tokens=25), request_id="bg")
        got = []
        for _ in range(3):
            got += llm.step()
        held = llm.prefill([PROMPTS[3]], SamplingParams(max_tokens=10))
        for _ in range(2):
            got += llm.step()
        held[0].state = "decode"          # the generation worker's side of the handoff
        out = llm.resume(held)
        while llm.has_unfinished():
            got += llm.step()
        bg = [t for d in got if d.request_id == "bg" for t in d.new_token_ids]
        res[ov] = (bg, out[0].token_ids, out[0].acceptance_lengths)
        _clean(llm)
    assert res[True] == res[False]


def test_a_failure_in_flight_fails_its_requests_and_frees_everything(ckpts, monkeypatch):
    llm = _llm(ckpts, True)
    real, calls = llm.runner.collect, []

    def boom(h):
        calls.append(1)
        out = real(h)
        if len(calls) == 4:
            raise RuntimeError("device lost")
        return out

    monkeypatch.setattr(llm.runner, "collect", boom)
    outs = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=30))
    assert {o.finish_reason for o in outs} == {"error"}
    assert all("device lost" in o.error for o in outs)
    _clean(llm)
    monkeypatch.setattr(llm.runner, "collect", real)
    again = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=6))[0]
    assert again.finish_reason == "length" and len(again.token_ids) == 6


def test_keyboard_interrupt_in_flight_frees_everything(ckpts, monkeypatch):
    llm = _llm(ckpts, True)
    real, calls = llm.runner.submit_next, []

    def boom(*a):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a)

    monkeypatch.setattr(llm.runner, "submit_next", boom)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, SamplingParams(max_tokens=20))
    _clean(llm)


def test_close_with_a_step_in_flight(ckpts):
    llm = _llm(ckpts, True)
    llm.add_request(PROMPTS[0], SamplingParams(max_tokens=30))
    llm.step()                       # the prompt (not overlapped), then decode steps
    llm.step()
    assert llm._flight is not None
    llm.close()
    assert llm.pool.num_in_use == 0 and llm._flight is None


@settings(max_examples=max(25, settings.default.max_examples // 2))
@given(data=st.data())
def test_step_inputs_reference(data):
    """The device-side step inputs by hand: host rows copied, continued rows advanced by the
    previous step's count, rows at their length limit turned into padding, split lengths."""
    mb, B = 8, 4
    rows = data.draw(st.integers(1, mb))
    out = torch.zeros((mb, B + 1), dtype=torch.int32)
    small = torch.zeros(3 * mb + 3, dtype=torch.int64)
    small[mb:2 * mb] = torch.tensor(data.draw(st.lists(st.integers(0, 90), min_size=mb,
                                                       max_size=mb)))
    out[:, :B] = torch.randint(0, 300, (mb, B), generator=torch.Generator().manual_seed(rows))
    out[:, B] = torch.tensor(data.draw(st.lists(st.integers(1, B), min_size=mb, max_size=mb)))
    inp = torch.zeros(5 * mb, dtype=torch.int64)
    want = []
    for i in range(rows):
        src = data.draw(st.integers(-1, mb - 1))
        maxlen = data.draw(st.integers(1, 100))
        htok, hstart, hqlen = data.draw(st.integers(0, 299)), data.draw(st.integers(-1, 90)), \
            data.draw(st.integers(1, B))
        inp[i], inp[mb + i], inp[2 * mb + i], inp[3 * mb + i], inp[4 * mb + i] = \
            src, htok, hstart, hqlen, maxlen
        if src < 0:
            want.append((htok, hstart, hqlen))
        else:
            cnt = int(out[src, B])
            start = int(small[mb + src]) + cnt
            want.append((int(out[src, cnt - 1]), start, min(B, maxlen - start))
                        if start < maxlen else (0, -1, B))
    qlen32 = torch.zeros(mb, dtype=torch.int32)
    assemble_step_inputs_ref(inp, small, qlen32, out, rows, B, (3, 5, 7), 32)
    got = [(int(small[i]), int(small[mb + i]), int(small[2 * mb + i])) for i in range(rows)]
    assert got == want
    assert qlen32[:rows].tolist() == [w[2] for w in want]
    top = max([max(w[1], 0) for w in want])
    for j, (s, add) in enumerate(((3, B), (5, 0), (7, B))):
        per = -(-max(top + add, 1) // s)
        assert int(small[3 * mb + j]) == -(-per // 32) * 32


@pytest.mark.parametrize("device", [
    "interpreter", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")])])
def test_step_inputs_triton_kernel_equals_reference(device):
    """The Triton kernel (on CUDA, or interpreted on the CPU) against the reference, random
    rows, batch sizes and block sizes."""
    pytest.importorskip("triton")
    if device == "interpreter" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel runs on the CPU through the interpreter only")
    from kvstrata.kernels.step_inputs import _assemble_kernel, assemble_step_inputs
    g = torch.Generator().manual_seed(0)
    for mb, B, rows in ((8, 4, 1), (16, 4, 5), (16, 16, 11), (64, 16, 64), (256, 1, 200)):
        out = torch.randint(0, 150000, (mb, B + 1), generator=g, dtype=torch.int32)
        out[:, B] = torch.randint(1, B + 1, (mb,), generator=g, dtype=torch.int32)
        small = torch.randint(-1, 9000, (3 * mb + 3,), generator=g)
        inp = torch.randint(0, 9000, (5 * mb,), generator=g)
        inp[:rows] = torch.randint(-1, mb, (rows,), generator=g)
        want_s, want_q = small.clone(), torch.zeros(mb, dtype=torch.int32)
        assemble_step_inputs_ref(inp, want_s, want_q, out, rows, B, (34, 3, 1), 32)
        got_s, got_q = small.clone(), torch.zeros(mb, dtype=torch.int32)
        if device == "cuda":
            got_s, got_q = got_s.cuda(), got_q.cuda()
            assemble_step_inputs(inp.cuda(), got_s, got_q, out.cuda(), rows, B, (34, 3, 1), 32)
        else:
            _assemble_kernel[(1,)](inp, got_s, got_q, out, out.stride(0), rows, mb, B, 34, 3,
                                   1, 32, BLOCK=max(16, 1 << (rows - 1).bit_length()))
        assert torch.equal(got_s.cpu(), want_s) and torch.equal(got_q.cpu(), want_q), (mb, rows)


@settings(max_examples=max(6, settings.default.max_examples // 7))
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "abort", "step", "step", "step"]),
                              st.integers(0, 4), st.integers(1, 24)),
                    min_size=4, max_size=30))
def test_random_add_abort_step_with_overlap(ckpts, ops):
    """Random interleavings of add_request / abort / step with overlapped steps: a request that
    ran to its end has exactly the synchronous engine's output; an aborted one streamed a prefix
    of it; per-request streams are consistent; every page is freed."""
    ref = _llm(ckpts, False, max_batch_size=3)
    llm = _llm(ckpts, True, max_batch_size=3)
    streams, params, n = {}, {}, 0
    for op, i, m in ops:
        if op == "add":
            rid = f"q{n}"
            n += 1
            params[rid] = (i, SamplingParams(max_tokens=m))
            llm.add_request(PROMPTS[i], params[rid][1], request_id=rid)
        elif op == "abort" and params:
            llm.abort(sorted(params)[i % len(params)])
        else:
            _stream(streams, llm.step())
    while True:             # until nothing runs, and the last abort's delta is delivered
        deltas = llm.step()
        _stream(streams, deltas)
        if not deltas and not llm.has_unfinished():
            break
    _clean(llm)
    for rid, (i, sp) in params.items():
        want = ref.generate([PROMPTS[i]], sp)[0].token_ids
        toks, reason = streams.get(rid, ([], "abort"))
        if reason == "abort":
            assert toks == want[:len(toks)], rid
        else:
            assert (toks, reason) == (want, "length"), rid
