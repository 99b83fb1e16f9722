"""``LLM``: the speculative-decoding engine (DFlash drafter + Qwen3 target over one page pool).

One step (see DESIGN.md, "Runtime"):

1. admit waiting requests; the longest cached prefix (device pool, then tiers) is reused for both
   groups, so only the uncached prompt tail is prefilled, at its true positions;
2-4. the :class:`~.runner.ModelRunner` runs the device side of the step: draft ``B-1`` tokens
   for every scheduled generating sequence, one target forward over every verify block and
   prefill chunk, acceptance (greedy match or rejection sampling) and the draft context K/V of
   the accepted rows; CUDA graphs for pure decode steps; one device->host copy of the tokens;
5. on the host: stop ids/strings, ``min_tokens``, lengths; then ``commit`` the tokens (hashing
   pages that became full: only now are both groups of those tokens written).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import time
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from ..assets import resolve_model
from ..tokenizer import Detokenizer, TextTokenizer, load_tokenizer
from ..tokenizer import eos_token_ids as read_eos_ids
from ..drafter import DFlashDrafter, DraftArena
from ..pagepool.hashing import Namespace
from ..pagepool.manager import KVCacheManager
from ..pagepool.pool import OutOfPagesError, PagePool
from .config import CacheConfig, check_drafter_compat, plan_cache
from .outputs import RequestDelta, RequestOutput
from .qwen3 import Qwen3Model
from .runner import ModelRunner, RunnerConfig, StepItem
from .sampling import SamplingParams
from .scheduler import (DECODE, DONE, PREEMPTED, PREFILL, PREFILLED, Request, Scheduler,
                        StepPlan)

log = logging.getLogger("kvstrata.runtime")


def _load(obj, loader, device, dtype, part: str):
    if obj is None or isinstance(obj, nn.Module):
        return obj, None
    if not isinstance(obj, (str, os.PathLike)):
        raise ValueError(f"expected a checkpoint directory or a loaded model, got {type(obj).__name__}")
    # A shipped model name ("kvstrata-tiny-py" or "kvstrata-tiny-py/target") or a directory.
    path = resolve_model(obj, part=part)
    return loader(path, device=device, dtype=dtype), path


def _make_tiers(spec, pool: PagePool, namespace: Namespace):
    """``CacheConfig.tiers``: None, a dict (``TierManager.from_config``), or
    ``(pool, namespace) -> tiers``."""
    if spec is None:
        return None
    if isinstance(spec, dict):
        from ..tiers.manager import TierManager
        return TierManager.from_config(pool, namespace, spec)
    if callable(spec):
        tiers = spec(pool, namespace)
    else:
        raise ValueError("CacheConfig.tiers must be None, a dict of TierManager arguments, or a "
                         "callable (pool, namespace) -> TierManager")
    if getattr(pool, "on_evict", None) is None and hasattr(tiers, "on_evict"):
        pool.on_evict = tiers.on_evict
    return tiers


def _choose_threads(device: torch.device, num_threads: int | None, hidden_size: int) -> None:
    """CPU intra-op threads. Small models run fastest on one thread: with torch's default the
    shipped pair decoded at 10-22 tok/s on a 2-core machine and at ~200 tok/s on one thread
    (OpenMP workers spin-wait between tiny kernels). ``num_threads`` or ``KVSTRATA_NUM_THREADS``
    override; ``OMP_NUM_THREADS`` set by the user is respected."""
    if device.type != "cpu":
        return
    env = os.environ.get("KVSTRATA_NUM_THREADS")
    if num_threads is None and env:
        try:
            num_threads = int(env)
        except ValueError:
            raise ValueError(f"KVSTRATA_NUM_THREADS must be an integer, got {env!r}") from None
    if num_threads is None:
        if os.environ.get("OMP_NUM_THREADS"):
            return
        num_threads = 1 if hidden_size <= 1024 else min(os.cpu_count() or 1, 16)
    if not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads must be a positive integer, got {num_threads!r}")
    if torch.get_num_threads() != num_threads:
        log.info("kvstrata: torch CPU threads %d -> %d (num_threads= or KVSTRATA_NUM_THREADS "
                 "to change)", torch.get_num_threads(), num_threads)
        torch.set_num_threads(num_threads)


class LLM:
    """Speculative decoding over a paged, prefix-cached, tiered KV store.

    An API over an engine core: :meth:`add_request` / :meth:`step` / :meth:`abort` /
    :meth:`has_unfinished` (what a server drives; one thread at a time), and :meth:`generate`,
    a loop over them. Use it as a context manager (or call :meth:`close`) so that cached pages
    reach the disk tier when one is configured.

    Args:
        target: Qwen3 checkpoint directory or shipped name (or a loaded :class:`Qwen3Model`).
        drafter: DFlash checkpoint directory (or a loaded :class:`DFlashDrafter`); ``None`` for
            plain decoding.
        cache: :class:`CacheConfig` (validated here against the models).
        device: torch device; dtype: ``"auto"`` keeps each checkpoint's dtype.
        block_size: override the drafter's block size.
        seed: seed of the sampling RNG shared by requests without their own seed.
        attn_impl: kernel implementation (``"auto"``, ``"triton"``, ``"torch"``).
        tokenizer: ``"auto"`` (the target directory's: the shipped byte tokenizer or a Hugging
            Face ``tokenizer.json``), a tokenizer object (``encode``/``decode``), or ``None``
            (token ids only).
        eos_token_ids: end-of-sequence ids (default: the target directory's ``config.json`` and
            ``generation_config.json``); requests stop there unless ``ignore_eos``.
        num_threads: torch CPU threads (default: 1 for small models; see ``_choose_threads``).
        runner: :class:`RunnerConfig` (CUDA graphs on by default on CUDA; the
            ``KVSTRATA_CUDA_GRAPHS=0`` environment variable turns them off; opt-in timing).
    """

    def __init__(self, target, drafter=None, cache: CacheConfig | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype | str = "auto",
                 block_size: int | None = None, seed: int = 0, attn_impl: str = "auto",
                 tokenizer="auto", eos_token_ids: Sequence[int] | None = None,
                 num_threads: int | None = None, runner: RunnerConfig | None = None):
        self.cache = cache = cache if cache is not None else CacheConfig()
        if not isinstance(cache, CacheConfig):
            raise ValueError(f"cache must be a CacheConfig, got {type(cache).__name__}")
        self.device = torch.device(device)
        self.attn_impl = attn_impl
        self.target, tdir = _load(target, Qwen3Model.from_pretrained, self.device, dtype,
                                  "target")
        self.drafter, _ = _load(drafter, DFlashDrafter.from_pretrained, self.device, dtype,
                                "drafter")
        self.target: Qwen3Model
        self.drafter: DFlashDrafter | None
        tcfg = self.target.config
        _choose_threads(self.device, num_threads, tcfg.hidden_size)
        self.model_name = (str(target).strip("/") if isinstance(target, str) and tdir is not None
                           and not os.path.isdir(target) else
                           Path(tdir).name if tdir is not None else "model")
        self.tokenizer: TextTokenizer | None = (
            load_tokenizer(tdir) if tokenizer == "auto" and tdir is not None else
            None if tokenizer == "auto" else tokenizer)
        eos = eos_token_ids if eos_token_ids is not None else (
            read_eos_ids(tdir) if tdir is not None else ())
        self.eos_token_ids = tuple(int(t) for t in eos if 0 <= int(t) < tcfg.vocab_size)
        limits = {"target": tcfg.max_position_embeddings}
        if self.drafter is not None:
            check_drafter_compat(tcfg, self.drafter.cfg)
            limits["drafter"] = self.drafter.cfg.max_position_embeddings
            B = self.drafter.cfg.block_size if block_size is None else block_size
            if not isinstance(B, int) or B < 1:
                raise ValueError(f"block_size must be a positive integer, got {B!r}")
        else:
            B = 1
        self.block_size = B
        self.paged = self.drafter is not None and cache.drafter_backend == "paged"
        groups = [self.target.kv_spec(codec=cache.target_codec)]
        if self.paged:
            groups.append(self.drafter.kv_spec(codec=cache.draft_codec))
        free = None
        if self.device.type == "cuda" and cache.kv_cache_bytes is None:
            # The runner's activations and captured graphs live beside the pool: keep room.
            free = int(torch.cuda.mem_get_info(self.device)[0] * 0.9) - ModelRunner.workspace_bytes(
                self.target, self.drafter, cache.max_batch_size, B,
                cache.max_num_batched_tokens)
        self.plan = plan_cache(cache, groups, limits, B, free)
        self.max_seq_len = self.plan.max_seq_len
        self.pool = PagePool(groups, self.plan.num_pages, cache.page_size, self.device)
        self.namespace = Namespace(self.target.fingerprint(), tuple(groups), cache.page_size,
                                   drafter=self.drafter.fingerprint() if self.drafter else "none")
        self.tiers = _make_tiers(cache.tiers, self.pool, self.namespace)
        self.mgr = KVCacheManager(self.pool, self.namespace, lower=self.tiers)
        self.arena = (DraftArena(self.drafter, self.max_seq_len)
                      if self.drafter is not None and not self.paged else None)
        self.taps = list(self.drafter.cfg.target_layer_ids) if self.drafter else []
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.runner = ModelRunner(self.target, self.drafter, self.pool, self.mgr, block_size=B,
                                  max_batch_size=cache.max_batch_size,
                                  max_seq_len=self.max_seq_len, arena=self.arena,
                                  generator=self.generator, attn_impl=attn_impl, config=runner)
        self.runner.capture()
        self._ids = itertools.count()
        self._admissions = itertools.count()
        self.sched = self._scheduler()
        self._requests: dict[object, Request] = {}
        self._undelivered: list[RequestDelta] = []
        self._closed = False
        self.counters = {"steps": 0, "draft_s": 0.0, "target_s": 0.0, "step_s": 0.0,
                         "generated_tokens": 0, "prefill_tokens": 0, "verify_tokens": 0,
                         "preemptions": 0, "failed_requests": 0, "aborted_requests": 0}

    # -- engine core ----------------------------------------------------------------------------
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
        self._undelivered += self._deliver([r])
        return True

    def has_unfinished(self) -> bool:
        return any(r.state != DONE for r in self._requests.values())

    def close(self) -> None:
        """Abort unfinished requests; with a disk tier, write every cached device page and every
        host page down to it and close it, so a restarted engine finds them (idempotent)."""
        if self._closed:
            return
        for rid in [k for k, r in self._requests.items() if r.state != DONE]:
            self.abort(rid)
        self._requests.clear()
        self._closed = True
        if self.tiers is not None:
            if getattr(self.tiers, "disk", None) is not None:
                # Evicting sends the cached pages through the tiers' eviction path (to the host
                # tier); close() then drains the host tier to disk.
                self.pool.evict(self.pool.num_cached)
            if hasattr(self.tiers, "close"):
                self.tiers.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- public API ---------------------------------------------------------------------------
    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        """Generate for every prompt; returns outputs in prompt order.

        ``prompts``: a list of prompts, each text (needs a tokenizer) or a list of token ids; a
        single text or a single flat list of ids is one prompt. Bad requests are rejected one by
        one (``finish_reason="rejected"``, ``error`` says why); the others run. Requests added
        with :meth:`add_request` progress too (their deltas wait for the next :meth:`step`).
        Whatever happens (an exception, ``KeyboardInterrupt``), this call's requests are freed.
        """
        self._check_open()
        prompts = self._as_prompt_list(prompts)
        plist = self._params_list(params, len(prompts))
        outs: list[RequestOutput | None] = [None] * len(prompts)
        mine: dict[str, int] = {}
        try:
            for i, (p, sp) in enumerate(zip(prompts, plist)):
                try:
                    rid = self.add_request(p, sp, request_id=f"generate-{next(self._ids)}",
                                           cache_salt=cache_salt)
                except ValueError as e:
                    outs[i] = RequestOutput(i, p if isinstance(p, list) else [], [],
                                            finish_reason="rejected", error=f"request {i}: {e}")
                    continue
                mine[rid] = i
            while any(self._requests[rid].state != DONE for rid in mine):
                touched = self._advance(self.sched)
                self.sched.finished.clear()
                self._undelivered += self._deliver([r for r in touched if r.rid not in mine])
        finally:
            for rid in mine:
                r = self._requests.pop(rid)
                if r.state != DONE:
                    self._abort(self.sched, r)
                outs[mine[rid]] = self._output(r, mine[rid])
        return outs

    def prefill(self, prompts: Sequence[Sequence[int]],
                params: SamplingParams | Sequence[SamplingParams] | None = None,
                cache_salt: str | None = None) -> list[Request | RequestOutput]:
        """Context-worker half of :meth:`generate`: prefill (prefix reuse included) and sample the
        first token, then stop.

        Per prompt: a :class:`Request` in state ``PREFILLED`` whose sequence (``rid_key``; every
        prompt token committed in both groups) stays held until :meth:`release`, or a final
        :class:`RequestOutput` (rejected, or finished at its first token).
        """
        sched = self._scheduler()
        plist = self._params_list(params, len(prompts))
        outs: list = [None] * len(prompts)
        for i, (p, sp) in enumerate(zip(prompts, plist)):
            try:
                req = self._make_request(i, p, sp, cache_salt)
            except ValueError as e:
                outs[i] = RequestOutput(i, list(p) if isinstance(p, Sequence) else [],
                                        finish_reason="rejected", error=f"request {i}: {e}")
                continue
            req.handoff = True
            sched.add(req)
        held = self._drive(sched, outs)
        for r in held:
            outs[r.rid] = r
        return outs

    def resume(self, requests: Sequence[Request]) -> list[RequestOutput]:
        """Generation-worker half: decode requests whose prompt K/V is already in this pool.

        Each request is in state ``DECODE`` with ``tokens = prompt + [first token]``,
        ``num_computed == len(prompt)`` and ``rid_key`` naming an admitted sequence of this
        manager holding exactly the prompt (``disagg.workers`` builds them from a handoff).
        Returns outputs in the order given; the sequences are freed.
        """
        outs: list[RequestOutput | None] = [None] * len(requests)
        sched = self._scheduler()
        local = {}
        for i, r in enumerate(requests):
            seq = self.mgr.seqs.get(r.rid_key)
            if r.state != DECODE or seq is None or seq.token_ids != r.prompt or \
                    r.num_computed != len(r.prompt) or len(r.tokens) != len(r.prompt) + 1:
                raise ValueError(f"request {r.rid}: resume needs a DECODE request whose sequence "
                                 f"{r.rid_key!r} holds exactly its prompt and one pending token")
            local[i], r.rid = r.rid, i   # outputs are indexed locally, then renamed back
            r.stop_ids = self._stop_ids(r.params)
            sched.add(r)
        self._drive(sched, outs)
        for i, o in enumerate(outs):
            o.request_id = requests[i].rid = local[i]
        return outs

    def release(self, r: Request) -> None:
        """Free a request's sequence (a handed-off one: its full pages stay cached)."""
        self._release(r)

    def stats(self) -> dict:
        """Pool, prefix-cache, tier and engine counters."""
        p = self.pool
        out = {
            "pool": {"num_pages": p.num_pages, "page_size": p.page_size, "free": p.num_free,
                     "in_use": p.num_in_use, "cached": p.num_cached,
                     "evictions": p.num_evictions, "bytes": p.nbytes,
                     "groups": [g.name for g in p.groups]},
            "prefix": dict(self.mgr.stats),
            "engine": dict(self.counters, running=len(self.sched.running),
                           waiting=len(self.sched.waiting)),
            "runner": {"cuda_graphs": bool(self.runner.graphs),
                       "batch_sizes": list(self.runner.ladder) if self.runner.graphs else [],
                       "graph_pool_bytes": self.runner.graph_pool_bytes,
                       **self.runner.stats},
        }
        if self.arena is not None:
            out["arena_bytes"] = self.arena.nbytes
        if self.tiers is not None and hasattr(self.tiers, "stats"):
            out["tiers"] = self.tiers.stats()
        return out

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
        eos = () if sp.ignore_eos else self.eos_token_ids
        return frozenset(sp.stop_token_ids) | frozenset(eos)

    def _make_request(self, rid, prompt, sp, salt) -> Request:
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
        return Request(rid=rid, prompt=toks, params=sp, salt=salt, generator=gen,
                       max_length=min(len(toks) + sp.max_tokens, self.max_seq_len),
                       stop_ids=frozenset(t for t in self._stop_ids(sp) if t < V),
                       detok=Detokenizer(self.tokenizer) if self.tokenizer is not None else None,
                       t_arrival=time.perf_counter())

    def _drive(self, sched: Scheduler, outs: list) -> list[Request]:
        """Step a private scheduler (``prefill``/``resume``) until it is empty; outputs by rid."""
        held: list[Request] = []
        try:
            while sched.has_work:
                self._advance(sched, held)
                for r in list(sched.finished):
                    outs[r.rid] = self._output(r, r.rid)
                sched.finished.clear()
        finally:
            for r in list(sched.waiting) + list(sched.running):
                self._abort(sched, r)
                outs[r.rid] = self._output(r, r.rid)
        return held

    def _fits(self, sched: Scheduler, r: Request) -> bool:
        """Admission by need: the pages its (remaining) prompt and first block take, beyond what
        the running sequences need for their next block, are free or evictable."""
        live = [x for x in sched.running if x.rid_key in self.mgr.seqs]
        if not live:
            return True
        P = self.pool.page_size
        need = math.ceil(min(r.prefill_target + self.block_size, r.max_length) / P)
        headroom = sum(max(0, math.ceil(min(x.num_computed + self.block_size, x.max_length) / P)
                           - len(self.mgr.seqs[x.rid_key].page_ids)) for x in live)
        return self.pool.num_available - headroom >= need

    def _admit(self, sched: Scheduler) -> None:
        while sched.waiting and sched.free_slots() > 0:
            r = sched.waiting[0]
            if r.state != DECODE and not self._fits(sched, r):
                break
            sched.waiting.popleft()
            if r.state == DECODE:
                # Handed over (``resume``): the prompt's K/V is in the pool; the arena backend
                # starts empty here, which is exactly its disaggregation weakness.
                r.t_admit = r.t_first = time.perf_counter()
            else:
                r.rid_key = (next(self._ids), r.rid)
                upto = r.prefill_target
                pending = len(r.tokens) > upto          # resumed after a preemption in DECODE
                seq = self.mgr.admit(r.rid_key, r.tokens[:upto] if r.tokens else r.prompt,
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
                self.arena.open(r.rid_key, r.num_computed)
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
                    self.mgr.reserve(r.rid_key, r.num_computed + n)
                    break
                except OutOfPagesError:
                    live = [x for x in sched.running if x.state in (PREFILL, DECODE)]
                    self._preempt(sched, max(live, key=lambda x: x.admit_order))
        return StepPlan([(r, n) for r, n in plan.decode if r.state != PREEMPTED],
                        [(r, n) for r, n in plan.prefill if r.state != PREEMPTED])

    def _preempt(self, sched: Scheduler, r: Request) -> None:
        if len([x for x in sched.running if x.state in (PREFILL, DECODE)]) == 1:
            raise RuntimeError(f"request {r.rid}: the pool cannot hold one sequence's next "
                               "block even with every other sequence preempted")
        self._release(r)
        if r.state == DECODE:
            r.resume_to = r.num_computed
        r.num_computed, r.state, r.rid_key = 0, PREEMPTED, None
        r.num_preemptions += 1
        self.counters["preemptions"] += 1
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
            self.counters["aborted_requests" if reason == "abort" else "failed_requests"] += 1

    def _release(self, r: Request) -> None:
        if r.rid_key is not None and r.rid_key in self.mgr.seqs:
            self.mgr.free(r.rid_key)
            if self.arena is not None:
                self.arena.close(r.rid_key)

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
                r.rid, gen, text, finished, r.finish_reason if finished else None, r.last_al,
                len(r.prompt), r.num_cached_tokens, dict(r.cached_from),
                (r.t_first - r.t_arrival) if first and r.t_first else None, r.error))
            if finished and self._requests.get(r.rid) is r:
                del self._requests[r.rid]
        return out

    # -- one step -------------------------------------------------------------------------------
    def _advance(self, sched: Scheduler, held: list | None = None) -> list[Request]:
        """One step of ``sched``: admit, schedule, reserve (preempting under pressure), run with
        failures isolated per request, retire. Returns the requests the step touched."""
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
        log.warning("request %s failed: %s: %s", r.rid, type(e).__name__, e)
        self._abort(sched, r, "error", f"{type(e).__name__}: {e}")
        sched.finished.append(r)

    @torch.inference_mode()
    def _step(self, plan: StepPlan) -> None:
        """Hand the scheduled batch to the runner (device side: draft, verify, accept, draft
        context write; one device->host copy), then apply the produced tokens on the host."""
        t0 = time.perf_counter()
        items = [self._item(r, n, True) for r, n in plan.decode]
        items += [self._item(r, n, False) for r, n in plan.prefill]
        produced = self.runner.execute(items)
        self._accept(plan.decode + plan.prefill, items, produced)
        c = self.counters
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
        return StepItem(r.rid_key, r.num_computed, n, toks, decode, r.params, sample=sample,
                        generator=r.generator, banned=r.stop_ids if masked else frozenset(),
                        banned_rows=masked)

    def _accept(self, scheduled: list[tuple[Request, int]], items: list[StepItem],
                produced: list[list[int]]) -> None:
        """Host side of acceptance: append (stops, ``min_tokens``, lengths), then commit the
        tokens whose K/V (both groups) the runner wrote."""
        now = time.perf_counter()
        c = self.counters
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
            self.mgr.commit(r.rid_key, commit)
            r.num_computed += len(commit)
