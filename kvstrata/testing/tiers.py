"""The Tier protocol's conformance checks, shipped with the package so every tier (host, disk,
remote, an outside engine's own) runs the same suite: ``check_tier(tier)`` on an empty tier.

Records are real ones (:func:`make_records`: a chain of pages of two groups, identity codec) so a
tier that stores the bytes back to front or mixes keys fails here, not in an engine.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..codecs import get_codec
from ..pagepool import KVGroupSpec, Namespace, PageInfo, page_hashes
from ..tiers.protocol import COUNTERS, Tier, leading
from ..tiers.record import build_record, parse_record, verify_record

PAGE = 4
GROUPS = (KVGroupSpec("target", 2, 1, 16, torch.bfloat16, "identity"),
          KVGroupSpec("draft", 1, 1, 16, torch.float32, "identity"))


def chain(ns: Namespace, n: int, page_size: int = PAGE, first_page_id: int = 0
          ) -> list[PageInfo]:
    """PageInfo of ``n`` chained pages of tokens ``0, 1, 2, ...`` under ``ns`` (page ids from
    ``first_page_id``)."""
    tokens = list(range(n * page_size))
    hashes = page_hashes(ns, tokens)
    return [PageInfo(first_page_id + i, h, hashes[i - 1] if i else ns.digest,
                     tuple(tokens[i * page_size:(i + 1) * page_size]))
            for i, h in enumerate(hashes)]


def make_records(n: int, seed: int = 0, salt: str | None = None
                 ) -> tuple[Namespace, list[PageInfo], list[list]]:
    """``(namespace, infos, records)`` of a chain of ``n`` pages (identity codec)."""
    ns = Namespace("conformance", GROUPS, PAGE, drafter="d")
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 1000, (n * PAGE,), generator=gen).tolist()
    hashes = page_hashes(ns.with_salt(salt), tokens)
    infos, recs, parent = [], [], ns.with_salt(salt).digest
    codec = get_codec("identity")
    for i, h in enumerate(hashes):
        info = PageInfo(i, h, parent, tuple(tokens[i * PAGE:(i + 1) * PAGE]))
        pages = [codec.encode(torch.randn(g.page_shape(PAGE), generator=gen).to(g.dtype))
                 for g in GROUPS]
        recs.append(build_record(ns.digest, info, [g.name for g in GROUPS], pages,
                                 [p.payload.numpy().data for p in pages]))
        infos.append(info)
        parent = h
    return ns, infos, recs


def _same(a: Sequence, b: Sequence) -> bool:
    """The same record: header fields (a tier may rebuild the header: ``created`` may differ)
    and payload bytes."""
    ra, rb = parse_record(a), parse_record(b)
    ha, hb = dict(ra.header), dict(rb.header)
    ha.pop("created"), hb.pop("created")
    return ha == hb and [bytes(p) for p in ra.payloads] == [bytes(p) for p in rb.payloads]


def check_tier(tier: Tier, n: int = 6) -> None:
    """Drive an empty ``tier`` through the protocol and assert every answer (raises
    AssertionError naming the first broken promise)."""
    assert isinstance(tier, Tier), f"{type(tier).__name__} does not implement Tier"
    assert isinstance(tier.name, str) and tier.name
    ns, infos, recs = make_records(n)
    keys = [i.hash for i in infos]
    assert tier.exists(keys) == [False] * n
    assert tier.get(keys) == [None] * n
    ok = tier.put(list(zip(keys[:4], recs[:4])))
    assert ok == [True] * 4, f"put answered {ok}"
    assert tier.exists(keys) == [True] * 4 + [False] * (n - 4)
    assert leading(tier.exists(keys)) == 4
    got = tier.get([keys[2], keys[5], keys[0]])
    assert got[1] is None
    for parts, j in ((got[0], 2), (got[2], 0)):
        assert parts is not None and _same(parts, recs[j]), f"record {j} differs"
        verify_record(parts, ns.digest, infos[j], GROUPS,
                      [get_codec(g.codec) for g in GROUPS], PAGE)
    # A key put again keeps one whole, valid record.
    assert tier.put([(keys[1], recs[1])]) == [True]
    assert parse_record(tier.get([keys[1]])[0]).page_hash == keys[1]
    tier.touch(keys[:2])
    assert tier.delete([keys[0], keys[5]]) == 1
    assert tier.exists(keys[:2]) == [False, True]
    c = tier.counters()
    missing = [k for k in COUNTERS if k not in c]
    assert not missing, f"counters() lacks {missing}"
    assert c["hits"] >= 3 and c["misses"] >= n + 1 and c["puts"] >= 5, c
