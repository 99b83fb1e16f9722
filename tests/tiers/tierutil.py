"""Helpers for the tier tests: tiny pools whose page content is a function of the hash."""

from __future__ import annotations

import torch

from kvstrata.codecs import get_codec
from kvstrata.pagepool import KVCacheManager, KVGroupSpec, Namespace, PagePool, page_hashes
from kvstrata.tiers import DiskTier, TierManager

PAGE = 4


def make_groups(target_codec: str = "identity", draft_codec: str = "identity"):
    return (KVGroupSpec("target", 2, 1, 16, torch.bfloat16, target_codec),
            KVGroupSpec("draft", 1, 1, 16, torch.float32, draft_codec))


def page_content(h: bytes, g: KVGroupSpec) -> torch.Tensor:
    """Deterministic page content derived from its hash (so any mix-up shows as wrong data)."""
    gen = torch.Generator().manual_seed(int.from_bytes(h[:8], "little") & 0x7FFFFFFF)
    return torch.randn(g.page_shape(PAGE), generator=gen).to(g.dtype)


def expected(h: bytes, g: KVGroupSpec) -> torch.Tensor:
    """What a page reads back as after a trip through the tiers: exact for lossless codecs, the
    codec's own round trip for lossy ones (the tiers add no error of their own)."""
    want = page_content(h, g)
    codec = get_codec(g.codec)
    return want if codec.lossless else codec.decode(codec.encode(want))


class Stack:
    """Pool + manager + tiers; ``run(tokens)`` admits, fills missing pages, commits, frees."""

    def __init__(self, tmp_path, num_pages=8, host_pages=4, disk=True, codecs=("identity", "identity"),
                 write_through=False, map_size=1 << 24, disk_bytes=None):
        self.groups = make_groups(*codecs)
        self.ns = Namespace("t", self.groups, PAGE, drafter="d")
        self.pool = PagePool(self.groups, num_pages, PAGE)
        self.path = tmp_path / "disk"
        self.disk = DiskTier(self.path, map_size=map_size, capacity_bytes=disk_bytes) if disk else None
        slot = TierManager.slot_bytes_for(self.pool)
        self.tiers = TierManager(self.pool, self.ns, host_bytes=slot * host_pages, disk=self.disk,
                                 write_through=write_through)
        self.mgr = KVCacheManager(self.pool, self.ns, tiers=self.tiers)
        self.n = 0
        self.expected = expected

    def run(self, tokens, check=True):
        sid = self.n
        self.n += 1
        seq = self.mgr.admit(sid, tokens)
        hashes = page_hashes(self.ns, tokens)
        k = seq.num_cached_tokens // PAGE
        if check:
            for i in range(k):
                for g in self.groups:
                    got = self.pool.kv[g.name][seq.page_ids[i]]
                    assert torch.equal(got, expected(hashes[i], g)), f"page {i} of {g.name} wrong"
        self.mgr.reserve(sid, len(tokens))
        for i in range(k, len(seq.page_ids)):
            for g in self.groups:
                h = hashes[i] if i < len(hashes) else b"\0" * 16
                self.pool.kv[g.name][seq.page_ids[i]] = page_content(h, g)
        self.mgr.commit(sid, tokens[seq.num_cached_tokens:])
        self.mgr.free(sid)
        return seq
