"""TierManager scenarios on tiny pools: exact data, exact counters, restarts, write-through."""

from __future__ import annotations

import random

import pytest
import torch

from kvstrata.codecs import get_codec
from kvstrata.pagepool import Namespace, page_hashes
from kvstrata.tiers import TierManager

from tierutil import PAGE, Stack


def _prompts(n, pages, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1000) for _ in range(pages * PAGE + 1)] for _ in range(n)]


def test_host_only_round_trip_counts_exactly(tmp_path):
    s = Stack(tmp_path, num_pages=8, host_pages=8, disk=False)
    a, b = _prompts(2, 3)
    s.run(a)                     # 3 full pages + 1 partial; all cached or free after free()
    s.run(b)                     # needs 4 pages: 4 free, nothing evicted yet
    s.run(a)                     # device hit
    assert s.tiers.stats()["d2h_pages"] == 0
    s.pool.evict(8)              # every cached page goes to the host
    st = s.tiers.stats()
    assert st["d2h_pages"] == 6 and st["host_pages"] == 6
    seq = s.run(b)               # promoted from host, data checked inside run()
    assert seq.cached_from == {"device": 0, "lower": 3}
    st = s.tiers.stats()
    assert st["h2d_pages"] == 3 and st["host_hits"] == 3 and st["dropped_pages"] == 0


def test_spill_to_disk_and_promote_back(stack):
    prompts = _prompts(6, 6)
    for p in prompts:
        stack.run(p)
    for p in prompts:
        seq = stack.run(p)
        assert seq.num_cached_tokens == 6 * PAGE
    st = stack.tiers.stats()
    assert st["disk_to_host_pages"] > 0 and st["host_to_disk_pages"] > 0
    assert st["checksum_failures"] == 0 and st["mismatches"] == 0 and st["dropped_pages"] == 0


def test_disk_survives_restart(tmp_path):
    prompts = _prompts(4, 5)
    s = Stack(tmp_path)
    for p in prompts:
        s.run(p)
    s.pool.evict(s.pool.num_cached)
    s.tiers.close()               # write-back: host pages go to disk at shutdown
    s2 = Stack(tmp_path)          # a new process: fresh pool, empty host, same directory
    assert len(s2.disk) == 20
    for p in prompts:
        seq = s2.run(p)
        assert seq.cached_from["lower"] == 5
    s2.tiers.close()


def test_write_through_writes_pages_when_hashed(tmp_path):
    s = Stack(tmp_path, num_pages=16, host_pages=16, write_through=True)
    for p in _prompts(3, 4):
        s.run(p)
    s.tiers.flush()
    assert len(s.disk) == 12 and len(s.tiers.host) == 12
    assert s.pool.num_evictions == 0
    s.tiers.close()


def test_corrupt_disk_page_is_a_counted_miss_and_deleted(stack):
    a = _prompts(1, 3)[0]
    stack.run(a)
    stack.pool.evict(stack.pool.num_cached)
    assert stack.tiers.drain_host() == 3
    h = page_hashes(stack.ns, a)
    seg_path, off, lens = stack.disk.where(h[1])
    with open(seg_path, "r+b") as f:                # a flipped bit in the record's head
        f.seek(off + lens[0] - 3)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    seq = stack.run(a)
    assert seq.cached_from["lower"] == 1            # page 0 ok, page 1 corrupt: stop there
    st = stack.tiers.stats()
    assert st["checksum_failures"] == 1
    assert stack.disk.contains([h[1]]) == [False]


def test_other_namespace_is_rejected_at_the_boundary(stack):
    other = Namespace("another-model", stack.groups, PAGE)
    with pytest.raises(ValueError, match="target"):
        stack.tiers.lookup_prefix(other, [b"\0" * 16])


def test_bad_configuration_is_value_error(tmp_path):
    s = Stack(tmp_path, disk=False)
    with pytest.raises(ValueError, match="at least one page slot"):
        TierManager(s.pool, s.ns, host_bytes=0)
    with pytest.raises(ValueError, match="batch_pages"):
        TierManager(s.pool, s.ns, batch_pages=0)


@pytest.mark.parametrize("codecs", [("nvfp4", "lossless"), ("lossless", "identity")])
def test_codecs_round_trip_through_every_tier(tmp_path, codecs):
    s = Stack(tmp_path, codecs=codecs, host_pages=2)
    prompts = _prompts(4, 3, seed=1)
    for p in prompts:
        s.run(p, check=False)
    for p in prompts:
        seq = s.run(p, check=False)
        assert seq.cached_from["lower"] == 3
        hashes = page_hashes(s.ns, p)
        for i, pid in enumerate(seq.page_ids[:3]):
            for g in s.groups:
                want = s.expected(hashes[i], g)
                got = s.pool.kv[g.name][pid]
                assert torch.equal(got, want), f"{g.name} ({g.codec}) page {i} differs"
    s.tiers.close()


def test_unencodable_page_is_not_stored_and_the_rest_of_its_batch_is(tmp_path, caplog):
    # NVFP4 cannot hold NaN: that page is refused at visibility time (no device sync on the way
    # down), counted and logged once; its neighbours in the same batch are stored and promoted.
    s = Stack(tmp_path, codecs=("nvfp4", "lossless"), num_pages=8, host_pages=8, disk=False)
    prompt = _prompts(1, 3, seed=5)[0]
    seq = s.run(prompt, check=False)
    bad = seq.page_ids[1]
    s.pool.kv["target"][bad, 0, 0, 0, 0, 3] = float("nan")
    with caplog.at_level("WARNING", logger="kvstrata.tiers.host"):
        s.pool.evict(8)
        st = s.tiers.stats()
    assert st["unencodable_pages"] == 1 and st["d2h_pages"] == 2 and st["host_pages"] == 2
    assert [r.message for r in caplog.records if "could not be encoded" in r.message]
    hashes = page_hashes(s.ns, prompt)
    assert s.tiers.host.entry(hashes[1]) is None
    assert s.tiers.lookup_prefix(s.ns, hashes) == 1      # page 0 only: page 1 is missing
    assert len(s.tiers.host._free) == 8 - 2                # the refused page's slot is free


def test_host_slots_come_out_ascending_so_runs_are_one_copy(tmp_path):
    s = Stack(tmp_path, num_pages=8, host_pages=8, disk=False)
    host = s.tiers.host
    slots, _ = host.take_slots(8)
    host.give_back(slots)                                  # a stack fed in some order
    host.give_back([])
    again, _ = host.take_slots(5)
    assert again == sorted(again)


def test_lossless_group_stays_raw_on_host_and_is_encoded_at_the_disk_boundary(tmp_path,
                                                                              monkeypatch):
    # The lossless codec has no device batch path: its pages move like identity (no per-page
    # encode, no device sync on eviction), are raw in host slots, and are compressed only when
    # they go to disk; the records on disk are the lossless codec's, as before.
    from kvstrata.codecs import LosslessCodec
    from kvstrata.tiers import transfer
    from kvstrata.tiers.record import check_record_groups, check_payloads, parse_record

    in_down, encodes = [], []
    real_encode, real_down = LosslessCodec.encode, transfer.Mover.demote

    def encode(self, page):
        if in_down:
            raise AssertionError("lossless encode on the device -> host path")
        encodes.append(page.shape)
        return real_encode(self, page)

    def demote(self, *a, **k):
        in_down.append(True)
        try:
            return real_down(self, *a, **k)
        finally:
            in_down.pop()
    monkeypatch.setattr(LosslessCodec, "encode", encode)
    monkeypatch.setattr(transfer.Mover, "demote", demote)

    s = Stack(tmp_path, codecs=("identity", "lossless"), num_pages=8, host_pages=2)
    draft = s.groups[1]
    prompts = _prompts(3, 3, seed=3)
    for p in prompts:
        s.run(p)
    s.pool.evict(s.pool.num_cached)
    s.tiers.host.settle()
    st = s.tiers.stats()
    assert st["d2h_pages"] == 9 and st["host_evictions"] == 7 and st["host_to_disk_pages"] == 7
    assert len(encodes) == 7                         # one per page spilled, none on the way down
    for h in s.tiers.host.lru():                     # the host keeps the draft group raw
        e = s.tiers.host.entry(h)
        assert (e.headers[1].codec, e.sizes[1]) == ("identity", draft.bytes_per_page(PAGE))
        raw = s.tiers.host.payload(e, 1).view(draft.dtype).view(draft.page_shape(PAGE))
        assert torch.equal(raw, s.expected(h, draft))
    assert s.tiers.drain_host() == 2 and len(encodes) == 9

    codec = get_codec("lossless")
    hashes = [h for p in prompts for h in page_hashes(s.ns, p)[:3]]
    with s.disk.reader() as get:
        for h in hashes:
            rec = parse_record([bytes(x) for x in get(h)])
            check_record_groups(rec, s.groups, s.tiers.codecs, PAGE)
            check_payloads(rec)
            g = rec.header["groups"][1]
            assert g["codec"] == "lossless" and len(g["meta"]["planes"]) == 4   # fp32 planes
            assert g["nbytes"] < draft.bytes_per_page(PAGE)  # compressed on disk
            page = codec.decode(rec.encoded()[1])
            assert torch.equal(page.view(torch.int32), s.expected(h, draft).view(torch.int32))

    for p in prompts:                                # promoted from disk: bit-exact (run checks)
        seq = s.run(p)
        assert seq.cached_from["lower"] == 3
    st = s.tiers.stats()
    assert st["disk_to_host_pages"] >= 3 and st["checksum_failures"] == st["mismatches"] == 0
    for h in s.tiers.host.lru():
        assert s.tiers.host.entry(h).headers[1].codec == "identity"
    s.tiers.close()
