"""``LLM``: the speculative-decoding engine's API (DFlash drafter + Qwen3 target over one page
pool): loading the models, sizing the pool, building the tiers, the manager and the runner, and
the calls users make (:meth:`LLM.generate`, the disaggregated :meth:`LLM.prefill` /
:meth:`LLM.resume` halves, :meth:`LLM.stats`, :meth:`LLM.close`). The engine core it runs on
(requests, admission, preemption, deltas) is :class:`~.core.EngineCore`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from ..assets import resolve_model
from ..devices import resolve_device
from ..tokenizer import TextTokenizer, load_tokenizer
from ..tokenizer import eos_token_ids as read_eos_ids
from ..drafter import DFlashDrafter, DraftArena
from ..pagepool.hashing import Namespace
from ..pagepool.manager import KVCacheManager
from ..pagepool.pool import PagePool
from .config import CacheConfig, RunnerConfig, check_drafter_compat, plan_cache
from .core import EngineCore
from .outputs import RequestOutput
from .qwen3 import Qwen3Model
from .runner import ModelRunner
from .sampling import SamplingParams
from .scheduler import DECODE, DONE, Request

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


class LLM(EngineCore):
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
        self.device = resolve_device(device)
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
        self.mgr = KVCacheManager(self.pool, self.namespace, tiers=self.tiers)
        self.arena = (DraftArena(self.drafter, self.max_seq_len)
                      if self.drafter is not None and not self.paged else None)
        self.taps = list(self.drafter.cfg.target_layer_ids) if self.drafter else []
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.runner = ModelRunner(self.target, self.drafter, self.pool, self.mgr, block_size=B,
                                  max_batch_size=cache.max_batch_size,
                                  max_seq_len=self.max_seq_len, arena=self.arena,
                                  generator=self.generator, attn_impl=attn_impl, config=runner)
        self.runner.capture()
        super().__init__()

    def close(self) -> None:
        """Abort unfinished requests; with a disk tier, write every cached device page and every
        host page down to it and close it, so a restarted engine finds them (idempotent)."""
        if self._closed:
            return
        for request_id in [k for k, r in self._requests.items() if r.state != DONE]:
            self.abort(request_id)
        self._abandon(self.sched)
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
                    request_id = self.add_request(p, sp, request_id=f"generate-{next(self._ids)}",
                                           cache_salt=cache_salt)
                except ValueError as e:
                    outs[i] = RequestOutput(i, p if isinstance(p, list) else [], [],
                                            finish_reason="rejected", error=f"request {i}: {e}")
                    continue
                mine[request_id] = i
            while any(self._requests[request_id].state != DONE for request_id in mine):
                touched = self._advance(self.sched)
                self.sched.finished.clear()
                self._undelivered += self._deliver([r for r in touched if r.request_id not in mine])
        finally:
            for request_id in mine:
                r = self._requests.pop(request_id)
                if r.state != DONE:
                    self._abort(self.sched, r)
                outs[mine[request_id]] = self._output(r, mine[request_id])
            self._settle()
        return outs

    def prefill(self, prompts: Sequence[Sequence[int]],
                params: SamplingParams | Sequence[SamplingParams] | None = None,
                cache_salt: str | None = None) -> list[Request | RequestOutput]:
        """Context-worker half of :meth:`generate`: prefill (prefix reuse included) and sample the
        first token, then stop.

        Per prompt: a :class:`Request` in state ``PREFILLED`` whose sequence (``seq_id``; every
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
            outs[r.request_id] = r
        return outs

    def resume(self, requests: Sequence[Request]) -> list[RequestOutput]:
        """Generation-worker half: decode requests whose prompt K/V is already in this pool.

        Each request is in state ``DECODE`` with ``tokens = prompt + [first token]``,
        ``num_computed == len(prompt)`` and ``seq_id`` naming an admitted sequence of this
        manager holding exactly the prompt (``disagg.workers`` builds them from a handoff).
        Returns outputs in the order given; the sequences are freed.
        """
        outs: list[RequestOutput | None] = [None] * len(requests)
        sched = self._scheduler()
        local = {}
        for i, r in enumerate(requests):
            seq = self.mgr.seqs.get(r.seq_id)
            if r.state != DECODE or seq is None or seq.token_ids != r.prompt or \
                    r.num_computed != len(r.prompt) or len(r.tokens) != len(r.prompt) + 1:
                raise ValueError(f"request {r.request_id}: resume needs a DECODE request whose "
                                 f"sequence {r.seq_id!r} holds exactly its prompt and one "
                                 "pending token")
            # outputs are indexed locally, then renamed back
            local[i], r.request_id = r.request_id, i
            r.stop_ids = self._stop_ids(r.params)
            sched.add(r)
        self._drive(sched, outs)
        for i, o in enumerate(outs):
            o.request_id = requests[i].request_id = local[i]
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
            "prefix": self.mgr.stats(),
            "engine": dict(self._counters, running=len(self.sched.running),
                           waiting=len(self.sched.waiting)),
            "runner": {"cuda_graphs": bool(self.runner.graphs), "overlap": self.runner.overlap,
                       "batch_sizes": list(self.runner.ladder) if self.runner.graphs else [],
                       "graph_pool_bytes": self.runner.graph_pool_bytes,
                       **self.runner.stats()},
        }
        if self.arena is not None:
            out["arena_bytes"] = self.arena.nbytes
        if self.tiers is not None and hasattr(self.tiers, "stats"):
            out["tiers"] = self.tiers.stats()
        return out
