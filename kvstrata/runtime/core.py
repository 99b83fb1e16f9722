"""The engine core under :class:`~.engine.LLM`: requests, admission, preemption, steps, deltas.

One step (see DESIGN.md, "Runtime"):

1. admit waiting requests; the longest cached prefix (device pool, then tiers) is reused for both
   groups, so only the uncached prompt tail is prefilled, at its true positions;
2-4. the :class:`~.runner.ModelRunner` runs the device side of the step: draft ``B-1`` tokens
   for every scheduled generating sequence, one target forward over every verify block and
   prefill chunk, acceptance (greedy match or rejection sampling) and the draft context K/V of
   the accepted rows; CUDA graphs for pure decode steps; one device->host copy of the tokens;
5. on the host: stop ids/strings, ``min_tokens``, lengths; then ``commit`` the tokens (hashing
   pages that became full: only now are both groups of those tokens written).

Overlapped steps, where the core submits step N + 1 before it reads step N's tokens, live in
:mod:`.overlap` (:class:`~.overlap.OverlappedSteps`, the base of :class:`EngineCore`).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from typing import Sequence

import torch

from ..tokenizer import Detokenizer
from ..pagepool.pool import OutOfPagesError
from .outputs import RequestDelta, RequestOutput
from .overlap import OverlappedSteps
from .step import StepItem
from .sampling import SamplingParams
from .scheduler import (DECODE, DONE, PREEMPTED, PREFILL, PREFILLED, Request, Scheduler,
                        StepPlan)

log = logging.getLogger("kvstrata.runtime")


class EngineCore(OverlappedSteps):
    """Requests over a scheduler, a page manager and a model runner: :meth:`add_request` /
    :meth:`step` / :meth:`abort` / :meth:`has_unfinished` (what a server drives; one thread at a
    time), and the private scheduler loops behind :class:`~.engine.LLM`'s ``prefill`` and
    ``resume``.

    The subclass builds what the core runs on before calling ``__init__``: ``cache``
    (:class:`~.config.CacheConfig`), ``block_size``, ``max_seq_len``, ``device``, ``target``,
    ``drafter``, ``pool``, ``mgr`` (the page manager), ``tiers``, ``arena``, ``runner``,
    ``tokenizer`` and ``eos_token_ids``.
    """

    # -- engine core ---------------------------------------------------------------------------
    def __init__(self) -> None:
        self._ids = itertools.count()
        self._admissions = itertools.count()
        self.sched = self._scheduler()
        self._requests: dict[object, Request] = {}
        self._undelivered: list[RequestDelta] = []
        self._closed = False
        self._flight = None
        self._counters = {"steps": 0, "draft_s": 0.0, "target_s": 0.0, "step_s": 0.0,
                         "generated_tokens": 0, "prefill_tokens": 0, "verify_tokens": 0,
                         "preemptions": 0, "failed_requests": 0, "aborted_requests": 0}

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None) -> str:
        """Queue a request; returns its id. Raises ``ValueError`` (allocating nothing) for a bad
        request: empty or too long prompt, ids outside the vocabulary, text without a tokenizer,
        a request id already in use."""
        self._check_open()
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
            while request_id in self._requests:
                request_id = f"req-{next(self._ids)}"
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        elif request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use by an unfinished "
                             "request")
        r = self._make_request(request_id, prompt, params, cache_salt)
        self._requests[request_id] = r
        self.sched.add(r)
        return request_id

    def step(self) -> list[RequestDelta]:
        """Run one engine step; returns what changed per request (new tokens and text, finish).

        A failure inside the step is isolated: the step's requests are retried one by one and a
        request that fails alone finishes with ``finish_reason="error"`` (its pages freed); the
        others go on. ``KeyboardInterrupt`` aborts the step's requests (pages freed) and is
        re-raised.
        """
        self._check_open()
        touched = self._advance(self.sched)
        self.sched.finished.clear()
        out, self._undelivered = self._undelivered, []
        out += self._deliver(touched)
        return out

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its pages; ``False`` if it is unknown or finished."""
        r = self._requests.get(request_id)
        if r is None or r.state == DONE:
            return False
        self._abort(self.sched, r)
        self._settle()
        self._undelivered += self._deliver([r])
        return True

    def has_unfinished(self) -> bool:
        return any(r.state != DONE for r in self._requests.values())

    # -- requests -------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this LLM is closed; build a new one")

    def _scheduler(self) -> Scheduler:
        return Scheduler(self.cache.max_batch_size, self.cache.max_num_batched_tokens,
                         self.block_size)

    @staticmethod
    def _as_prompt_list(prompts) -> list:
        if isinstance(prompts, str):
            return [prompts]
        if isinstance(prompts, bytes) or not isinstance(prompts, Sequence):
            raise ValueError("prompts must be a list of prompts (each a string or a list of "
                             f"token ids), got {type(prompts).__name__}")
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]          # one prompt given as a flat list of token ids
        return [p if isinstance(p, str) else list(p) if isinstance(p, Sequence) else p
                for p in prompts]

    @staticmethod
    def _params_list(params, n: int) -> list:
        if params is None:
            params = SamplingParams()
        plist = [params] * n if isinstance(params, SamplingParams) else list(params)
        if len(plist) != n:
            raise ValueError(f"got {len(plist)} SamplingParams for {n} prompts")
        return plist

    def _stop_ids(self, sp: SamplingParams) -> frozenset:
        """The ids that end a request: its ``stop_token_ids`` and, unless ``ignore_eos``, the
        model's EOS ids; only those inside the vocabulary (the target never samples the rest)."""
        eos = () if sp.ignore_eos else self.eos_token_ids
        V = self.target.config.vocab_size
        return frozenset(t for t in (*sp.stop_token_ids, *eos) if t < V)

    def _make_request(self, request_id, prompt, sp, salt) -> Request:
        if sp is None:
            sp = SamplingParams()
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(sp).__name__}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; this model has none (pass "
                                 "token ids, or LLM(tokenizer=...))")
            prompt = self.tokenizer.encode(prompt)
        elif isinstance(prompt, bytes) or not isinstance(prompt, Sequence):
            raise ValueError(f"a prompt is a string or a list of token ids, got "
                             f"{type(prompt).__name__}")
        toks = list(prompt)
        if not toks:
            raise ValueError("empty prompt")
        V = self.target.config.vocab_size
        bad = [t for t in toks if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < V]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {V})")
        if len(toks) >= self.max_seq_len:
            raise ValueError(f"prompt of {len(toks)} tokens leaves no room to generate within "
                             f"max_seq_len={self.max_seq_len}; at most {self.max_seq_len - 1} "
                             "prompt tokens fit")
        if salt is not None and not isinstance(salt, str):
            raise ValueError(f"cache_salt must be a string or None, got {type(salt).__name__}")
        if sp.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none (use "
                             "stop_token_ids)")
        gen = None
        if sp.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(sp.seed)
        return Request(request_id=request_id, prompt=toks, params=sp, salt=salt, generator=gen,
                       max_length=min(len(toks) + sp.max_tokens, self.max_seq_len),
                       stop_ids=self._stop_ids(sp),
                       detok=Detokenizer(self.tokenizer) if self.tokenizer is not None else None,
                       t_arrival=time.perf_counter())

    def _drive(self, sched: Scheduler, outs: list) -> list[Request]:
        """Step a private scheduler (``prefill``/``resume``) until it is empty; outputs by request
        id."""
        held: list[Request] = []
        try:
            while sched.has_work:
                self._advance(sched, held)
                for r in list(sched.finished):
                    outs[r.request_id] = self._output(r, r.request_id)
                sched.finished.clear()
        finally:
            for r in list(sched.waiting) + list(sched.running):
                self._abort(sched, r)
                outs[r.request_id] = self._output(r, r.request_id)
            self._settle()      # an exception may have left this scheduler's step in flight
        return held

    def _fits(self, sched: Scheduler, r: Request) -> bool:
        """Admission by need: the pages its (remaining) prompt and first block take, beyond what
        the running sequences need for their next block, are free or evictable."""
        live = [x for x in sched.running if x.seq_id in self.mgr.seqs]
        if not live:
            return True
        P = self.pool.page_size
        need = math.ceil(min(r.prefill_target + self.block_size, r.max_length) / P)
        headroom = sum(max(0, math.ceil(min(x.num_computed + self.block_size, x.max_length) / P)
                           - len(self.mgr.seqs[x.seq_id].page_ids)) for x in live)
        return self.pool.num_available - headroom >= need

    def _admit(self, sched: Scheduler) -> None:
        while sched.waiting and sched.free_seats() > 0:
            r = sched.waiting[0]
            if r.state != DECODE and not self._fits(sched, r):
                break
            sched.waiting.popleft()
            if r.state == DECODE:
                # Handed over (``resume``): the prompt's K/V is in the pool; the arena backend
                # starts empty here, which is exactly its disaggregation weakness.
                r.t_admit = r.t_first = time.perf_counter()
            else:
                r.seq_id = (next(self._ids), r.request_id)
                upto = r.prefill_target
                pending = len(r.tokens) > upto          # resumed after a preemption in DECODE
                seq = self.mgr.admit(r.seq_id, r.tokens[:upto] if r.tokens else r.prompt,
                                     cache_salt=r.salt,
                                     max_cached_tokens=upto if pending else upto - 1)
                r.num_computed = seq.num_cached_tokens
                if r.state != PREEMPTED:
                    r.num_cached_tokens = seq.num_cached_tokens
                    r.cached_from = self._cached_by_tier(seq.cached_from)
                    r.tokens = list(r.prompt)
                    r.t_admit = time.perf_counter()
                r.state = DECODE if pending and r.num_computed == upto else PREFILL
            r.admit_order = next(self._admissions)
            if self.arena is not None:
                self.arena.open(r.seq_id, r.num_computed)
            sched.running.append(r)

    def _cached_by_tier(self, pages: dict[str, int]) -> dict[str, int]:
        """Prefix tokens reused per tier: the manager counts device pages and "lower" pages; the
        tier manager's ``last_load`` says which lower tier served them (host first, then in
        the order the tiers were asked)."""
        P = self.pool.page_size
        out = {"device": pages.get("device", 0) * P} if pages.get("device") else {}
        left = pages.get("lower", 0)
        for name, n in (getattr(self.tiers, "last_load", None) or {}).items():
            take = min(n, left)
            if take:
                out[name] = take * P
                left -= take
        if left:
            out["lower"] = left * P
        return out

    def _reserve(self, sched: Scheduler, plan: StepPlan) -> StepPlan:
        """Pages for this step's positions; under pool pressure the most recently admitted
        running sequence is preempted (its sequence freed: full pages stay cached and move to
        the tiers when evicted; it is re-admitted later and recomputes what is gone)."""
        for r, n in plan.decode + plan.prefill:
            while r.state != PREEMPTED:
                try:
                    self.mgr.reserve(r.seq_id, r.num_computed + n)
                    break
                except OutOfPagesError:
                    live = [x for x in sched.running if x.state in (PREFILL, DECODE)]
                    self._preempt(sched, max(live, key=lambda x: x.admit_order))
        return StepPlan([(r, n) for r, n in plan.decode if r.state != PREEMPTED],
                        [(r, n) for r, n in plan.prefill if r.state != PREEMPTED])

    def _preempt(self, sched: Scheduler, r: Request) -> None:
        if len([x for x in sched.running if x.state in (PREFILL, DECODE)]) == 1:
            raise RuntimeError(f"request {r.request_id}: the pool cannot hold one sequence's next "
                               "block even with every other sequence preempted")
        self._release(r)
        if r.state == DECODE:
            r.resume_to = r.num_computed
        r.num_computed, r.state, r.seq_id = 0, PREEMPTED, None
        r.num_preemptions += 1
        self._counters["preemptions"] += 1
        sched.running.remove(r)
        sched.waiting.appendleft(r)

    def _abort(self, sched: Scheduler, r: Request, reason: str = "abort",
               error: str | None = None) -> None:
        if r in sched.waiting:
            sched.waiting.remove(r)
        if r in sched.running:
            sched.running.remove(r)
        self._release(r)
        if r.state != DONE:
            r.finish(reason, error)
            self._counters["aborted_requests" if reason == "abort" else "failed_requests"] += 1

    def _release(self, r: Request) -> None:
        f = self._flight
        if f is not None and id(r) in f.ids:
            # A step in flight still writes this sequence's pages: free them once it lands.
            if all(x is not r for x in f.defer):
                f.defer.append(r)
            return
        if r.seq_id is not None and r.seq_id in self.mgr.seqs:
            self.mgr.free(r.seq_id)
            if self.arena is not None:
                self.arena.close(r.seq_id)

    def _output(self, r: Request, index) -> RequestOutput:
        done = r.t_done or time.perf_counter()
        return RequestOutput(
            index, list(r.prompt), r.tokens[len(r.prompt):], list(r.acceptance_lengths),
            r.num_cached_tokens, r.finish_reason, r.error,
            {"ttft_s": (r.t_first - r.t_arrival) if r.t_first else None,
             "total_s": done - r.t_arrival, "num_steps": len(r.acceptance_lengths),
             "num_preemptions": r.num_preemptions},
            text=r.text)

    def _deliver(self, touched: Sequence[Request]) -> list[RequestDelta]:
        """Deltas of requests that changed (each once); finished ones leave ``_requests``."""
        out, seen = [], set()
        for r in touched:
            if id(r) in seen:
                continue
            seen.add(id(r))
            gen = r.tokens[len(r.prompt) + r.sent_tokens:] if r.tokens else []
            text = r.text[r.sent_text:]
            finished = r.state == DONE
            if not gen and not text and not finished:
                continue
            first = r.sent_tokens == 0 and bool(gen)
            r.sent_tokens += len(gen)
            r.sent_text = len(r.text)
            out.append(RequestDelta(
                r.request_id, gen, text, finished, r.finish_reason if finished else None, r.last_al,
                len(r.prompt), r.num_cached_tokens, dict(r.cached_from),
                (r.t_first - r.t_arrival) if first and r.t_first else None, r.error))
            if finished and self._requests.get(r.request_id) is r:
                del self._requests[r.request_id]
        return out

    # -- one step -------------------------------------------------------------------------------
    def _advance(self, sched: Scheduler, held: list | None = None) -> list[Request]:
        """One step of ``sched``: admit, schedule, reserve (preempting under pressure), run with
        failures isolated per request, retire. Returns the requests the step touched.

        With a decode step in flight (overlapped steps), the step continues it instead, or
        drains it first when this step cannot continue it on the device."""
        if self._flight is not None:
            if self._flight.sched is sched:
                return self._land(sched, chain=True)
            self._undelivered += self._deliver(self._drain())
        if not sched.has_work:
            return []
        self._admit(sched)
        plan = self._reserve(sched, sched.schedule())
        items = plan.decode + plan.prefill
        if not items:
            if sched.running or not sched.waiting:
                raise RuntimeError("scheduler produced an empty step")  # unreachable
            return []
        touched = [r for r, _ in items]
        for r in touched:
            r.last_al = None
        try:
            if self._submit(sched, plan):
                return self._land(sched, chain=True)
            self._step(plan)
        except Exception as e:
            if len(items) == 1:
                self._fail(sched, touched[0], e)
            else:
                for r, n in items:          # isolate: each request alone
                    solo = StepPlan([(r, n)] if (r, n) in plan.decode else [],
                                    [(r, n)] if (r, n) in plan.prefill else [])
                    try:
                        self._step(solo)
                    except Exception as e1:
                        self._fail(sched, r, e1)
        except BaseException:
            for r in touched:
                self._abort(sched, r)
            raise
        for r in sched.retire():
            if r.state == PREFILLED:
                if held is not None:
                    held.append(r)       # its sequence stays admitted for the handoff
                continue
            self._release(r)
            sched.finished.append(r)
        return touched

    def _fail(self, sched: Scheduler, r: Request, e: BaseException) -> None:
        log.warning("request %s failed: %s: %s", r.request_id, type(e).__name__, e)
        self._abort(sched, r, "error", f"{type(e).__name__}: {e}")
        sched.finished.append(r)

    def _step(self, plan: StepPlan) -> None:
        """Hand the scheduled batch to the runner (device side: draft, verify, accept, draft
        context write; one device->host copy), then apply the produced tokens on the host.

        No inference mode here: ``ModelRunner.execute`` enters it for the device work, and the
        host side makes no tensors (entering it once more cost ~25 us a step on the CPU).
        """
        t0 = time.perf_counter()
        items = [self._item(r, n, True) for r, n in plan.decode]
        items += [self._item(r, n, False) for r, n in plan.prefill]
        produced = self.runner.execute(items)
        self._accept(plan.decode + plan.prefill, items, produced)
        c = self._counters
        c["steps"] += 1
        c["draft_s"] = self.runner.timing.draft_s      # CUDA events, only with timing on
        c["target_s"] = self.runner.timing.target_s
        c["step_s"] += time.perf_counter() - t0       # the runner waited for its one copy

    def _item(self, r: Request, n: int, decode: bool) -> StepItem:
        """One request's part of the step, for the runner."""
        if decode:
            toks, rows, sample = [r.tokens[-1]], n, False
        else:
            toks = r.tokens[r.num_computed:r.num_computed + n]
            # A request resumed after a preemption already holds its next token.
            sample = (r.num_computed + n == r.prefill_target
                      and len(r.tokens) == r.prefill_target)
            rows = int(sample)
        # min_tokens: stop ids are masked out of the rows that produce generated token number
        # <= min_tokens (vLLM's semantics), so greedy/spec/plain agree on them.
        g0 = len(r.tokens) - len(r.prompt)
        masked = max(0, min(rows, r.params.min_tokens - g0)) if r.stop_ids else 0
        return StepItem(r.seq_id, r.num_computed, n, toks, decode, r.params, sample=sample,
                        generator=r.generator, banned=r.stop_ids if masked else frozenset(),
                        banned_rows=masked)

    def _accept(self, scheduled: list[tuple[Request, int]], items: list[StepItem],
                produced: list[list[int]]) -> None:
        """Host side of acceptance: append (stops, ``min_tokens``, lengths), then commit the
        tokens whose K/V (both groups) the runner wrote."""
        now = time.perf_counter()
        c = self._counters
        for (r, n), it, new in zip(scheduled, items, produced):
            if it.decode:
                new = new[:max(1, r.max_length - r.num_computed - 1)]
                # The inputs of the produced tokens' rows: the pending token, then the accepted
                # drafts (which equal the produced tokens before the last).
                fed = [r.tokens[-1]] + new
                done = r.append(new)
                commit = fed[:done]
                r.acceptance_lengths.append(done)
                r.last_al = done
                c["verify_tokens"] += n
                c["generated_tokens"] += done
            else:
                commit = it.tokens
                c["prefill_tokens"] += n
                if r.num_computed + n >= r.prefill_target:
                    if not new:           # resumed: decoding goes on from its pending token
                        r.state, r.resume_to = DECODE, 0
                    else:
                        r.state, r.t_first, r.resume_to = DECODE, now, 0
                        r.append(new)
                        if r.handoff and r.state == DECODE:
                            r.state = PREFILLED
                            # The prompt commit below still runs: a handoff carries its pages.
                        c["generated_tokens"] += 1
            self.mgr.commit(r.seq_id, commit)
            r.num_computed += len(commit)
