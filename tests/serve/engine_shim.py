"""TEMPORARY test scaffolding: the engine-core API of ``ENGINE_API.md`` over today's ``LLM``.

The lead is building ``LLM.add_request / step / abort / has_unfinished`` (issues 14 + 18) in
``runtime/engine.py``. Until that lands, :func:`install` adds a thin version of that API to
``LLM`` (no preemption, device-tier reuse only) so the server can be developed and tested. It does
nothing once the real API exists, and goes away with it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import kvstrata.runtime as runtime
from kvstrata import tokenizer as bytetok
from kvstrata.runtime import LLM, SamplingParams
from kvstrata.runtime.scheduler import DONE, Scheduler


@dataclass
class RequestDelta:
    request_id: str
    new_token_ids: list
    new_text: str
    finished: bool
    finish_reason: str | None
    acceptance_length: int | None
    num_prompt_tokens: int
    num_cached_tokens: int
    cached_by_tier: dict
    ttft_s: float | None
    error: str | None


class _ByteTokenizer:
    eos_token_ids = (bytetok.EOS,)
    chat_template = None

    def encode(self, text):
        return bytetok.encode(text)

    def decode(self, ids):
        return bytetok.decode(ids)

    def apply_chat_template(self, messages):
        raise ValueError("no chat template")


def _state(self):
    st = getattr(self, "_shim", None)
    if st is None:
        st = self._shim = {"sched": Scheduler(self.cache.max_batch_size,
                                              self.cache.max_num_batched_tokens,
                                              self.block_size),
                           "reqs": {}, "sent": {}, "ids": itertools.count()}
    return st


def add_request(self, prompt, params=None, request_id=None, cache_salt=None):
    st = _state(self)
    if isinstance(prompt, str):
        prompt = bytetok.encode(prompt)
    rid = request_id if request_id is not None else f"req-{next(st['ids'])}"
    if rid in st["reqs"]:
        raise ValueError(f"duplicate request_id {rid!r}")
    r = self._make_request(rid, prompt, params or SamplingParams(), cache_salt)
    st["sched"].add(r)
    st["reqs"][rid] = r
    st["sent"][rid] = (0, "")
    return rid


def step(self):
    st = _state(self)
    sched = st["sched"]
    if not sched.has_work:
        return []
    n_al = {id(r): len(r.acceptance_lengths) for r in sched.running}
    self._step(sched)
    done = sched.retire()
    for r in done:
        self._release(r)
    out = []
    for r in list(sched.running) + done:
        gen = r.tokens[len(r.prompt):]
        k, text = st["sent"][r.rid]
        if len(gen) == k and r.state != DONE:
            continue
        full = bytetok.decode(gen)
        al = r.acceptance_lengths[-1] if len(r.acceptance_lengths) > n_al.get(id(r), 0) else None
        out.append(RequestDelta(r.rid, gen[k:], full[len(text):], r.state == DONE,
                                r.finish_reason if r.state == DONE else None, al, len(r.prompt),
                                r.num_cached_tokens, {"device": r.num_cached_tokens},
                                (r.t_first - r.t_admit) if k == 0 else None, None))
        st["sent"][r.rid] = (len(gen), full)
        if r.state == DONE:
            del st["reqs"][r.rid], st["sent"][r.rid]
    return out


def abort(self, request_id):
    st = _state(self)
    r = st["reqs"].pop(request_id, None)
    if r is None:
        return False
    st["sent"].pop(request_id, None)
    sched = st["sched"]
    if r in sched.waiting:
        sched.waiting.remove(r)
    else:
        sched.running.remove(r)
        self._release(r)
    return True


def has_unfinished(self):
    return _state(self)["sched"].has_work


def install() -> bool:
    """Add the API where ``LLM`` lacks it; True if it did (the real engine core is missing)."""
    if hasattr(LLM, "add_request"):
        return False
    runtime.RequestDelta = RequestDelta
    LLM.add_request, LLM.step, LLM.abort, LLM.has_unfinished = (add_request, step, abort,
                                                                has_unfinished)
    LLM.tokenizer = property(lambda self: _ByteTokenizer())
    LLM.model_name = property(lambda self: "kvstrata-tiny-py")
    LLM.close = lambda self: None
    return True
