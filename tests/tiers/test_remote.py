"""The remote tier on a real redis-server (standalone and a 3-node cluster), and its faults."""

from __future__ import annotations

import logging
import threading

import pytest

from kvstrata.codecs import get_codec
from kvstrata.pagepool import page_hashes
from kvstrata.testing.redis import RedisClusterServers, RedisServer, free_port
from kvstrata.testing.tiers import GROUPS, PAGE, check_tier, make_records
from kvstrata.tiers import TierManager
from kvstrata.tiers.record import build_record, verify_record
from kvstrata.tiers.remote import RemoteTier, check_url

from tierutil import Stack

CODECS = [get_codec(g.codec) for g in GROUPS]


@pytest.fixture(scope="module")
def server():
    with RedisServer() as s:
        yield s


@pytest.fixture
def redis_url(server):
    import redis
    r = redis.Redis.from_url(server.url)
    r.flushall()
    r.close()
    return server.url


def test_standalone_conforms(redis_url):
    ns, _, _ = make_records(1)
    tier = RemoteTier(redis_url, ns.digest)
    assert not tier.cluster
    check_tier(tier)
    assert tier.key(b"\x01" * 16) == f"kvstrata:{ns.digest.hex()}:{'01' * 16}".encode()
    assert sorted(h for _, h in tier.scan()) == sorted(
        h for _, h in tier.scan(ns.digest))
    tier.close()


def test_cluster_conforms_and_spreads_keys_over_the_nodes():
    import redis
    with RedisClusterServers(3) as cl:
        ns, infos, recs = make_records(40, seed=3)
        tier = RemoteTier(cl.url, ns.digest)
        assert tier.cluster
        check_tier(tier)
        assert tier.put([(i.hash, r) for i, r in zip(infos, recs)]) == [True] * 40
        per_node = [redis.Redis(port=n.port).dbsize() for n in cl.nodes]
        assert sum(per_node) >= 40 and min(per_node) > 0, per_node
        assert {h for _, h in tier.scan(ns.digest)} >= {i.hash for i in infos}
        got = tier.get([i.hash for i in infos])
        for info, parts in zip(infos, got):
            verify_record(parts, ns.digest, info, GROUPS, CODECS, PAGE)
        assert tier.server_info()["nodes"] == 3
        tier.close()


def _stack(tmp_path, url, **kw):
    s = Stack(tmp_path, disk=False, **kw)
    remote = RemoteTier(url, s.ns.digest)
    s.tiers = TierManager(s.pool, s.ns, host_bytes=s.tiers.host.capacity_bytes, remote=remote,
                          write_through=kw.get("write_through", False))
    s.mgr.tiers = s.tiers
    return s


def _prompts(n, pages, base=0):
    return [[base + 1000 * i + j for j in range(pages * PAGE + 1)] for i in range(n)]


def test_two_managers_share_pages_through_redis(tmp_path, redis_url):
    a = _stack(tmp_path / "a", redis_url, write_through=True)
    prompts = _prompts(3, 3)
    for p in prompts:
        a.run(p)
    a.tiers.flush()
    assert a.tiers.stats()["host_to_remote_pages"] == 9
    b = _stack(tmp_path / "b", redis_url)          # another engine: empty pool and host
    for p in prompts:
        assert b.run(p).cached_from == {"device": 0, "lower": 3}   # data checked in run()
    st = b.tiers.stats()
    assert st["remote_to_host_pages"] == 9 and st["remote_hits"] == 9
    assert st["mismatches"] == 0 and st["checksum_failures"] == 0


def test_garbage_and_foreign_records_are_counted_misses_and_deleted(tmp_path, redis_url):
    import redis
    a = _stack(tmp_path / "a", redis_url, write_through=True)
    p = _prompts(1, 3)[0]
    a.run(p)
    a.tiers.flush()
    hashes = page_hashes(a.ns, p)
    r = redis.Redis.from_url(redis_url)
    r.set(a.tiers.remote.key(hashes[0]), b"KVSR" + b"\x00" * 64)        # garbage
    # another namespace's whole, valid record under page 1's key
    ns2, infos2, recs2 = make_records(1, seed=9)
    r.set(a.tiers.remote.key(hashes[1]), b"".join(bytes(x) for x in recs2[0]))
    b = _stack(tmp_path / "b", redis_url)
    assert b.run(p).cached_from["lower"] == 0
    st = b.tiers.stats()
    assert st["checksum_failures"] + st["mismatches"] == 1 and st["remote_to_host_pages"] == 0
    assert r.exists(a.tiers.remote.key(hashes[0])) == 0          # deleted, never decoded
    b2 = _stack(tmp_path / "c", redis_url)
    r.delete(a.tiers.remote.key(hashes[0]))
    b2.tiers.remote.put([(hashes[0], a.tiers.host.records([a.tiers.host.entry(hashes[0])])[0])])
    assert b2.run(p).cached_from["lower"] == 1                    # page 1 is foreign: a miss
    assert b2.tiers.stats()["mismatches"] == 1
    assert r.exists(a.tiers.remote.key(hashes[1])) == 0
    r.close()


def test_server_killed_mid_batch_then_restarted(tmp_path):
    ns, infos, recs = make_records(24, seed=4)
    big = [[bytes(rec[0]), *(bytes(p) * 1 for p in rec[1:]), b"\0" * (1 << 20)] for rec in recs]
    with RedisServer(config={"maxmemory": "1gb"}) as srv:
        tier = RemoteTier(srv.url, ns.digest, socket_timeout=1.0, connect_timeout=0.5,
                          retries=0, retry_after_s=0.2, put_batch_bytes=4 << 20)
        killer = threading.Timer(0.02, srv.stop)
        killer.start()
        ok = tier.put([(i.hash, r) for i, r in zip(infos, big)])   # never raises
        killer.join()
        assert len(ok) == 24 and not all(ok)
        c = tier.counters()
        assert c["put_failures"] == ok.count(False) and c["errors"] >= 1 and c["available"] == 0
        assert tier.get([infos[0].hash]) == [None]                  # a miss, not an exception
        assert tier.exists([infos[0].hash]) == [False]
        srv.start()                                                 # same port, empty server
        import time
        time.sleep(0.25)                                            # past retry_after_s
        assert tier.put([(infos[0].hash, recs[0])]) == [True]       # reconnected by itself
        got = tier.get([infos[0].hash])[0]
        verify_record(got, ns.digest, infos[0], GROUPS, CODECS, PAGE)
        assert tier.counters()["available"] == 1
        tier.close()


def test_two_writers_of_one_page_leave_a_whole_valid_record(redis_url):
    ns, infos, _ = make_records(1, seed=6)
    info = infos[0]
    codec = get_codec("identity")
    import torch
    # Two engines' records of the same page (same tokens, payloads of 1 MiB, written at
    # different times).
    pages = [codec.encode(torch.ones(g.page_shape(PAGE), dtype=g.dtype)) for g in GROUPS]
    recs = [build_record(ns.digest, info, [g.name for g in GROUPS], pages,
                         [p.payload.numpy().data for p in pages], created=t) for t in (1.0, 2.0)]
    stop = threading.Event()
    errors = []

    def writer(rec):
        t = RemoteTier(redis_url, ns.digest)
        while not stop.is_set():
            if t.put([(info.hash, rec)]) != [True]:
                errors.append("put failed")
        t.close()

    threads = [threading.Thread(target=writer, args=(r,)) for r in recs]
    for t in threads:
        t.start()
    reader = RemoteTier(redis_url, ns.digest)
    seen = set()
    try:
        for _ in range(200):
            parts = reader.get([info.hash])[0]
            if parts is not None:
                rec = verify_record(parts, ns.digest, info, GROUPS, CODECS, PAGE)
                seen.add(rec.header["created"])
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors and seen and seen <= {1.0, 2.0}
    reader.close()


def test_unreachable_at_start_runs_without_the_tier_and_says_so_once(tmp_path, caplog):
    s = Stack(tmp_path, disk=False)
    url = f"redis://127.0.0.1:{free_port()}/0"
    with caplog.at_level(logging.WARNING, logger="kvstrata.tiers.remote"):
        t = TierManager.from_config(s.pool, s.ns, dict(host_bytes=s.tiers.host.capacity_bytes,
                                                       remote=url, remote_options=dict(
                                                           connect_timeout=0.5)))
    assert t.remote is None and t.lower == []
    msgs = [r.message for r in caplog.records if "runs without the remote tier" in r.message]
    assert len(msgs) == 1 and url.split("/0")[0] in msgs[0]


def test_bad_urls_and_options_are_value_errors():
    for url, msg in [("http://x:1/0", "scheme"), ("redis://:1/0", "no host"),
                     ("redis://h:port/0", "port"), ("redis://h:1/x", "database"), (5, "URL")]:
        with pytest.raises(ValueError, match=msg):
            check_url(url)
    with pytest.raises(ValueError, match="socket_timeout"):
        RemoteTier("redis://127.0.0.1:1/0", b"\0" * 16, socket_timeout=-1)
    with pytest.raises(ValueError, match="prefix"):
        RemoteTier("redis://127.0.0.1:1/0", b"\0" * 16, prefix="a:b")


def test_the_password_never_reaches_the_log(caplog):
    url = f"redis://user:s3cret@127.0.0.1:{free_port()}/0"
    with caplog.at_level(logging.WARNING, logger="kvstrata.tiers.remote"):
        assert RemoteTier.connect(url, b"\0" * 16, connect_timeout=0.5) is None
    assert caplog.records and all("s3cret" not in r.getMessage() for r in caplog.records)


def test_disk_then_remote_nearest_first_and_written_to_both(tmp_path, redis_url):
    from kvstrata.tiers import DiskTier
    s = Stack(tmp_path / "a", num_pages=8, host_pages=2)      # disk + host of 2 slots
    remote = RemoteTier(redis_url, s.ns.digest)
    s.tiers = TierManager(s.pool, s.ns, host_bytes=s.tiers.host.capacity_bytes, disk=s.disk,
                          remote=remote)
    s.mgr.tiers = s.tiers
    prompts = _prompts(2, 3)
    for p in prompts:
        s.run(p)
    s.pool.evict(s.pool.num_cached)             # 6 pages: 4 spill from the host to both tiers
    st = s.tiers.stats()
    assert st["host_to_disk_pages"] == 4 and st["host_to_remote_pages"] == 4
    assert st["dropped_pages"] == 0
    for p in prompts:                           # every page comes back from the nearest tier
        assert s.run(p).cached_from["lower"] == 3
    assert s.tiers.stats()["remote_to_host_pages"] == 0    # the disk had them all
    s.tiers.close()
    # Another engine with no disk of its own: A's close drained its host to both tiers, so
    # every page comes from the remote tier.
    b = _stack(tmp_path / "b", redis_url)
    for p in prompts:
        assert b.run(p).cached_from["lower"] == 3
    assert b.tiers.stats()["remote_to_host_pages"] == 6
    with DiskTier(s.path, readonly=True) as d:
        assert len(d) == 6                      # A's close drained its host to the disk
