"""Space reclamation of the disk tier: compaction of segments that hold dead bytes.

Eviction and deletion leave dead entries inside segments that still hold live records (a segment
with no live record is unlinked at once). When the dead bytes plus the live records exceed the
tier's capacity + ``reclaim_slack``, the sealed segment with the most dead bytes has its live
records re-appended to the current segment and is unlinked. Compaction keeps every record and
its access order; it never evicts. A reader whose snapshot still points into the unlinked
segment follows the record to its new place (:meth:`~kvstrata.tiers.DiskTier.reader`).
"""

from __future__ import annotations

from .diskschema import SEQ, U64, key_of, record_value, u64


def reclaim(tier, max_rounds: int = 4) -> None:
    """Compact ``tier`` while its dead segment bytes + live records exceed
    :meth:`~kvstrata.tiers.DiskTier.file_limit`: the sealed segment with the
    most dead bytes has its live records re-appended to the current segment, then goes."""
    for _ in range(max_rounds):
        segs = tier.segments()
        # frames do not count against the capacity: dead bytes + live records vs the limit
        dead = sum(end - live for live, _, end in segs.values())
        if dead + tier.stored_bytes() <= tier.file_limit():
            return
        sealed = [(end - live, s) for s, (live, _, end) in segs.items()
                  if s != tier.files.current and end > live]
        if not sealed:
            return
        compact(tier, max(sealed)[1])


def compact(tier, victim: int) -> None:
    """Re-append the live records of sealed segment ``victim`` to the current segment (same
    access order; bytes copied as they are, their CRCs still cover them), then unlink it."""
    with tier.env.begin(buffers=True) as txn:
        cur = txn.cursor(db=tier.index.dbs[b"byseg"])
        prefix = SEQ.pack(victim)
        moves = []
        ok = cur.set_range(prefix)
        while ok:
            k = key_of(cur.key())
            if not k.startswith(prefix):
                break
            h = k[len(prefix):]
            v = txn.get(h, db=tier.index.dbs[b"records"])
            if v is not None:
                moves.append((h, record_value(v)))
            ok = cur.next()
    lost, entries, keep = [], [], []
    for h, v in moves:
        parts = tier.reads.parts_at(h, v)
        if parts is None:
            lost.append((h, v))    # its bytes are gone: drop it (a read would miss anyway)
        else:
            entries.append((h, parts))
            keep.append((h, v))
        parts = None
    freed: list[int] = []
    with tier.env.begin(write=True, buffers=True) as txn:
        deltas: dict[int, list[int]] = {}
        total = u64(txn.get(b"bytes", db=tier.index.dbs[b"meta"]), 0)
        for (h, v) in lost:
            if _current(txn, tier, h) == v:
                total -= tier.index.drop(txn, h, v, deltas)
                tier.index.counts["deleted"] += 1
        seqs = []
        for h, v in keep:
            if _current(txn, tier, h) != v:
                raise RuntimeError("a record changed under compaction (one writer only)")
            seqs.append(U64.unpack_from(v, 0)[0])
            tier.index.drop(txn, h, v, deltas)
        if entries:
            tier.index.add(txn, entries, seqs, deltas)   # same access order
            tier.index.counts["moved_records"] += len(entries)
            tier.index.counts["moved_bytes"] += sum(sum(len(p) for p in ps) for _, ps in entries)
        entries.clear()
        txn.put(b"bytes", U64.pack(max(total, 0)), db=tier.index.dbs[b"meta"])
        deltas.setdefault(victim, [0, 0])
        freed = tier.index.settle(txn, deltas)
    tier.files.forget(victim)
    tier.index.unlink(freed)
    tier.index.counts["compactions"] += 1


def _current(txn, tier, h: bytes) -> bytes | None:
    v = txn.get(h, db=tier.index.dbs[b"records"])
    return None if v is None else record_value(v)
