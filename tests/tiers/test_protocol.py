"""The Tier protocol on the host and disk tiers; TierManager.from_config, write_back, and the
PoolView seam (an outside engine's layout moves through the same path)."""

from __future__ import annotations

import pytest
import torch

from kvstrata.codecs import get_codec
from kvstrata.pagepool import LAYER_KV_FIRST, GroupView, PagePool, PoolView, page_hashes
from kvstrata.testing.tiers import GROUPS, PAGE, check_tier, make_records
from kvstrata.tiers import DiskTier, HostTier, TierManager

from tierutil import Stack, expected


def test_host_tier_conforms():
    codecs = [get_codec(g.codec) for g in GROUPS]
    host = HostTier(GROUPS, codecs, PAGE, 8 * HostTier(GROUPS, codecs, PAGE, 0).slot_bytes)
    check_tier(host)


def test_disk_tier_conforms(tmp_path):
    with DiskTier(tmp_path / "d", map_size=1 << 24) as disk:
        check_tier(disk)


def test_host_put_refuses_a_damaged_record_and_keeps_the_rest():
    codecs = [get_codec(g.codec) for g in GROUPS]
    host = HostTier(GROUPS, codecs, PAGE, 4 * HostTier(GROUPS, codecs, PAGE, 0).slot_bytes)
    _, infos, recs = make_records(2)
    bad = bytearray(b"".join(bytes(p) for p in recs[1]))
    bad[-1] ^= 1
    assert host.put([(infos[0].hash, recs[0]), (infos[1].hash, [bytes(bad)])]) == [True, False]
    assert host.exists([infos[0].hash, infos[1].hash]) == [True, False]
    assert host.counters()["put_failures"] == 1


def test_from_config_opens_a_disk_path_and_rejects_bad_values(tmp_path):
    s = Stack(tmp_path, disk=False)
    pool = PagePool(s.groups, 8, PAGE)
    slot = TierManager.slot_bytes_for(pool)
    t = TierManager.from_config(pool, s.ns, dict(host_bytes=4 * slot, disk=str(tmp_path / "x"),
                                                 disk_bytes=1 << 22))
    assert isinstance(t.disk, DiskTier) and t.disk.capacity_bytes == 1 << 22
    assert pool.on_evict == t.on_evict          # a PagePool is subscribed to
    t.close()
    t2 = TierManager.from_config(pool, s.ns, dict(host_bytes=4 * slot, disk=tmp_path / "x"))
    t2.close()
    for spec, msg in [(dict(disk=3), "directory"), (dict(remote=3), "redis://"),
                      (dict(hosts_bytes=1), "unknown key"), ([1], "dict"),
                      (dict(remote_options={}), "needs a 'remote'"),
                      (dict(write_through=1), "bool"),
                      (dict(disk=str(tmp_path / "y"), disk_bytes=-1), "disk_bytes")]:
        with pytest.raises(ValueError, match=msg):
            TierManager.from_config(pool, s.ns, spec)
    with pytest.raises(ValueError, match="Tier protocol"):
        TierManager(pool, s.ns, host_bytes=4 * slot, disk=object())
    # A failure after the disk was opened releases it (its writer lock): it opens again.
    with pytest.raises(ValueError, match="page slot"):
        TierManager.from_config(pool, s.ns, dict(host_bytes=1, disk=str(tmp_path / "z")))
    DiskTier(tmp_path / "z").close()


def test_write_back_writes_device_and_host_pages_down_and_keeps_them(tmp_path):
    s = Stack(tmp_path, num_pages=8, host_pages=4)
    prompts = [[i * 100 + j for j in range(3 * PAGE + 1)] for i in range(2)]
    for p in prompts:
        s.run(p)
    assert len(s.disk) == 0 and s.pool.num_cached == 6
    assert s.tiers.write_back() == 6
    assert len(s.disk) == 6 and s.pool.num_cached == 6     # still cached on the device
    assert s.tiers.write_back() == 0                          # nothing new
    s.tiers.close()
    s2 = Stack(tmp_path)
    for p in prompts:
        assert s2.run(p).cached_from == {"device": 0, "lower": 3}
    assert s2.tiers.last_load == {"host": 0, "disk": 3}
    s2.tiers.close()


def test_an_outside_layout_moves_through_the_same_path(tmp_path):
    """A vLLM-style cache (per layer [2, N, P, H, D]) demotes and promotes bit-exactly."""
    s = Stack(tmp_path, disk=False)
    n = 8
    layers = {g.name: tuple(torch.zeros(2, n, PAGE, g.num_kv_heads, g.head_dim, dtype=g.dtype)
                            for _ in range(g.num_layers)) for g in s.groups}
    view = PoolView(tuple(GroupView(g, LAYER_KV_FIRST, layers[g.name]) for g in s.groups), n, PAGE)
    tiers = TierManager(view, s.ns, host_bytes=8 * TierManager.slot_bytes_for(view))
    tokens = list(range(2 * PAGE))
    hashes = page_hashes(s.ns, tokens)
    from kvstrata.pagepool import PageInfo
    parent = s.ns.digest
    infos = []
    for i, h in enumerate(hashes):
        infos.append(PageInfo(i + 3, h, parent, tuple(tokens[i * PAGE:(i + 1) * PAGE])))
        parent = h
        for gi, g in enumerate(s.groups):
            view.write(gi, torch.tensor([i + 3]), expected(h, g)[None])
    tiers.on_evict(infos)
    assert tiers.lookup_prefix(s.ns, hashes) == 2
    assert tiers.load_prefix(s.ns, infos, [6, 0]) == 2
    for gi, g in enumerate(s.groups):
        got = view.read(gi, torch.tensor([6, 0]))
        assert torch.equal(got[0], expected(hashes[0], g)) and torch.equal(got[1], expected(hashes[1], g))


def test_write_through_flushes_pages_that_waited_past_flush_after_s(tmp_path):
    s = Stack(tmp_path, num_pages=16, host_pages=8, write_through=True)
    prompt = [7 * j for j in range(4 * PAGE + 1)]
    s.tiers.flush_after_s = 3600.0
    s.run(prompt)
    assert len(s.disk) == 0                     # queued: fewer than a batch, not old enough
    s.tiers.flush_after_s = 0.0
    s.run([5 * j for j in range(2 * PAGE + 1)])
    # the next hashed page found the queue old enough: everything queued so far was written
    assert len(s.disk) >= 4
    s.tiers.flush()
    assert len(s.disk) == 6
    s.tiers.close()
