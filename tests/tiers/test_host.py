"""The host tier on its own: slot layout and capacity, exact LRU order and victims, slots given
back, records in and out (byte for byte), and counters."""

from __future__ import annotations

import pytest

from kvstrata.codecs import get_codec
from kvstrata.testing.tiers import GROUPS, PAGE, make_records
from kvstrata.tiers import HostTier
from kvstrata.tiers.record import parse_record

CODECS = [get_codec(g.codec) for g in GROUPS]
SLOT = HostTier(GROUPS, CODECS, PAGE, 0).slot_bytes


def _host(slots: int) -> HostTier:
    return HostTier(GROUPS, CODECS, PAGE, slots * SLOT)


def _payloads(parts) -> list[bytes]:
    return [bytes(p) for p in parse_record(parts).payloads]


def test_slot_layout_and_capacity():
    # identity pages: each group's slot region is its raw page size, back to back
    sizes = [g.bytes_per_token() * PAGE for g in GROUPS]
    host = _host(3)
    assert host.offsets == [0, sizes[0]] and host.max_sizes == sizes
    assert host.slot_bytes == SLOT == sum(sizes)
    assert host.num_slots == 3 and host.capacity_bytes == 3 * SLOT and len(host) == 0
    assert HostTier(GROUPS, CODECS, PAGE, 3 * SLOT + SLOT - 1).num_slots == 3
    assert HostTier(GROUPS, CODECS, PAGE, 0).num_slots == 0
    with pytest.raises(ValueError, match=f"use at least {SLOT} bytes"):
        HostTier(GROUPS, CODECS, PAGE, SLOT - 1)
    with pytest.raises(ValueError, match="non-negative number of bytes"):
        HostTier(GROUPS, CODECS, PAGE, -1)


def test_put_get_round_trip_and_lru_eviction_order():
    host = _host(2)
    _, infos, recs = make_records(3)
    keys = [i.hash for i in infos]
    assert host.put([(keys[0], recs[0]), (keys[1], recs[1])]) == [True, True]
    assert host.lru() == keys[:2] and host.stored_bytes == 2 * SLOT
    got = host.get([keys[1], keys[2]])
    assert got[1] is None and _payloads(got[0]) == _payloads(recs[1])
    assert parse_record(got[0]).header["tokens"] == list(infos[1].token_ids)
    host.touch([keys[0]])                        # page 1 is now the oldest
    assert host.lru() == [keys[1], keys[0]]
    assert host.put([(keys[2], recs[2])]) == [True]
    assert host.lru() == [keys[0], keys[2]] and host.exists(keys) == [True, False, True]
    c = host.counters()
    assert (c["puts"], c["hits"], c["misses"], c["evictions"], c["pages"]) == (3, 1, 1, 1, 2)
    assert _payloads(host.get([keys[0]])[0]) == _payloads(recs[0])


def test_take_slots_free_first_then_lru_victims_never_kept_ones():
    host = _host(3)
    _, infos, recs = make_records(3)
    keys = [i.hash for i in infos]
    host.put(list(zip(keys[:2], recs[:2])))
    slot_of = {k: host.entry(k).slot for k in keys[:2]}
    slots, victims = host.take_slots(2, keep=frozenset([keys[0]]))
    # the one free slot, then the oldest entry not kept (page 1; page 0 is kept)
    assert [v.info.hash for v in victims] == [keys[1]]
    assert slots == sorted([2, slot_of[keys[1]]])
    assert host.lru() == [keys[0]] and not host.has(keys[1])
    # a victim's bytes stay until the slot is overwritten
    assert bytes(host.payload(victims[0], 0).numpy()) == _payloads(recs[1])[0]
    host.give_back(slots)                        # not filled: free again
    last = host.entry(keys[0])
    slots, victims = host.take_slots(5)
    assert slots == [0, 1, 2] and victims == [last] and len(host) == 0


def test_discard_delete_and_clear_free_their_slots():
    host = _host(2)
    _, infos, recs = make_records(2)
    keys = [i.hash for i in infos]
    host.put(list(zip(keys, recs)))
    assert host.discard([keys[0], b"\0" * 16]) == 1 and host.lru() == [keys[1]]
    assert host.delete([keys[1]]) == 1 and len(host) == 0
    assert host.counters()["deletes"] == 1
    slots, victims = host.take_slots(2)
    assert sorted(slots) == [0, 1] and victims == []
    host.give_back(slots)
    host.put(list(zip(keys, recs)))
    host.clear()
    assert len(host) == 0 and host.stored_bytes == 0
    assert host.take_slots(2) == ([0, 1], [])


def test_a_zero_capacity_host_stores_nothing():
    host = _host(0)
    _, infos, recs = make_records(1)
    assert host.put([(infos[0].hash, recs[0])]) == [False]
    assert host.exists([infos[0].hash]) == [False] and host.counters()["put_failures"] == 1
