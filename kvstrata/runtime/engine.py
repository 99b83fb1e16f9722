"""``LLM``: the speculative-decoding engine (DFlash drafter + Qwen3 target over one page pool).

One step (see DESIGN.md, "Runtime"):

1. admit waiting requests; the longest cached prefix (device pool, then tiers) is reused for both
   groups, so only the uncached prompt tail is prefilled, at its true positions;
2. draft ``B-1`` tokens for every scheduled generating sequence in one drafter forward;
3. one target forward over every verify block and prefill chunk (K/V written into the target
   group; the drafter's tap layers captured);
4. accept (greedy match or rejection sampling), write the draft context K/V of the committed
   tokens into the draft group, then ``commit`` them (hashing pages that became full: only now
   are both groups of those tokens written).
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Sequence

import torch
from torch import nn

from ..assets import resolve_model
from ..drafter import DFlashDrafter, DraftArena
from ..pagepool.hashing import Namespace
from ..pagepool.manager import KVCacheManager
from ..pagepool.pool import PagePool
from .config import CacheConfig, check_drafter_compat, plan_cache
from .outputs import RequestOutput
from .qwen3 import Qwen3Model
from .runner import ModelRunner, RunnerConfig, StepItem
from .sampling import SamplingParams
from .scheduler import DECODE, PREFILL, PREFILLED, Request, Scheduler


def _load(obj, loader, device, dtype, part: str):
    if obj is None or isinstance(obj, nn.Module):
        return obj
    if not isinstance(obj, (str, os.PathLike)):
        raise ValueError(f"expected a checkpoint directory or a loaded model, got {type(obj).__name__}")
    # A shipped model name ("kvstrata-tiny-py" or "kvstrata-tiny-py/target") or a directory.
    return loader(resolve_model(obj, part=part), device=device, dtype=dtype)


def _make_tiers(spec, pool: PagePool, namespace: Namespace):
    """``CacheConfig.tiers``: None, kwargs for ``TierManager``, or ``(pool, namespace) -> tiers``."""
    if spec is None:
        return None
    if isinstance(spec, dict):
        from ..tiers.manager import TierManager
        return TierManager(pool, namespace, **spec)
    if callable(spec):
        tiers = spec(pool, namespace)
    else:
        raise ValueError("CacheConfig.tiers must be None, a dict of TierManager arguments, or a "
                         "callable (pool, namespace) -> TierManager")
    if getattr(pool, "on_evict", None) is None and hasattr(tiers, "on_evict"):
        pool.on_evict = tiers.on_evict
    return tiers


class LLM:
    """Speculative decoding over a paged, prefix-cached, tiered KV store.

    Args:
        target: Qwen3 checkpoint directory (or a loaded :class:`Qwen3Model`).
        drafter: DFlash checkpoint directory (or a loaded :class:`DFlashDrafter`); ``None`` for
            plain decoding.
        cache: :class:`CacheConfig` (validated here against the models).
        device: torch device; dtype: ``"auto"`` keeps each checkpoint's dtype.
        block_size: override the drafter's block size.
        seed: seed of the sampling RNG shared by requests without their own seed.
        attn_impl: kernel implementation (``"auto"``, ``"triton"``, ``"torch"``).
        runner: :class:`RunnerConfig` (CUDA graphs on by default on CUDA; the
            ``KVSTRATA_CUDA_GRAPHS=0`` environment variable turns them off; opt-in timing).
    """

    def __init__(self, target, drafter=None, cache: CacheConfig | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype | str = "auto",
                 block_size: int | None = None, seed: int = 0, attn_impl: str = "auto",
                 runner: RunnerConfig | None = None):
        self.cache = cache = cache if cache is not None else CacheConfig()
        if not isinstance(cache, CacheConfig):
            raise ValueError(f"cache must be a CacheConfig, got {type(cache).__name__}")
        self.device = torch.device(device)
        self.attn_impl = attn_impl
        self.target: Qwen3Model = _load(target, Qwen3Model.from_pretrained, self.device, dtype,
                                        "target")
        self.drafter: DFlashDrafter | None = _load(drafter, DFlashDrafter.from_pretrained,
                                                   self.device, dtype, "drafter")
        tcfg = self.target.config
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
        self.counters = {"steps": 0, "draft_s": 0.0, "target_s": 0.0, "step_s": 0.0,
                         "generated_tokens": 0, "prefill_tokens": 0, "verify_tokens": 0}

    # -- public API ---------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        """Generate for every prompt (lists of token ids); returns outputs in prompt order.

        Bad requests are rejected one by one (``finish_reason="rejected"``, ``error`` says why);
        the others run.
        """
        sched, outs = self._submit(prompts, params, cache_salt, handoff=False)
        self._run(sched, outs, [])
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
        sched, outs = self._submit(prompts, params, cache_salt, handoff=True)
        held: list[Request] = []
        self._run(sched, outs, held)
        res: list[Request | RequestOutput] = list(outs)
        for r in held:
            res[r.rid] = r
        return res

    def resume(self, requests: Sequence[Request]) -> list[RequestOutput]:
        """Generation-worker half: decode requests whose prompt K/V is already in this pool.

        Each request is in state ``DECODE`` with ``tokens = prompt + [first token]``,
        ``num_computed == len(prompt)`` and ``rid_key`` naming an admitted sequence of this
        manager holding exactly the prompt (``disagg.workers`` builds them from a handoff).
        Returns outputs in the order given; the sequences are freed.
        """
        outs: list[RequestOutput | None] = [None] * len(requests)
        sched = Scheduler(self.cache.max_batch_size, self.cache.max_num_batched_tokens,
                          self.block_size)
        local = {}
        for i, r in enumerate(requests):
            seq = self.mgr.seqs.get(r.rid_key)
            if r.state != DECODE or seq is None or seq.token_ids != r.prompt or \
                    r.num_computed != len(r.prompt) or len(r.tokens) != len(r.prompt) + 1:
                raise ValueError(f"request {r.rid}: resume needs a DECODE request whose sequence "
                                 f"{r.rid_key!r} holds exactly its prompt and one pending token")
            local[i], r.rid = r.rid, i   # outputs are indexed locally, then renamed back
            sched.add(r)
        self._run(sched, outs, [])
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
            "engine": dict(self.counters),
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
    def _submit(self, prompts, params, cache_salt, handoff: bool) -> tuple[Scheduler, list]:
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise ValueError("prompts must be a list of token-id lists")
        if params is None:
            params = SamplingParams()
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        outs = [RequestOutput(i, []) for i in range(len(prompts))]
        sched = Scheduler(self.cache.max_batch_size, self.cache.max_num_batched_tokens,
                          self.block_size)
        for i, (p, sp) in enumerate(zip(prompts, plist)):
            try:
                req = self._make_request(i, p, sp, cache_salt)
            except ValueError as e:
                outs[i].prompt_token_ids = list(p) if isinstance(p, Sequence) else []
                outs[i].finish_reason, outs[i].error = "rejected", str(e)
                continue
            req.handoff = handoff
            sched.add(req)
        return sched, outs

    def _run(self, sched: Scheduler, outs: list, held: list[Request]) -> None:
        while sched.has_work:
            self._step(sched)
            for r in sched.retire():
                if r.state == PREFILLED:
                    held.append(r)       # its sequence stays admitted for the handoff
                    continue
                self._release(r)
                outs[r.rid] = self._output(r)

    def _make_request(self, i: int, prompt, sp, salt) -> Request:
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"request {i}: params must be SamplingParams, got {type(sp).__name__}")
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
            raise ValueError(f"request {i}: a prompt is a list of token ids, got "
                             f"{type(prompt).__name__}")
        toks = list(prompt)
        if not toks:
            raise ValueError(f"request {i}: empty prompt")
        V = self.target.config.vocab_size
        bad = [t for t in toks if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < V]
        if bad:
            raise ValueError(f"request {i}: token ids {bad[:5]} are outside the vocabulary "
                             f"[0, {V})")
        if len(toks) >= self.max_seq_len:
            raise ValueError(f"request {i}: prompt of {len(toks)} tokens leaves no room to "
                             f"generate within max_seq_len={self.max_seq_len}; at most "
                             f"{self.max_seq_len - 1} prompt tokens fit")
        if salt is not None and not isinstance(salt, str):
            raise ValueError(f"cache_salt must be a string or None, got {type(salt).__name__}")
        gen = None
        if sp.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(sp.seed)
        return Request(rid=i, prompt=toks, params=sp, salt=salt, generator=gen,
                       max_length=min(len(toks) + sp.max_tokens, self.max_seq_len))

    def _admit(self, sched: Scheduler) -> None:
        while sched.waiting and sched.free_slots() > 0:
            r = sched.waiting.popleft()
            if r.state == DECODE:
                # Handed over (``resume``): the prompt's K/V is in the pool; the arena backend
                # starts empty here, which is exactly its disaggregation weakness.
                r.t_admit = r.t_first = time.perf_counter()
            else:
                r.rid_key = (next(self._ids), r.rid)
                seq = self.mgr.admit(r.rid_key, r.prompt, cache_salt=r.salt)
                r.num_computed = r.num_cached_tokens = seq.num_cached_tokens
                r.tokens = list(r.prompt)
                r.state, r.t_admit = PREFILL, time.perf_counter()
            if self.arena is not None:
                self.arena.open(r.rid_key, r.num_computed)
            sched.running.append(r)

    def _release(self, r: Request) -> None:
        self.mgr.free(r.rid_key)
        if self.arena is not None:
            self.arena.close(r.rid_key)

    def _output(self, r: Request) -> RequestOutput:
        return RequestOutput(
            r.rid, list(r.prompt), r.tokens[len(r.prompt):], list(r.acceptance_lengths),
            r.num_cached_tokens, r.finish_reason, None,
            {"ttft_s": r.t_first - r.t_admit, "total_s": r.t_done - r.t_admit,
             "num_steps": len(r.acceptance_lengths)})

    # -- one step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def _step(self, sched: Scheduler) -> None:
        """Schedule, hand the batch to the runner (draft, verify, accept and the draft context
        write run on the device), then apply stops/lengths on the host and commit."""
        t0 = time.perf_counter()
        self._admit(sched)
        plan = sched.schedule()
        if not plan.decode and not plan.prefill:
            raise RuntimeError("scheduler produced an empty step")  # unreachable by construction
        for r, n in plan.decode + plan.prefill:
            self.mgr.reserve(r.rid_key, r.num_computed + n)
        items = [StepItem(r.rid_key, r.num_computed, n, [r.tokens[-1]], True, r.params,
                          generator=r.generator) for r, n in plan.decode]
        items += [StepItem(r.rid_key, r.num_computed, n,
                           r.prompt[r.num_computed:r.num_computed + n], False, r.params,
                           sample=r.num_computed + n == len(r.prompt), generator=r.generator)
                  for r, n in plan.prefill]
        produced = self.runner.execute(items)
        self._accept(plan.decode + plan.prefill, items, produced)
        c = self.counters
        c["steps"] += 1
        c["draft_s"] = self.runner.timing.draft_s
        c["target_s"] = self.runner.timing.target_s
        c["step_s"] += time.perf_counter() - t0   # the runner waited for its one D2H copy

    def _accept(self, scheduled: list[tuple[Request, int]], items: list[StepItem],
                produced: list[list[int]]) -> None:
        """Host side of acceptance: cut at stop tokens and ``max_length``, append, commit."""
        now = time.perf_counter()
        for (r, n), it, new in zip(scheduled, items, produced):
            if it.decode:
                start = r.num_computed
                new = new[:max(1, r.max_length - start - 1)]
                stops = r.params.stop_token_ids
                for j, t in enumerate(new):
                    if t in stops:
                        new = new[:j + 1]
                        break
                # The inputs of the produced tokens' rows: the pending token, then the accepted
                # drafts (which equal the produced tokens before the last).
                commit = ([r.tokens[-1]] + new)[:len(new)]
                r.acceptance_lengths.append(len(new))
                r.append(new)
                self.counters["verify_tokens"] += n
                self.counters["generated_tokens"] += len(new)
            else:
                commit = it.tokens
                self.counters["prefill_tokens"] += n
                if new:
                    r.state, r.t_first = DECODE, now
                    r.append(new)
                    if r.handoff and r.state == DECODE:
                        r.state = PREFILLED
                        # The prompt commit below still runs: a handoff carries committed pages.
                    self.counters["generated_tokens"] += 1
            self.mgr.commit(r.rid_key, commit)
            r.num_computed += len(commit)
