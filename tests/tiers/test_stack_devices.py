"""The tier stack end to end on a CPU pool and, on a GPU machine, a CUDA pool (streams, events,
pinned slots, device codecs)."""

from __future__ import annotations

import pytest
import torch

from kvstrata.codecs import get_codec
from kvstrata.pagepool import KVCacheManager, KVGroupSpec, Namespace, PagePool, page_hashes
from kvstrata.tiers import DiskTier, TierManager

PAGE = 16
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                reason="needs CUDA"))]


def _content(h: bytes, g: KVGroupSpec) -> torch.Tensor:
    gen = torch.Generator().manual_seed(int.from_bytes(h[:8], "little") & 0x7FFFFFFF)
    return torch.randn(g.page_shape(PAGE), generator=gen).to(g.dtype)


def _expected(h: bytes, g: KVGroupSpec) -> torch.Tensor:
    want = _content(h, g)
    codec = get_codec(g.codec)
    return want if codec.lossless else codec.decode(codec.encode(want))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk", [None, 3])
def test_pages_round_trip_device_host_disk(tmp_path, chunk, device):
    # NVFP4 target (encoded on the GPU) + lossless draft (raw on the host, zstd at the disk):
    # every page promoted back equals the codec's own round trip; a NaN page is refused.
    groups = (KVGroupSpec("target", 4, 2, 64, torch.bfloat16, "nvfp4"),
              KVGroupSpec("draft", 1, 2, 64, torch.bfloat16, "lossless"))
    ns = Namespace("cuda-test", groups, PAGE, drafter="d")
    pool = PagePool(groups, 12, PAGE, device=device)
    disk = DiskTier(tmp_path / "disk", map_size=1 << 26)
    slot = TierManager.slot_bytes_for(pool)
    tiers = TierManager(pool, ns, host_bytes=slot * 6, disk=disk, batch_pages=8, chunk_pages=chunk)
    mgr = KVCacheManager(pool, ns, tiers=tiers)
    prompts = [[(s * 7919 + i) % 997 for i in range(4 * PAGE + 1)] for s in range(6)]

    def run(sid, tokens, check):
        seq = mgr.admit(sid, tokens)
        hashes = page_hashes(ns, tokens)
        k = seq.num_cached_tokens // PAGE
        if check:
            if device == "cuda":
                torch.cuda.synchronize()
            for i in range(k):
                for g in groups:
                    got = pool.kv[g.name][seq.page_ids[i]].cpu()
                    assert torch.equal(got, _expected(hashes[i], g)), (sid, i, g.name)
        mgr.reserve(sid, len(tokens))
        for i in range(k, len(seq.page_ids)):
            for g in groups:
                h = hashes[i] if i < len(hashes) else b"\0" * 16
                pool.kv[g.name][seq.page_ids[i]] = _content(h, g).to(device)
        mgr.commit(sid, tokens[seq.num_cached_tokens:])
        mgr.free(sid)
        return seq

    sid = 0
    for p in prompts:
        run(sid, p, check=False)
        sid += 1
    cached = 0
    for p in prompts:
        cached += run(sid, p, check=True).num_cached_tokens
        sid += 1
    st = tiers.stats()
    assert cached >= len(prompts) * 4 * PAGE // 2
    assert st["d2h_pages"] > 0 and st["h2d_pages"] > 0 and st["host_to_disk_pages"] > 0
    assert st["disk_to_host_pages"] > 0
    assert st["checksum_failures"] == 0 and st["mismatches"] == 0

    # A page with NaN under NVFP4 is refused when its batch becomes visible, the rest stored.
    bad = [5] * (2 * PAGE + 1)
    seq = run(sid, bad, check=False)
    pid = seq.page_ids[0]
    pool.kv["target"][pid, 0, 0, 0, 0, 0] = float("nan")
    pool.evict(pool.num_pages)
    tiers.flush()
    st = tiers.stats()
    assert st["unencodable_pages"] == 1
    h = page_hashes(ns, bad)
    assert tiers.host.entry(h[0]) is None and tiers.host.entry(h[1]) is not None
    tiers.close()
