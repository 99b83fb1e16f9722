"""``KVStrataHiCacheStorage``: an SGLang HiCache L3 storage backend over kvstrata's tiers.

SGLang's hierarchical cache moves pages device -> host pool (L2) -> storage (L3). This backend is
the L3: each page SGLang backs up becomes one kvstrata record (per-group codec, namespace digest,
CRCs) in the configured tiers, and a prefetch reads records back, verifies them and writes the
page into SGLang's host pool. Turn it on with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvstrata",
        "module_path": "kvstrata.integrations.sglang", "class_name": "KVStrataHiCacheStorage",
        "interface_v1": 1, "disk_path": "/var/cache/kvstrata"}'

Keys. SGLang names a page by its own key (a hex SHA-256 chained over the page's tokens) and
passes no token ids to storage. A record's identity is therefore bound to that key: its parent
hash is ``H(namespace ‖ key)`` and its page hash ``H(parent)``, so a record read under another key
or another namespace (model, TP rank, KV layout, codec) fails verification and is a miss.

Interface. ``batch_get_v1`` / ``batch_set_v1`` (SGLang's zero-copy interface, used with
``"interface_v1": 1``) read and write pages straight in the registered host pool by host index;
``get`` / ``batch_get`` / ``set`` / ``batch_set`` take SGLang's flat data pages (the generic
interface); ``exists`` / ``batch_exists`` answer per key and longest prefix. The v2 multi-pool
interface (Mamba, SWA, DSA sidecar pools) and ``clear`` raise ``NotImplementedError``.
Supported host pools: MHA, layouts ``layer_first``, ``page_first``, ``page_first_direct`` and
``page_head``.
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from ...pagepool import KVGroupSpec, PageKey, blake2b_128, hash_page
from ...pagepool.view import PAGE_MAJOR, GroupView, PoolView
from ..config import StoreConfig, acquire_store, release_store

log = logging.getLogger(__name__)

#: Keys of the extra config that SGLang itself reads (the rest are kvstrata's StoreConfig).
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1",
                         "tp_lcm_size"})

#: host-pool layout -> (flat page shape from (L, P, H, D), permutation to [L, 2, H, P, D])
_LAYOUTS = {
    "layer_first": (lambda L, P, H, D: (2, L, P, H, D), (1, 0, 3, 2, 4)),
    "page_first": (lambda L, P, H, D: (2, P, L, H, D), (2, 0, 3, 1, 4)),
    "page_first_direct": (lambda L, P, H, D: (2, L, P, H, D), (1, 0, 3, 2, 4)),
    "page_head": (lambda L, P, H, D: (2, H, P, L, D), (3, 0, 1, 2, 4)),
}


class KVStrataHiCacheStorage(HiCacheStorage):
    """SGLang ``HiCacheStorage`` storing pages as kvstrata records (see the module doc)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        extra = dict(storage_config.extra_config or {})
        self.config = StoreConfig.from_dict({k: v for k, v in extra.items()
                                             if k not in SGLANG_KEYS})
        if storage_config.is_mla_model:
            raise NotImplementedError("kvstrata: MLA models are not supported by "
                                      "KVStrataHiCacheStorage (MHA host pools only)")
        self.storage_config = storage_config
        self.store = None
        self.mem_pool_host = None

    # -- set-up ---------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Fix the page format from SGLang's host pool and open the tiers."""
        layout = mem_pool_host.layout
        if layout not in _LAYOUTS:
            raise NotImplementedError(f"kvstrata: host pool layout {layout!r} is not supported; "
                                      f"use one of {sorted(_LAYOUTS)}")
        if getattr(mem_pool_host, "v_head_dim", mem_pool_host.head_dim) != mem_pool_host.head_dim:
            raise NotImplementedError("kvstrata: K and V of different head sizes are not "
                                      "supported")
        sc = self.storage_config
        spec = KVGroupSpec("target", mem_pool_host.layer_num, mem_pool_host.head_num,
                           mem_pool_host.head_dim, mem_pool_host.dtype, self.config.codec)
        # Each TP / PP / CP rank stores its own shard of every page under its own namespace.
        shard = f"tp{sc.tp_rank}/{sc.tp_size}:pp{sc.pp_rank}/{sc.pp_size}:" \
                f"cp{sc.attn_cp_rank}/{sc.attn_cp_size}:dp{sc.dp_rank}"
        self.namespace = self.config.namespace(f"sglang:{sc.model_name}", (spec,),
                                               mem_pool_host.page_size, shard)
        self.spec, self.page_size = spec, mem_pool_host.page_size
        shape_of, self._perm = _LAYOUTS[layout]
        self._flat_shape = shape_of(spec.num_layers, self.page_size, spec.num_kv_heads,
                                    spec.head_dim)
        self._inv = tuple(self._perm.index(i) for i in range(5))
        self.close()
        self.store = acquire_store(self.config, self.namespace)
        self.mem_pool_host = mem_pool_host

    def close(self) -> None:
        store, self.store = self.store, None
        if store is not None:
            release_store(store)

    # -- keys and pages -------------------------------------------------------------------------
    def _info(self, key: str) -> PageKey:
        if not isinstance(key, str) or not key:
            raise ValueError(f"kvstrata: page keys are non-empty strings, got {key!r}")
        parent = blake2b_128(self.namespace.digest + b"sglang-key\x00" + key.encode())
        return PageKey(hash_page(parent, ()), parent, ())

    def _canonical(self, flat: torch.Tensor) -> torch.Tensor:
        """SGLang flat data page -> ``[L, 2, H, P, D]``."""
        return flat.reshape(self._flat_shape).permute(self._perm)

    def _flat(self, page: torch.Tensor) -> torch.Tensor:
        """``[L, 2, H, P, D]`` -> SGLang's flat data page (a new contiguous tensor)."""
        return page.permute(self._inv).contiguous().flatten()

    def _view(self, pages: torch.Tensor) -> PoolView:
        return PoolView((GroupView(self.spec, PAGE_MAJOR, (pages,)),), pages.shape[0],
                        self.page_size)

    def _require_store(self):
        if self.store is None:
            raise RuntimeError("kvstrata: register_mem_pool_host was not called; the page "
                               "format is unknown")
        return self.store

    def _save(self, keys: List[str], pages: List[torch.Tensor]) -> List[bool]:
        store = self._require_store()
        if not keys:
            return []
        staged = torch.stack([p.to("cpu", self.spec.dtype) for p in pages])
        return store.save(self._view(staged), range(len(keys)), [self._info(k) for k in keys])

    def _load(self, keys: List[str]) -> List[Optional[torch.Tensor]]:
        """Per key: the verified ``[L, 2, H, P, D]`` page, or None. Longest-prefix, as SGLang
        reads: from the first page that is absent or fails verification on, every page is None."""
        store = self._require_store()
        if not keys:
            return []
        staged = torch.empty((len(keys), *self.spec.page_shape(self.page_size)),
                             dtype=self.spec.dtype)
        n = store.load(self._view(staged), range(len(keys)), [self._info(k) for k in keys])
        return [staged[i] if i < n else None for i in range(len(keys))]

    # -- zero-copy interface (host indices) -----------------------------------------------------
    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> List[bool]:
        pool = self._require_pool(host_indices, keys)
        flags = []
        for i, page in enumerate(self._load(keys)):
            if page is not None:
                pool.set_from_flat_data_page(int(host_indices[i * self.page_size]),
                                             self._flat(page))
            flags.append(page is not None)
        return flags

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> List[bool]:
        pool = self._require_pool(host_indices, keys)
        pages = [self._canonical(pool.get_data_page(int(host_indices[i * self.page_size]),
                                                    flat=True))
                 for i in range(len(keys))]
        return self._save(keys, pages)

    def _require_pool(self, host_indices: torch.Tensor, keys: List[str]):
        if self.mem_pool_host is None:
            raise RuntimeError("kvstrata: register_mem_pool_host was not called")
        if len(host_indices) != len(keys) * self.page_size:
            raise ValueError(f"kvstrata: {len(host_indices)} host indices for {len(keys)} pages "
                             f"of {self.page_size} tokens")
        return self.mem_pool_host

    # -- generic interface (flat data pages) ----------------------------------------------------
    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[torch.Tensor | None]:
        out = []
        for i, page in enumerate(self._load(keys)):
            if page is None:
                out.append(None)
                continue
            flat = self._flat(page)
            if target_locations is not None and target_locations[i] is not None:
                dst = target_locations[i]
                if dst.numel() != flat.numel():
                    raise ValueError(f"kvstrata: target of {dst.numel()} elements for a page of "
                                     f"{flat.numel()}")
                dst.view(-1).copy_(flat)
                flat = dst
            out.append(flat)
        return out

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        if values is None or len(values) != len(keys):
            raise ValueError("kvstrata: batch_set needs one flat data page per key")
        return all(self._save(keys, [self._canonical(v) for v in values]))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        """Number of leading keys whose pages some tier holds."""
        return self._require_store().lookup([self._info(k).hash for k in keys])

    # -- the rest -------------------------------------------------------------------------------
    def clear(self) -> None:
        raise NotImplementedError(
            "kvstrata: clear() is not supported: the tiers are persistent and may be shared by "
            "other engines; remove the disk tier directory (or the remote keys under the "
            "configured prefix) to drop them")

    def get_stats(self):
        # SGLang's storage metrics take its own StorageMetrics (transfer sizes and bandwidths it
        # measures itself); None lets it fill those in. kvstrata's counters: stats().
        return None

    def stats(self) -> dict:
        """Counters of the store (``loaded_pages``, ``corrupt_records``, ...) and its tiers."""
        return {} if self.store is None else self.store.stats()
