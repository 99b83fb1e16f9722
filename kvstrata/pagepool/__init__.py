"""The paged KV pool: layer-group specs, page pool, prefix hashing and the request manager."""

from .hashing import (HASH_BYTES, Namespace, blake2b_128, hash_page, namespace_differences,
                      page_hashes, tokens_to_bytes)
from .manager import KVCacheManager, PrefixHit, PrefixSource, SequenceState
from .pool import EvictCallback, OutOfPagesError, PageInfo, PageKey, PagePool, PageState
from .view import LAYER_KV_FIRST, PAGE_MAJOR, GroupView, PoolView
from .spec import (LAYOUT_VERSION, KVGroupSpec, bytes_per_page, bytes_per_token, check_page_size,
                   format_bytes, max_tokens_for_pages, pages_for_budget)

__all__ = [
    "HASH_BYTES", "LAYER_KV_FIRST", "LAYOUT_VERSION", "PAGE_MAJOR", "EvictCallback", "GroupView",
    "KVCacheManager", "KVGroupSpec", "Namespace", "OutOfPagesError", "PageInfo", "PageKey",
    "PagePool", "PageState", "PoolView", "PrefixHit", "PrefixSource",
    "SequenceState", "blake2b_128", "bytes_per_page", "bytes_per_token", "check_page_size",
    "format_bytes", "hash_page", "max_tokens_for_pages", "namespace_differences", "page_hashes",
    "pages_for_budget", "tokens_to_bytes",
]
