"""The pool state machine with the tier stack underneath: demote, promote, evict, restart.

:class:`TierMachine` reuses every rule and invariant of :class:`PoolMachine` (so every reused
token's K/V is checked against its deterministic value, whichever tier it came from) and adds
host drops, disk restarts, and a model of every page ever hashed: with capacities larger than the
traffic, each one must stay findable in some tier.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch
from hypothesis import note, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from kvstrata.codecs import get_codec
from kvstrata.pagepool import KVCacheManager, KVGroupSpec
from kvstrata.testing.stateful import PAGE_SIZE, SALTS, VOCAB, PoolMachine, token_kv
from kvstrata.tiers import DiskTier, TierManager

HOST_PAGES = 3


class TierMachine(PoolMachine):
    def make_manager(self) -> KVCacheManager:
        self.tmp = tempfile.mkdtemp(prefix="kvstrata-tiers-")
        self.ever: dict[bytes, str] = {}
        self.history: set[tuple[tuple[int, ...], str | None]] = set()
        self.tiers = self._open_tiers()
        return KVCacheManager(self.pool, self.ns, tiers=self.tiers)

    def _open_tiers(self) -> TierManager:
        disk = DiskTier(f"{self.tmp}/disk", map_size=1 << 24)
        slot = TierManager.slot_bytes_for(self.pool)
        return TierManager(self.pool, self.ns, host_bytes=HOST_PAGES * slot, disk=disk)

    def teardown(self) -> None:
        self.tiers.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    @precondition(lambda self: self.pool.num_cached > 0)
    @rule()
    def evict_all(self):
        note(f"evict all {self.pool.num_cached} cached pages to the tiers")
        self.pool.evict(self.pool.num_cached)

    @rule(tokens=st.lists(st.integers(0, VOCAB - 1), min_size=9, max_size=14),
          salt=st.sampled_from(SALTS))
    def turn(self, tokens, salt):
        # A whole request in one step: admit (maybe promote), write, commit, free -> cached pages.
        self.history.add((tuple(tokens), salt))
        sid = PoolMachine.admit(self, tokens, salt)
        if sid is not None:
            PoolMachine.free(self, sid)

    @precondition(lambda self: bool(self.history))
    @rule(data=st.data())
    def readmit(self, data):
        # Admit a prompt seen before (its pages may sit on any tier), check it, free it again.
        tokens, salt = data.draw(st.sampled_from(sorted(self.history, key=repr)))
        sid = PoolMachine.admit(self, list(tokens), salt)
        if sid is not None:
            PoolMachine.free(self, sid)

    @rule()
    def drop_host(self):
        n = self.tiers.drain_host()
        note(f"drain host -> disk ({n} pages)")

    @rule()
    def restart_disk(self):
        # A graceful restart of the lower tiers: host pages written back, LMDB closed and reopened.
        note("restart tiers (close + reopen the disk tier)")
        self.tiers.close()
        self.tiers = self._open_tiers()
        self.mgr.tiers = self.tiers

    @invariant()
    def every_hashed_page_is_somewhere(self):
        for sid, (tokens, salt) in self.model.items():
            self.history.add((tokens, salt))
            for h in self.mgr.seqs[sid].hashes:
                self.ever[h] = "seen"
        hashes = list(self.ever)
        on_disk = self.tiers.disk.contains(hashes)
        self.tiers.host.settle()
        for h, d in zip(hashes, on_disk):
            assert self.pool.lookup(h) is not None or self.tiers.host.has(h) or d, \
                f"page {h.hex()} was lost although every tier had room"

    @invariant()
    def no_tier_errors(self):
        st = self.tiers.stats()
        assert st["checksum_failures"] == st["mismatches"] == st["dropped_pages"] == 0, st


class CodecTierMachine(TierMachine):
    """Target pages through NVFP4 (lossy), draft pages through the lossless codec."""

    groups = (KVGroupSpec("target", 2, 1, 16, torch.bfloat16, "nvfp4"),
              KVGroupSpec("draft", 1, 1, 16, torch.bfloat16, "lossless"))

    def _check_data(self, sid, tokens, n, salt):
        # Page by page: lossless groups bit-exact; an NVFP4 page is either the raw page (never
        # left the device) or exactly the codec's round trip of it (the tiers add no error).
        P = PAGE_SIZE
        digest = self.ns.digest + repr(salt).encode()   # as PoolMachine._write derives it
        seq = self.mgr.seqs[sid]
        for i in range(-(-n // P)):
            pos = range(i * P, min(n, (i + 1) * P))
            for g in self.groups:
                numel = g.num_layers * 2 * g.num_kv_heads * g.head_dim
                raw = torch.stack([token_kv(digest, tokens[:p + 1], numel, g.dtype).view(
                    g.num_layers, 2, g.num_kv_heads, g.head_dim) for p in pos], dim=3)
                got = self.pool.kv[g.name][seq.page_ids[i]][:, :, :, :len(pos)]
                if torch.equal(got, raw):
                    continue
                codec = get_codec(g.codec)
                assert not codec.lossless and len(pos) == P, \
                    f"seq {sid}: {g.name} page {i} differs from its K/V"
                assert torch.equal(got, codec.decode(codec.encode(raw))), \
                    f"seq {sid}: {g.name} page {i} is neither raw nor the codec round trip"


# CI runs a bounded, derandomized slice; the nightly profile keeps its own (much larger) budget.
_NIGHTLY = os.environ.get("KVSTRATA_HYPOTHESIS_PROFILE") == "nightly"
TestTierMachine = TierMachine.TestCase
TestCodecTierMachine = CodecTierMachine.TestCase
if not _NIGHTLY:
    TestTierMachine.settings = settings(max_examples=40, stateful_step_count=40)
    TestCodecTierMachine.settings = settings(max_examples=40, stateful_step_count=40)
