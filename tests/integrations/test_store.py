"""PageStore (what the engine integrations share): per-group codecs, prefix lookup, verified
loads, corrupt records, promotion, and the integration config. No engine needed."""

from __future__ import annotations

import pytest
import torch

from kvstrata.codecs import get_codec
from kvstrata.integrations import PageStore, StoreConfig
from kvstrata.integrations.config import acquire_store, open_tiers, release_store
from kvstrata.pagepool import KVGroupSpec, Namespace
from kvstrata.testing.tiers import chain
from kvstrata.pagepool.view import PAGE_MAJOR, GroupView, PoolView

P = 16
GROUPS = (KVGroupSpec("target", 2, 2, 32, torch.bfloat16, "nvfp4"),
          KVGroupSpec("draft", 1, 2, 32, torch.bfloat16, "lossless"))
NS = Namespace("model-a", GROUPS, P)


def view(n: int, seed: int | None = None) -> PoolView:
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    kv = {s.name: (torch.randn((n, *s.page_shape(P)), generator=g).to(s.dtype) if g
                   else torch.zeros((n, *s.page_shape(P)), dtype=s.dtype)) for s in GROUPS}
    return PoolView(tuple(GroupView(s, PAGE_MAJOR, (kv[s.name],)) for s in GROUPS), n, P)


def disk_store(path, ns: Namespace = NS, **cfg) -> PageStore:
    return PageStore(ns, open_tiers(StoreConfig(disk_path=str(path), disk_bytes=16 << 20, **cfg),
                                    ns))


@pytest.fixture
def store(tmp_path):
    s = disk_store(tmp_path / "disk")
    yield s
    s.close()


def test_round_trip_with_per_group_codecs(store):
    src, dst = view(4, seed=0), view(4)
    pages = chain(NS, 4, P)
    assert store.save(src, [0, 1, 2, 3], pages) == [True] * 4
    assert store.lookup([p.hash for p in pages]) == 4
    assert store.load(dst, [3, 2, 1, 0], pages) == 4
    ids = torch.tensor([3, 2, 1, 0])
    # lossless group: bit for bit
    assert torch.equal(dst.read(1, ids), src.read(1, torch.arange(4)))
    # NVFP4 group: exactly what the codec's own round trip gives
    nv = get_codec("nvfp4")
    want = torch.stack([nv.decode(nv.encode(p)) for p in src.read(0, torch.arange(4))])
    assert torch.equal(dst.read(0, ids), want)
    assert store.counters["loaded_pages"] == 4 and store.counters["corrupt_records"] == 0


def test_lookup_is_the_longest_prefix(store):
    pages = chain(NS, 4, P)
    store.save(view(4, seed=1), [0, 1, 3], [pages[0], pages[1], pages[3]])
    assert store.lookup([p.hash for p in pages]) == 2          # page 2 is missing
    dst = view(4)
    assert store.load(dst, [0, 1, 2, 3], pages) == 2           # so is the load
    assert store.counters["load_misses"] == 2


def test_salt_and_model_change_every_key(store):
    pages = chain(NS, 4, P)
    store.save(view(4, seed=2), [0, 1, 2, 3], pages)
    for other in (NS.with_salt("tenant"), Namespace("model-b", GROUPS, P)):
        assert store.lookup([p.hash for p in chain(other, 4, P)]) == 0


def test_a_record_under_another_namespace_is_a_miss(tmp_path):
    """A record stored under the right key by a store of another model (a collision, or a
    shared tier misused) fails the namespace check, is counted and deleted."""
    other = Namespace("model-b", GROUPS, P)
    a = disk_store(tmp_path / "disk")
    pages = chain(NS, 4, P)
    b_store = PageStore(other, a.tiers)        # same tier, other namespace
    b_store.save(view(4, seed=3), [0], pages[:1])
    assert a.lookup([pages[0].hash]) == 1      # the key is there...
    assert a.load(view(1), [0], pages[:1]) == 0   # ...but it is not this namespace's page
    assert a.counters["corrupt_records"] == 1
    assert a.lookup([pages[0].hash]) == 0      # and it is gone
    a.close()


def test_corrupt_in_one_tier_is_read_from_the_next_and_promoted(tmp_path):
    fast = open_tiers(StoreConfig(disk_path=str(tmp_path / "fast"), disk_bytes=16 << 20), NS)
    slow = open_tiers(StoreConfig(disk_path=str(tmp_path / "slow"), disk_bytes=16 << 20), NS)
    store = PageStore(NS, fast + slow)
    src = view(2, seed=4)
    pages = chain(NS, 4, P)[:2]
    assert store.save(src, [0, 1], pages) == [True, True]
    # flip a payload byte of page 1 in the fast tier only
    seg = sorted((tmp_path / "fast" / "segments").glob("*.seg"))[-1]
    data = bytearray(seg.read_bytes())
    data[-50] ^= 0x10
    seg.write_bytes(bytes(data))
    dst = view(2)
    assert store.load(dst, [0, 1], pages) == 2
    assert torch.equal(dst.read(1, torch.arange(2)), src.read(1, torch.arange(2)))
    c = store.counters
    assert c["corrupt_records"] == 1 and c["promoted_pages"] == 1
    assert fast[0].exists([pages[1].hash]) == [True]          # a good copy again
    # and it verifies now
    fresh = PageStore(NS, fast)
    assert fresh.load(view(2), [0, 1], pages) == 2 and fresh.counters["corrupt_records"] == 0
    store.close()


def test_an_unencodable_page_is_not_stored(store):
    src = view(2, seed=5)
    src.groups[0].tensors[0][1, 0, 0, 0, 0, 0] = float("nan")    # NVFP4 refuses non-finite
    pages = chain(NS, 4, P)[:2]
    assert store.save(src, [0, 1], pages) == [True, False]
    assert store.counters["unencodable_pages"] == 1
    assert store.lookup([p.hash for p in pages]) == 1


def test_acquire_shares_one_store_per_config(tmp_path):
    cfg = StoreConfig(disk_path=str(tmp_path / "d"), disk_bytes=16 << 20)
    a, b = acquire_store(cfg, NS), acquire_store(cfg, NS.with_salt("x"))
    assert a is b                              # one LMDB environment per process
    release_store(a)
    release_store(b)
    c = acquire_store(cfg, NS)                 # closed and reopened
    assert c is not a
    release_store(c)


@pytest.mark.parametrize("bad, match", [
    ({}, "no tier configured"),
    ({"disk_path": "/x", "codec": "gzip"}, "codec 'gzip' is unknown"),
    ({"disk_path": "/x", "remote_url": "http://h"}, "must be redis://"),
    ({"disk_path": "/x", "disk_bytes": -1}, "disk_bytes must be"),
    ({"disk_path": "/x", "dsk": 1}, "unknown option"),
])
def test_config_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        StoreConfig.from_dict(bad)


def test_host_tier_in_front_of_disk(tmp_path):
    """The host tier holds a lossless group raw (identity records); reads from it verify and
    decode like any tier's, and a page found only on disk is promoted into it."""
    cfg = dict(disk_path=str(tmp_path / "disk"), disk_bytes=16 << 20, host_bytes=4 << 20)
    store = PageStore(NS, open_tiers(StoreConfig(**cfg), NS))
    src = view(3, seed=6)
    pages = chain(NS, 4, P)[:3]
    assert store.save(src, [0, 1, 2], pages) == [True] * 3
    host, disk = store.tiers
    assert host.name == "host" and host.exists([p.hash for p in pages]) == [True] * 3
    dst = view(3)
    assert store.load(dst, [0, 1, 2], pages) == 3
    assert torch.equal(dst.read(1, torch.arange(3)), src.read(1, torch.arange(3)))
    assert store.counters["corrupt_records"] == 0 and disk.counters()["hits"] == 0
    # a new process: empty host, same disk
    store.close()
    again = PageStore(NS, open_tiers(StoreConfig(**cfg), NS))
    assert again.load(view(3), [0, 1, 2], pages) == 3
    assert again.counters["promoted_pages"] == 3
    assert again.tiers[0].exists([p.hash for p in pages]) == [True] * 3
    again.close()


@pytest.fixture(scope="module")
def redis_url():
    from kvstrata.testing.redis import RedisServer
    with RedisServer() as s:
        yield s.url


def test_two_engines_share_pages_through_the_remote_tier(redis_url):
    ns = Namespace("model-r", GROUPS, P)
    a = PageStore(ns, open_tiers(StoreConfig(remote_url=redis_url), ns))
    b = PageStore(ns, open_tiers(StoreConfig(remote_url=redis_url), ns))
    src = view(2, seed=7)
    pages = chain(ns, 4, P)[:2]
    assert a.save(src, [0, 1], pages) == [True, True]
    assert b.lookup([p.hash for p in pages]) == 2
    dst = view(2)
    assert b.load(dst, [0, 1], pages) == 2
    assert torch.equal(dst.read(1, torch.arange(2)), src.read(1, torch.arange(2)))
    other = Namespace("model-s", GROUPS, P)
    c = PageStore(other, open_tiers(StoreConfig(remote_url=redis_url), other))
    assert c.lookup([p.hash for p in chain(other, 4, P)[:2]]) == 0
    for s in (a, b, c):
        s.close()


def test_an_unreachable_remote_leaves_no_tier(caplog):
    from kvstrata.testing.redis import free_port
    ns = Namespace("model-u", GROUPS, P)
    tiers = open_tiers(StoreConfig(remote_url=f"redis://127.0.0.1:{free_port()}/0"), ns)
    assert tiers == []
    store = PageStore(ns, tiers)
    pages = chain(ns, 4, P)[:1]
    assert store.lookup([pages[0].hash]) == 0 and store.save(view(1, seed=8), [0], pages) == [False]


def test_a_tier_that_fails_to_open_releases_the_ones_before_it(tmp_path):
    """The remote tier refuses its prefix after the disk tier was opened: the disk tier is
    closed again (its writer lock released) and no store is left registered."""
    from kvstrata.integrations import config
    from kvstrata.tiers import DiskTier
    cfg = StoreConfig(disk_path=str(tmp_path / "d"), disk_bytes=16 << 20,
                      remote_url="redis://127.0.0.1:1/0", remote_prefix="a:b")
    with pytest.raises(ValueError, match="prefix"):
        acquire_store(cfg, NS)
    assert not config._stores
    DiskTier(tmp_path / "d", map_size=32 << 20, capacity_bytes=16 << 20).close()   # not locked
