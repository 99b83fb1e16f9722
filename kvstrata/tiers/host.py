"""The host tier: fixed page slots in one host buffer (pinned when CUDA is present), LRU.

The buffer is allocated once, ``[num_slots, slot_bytes]`` uint8, and slots are reused: a slot
holds every group's payload of one page at fixed offsets (the largest payload each group's host
format can take), so the host never allocates per page and a D2H copy lands directly in its final
place. A group's host format is :func:`host_codec` of its codec: the codec's own output when it
has a device batch path (identity, NVFP4), the raw page bytes (identity) for a CPU-only lossless
codec, which runs at the disk boundary instead (its bound is the raw page anyway: compressing for
the host would save no host memory, only cost device syncs and CPU time on the eviction path).
Entries become visible only when the copy that fills them has completed
(:meth:`HostTier.settle`).

The tier owns its bytes: the device copies (:class:`~kvstrata.tiers.transfer.Mover`) reach the
slots through :meth:`HostTier.rows`, a record read from a lower tier lands in a slot through
:meth:`HostTier.fill` (which turns it into the host format), and a slot leaves as a record through
:meth:`HostTier.get` (the :class:`~kvstrata.tiers.protocol.Tier` protocol, whose records carry the
host format's codec headers). The :class:`~kvstrata.tiers.manager.TierManager` decides what is
copied where and when; a slot taken with :meth:`take_slots` whose old entry was evicted keeps its
bytes until the caller overwrites it, so the caller writes victims down first.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from ..codecs import Codec, CorruptPageError, EncodedPage, LosslessCodec, get_codec
from ..dtypes import canonical_dtype, dtype_name
from ..pagepool import KVGroupSpec, PageKey, format_bytes
from .protocol import Parts, check_key, new_counters, record_nbytes
from .record import (Record, RecordMismatch, build_record, check_identity, check_payloads,
                     parse_record)

log = logging.getLogger(__name__)
_EMPTY = torch.empty(0, dtype=torch.uint8)

#: Threads that encode host pages into records (zstd and numpy release the GIL).
_ENCODE_THREADS = min(4, os.cpu_count() or 1)
_encoders: tuple[int, ThreadPoolExecutor] | None = None
_encoders_lock = threading.Lock()


def _encoder_pool() -> ThreadPoolExecutor:
    """The process's shared encoder threads (made again in a forked child, which has none)."""
    global _encoders
    with _encoders_lock:
        if _encoders is None or _encoders[0] != os.getpid():
            _encoders = (os.getpid(), ThreadPoolExecutor(_ENCODE_THREADS,
                                                         thread_name_prefix="kvstrata-encode"))
        return _encoders[1]


@dataclass(slots=True)
class HostEntry:
    """One page in the host tier: which slot, and each group's codec header (payload lives in the
    slot, ``sizes[i]`` bytes at ``HostTier.offsets[i]``)."""

    info: PageKey
    ns: bytes
    slot: int
    headers: list[EncodedPage]      # payload fields are empty placeholders; bytes are in the slot
    sizes: list[int]
    on_disk: bool = False           # a copy is (believed to be) on the disk tier already
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)


def host_codec(codec: Codec) -> Codec:
    """The codec whose output a host slot holds for a group configured with ``codec``.

    Codecs with a device batch path (``rows_path``: identity, NVFP4) encode straight into the
    staging rows, so the host holds their output. A lossless codec without one (``lossless``:
    byte planes + zstd on the CPU) is kept raw in the host tier (identity) and runs only at the
    disk boundary. A lossy codec without a device path has no raw stand-in and keeps its own
    format (encoded page by page).
    """
    if codec.rows_path or not codec.lossless:
        return codec
    return get_codec("identity")


def slot_layout(specs: Sequence[KVGroupSpec], codecs: Sequence[Codec], page_size: int
                ) -> tuple[list[int], list[int], int]:
    """``(offsets, max_sizes, slot_bytes)``: each group's payload offset and bound in a slot.

    Offsets are 256-byte aligned so that every group's payload can be viewed as any dtype and
    DMA'd at full speed.
    """
    offsets, sizes, off = [], [], 0
    for spec, codec in zip(specs, codecs):
        n = host_codec(codec).encoded_nbytes(spec, page_size)
        n = spec.bytes_per_page(page_size) if n is None else int(n)
        offsets.append(off)
        sizes.append(n)
        off += -(-n // 256) * 256
    return offsets, sizes, off


class HostTier:
    """Host page slots with a byte capacity and LRU eviction.

    Args:
        specs, codecs, page_size: the pool's groups and the codec of each (they fix the slot layout).
        capacity_bytes: host memory for slots; ``capacity_bytes // slot_bytes`` slots are allocated.
        pin: allocate page-locked memory (needed for async DMA; only when CUDA is available).
    """

    name = "host"

    def __init__(self, specs: Sequence[KVGroupSpec], codecs: Sequence[Codec], page_size: int,
                 capacity_bytes: int, pin: bool = False):
        self.specs, self.codecs, self.page_size = list(specs), list(codecs), page_size
        self.names = [g.name for g in self.specs]
        self.host_codecs = [host_codec(c) for c in self.codecs]
        self.offsets, self.max_sizes, self.slot_bytes = slot_layout(specs, codecs, page_size)
        # The header every page of a group with a device batch path gets (payload in the slot).
        self._row_headers = [
            EncodedPage(c.name, c.version, tuple(g.page_shape(page_size)), dtype_name(g.dtype),
                        _EMPTY) if c.rows_path else None
            for g, c in zip(self.specs, self.host_codecs)]
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"host capacity must be a non-negative number of bytes, "
                             f"got {capacity_bytes!r}")
        self.num_slots = capacity_bytes // self.slot_bytes
        if capacity_bytes and not self.num_slots:
            raise ValueError(
                f"a host capacity of {format_bytes(capacity_bytes)} does not hold one page slot of "
                f"{format_bytes(self.slot_bytes)}; use at least {self.slot_bytes} bytes, or 0 to "
                f"disable the host tier")
        self.buf = torch.empty((self.num_slots, self.slot_bytes), dtype=torch.uint8,
                               pin_memory=pin and self.num_slots > 0)
        self._free: list[int] = list(range(self.num_slots - 1, -1, -1))
        self._entries: OrderedDict[bytes, HostEntry] = OrderedDict()   # LRU: oldest first
        # (event, entries, valid): published once the event completed; see add()
        self._pending: list[tuple[Any, list[HostEntry], Any]] = []
        self._pending_hashes: set[bytes] = set()
        self._counters = new_counters("evictions", "rejected_pages", "rejected_bytes")
        self.timings = {"decode_s": 0.0, "encode_s": 0.0}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, page_hash: bytes) -> bool:
        return page_hash in self._entries

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    def stored_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def has(self, page_hash: bytes) -> bool:
        """Visible, or written and waiting for its copy to complete."""
        return page_hash in self._entries or page_hash in self._pending_hashes

    def entry(self, page_hash: bytes) -> HostEntry | None:
        """The visible entry for ``page_hash`` (no LRU update)."""
        return self._entries.get(page_hash)

    def touch(self, hashes: Iterable[bytes]) -> None:
        for h in hashes:
            if h in self._entries:
                self._entries.move_to_end(h)

    def lru(self) -> list[bytes]:
        """Visible page hashes, next to be evicted first."""
        return list(self._entries)

    def row_header(self, group: int) -> EncodedPage:
        """The host header of group index ``group`` when its host format has a device batch
        path (identity, NVFP4; identity for CPU-only lossless codecs); payload empty."""
        hdr = self._row_headers[group]
        if hdr is None:
            raise ValueError(f"group {self.names[group]!r} has no fixed host row format")
        return hdr

    def rows(self, slot: int, n: int = 1) -> torch.Tensor:
        """Slots ``slot .. slot+n-1`` as one ``[n, slot_bytes]`` uint8 view (a DMA source or
        destination laid out like the staging rows)."""
        return self.buf[slot:slot + n]

    def payload(self, entry: HostEntry, group: int) -> torch.Tensor:
        """The 1-D uint8 view of ``entry``'s payload for group index ``group`` in its slot."""
        off = self.offsets[group]
        return self.buf[entry.slot, off:off + entry.sizes[group]]

    def group_region(self, slot: int, group: int) -> torch.Tensor:
        """The 1-D uint8 view of host slot ``slot``'s whole region for group index ``group``
        (room for its largest payload): where the peer link parses received payloads."""
        off = self.offsets[group]
        return self.buf[slot, off:off + self.max_sizes[group]]

    # -- slots --------------------------------------------------------------------------------
    def take_slots(self, n: int, keep: frozenset[bytes] = frozenset()
                   ) -> tuple[list[int], list[HostEntry]]:
        """Up to ``n`` slots: free ones first, then the LRU entries' (never those in ``keep``).

        Returns ``(slots, victims)``. Victims are no longer visible, but their bytes are intact
        until the caller overwrites the slots: write them to the next tier first.
        """
        slots: list[int] = []
        while self._free and len(slots) < n:
            slots.append(self._free.pop())
        victims: list[HostEntry] = []
        if len(slots) < n:
            for h in list(self._entries):
                if len(slots) >= n:
                    break
                if h in keep:
                    continue
                e = self._entries.pop(h)
                victims.append(e)
                slots.append(e.slot)
        # Ascending slots: consecutive ones are copied by one DMA (the free list is a stack fed
        # in LRU order, so without this a batch would come out in descending single slots).
        slots.sort()
        return slots, victims

    def evict_all(self) -> list[HostEntry]:
        """Remove every visible entry (LRU first); as with :meth:`take_slots`, the bytes stay
        intact until the caller returns the slots with :meth:`give_back`."""
        victims = list(self._entries.values())
        self._entries.clear()
        return victims

    def give_back(self, slots: Iterable[int]) -> None:
        """Return slots that were taken but not filled (a failed copy)."""
        self._free.extend(slots)

    def add(self, entries: Sequence[HostEntry], event: Any = None, refused: Any = None) -> None:
        """Make ``entries`` visible once ``event`` (a CUDA event, or ``None``: already done) has
        completed; a page is never visible before its bytes are. ``refused``: optional host
        tensor ``[len(entries), ...]``, readable once ``event`` completed; an entry with any
        nonzero flag (its codec refused the page) is never published, its slot is freed and
        counted (``rejected_pages``) and logged once."""
        if event is None:
            self._publish(entries, refused)
        else:
            self._pending.append((event, list(entries), refused))
            self._pending_hashes.update(e.info.hash for e in entries)

    def settle(self, block: bool = True) -> None:
        """Publish entries whose copies completed (all of them, waiting, with ``block``)."""
        still = []
        for ev, entries, refused in self._pending:
            if block:
                ev.synchronize()
            if block or ev.query():
                self._publish(entries, refused)
            else:
                still.append((ev, entries, refused))
        self._pending = still

    def _publish(self, entries: Sequence[HostEntry], refused: Any = None) -> None:
        bad = None
        if refused is not None:
            bad = refused.reshape(len(entries), -1).ne(0).any(dim=1).tolist()
        rejected = []
        for j, e in enumerate(entries):
            self._pending_hashes.discard(e.info.hash)
            if bad is not None and bad[j]:
                rejected.append(e)
                self._free.append(e.slot)
                continue
            old = self._entries.pop(e.info.hash, None)
            if old is not None and old.slot != e.slot:
                self._free.append(old.slot)
            self._entries[e.info.hash] = e
        if rejected:
            self._rejected(rejected)

    def _rejected(self, entries: list[HostEntry]) -> None:
        """Pages a codec refused on the way down (e.g. NaN/Inf under NVFP4): never stored."""
        if not self._counters["rejected_pages"]:
            names = [f"{g.name}: {c.name}" for g, c in zip(self.specs, self.codecs)
                     if not c.lossless]
            log.warning("tiers: %d evicted page(s) could not be encoded (%s; NaN/Inf in the KV?) "
                        "and were not stored; counted in stats()['unencodable_pages'], not logged "
                        "again", len(entries), ", ".join(names))
        self._counters["rejected_pages"] += len(entries)
        self._counters["rejected_bytes"] += sum(e.nbytes for e in entries)

    def discard(self, hashes: Iterable[bytes]) -> int:
        """Drop entries (e.g. found corrupt); their slots become free. Returns how many."""
        n = 0
        for h in hashes:
            e = self._entries.pop(h, None)
            if e is not None:
                self._free.append(e.slot)
                n += 1
        return n

    def clear(self) -> None:
        self.settle()
        self.discard(list(self._entries))

    # -- records in and out -------------------------------------------------------------------
    def fill(self, slot: int, info: PageKey, ns: bytes, rec: Record) -> HostEntry:
        """Copy a verified record into slot ``slot`` in each group's host format: as it is, or
        decoded to raw bytes (CPU) for a group kept raw on the host whose record holds its
        configured codec. Returns the (not yet visible) entry; pass it to :meth:`add`. Raises
        :class:`CorruptPageError` if a payload does not decode or fit."""
        headers, sizes = [], []
        for gi, (g, p) in enumerate(zip(rec.header["groups"], rec.payloads)):
            off, nb = self.offsets[gi], self.max_sizes[gi]
            hc = self.host_codecs[gi]
            if g["codec"] != hc.name and g["codec"] == self.codecs[gi].name:
                # payload CRC verified already: decode without a second pass
                enc = EncodedPage.from_header({**g, "checksum": None}, p)
                t0 = time.perf_counter()
                raw = self.codecs[gi].decode(enc).contiguous().reshape(-1).view(torch.uint8)
                self.timings["decode_s"] += time.perf_counter() - t0
                if raw.numel() != nb:
                    raise CorruptPageError(f"group {self.names[gi]!r}: decoded page has "
                                           f"{raw.numel()} bytes, the host slot holds {nb}")
                self.buf[slot, off:off + nb].copy_(raw)
                headers.append(self.row_header(gi))
                sizes.append(nb)
                continue
            if g["codec"] != hc.name:
                raise RecordMismatch(f"group {self.names[gi]!r}: record codec {g['codec']!r}, "
                                     f"the host holds {hc.name!r}")
            if len(p) > nb:
                raise CorruptPageError(f"group {self.names[gi]!r}: {len(p)}-byte payload, the "
                                       f"host slot holds {nb}")
            dst, src = self.buf[slot, off:off + len(p)].numpy(), np.frombuffer(p, dtype=np.uint8)
            if src.ctypes.data != dst.ctypes.data:      # (received straight into the slot)
                np.copyto(dst, src)
            headers.append(EncodedPage.from_header(g, _EMPTY))
            sizes.append(len(p))
        return HostEntry(info, ns, slot, headers, sizes)

    def records(self, entries: Sequence[HostEntry]) -> list[list]:
        """Records (parts) of entries in the *configured* codecs, the format of every lower
        tier and of the peer path: groups kept raw on the host are encoded here, on the CPU.
        Payloads of other groups are views of the slots (write them before reusing a slot)."""
        if not entries:
            return []
        pages = [list(e.headers) for e in entries]
        payloads = [[self.payload(e, gi).numpy().data for gi in range(len(self.specs))]
                    for e in entries]
        jobs = [(j, gi) for j, e in enumerate(entries) for gi, c in enumerate(self.codecs)
                if e.headers[gi].codec != c.name]
        if jobs:
            t0 = time.perf_counter()
            encs = self._encode_raw([(entries[j], gi) for j, gi in jobs])
            self.timings["encode_s"] += time.perf_counter() - t0
            for (j, gi), enc in zip(jobs, encs):
                pages[j][gi] = enc
                payloads[j][gi] = enc.payload.numpy().data
        return [build_record(e.ns, e.info, self.names, hdrs, pls)
                for e, hdrs, pls in zip(entries, pages, payloads)]

    def _encode_raw(self, jobs: list[tuple[HostEntry, int]]) -> list[EncodedPage]:
        """Each ``(entry, group)``'s raw host bytes encoded with the group's configured codec
        (the encoded payloads are new host tensors: the slots may be reused afterwards). The
        built-in lossless codec is thread-safe and encodes on a few threads; any other codec
        page by page."""
        def one(job: tuple[HostEntry, int]) -> EncodedPage:
            e, gi = job
            h = e.headers[gi]
            raw = self.payload(e, gi).view(canonical_dtype(h.dtype)).view(h.shape)
            return self.codecs[gi].encode(raw)
        if len(jobs) > 1 and all(type(self.codecs[gi]) is LosslessCodec for _, gi in jobs):
            return list(_encoder_pool().map(one, jobs))
        return [one(job) for job in jobs]

    # -- the Tier protocol (records in the host format; see kvstrata.tiers.protocol) ---------------
    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return [check_key(k) in self._entries for k in keys]

    def get(self, keys: Sequence[bytes]) -> list[Parts | None]:
        """Records of visible entries in the host format: head + copies of the slot's payloads
        (a slot is reused; the protocol promises buffers that stay as they are). The
        TierManager reaches slots through :meth:`rows` / :meth:`records` instead."""
        out: list[Parts | None] = []
        for k in keys:
            e = self._entries.get(check_key(k))
            if e is None:
                self._counters["misses"] += 1
                out.append(None)
                continue
            payloads = [self.payload(e, gi).numpy().tobytes() for gi in range(len(self.specs))]
            parts = build_record(e.ns, e.info, self.names, e.headers, payloads)
            self._counters["hits"] += 1
            self._counters["read_bytes"] += record_nbytes(parts)
            out.append(parts)
        return out

    def put(self, items: Sequence[tuple[bytes, Parts]]) -> list[bool]:
        """Store records (structurally checked: a record that fails is not stored) in free
        slots, evicting LRU entries when full. Used on its own the host tier drops what it
        evicts (counted); a :class:`~kvstrata.tiers.manager.TierManager` takes slots itself and
        writes victims down first."""
        self.settle()
        ok = []
        for k, parts in items:
            key = check_key(k)
            try:
                rec = parse_record(parts)
                h = rec.header
                check_identity(rec, h["ns"], None)
                check_payloads(rec)
                if h["hash"] != key:
                    raise RecordMismatch("record holds another page than its key")
                info = PageKey(key, h["parent"], tuple(h["tokens"]))
                slots, victims = self.take_slots(1)
                if not slots:
                    raise CorruptPageError("the host tier has no slot")
                self._counters["evictions"] += len(victims)
                try:
                    entry = self.fill(slots[0], info, h["ns"], rec)
                except CorruptPageError:
                    self.give_back(slots)
                    raise
            except (CorruptPageError, KeyError, TypeError):
                self._counters["put_failures"] += 1
                ok.append(False)
                continue
            self._publish([entry])
            self._counters["puts"] += 1
            self._counters["written_bytes"] += record_nbytes(parts)
            ok.append(True)
        return ok

    def delete(self, keys: Sequence[bytes]) -> int:
        n = self.discard(check_key(k) for k in keys)
        self._counters["deletes"] += n
        return n

    def counters(self) -> dict[str, int | float]:
        return {**self._counters, **self.timings, "pages": len(self),
                "stored_bytes": self.stored_bytes, "capacity_bytes": self.capacity_bytes}

    def close(self) -> None:
        self.clear()
