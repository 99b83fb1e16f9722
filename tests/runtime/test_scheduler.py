"""The scheduler and a request's stopping rules, without a model."""

from __future__ import annotations

from kvstrata.runtime.sampling import SamplingParams
from kvstrata.runtime.scheduler import DECODE, DONE, PREFILL, Request, Scheduler
from kvstrata.tokenizer import ByteTokenizer, Detokenizer, encode


def _req(request_id, prompt_len=10, state=DECODE, computed=None, max_tokens=50, **sp):
    prompt = list(range(1, prompt_len + 1))
    r = Request(request_id=request_id, prompt=prompt,
                params=SamplingParams(max_tokens=max_tokens, **sp),
                max_length=prompt_len + max_tokens, tokens=list(prompt), state=state)
    r.num_computed = prompt_len if computed is None else computed
    return r


def test_generators_first_within_budget_then_rotated():
    s = Scheduler(max_batch_size=8, token_budget=10, block_size=4)
    a, b, c = _req("a"), _req("b"), _req("c")
    s.running.extend([a, b, c])
    p1 = s.schedule()
    assert [(r.request_id, n) for r, n in p1.decode] == [("a", 4), ("b", 4)] and p1.prefill == []
    # Those left out go first next step.
    p2 = s.schedule()
    assert [r.request_id for r, _ in p2.decode] == ["c", "a"]


def test_rotation_when_every_generator_is_scheduled():
    s = Scheduler(max_batch_size=8, token_budget=64, block_size=4)
    a, b, c = _req("a"), _req("b"), _req("c")
    s.running.extend([a, b, c])
    assert [r.request_id for r, _ in s.schedule().decode] == ["a", "b", "c"]
    assert list(s.running) == [a, b, c]
    # A prompt behind them: the scheduled generators still move behind it.
    p = _req("p", state=PREFILL, computed=0)
    s.running.append(p)
    plan = s.schedule()
    assert list(s.running) == [p, a, b, c] and [(r, n) for r, n in plan.prefill] == [(p, 10)]


def test_prefill_chunks_fill_what_is_left():
    s = Scheduler(max_batch_size=8, token_budget=9, block_size=4)
    g = _req("g")
    p = _req("p", prompt_len=20, state=PREFILL, computed=3)
    q = _req("q", prompt_len=5, state=PREFILL, computed=0)
    s.running.extend([p, g, q])
    plan = s.schedule()
    assert [(r.request_id, n) for r, n in plan.decode] == [("g", 4)]
    assert [(r.request_id, n) for r, n in plan.prefill] == [("p", 5)]
    assert plan.num_tokens == 9
    # A resumed request prefills up to what it had computed, not only its prompt.
    p.resume_to, p.num_computed = 17, 12
    plan = Scheduler(8, 100, 4)
    plan.running.append(p)
    assert [(r.request_id, n) for r, n in plan.schedule().prefill] == [("p", 5)]


def test_last_block_is_shortened_to_max_length_and_seats_count():
    r = _req("r", prompt_len=10, max_tokens=3)
    r.num_computed = 11
    assert r.block_len(16) == 2
    s = Scheduler(max_batch_size=2, token_budget=64, block_size=4)
    s.running.append(r)
    assert s.free_seats() == 1


def test_retire_takes_finished_only():
    s = Scheduler(4, 64, 4)
    a, b = _req("a"), _req("b")
    s.running.extend([a, b])
    a.finish("length")
    assert s.retire() == [a] and list(s.running) == [b] and a.state == DONE


def test_append_stops_at_stop_ids_after_min_tokens():
    r = _req("r", stop_token_ids=(7,), min_tokens=2)
    r.stop_ids = frozenset({7})
    assert r.append([7, 5]) == 2 and r.state == DECODE       # too early: 7 is just a token
    assert r.append([9, 7, 8]) == 2 and r.finish_reason == "stop"
    assert r.tokens[-1] == 7


def test_append_cuts_at_stop_strings_and_at_length():
    r = _req("r", max_tokens=40, stop=("END",))
    r.detok = Detokenizer(ByteTokenizer())
    assert r.append(encode("ab EN")) == 5 and r.state == DECODE and r.text == "ab EN"
    assert r.append(encode("D!")) == 1 and r.finish_reason == "stop" and r.text == "ab "
    s = _req("s", max_tokens=3)
    assert s.append([4, 5, 6, 7]) == 4 and s.finish_reason == "length"


def test_detokenizer_holds_back_partial_characters():
    d = Detokenizer(ByteTokenizer())
    out = [d.push(t) for t in "é€".encode()]
    assert out == ["", "é", "", "", "€"]
    d.push(0xE2)
    assert d.flush() == "\ufffd"
