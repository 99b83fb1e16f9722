"""``KVStrataConnector``: vLLM's KV connector (``KVConnectorBase_V1``) over kvstrata's tiers.

What it does, in vLLM's terms (one vLLM block = one kvstrata page; block size = page size):

Scheduler side (``role=SCHEDULER``)
    ``get_num_new_matched_tokens``: hashes the request's full blocks with kvstrata's chained
    BLAKE2b hashes under a namespace of the model fingerprint, the KV layout (layers, heads,
    head size, dtype, block size) and the request's ``cache_salt``, and asks the tiers how many
    leading blocks they hold (``exists`` only, no payload moves). The last token is never offered
    (vLLM must compute at least one token), so a hit covers ``(num_tokens - 1) // block_size``
    blocks at most. Loads are synchronous (``load_kv_async=False``).
    ``update_state_after_alloc``: remembers which of the request's blocks receive the hit.
    ``build_connector_meta``: tells the worker which blocks to load this step, and which blocks
    become full this step (prompt or generated tokens) and must be saved.
    ``request_finished``: forgets the request; returns ``(False, None)``: every full block was
    already saved in the step that filled it, so vLLM may free the blocks at once. A preempted
    request's full blocks are saved the same way before vLLM can free them, and its resumption
    finds them in the tiers.

Worker side (``role=WORKER``)
    ``register_kv_caches``: wraps vLLM's per-layer KV tensors in a
    :class:`~kvstrata.pagepool.PoolView` (no copy). ``start_load_kv``: loads every planned block
    (verified record -> decode -> the block), synchronously, before the forward;
    ``wait_for_layer_load`` therefore returns at once. ``save_kv_layer`` does nothing: whole pages
    (every layer) are saved in ``wait_for_save``, after the forward wrote them.
    A record that fails verification (CRC, namespace, chain link, token ids) is deleted and its
    block, and the blocks after it, are reported by ``get_block_ids_with_load_errors``: with
    ``kv_load_failure_policy="recompute"`` vLLM recomputes them; nothing of that step of the
    request is saved (its tail was computed over a block that was never loaded).

Not supported (refused at start-up with a clear error): more than one KV cache group (hybrid,
sliding-window or Mamba models), MLA, quantized KV caches, tensor/pipeline parallelism > 1
(pages would hold one rank's heads). Multimodal, prompt-embedding and LoRA requests are neither
looked up nor saved (their KV depends on more than the token ids).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata,
                                                               KVConnectorRole)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ...pagepool import KVGroupSpec, PageKey, page_hashes
from ...pagepool.view import LAYER_KV_FIRST, GroupView, PoolView
from ..config import StoreConfig, acquire_store, release_store

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PageTransfer:
    """Pages of one request to load or save this step: ``infos[i]`` lives in block
    ``block_ids[i]``."""

    req_id: str
    block_ids: list[int]
    infos: list[PageKey]


@dataclass
class KVStrataConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, one step: loads run before the forward, saves after it."""

    loads: list[PageTransfer] = field(default_factory=list)
    saves: list[PageTransfer] = field(default_factory=list)


@dataclass(slots=True)
class _Tracked:
    """Scheduler-side state of one request."""

    request: "Request"
    block_ids: list[int]
    hashes: list[bytes] = field(default_factory=list)   # chain over full pages hashed so far
    stored: int = 0                 # leading pages known to be in the tiers (hit or saved)
    load: tuple[int, int] | None = None                 # pages [a, b) to load next step


class KVStrataConnector(KVConnectorBase_V1):
    """vLLM KV connector storing full blocks in kvstrata's tiers (see the module doc)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config = StoreConfig.from_dict(self._kv_transfer_config.kv_connector_extra_config)
        self.spec, self.layer_names, self.page_size = _kv_layout(vllm_config, kv_cache_config,
                                                                 self.config.codec)
        self.namespace = self.config.namespace(_fingerprint(vllm_config), (self.spec,),
                                               self.page_size)
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.warning("kvstrata: kv_load_failure_policy=%r fails a request whose stored block "
                        "is found corrupt; set it to 'recompute' to recompute such blocks",
                        self._kv_transfer_config.kv_load_failure_policy)
        self.store = acquire_store(self.config, self.namespace)
        self._cache_hit_source = _hit_source(self.store)
        # scheduler side
        self._reqs: dict[str, _Tracked] = {}
        self._hits: dict[str, tuple[int, int]] = {}   # req id -> (local tokens, stored pages)
        # worker side
        self._view: PoolView | None = None
        self._failed_blocks: set[int] = set()
        self._failed_reqs: set[str] = set()

    @property
    def requires_kv_delivery(self) -> bool:
        # A cache, not a hand-off: a save that never happened is a later miss, never an error.
        return False

    # ==========================================================================================
    # Scheduler side
    # ==========================================================================================
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        if not _cacheable(request):
            return 0, False
        P = self.page_size
        usable = (request.num_tokens - 1) // P
        # Looked up even when vLLM's own prefix cache covers the prompt: pages already stored
        # are then not encoded and saved again.
        tr = self._reqs.get(request.request_id)
        hashes = self._hashes(request, usable, tr.hashes if tr is not None else None)
        n = self.store.lookup(hashes)
        self._hits[request.request_id] = (num_computed_tokens, n)
        return max(0, n * P - num_computed_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        if not _cacheable(request):
            return
        rid = request.request_id
        (block_ids,) = blocks.get_block_ids()
        local, stored = self._hits.pop(rid, (0, 0))
        tr = self._reqs.get(rid)
        if tr is None:
            tr = self._reqs[rid] = _Tracked(request, list(block_ids))
        else:           # resumed after preemption: new blocks
            tr.block_ids = list(block_ids)
        tr.stored = max(tr.stored, stored)
        if num_external_tokens > 0:
            P = self.page_size
            tr.load = (local // P, (local + num_external_tokens) // P)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KVStrataConnectorMetadata()
        so = scheduler_output
        computed: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            tr = self._reqs.get(new.req_id)
            if tr is not None:
                tr.block_ids = list(new.block_ids[0])
                computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            tr = self._reqs.get(rid)
            if tr is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                tr.block_ids = list(new_ids[0]) if new_ids is not None else tr.block_ids
            elif new_ids is not None:
                tr.block_ids.extend(new_ids[0])
            computed[rid] = cached.num_computed_tokens[i]
        P = self.page_size
        for rid, done in computed.items():
            tr = self._reqs[rid]
            if tr.load is not None:
                a, b = tr.load
                tr.load = None
                hashes = self._hashes(tr.request, b, tr.hashes)
                meta.loads.append(PageTransfer(rid, tr.block_ids[a:b],
                                               self._infos(tr.request, hashes, a, b)))
            # A load that failed (or a hit vLLM did not take) leaves fewer tokens computed than
            # the pages believed stored: those pages are recomputed, so they are saved again.
            tr.stored = min(tr.stored, done // P)
            # Draft tokens of speculative decoding may be rejected: their KV is not the tokens'.
            after = done + so.num_scheduled_tokens.get(rid, 0) - \
                len(so.scheduled_spec_decode_tokens.get(rid, ()))
            full = min(after, tr.request.num_tokens) // P
            if full > tr.stored:
                hashes = self._hashes(tr.request, full, tr.hashes)
                meta.saves.append(PageTransfer(rid, tr.block_ids[tr.stored:full],
                                               self._infos(tr.request, hashes, tr.stored, full)))
                tr.stored = full
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        # Full blocks were saved in the step that filled them: nothing is pending.
        self._reqs.pop(request.request_id, None)
        self._hits.pop(request.request_id, None)
        return False, None

    def _hashes(self, request: "Request", n: int, known: list[bytes] | None) -> list[bytes]:
        """The first ``n`` chain hashes of ``request`` (extending ``known`` in place)."""
        known = [] if known is None else known
        if len(known) < n:
            ns = self.namespace.with_salt(request.cache_salt)
            tokens = request.all_token_ids[:n * self.page_size]
            known.extend(page_hashes(ns, tokens, len(known), known[-1] if known else None))
        return known[:n]

    def _infos(self, request: "Request", hashes: list[bytes], a: int, b: int) -> list[PageKey]:
        P = self.page_size
        toks = request.all_token_ids
        root = self.namespace.with_salt(request.cache_salt).digest
        return [PageKey(hashes[i], hashes[i - 1] if i else root,
                        tuple(toks[i * P:(i + 1) * P])) for i in range(a, b)]

    # ==========================================================================================
    # Worker side
    # ==========================================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.layer_names if n not in kv_caches]
        if missing:
            raise ValueError(f"kvstrata: vLLM registered no KV cache for layers {missing}")
        num_blocks = self._kv_cache_config.num_blocks
        tensors = tuple(_as_layer_kv_first(kv_caches[n], num_blocks, self.spec, self.page_size)
                        for n in self.layer_names)
        self._view = PoolView((GroupView(self.spec, LAYER_KV_FIRST, tensors),),
                              num_blocks, self.page_size)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVStrataConnectorMetadata) or not meta.loads:
            return
        view = self._require_view()
        for t in meta.loads:
            n = self.store.load(view, t.block_ids, t.infos)
            if n < len(t.infos):
                self._failed_blocks.update(t.block_ids[n:])
                self._failed_reqs.add(t.req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # start_load_kv loads every layer before the forward begins.
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        # A record holds every layer of a page: pages are saved whole in wait_for_save.
        return

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        failed, self._failed_reqs = self._failed_reqs, set()
        if not isinstance(meta, KVStrataConnectorMetadata) or not meta.saves:
            return
        view = self._require_view()
        for t in meta.saves:
            if t.req_id not in failed:
                self.store.save(view, t.block_ids, t.infos)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._failed_blocks = self._failed_blocks, set()
        return out

    def _require_view(self) -> PoolView:
        if self._view is None:
            raise RuntimeError("kvstrata: KV transfer before vLLM registered its KV caches")
        return self._view

    # ==========================================================================================
    def stats(self) -> dict:
        """Counters of the store and its tiers (``store.loaded_pages``, ``corrupt_records``...)."""
        return self.store.stats()

    def shutdown(self) -> None:
        store, self.store = self.store, None
        if store is not None:
            release_store(store)


def _hit_source(store) -> CacheHitSource:
    """vLLM's label for this connector's hits: its outermost tier (a lookup does not say which
    tier holds each page)."""
    names = {"host": CacheHitSource.HOST, "disk": CacheHitSource.DISK}
    return CacheHitSource.outermost(names.get(t.name, CacheHitSource.EXTERNAL_UNSPECIFIED)
                                    for t in store.tiers)


def _cacheable(request: "Request") -> bool:
    """KV of these requests depends on the token ids alone."""
    return not (request.mm_features or request.prompt_embeds is not None
                or request.lora_request is not None)


def _fingerprint(vllm_config: "VllmConfig") -> str:
    mc = vllm_config.model_config
    return f"vllm:{mc.model}@{mc.revision or 'main'}:{mc.dtype}:{mc.quantization or 'none'}"


def _kv_layout(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", codec: str
               ) -> tuple[KVGroupSpec, list[str], int]:
    """The one layer group a page holds, the layer names in order, and the block size; raises
    for what the connector does not support."""
    pc = vllm_config.parallel_config
    if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
        raise NotImplementedError(
            f"kvstrata: tensor_parallel_size={pc.tensor_parallel_size}, pipeline_parallel_size="
            f"{pc.pipeline_parallel_size}; KVStrataConnector supports one worker (TP=PP=1)")
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise NotImplementedError(
            f"kvstrata: the model has {len(groups)} KV cache groups (hybrid, sliding-window or "
            f"Mamba layers); KVStrataConnector supports models with one full-attention group")
    spec = groups[0].kv_cache_spec
    if type(spec) is not FullAttentionSpec or isinstance(spec, MLAAttentionSpec) or \
            spec.sliding_window is not None:
        raise NotImplementedError(
            f"kvstrata: KV cache spec {type(spec).__name__} is not supported (full attention "
            f"without sliding window only)")
    head_v = spec.head_size_v if spec.head_size_v is not None else spec.head_size
    if head_v != spec.head_size or getattr(spec, "kv_quant_mode", 0):
        raise NotImplementedError("kvstrata: quantized KV caches or K/V of different head sizes "
                                  "are not supported")
    try:
        group = KVGroupSpec("target", len(groups[0].layer_names), spec.num_kv_heads,
                            spec.head_size, spec.dtype, codec)
    except ValueError as e:
        raise NotImplementedError(f"kvstrata: {e}") from None
    return group, list(groups[0].layer_names), spec.block_size


def _as_layer_kv_first(t: torch.Tensor, num_blocks: int, spec: KVGroupSpec, P: int
                       ) -> torch.Tensor:
    """A ``[2, num_blocks, P, H, D]`` view of one layer's vLLM KV cache (no copy).

    vLLM's layouts: ``[2, B, P, H, D]`` (flash-attention style), ``[B, 2, P, H, D]`` (FlashInfer
    NHD), and the CPU backend's ``[B, H, P, 2*D]``, whose bytes per block and head are ``P`` rows
    of K then ``P`` rows of V (it reads them as ``view(B, H, 2*P, D).chunk(2, dim=2)``).
    """
    H, D = spec.num_kv_heads, spec.head_dim
    shape = tuple(t.shape)
    if shape == (2, num_blocks, P, H, D):
        return t
    if shape == (num_blocks, 2, P, H, D):
        return t.transpose(0, 1)
    if shape == (num_blocks, H, P, 2 * D):
        return t.view(num_blocks, H, 2, P, D).permute(2, 0, 3, 1, 4)
    raise NotImplementedError(
        f"kvstrata: KV cache tensor of shape {shape} is not a layout KVStrataConnector knows "
        f"(expected [2, {num_blocks}, {P}, {H}, {D}], [{num_blocks}, 2, {P}, {H}, {D}] or "
        f"[{num_blocks}, {H}, {P}, {2 * D}])")
