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
from torch import Tensor, nn

from ..assets import resolve_model
from ..drafter import DFlashDrafter, DraftArena, PagedDraftAttention
from ..kernels.attention import plan_attention
from ..pagepool.hashing import Namespace
from ..pagepool.manager import KVCacheManager
from ..pagepool.pool import PagePool
from .config import CacheConfig, check_drafter_compat, plan_cache
from .outputs import RequestOutput
from .qwen3 import Qwen3Model
from .sampling import (SamplingParams, greedy_accept, rejection_accept, sample_from,
                       sampling_probs)
from .scheduler import DECODE, PREFILL, PREFILLED, Request, Scheduler


def _load(obj, loader, device, dtype, part: str):
    if obj is None or isinstance(obj, nn.Module):
        return obj
    if not isinstance(obj, (str, os.PathLike)):
        raise ValueError(f"expected a checkpoint directory or a loaded model, got {type(obj).__name__}")
    # A shipped model name ("kvstrata-tiny-py" or "kvstrata-tiny-py/target") or a directory.
    return loader(resolve_model(obj, part=part), device=device, dtype=dtype)


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
    """

    def __init__(self, target, drafter=None, cache: CacheConfig | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype | str = "auto",
                 block_size: int | None = None, seed: int = 0, attn_impl: str = "auto"):
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
            free = int(torch.cuda.mem_get_info(self.device)[0] * 0.9)
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
    def _sync(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @torch.inference_mode()
    def _step(self, sched: Scheduler) -> None:
        t0 = self._sync()
        self._admit(sched)
        plan = sched.schedule()
        if not plan.decode and not plan.prefill:
            raise RuntimeError("scheduler produced an empty step")  # unreachable by construction
        for r, n in plan.decode + plan.prefill:
            self.mgr.reserve(r.rid_key, r.num_computed + n)
        drafts = self._draft(plan.decode) if self.drafter is not None else {}
        t1 = self._sync()
        items = [(r, n, [r.tokens[-1]] + drafts.get(r, ([], None))[0]) for r, n in plan.decode]
        items += [(r, n, r.prompt[r.num_computed:r.num_computed + n]) for r, n in plan.prefill]
        hidden, taps, pos_t, slots_t = self._target_forward(items)
        t2 = self._sync()
        self._accept(items, drafts, hidden, taps, pos_t, slots_t)
        c = self.counters
        c["steps"] += 1
        c["draft_s"] += t1 - t0
        c["target_s"] += t2 - t1
        c["step_s"] += self._sync() - t0

    def _draft(self, decode: list[tuple[Request, int]]) -> dict:
        """Draft tokens (and their sampling distributions) for blocks longer than one token."""
        items = [(r, n) for r, n in decode if n > 1]
        if not items:
            return {}
        d, cfg, dev = self.drafter, self.drafter.cfg, self.device
        ids, pos, rows = [], [], []
        for r, n in items:
            start = r.num_computed
            rows += range(len(ids) + 1, len(ids) + n)
            ids += [r.tokens[-1]] + [cfg.mask_token_id] * (n - 1)
            pos += range(start, start + n)
        ids_t = torch.tensor(ids, dtype=torch.int64, device=dev)
        pos_t = torch.tensor(pos, dtype=torch.int64, device=dev)
        noise = self.target.embed(ids_t)
        if cfg.input_embedding_scale != 1.0:
            noise = noise * cfg.input_embedding_scale
        keys = [r.rid_key for r, _ in items]
        starts = [r.num_computed for r, _ in items]
        qlens = [n for _, n in items]
        if self.paged:
            bt, _ = self.mgr.block_tables(keys)
            slots = [s for (r, n) in items for s in self.mgr.slots(r.rid_key, r.num_computed,
                                                                  r.num_computed + n)]
            attn = PagedDraftAttention(d, self.pool.kv["draft"], bt, starts, qlens,
                                       torch.tensor(slots, dtype=torch.int64, device=dev),
                                       self.pool.page_size, impl=self.attn_impl)
        else:
            attn = self.arena.attention(keys, starts, qlens)
        hidden = d(noise, pos_t, attn)
        h = hidden[torch.tensor(rows, dtype=torch.int64, device=dev)].to(self.target.dtype)
        logits = d.postprocess_logits(self.target.compute_logits(h))
        greedy = logits.argmax(-1).tolist()
        out, at = {}, 0
        for r, n in items:
            k = n - 1
            sp = r.params
            if sp.greedy:
                out[r] = (greedy[at:at + k], None)
            else:
                probs = sampling_probs(logits[at:at + k], sp.temperature, sp.top_p, sp.top_k)
                toks = sample_from(probs, r.generator or self.generator)
                out[r] = (toks.tolist(), probs)
            at += k
        return out

    def _target_forward(self, items) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        """Hidden states, concatenated taps, positions and slots of the packed step's rows."""
        dev = self.device
        ids, pos, slots, qlens, slens = [], [], [], [], []
        for r, n, toks in items:
            s = r.num_computed
            ids += toks
            pos += range(s, s + n)
            slots += self.mgr.slots(r.rid_key, s, s + n)
            qlens.append(n)
            slens.append(s + n)
        bt, sl = self.mgr.block_tables([r.rid_key for r, _, _ in items], seq_lens=slens)
        meta = plan_attention(bt, sl, qlens, page_size=self.pool.page_size, causal=True,
                              seq_lens_host=slens,
                              num_kv_heads=self.target.config.num_key_value_heads)
        pos_t = torch.tensor(pos, dtype=torch.int64, device=dev)
        slots_t = torch.tensor(slots, dtype=torch.int64, device=dev)
        hidden, cap = self.target(
            torch.tensor(ids, dtype=torch.int64, device=dev), pos_t, meta, slots_t,
            self.pool.kv["target"], capture_layers=self.taps, attn_impl=self.attn_impl)
        return hidden, (torch.cat(cap, dim=-1) if cap else None), pos_t, slots_t

    def _accept(self, items, drafts, hidden: Tensor, taps: Tensor | None, pos_t: Tensor,
                slots_t: Tensor) -> None:
        dev = self.device
        # Rows whose logits we need: every verify row; the last row of a finished prompt.
        need, at = [], 0
        for r, n, _ in items:
            if r.state == DECODE:
                need += range(at, at + n)
            elif r.num_computed + n == len(r.prompt):
                need.append(at + n - 1)
            at += n
        logits = self.target.compute_logits(
            hidden[torch.tensor(need, dtype=torch.int64, device=dev)])
        greedy = logits.argmax(-1).tolist() if need else []
        commits = []          # (request, tokens to commit, first row in the packed step)
        li, at = 0, 0
        now = time.perf_counter()
        for r, n, toks in items:
            if r.state == DECODE:
                start = r.num_computed
                dr, dprobs = drafts.get(r, ([], None))
                sp = r.params
                if sp.greedy:
                    acc, bonus = greedy_accept(dr, greedy[li:li + n])
                else:
                    tp = sampling_probs(logits[li:li + n], sp.temperature, sp.top_p, sp.top_k)
                    d_t = torch.tensor(dr, dtype=torch.int64, device=dev)
                    if dprobs is None:
                        dprobs = tp[:0]
                    acc, bonus = rejection_accept(d_t, tp, dprobs, r.generator or self.generator)
                li += n
                new = (dr[:acc] + [bonus])[:max(1, r.max_length - start - 1)]
                stops = sp.stop_token_ids
                for j, t in enumerate(new):
                    if t in stops:
                        new = new[:j + 1]
                        break
                produced = len(new)
                commits.append((r, toks[:produced], at))
                r.acceptance_lengths.append(produced)
                r.append(new)
                self.counters["verify_tokens"] += n
                self.counters["generated_tokens"] += produced
            else:
                commits.append((r, toks, at))
                self.counters["prefill_tokens"] += n
                if r.num_computed + n == len(r.prompt):
                    sp = r.params
                    if sp.greedy:
                        first = greedy[li]
                    else:
                        probs = sampling_probs(logits[li], sp.temperature, sp.top_p, sp.top_k)
                        first = int(sample_from(probs, r.generator or self.generator))
                    li += 1
                    r.state, r.t_first = DECODE, now
                    r.append([first])
                    if r.handoff and r.state == DECODE:
                        r.state = PREFILLED
                        # The prompt commit below still runs: a handoff carries committed pages.
                    self.counters["generated_tokens"] += 1
            at += n
        self._write_context(commits, taps, pos_t, slots_t)
        for r, toks, _ in commits:
            self.mgr.commit(r.rid_key, toks)
            r.num_computed += len(toks)

    def _write_context(self, commits, taps: Tensor | None, pos_t: Tensor, slots_t: Tensor
                       ) -> None:
        """Draft context K/V of the tokens about to be committed (both groups before commit).

        ``pos_t``/``slots_t``: the step's packed positions and slots (``_target_forward``); a
        commit's tokens are the first rows of its item, so their positions and slots are those.
        """
        if self.drafter is None or not commits:
            return
        dev = self.device
        rows = []
        for r, toks, at in commits:
            s, m = r.num_computed, len(toks)
            if self.paged:
                rows += range(at, at + m)
            elif m:
                self.arena.append(r.rid_key, taps[at:at + m],
                                  torch.arange(s, s + m, device=dev))
        if self.paged and rows:
            idx = torch.tensor(rows, dtype=torch.int64, device=dev)
            self.drafter.write_context(taps[idx], pos_t[idx], slots_t[idx], self.pool.kv["draft"],
                                       impl=self.attn_impl)
