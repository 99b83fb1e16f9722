"""TierManager: demotes evicted pages device -> host -> disk and promotes prefix hits back.

Wiring::

    pool = PagePool(groups, num_pages, page_size, device)
    tiers = TierManager(pool, namespace, host_bytes=8 << 30,
                        disk=DiskTier("/var/cache/kvstrata", map_size=64 << 30))
    mgr = KVCacheManager(pool, namespace, lower=tiers)   # admit() promotes from the tiers

The constructor sets ``pool.on_evict`` (and, with ``write_through=True``, ``pool.on_hashed``).

Records carry the digest of the *unsalted* namespace (models, groups, page size, layout): a page's
salt is already bound by its chain hash (the key), so a reader checks the unsalted digest, the hash
link ``H(parent || tokens)`` and the token ids.

Codecs and tiers: host slots hold device-codec output (identity or NVFP4, encoded by the
:class:`~kvstrata.tiers.transfer.Mover` straight into its staging rows) or the raw page bytes for
a CPU-only lossless codec (``lossless``), whose host header says identity. CPU codecs run at the
disk boundary: :meth:`TierManager._to_disk` encodes such a group's raw host bytes with the
configured codec into the record (records on disk always hold the configured codec's output, so
``check_groups`` and ``kvstrata inspect --verify`` see the same records as ever), and
:meth:`TierManager._from_disk` decodes them back into raw host bytes. Eviction and promotion
through the host therefore never wait for the device nor run a CPU codec; host byte counters
(``host_bytes``, ``d2h_bytes``, ``h2d_bytes``) count raw bytes for those groups.

The host tier is inclusive: a page promoted from disk keeps its host copy, and a page demoted
again that is still on the host costs nothing. Pages go to disk when the host evicts them
(write-back, default) or as soon as they are hashed (``write_through=True``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np
import torch

from ..codecs import CorruptPageError, EncodedPage, LosslessCodec, get_codec
from ..dtypes import canonical_dtype
from ..pagepool import Namespace, PageInfo, PagePool
from .disk import DiskTier
from .host import HostEntry, HostTier, slot_layout
from .record import RecordMismatch, build_record, verify_record
from .transfer import Mover

log = logging.getLogger(__name__)

_COUNTERS = ("host_hits", "host_misses", "disk_hits", "disk_misses",
             "d2h_pages", "d2h_bytes", "h2d_pages", "h2d_bytes",
             "host_to_disk_pages", "host_to_disk_bytes", "disk_to_host_pages", "disk_to_host_bytes",
             "checksum_failures", "mismatches", "host_evictions", "dropped_pages",
             "unencodable_pages")

#: Threads that encode host pages for the disk tier (zstd and numpy release the GIL).
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


class TierManager:
    """The tiers below the device pool; a :class:`~kvstrata.pagepool.PrefixSource`.

    Args:
        pool: the device :class:`PagePool` (its groups fix codecs and the slot layout).
        namespace: the base namespace (its unsalted digest goes into every record).
        host_bytes: host tier capacity (at least one page slot).
        disk: an open :class:`DiskTier`, or ``None`` for host only.
        write_through: also write a page to host and disk as soon as it is hashed.
        batch_pages: most pages per copy batch (capped by the host slots). Each batch costs
            fixed host work (Python per page, launches per chunk); on an H200, NVFP4 evictions
            streamed at 3.25x the raw PCIe figure in batches of 256 and 2.6x in batches of 64
            (docs/benchmarks.md, Tiers).
        chunk_pages: pages per pipelined chunk of a batch (two staging buffers of this many
            pages per direction; chunk k's copy overlaps chunk k+1's encode/decode). Default:
            about 16 MiB of host slots (``transfer.default_chunk_pages``); ``>= batch_pages``:
            no pipelining within a batch.
    """

    def __init__(self, pool: PagePool, namespace: Namespace, host_bytes: int = 1 << 30,
                 disk: DiskTier | None = None, write_through: bool = False,
                 batch_pages: int = 256, attach: bool = True, chunk_pages: int | None = None):
        if namespace.page_size != pool.page_size:
            raise ValueError(f"namespace page_size {namespace.page_size} != pool page_size "
                             f"{pool.page_size}")
        if not isinstance(batch_pages, int) or batch_pages <= 0:
            raise ValueError(f"batch_pages must be a positive integer, got {batch_pages!r}")
        self.pool = pool
        self.namespace = namespace.with_salt(None)
        self.ns_digest = self.namespace.digest
        self.specs = list(pool.groups)
        self.names = [g.name for g in self.specs]
        self.codecs = [get_codec(g.codec) for g in self.specs]
        pin = pool.device.type == "cuda" and torch.cuda.is_available()
        self.host = HostTier(self.specs, self.codecs, pool.page_size, host_bytes, pin=pin)
        self.host.on_reject = self._rejected
        if self.host.num_slots == 0:
            raise ValueError("the tier stack needs a host tier of at least one page slot "
                             f"({self.host.slot_bytes} bytes): it stages every transfer")
        self.batch = min(batch_pages, self.host.num_slots)
        self.mover = Mover(pool, self.host, self.codecs, self.batch, chunk_pages)
        # Groups kept raw in the host tier whose configured (CPU) codec runs at the disk boundary.
        self._disk_coded = [gi for gi, (c, hc) in enumerate(zip(self.codecs,
                                                                self.mover.host_codecs))
                            if hc is not c]
        self.disk = disk
        self.write_through = write_through
        self._wt_queue: list[PageInfo] = []
        self.counters = dict.fromkeys(_COUNTERS, 0)
        if attach:
            self.attach()

    @staticmethod
    def slot_bytes_for(pool: PagePool) -> int:
        """Host bytes one page takes (every group's largest encoded payload, aligned): size
        ``host_bytes`` as a multiple of this."""
        codecs = [get_codec(g.codec) for g in pool.groups]
        return slot_layout(pool.groups, codecs, pool.page_size)[2]

    def attach(self) -> None:
        """Install this manager as the pool's eviction (and write-through) callback."""
        self.pool.on_evict = self.on_evict
        if self.write_through:
            if not hasattr(self.pool, "on_hashed"):
                raise ValueError("write_through needs a PagePool with the on_hashed hook")
            self.pool.on_hashed = self.on_hashed

    # -- demotion ---------------------------------------------------------------------------------
    def on_evict(self, infos: list[PageInfo]) -> None:
        """Pool callback: copy evicted cached pages (content intact during the call) down."""
        self._flush_write_through()
        self._demote(infos)

    def on_hashed(self, info: PageInfo) -> None:
        """Pool callback (write-through): queue a freshly hashed page; written in batches."""
        self._wt_queue.append(info)
        if len(self._wt_queue) >= self.batch:
            self._flush_write_through()

    def flush(self) -> None:
        """Finish queued write-through pages and pending copies; persist disk access order."""
        self._flush_write_through()
        self.host.settle()
        if self.disk is not None:
            self.disk.flush()

    def _flush_write_through(self) -> None:
        if not self._wt_queue:
            return
        # A queued page is still in the pool and indexed: it can only leave through on_evict,
        # which flushes this queue first, so its content is intact here.
        q, self._wt_queue = self._wt_queue, []
        q = [i for i in q if self.pool.lookup(i.hash) == i.page_id]
        self._demote(q)
        self.host.settle()
        if self.disk is not None:
            entries = [self.host.get(i.hash) for i in q]
            self._to_disk([e for e in entries if e is not None and not e.on_disk])

    def _demote(self, infos: Sequence[PageInfo]) -> None:
        self.host.settle(block=False)
        todo, seen = [], set()
        for i in infos:
            if self.host.has(i.hash) or i.hash in seen:
                continue
            seen.add(i.hash)
            todo.append(i)
        self.host.touch([i.hash for i in infos])
        for k in range(0, len(todo), self.batch):
            chunk = todo[k:k + self.batch]
            slots, victims = self.host.take_slots(len(chunk))
            if len(slots) < len(chunk):
                # The other slots hold pages whose copies are still in flight (not evictable
                # yet): let those land, then take LRU entries.
                self.host.settle()
                more, later = self.host.take_slots(len(chunk) - len(slots))
                slots, victims = slots + more, victims + later
            self._spill(victims)
            if len(slots) < len(chunk):       # a host smaller than a batch: count, never lose
                self.counters["dropped_pages"] += len(chunk) - len(slots)
                chunk = chunk[:len(slots)]
                if not chunk:
                    continue
            entries, ev, refused = self.mover.down(self.ns_digest, chunk, slots)
            self.host.add(entries, ev, refused)
            self.counters["d2h_pages"] += len(entries)
            self.counters["d2h_bytes"] += sum(e.nbytes for e in entries)

    def _rejected(self, entries: list[HostEntry]) -> None:
        """Pages a codec refused on the way down (e.g. NaN/Inf under NVFP4): never stored."""
        if not self.counters["unencodable_pages"]:
            names = [f"{g.name}: {c.name}" for g, c in zip(self.specs, self.codecs)
                     if not c.lossless]
            log.warning("tiers: %d evicted page(s) could not be encoded (%s; NaN/Inf in the KV?) "
                        "and were not stored; counted in stats()['unencodable_pages'], not logged "
                        "again", len(entries), ", ".join(names))
        self.counters["unencodable_pages"] += len(entries)
        self.counters["d2h_pages"] -= len(entries)
        self.counters["d2h_bytes"] -= sum(e.nbytes for e in entries)

    def drain_host(self) -> int:
        """Write every host page the disk lacks to disk and empty the host tier (shutdown, or to
        make a restart find everything). Returns how many host pages were drained."""
        self._flush_write_through()
        self.host.settle()
        victims = self.host.evict_all()
        self._spill(victims)
        self.host.give_back(v.slot for v in victims)
        return len(victims)

    def _spill(self, victims: list[HostEntry]) -> None:
        """Host evictions: write the ones the disk lacks (write-back), then the slots are free."""
        self.counters["host_evictions"] += len(victims)
        if not victims:
            return
        if self.disk is None:
            self.counters["dropped_pages"] += len(victims)
            return
        have = self.disk.contains([v.info.hash for v in victims])
        self._to_disk([v for v, h in zip(victims, have) if not h])

    def _to_disk(self, entries: Sequence[HostEntry]) -> None:
        """Write host entries to disk as records; groups kept raw on the host are encoded with
        their configured codec here, on the CPU (records always hold that codec's output)."""
        if not entries:
            return
        pages = [list(e.headers) for e in entries]
        payloads = [[self.host.payload(e, gi).numpy().data for gi in range(len(self.specs))]
                    for e in entries]
        jobs = [(j, gi) for j, e in enumerate(entries) for gi in self._disk_coded
                if e.headers[gi].codec != self.codecs[gi].name]
        if jobs:
            t0 = time.perf_counter()
            encs = self._encode_raw([(entries[j], gi) for j, gi in jobs])
            self.mover.timings["encode_s"] += time.perf_counter() - t0
            for (j, gi), enc in zip(jobs, encs):
                pages[j][gi] = enc
                payloads[j][gi] = enc.payload.numpy().data
        items = [(e.info.hash, build_record(e.ns, e.info, self.names, hdrs, pls))
                 for e, hdrs, pls in zip(entries, pages, payloads)]
        n = self.disk.put_batch(items)
        self.counters["dropped_pages"] += len(items) - n
        stored = items[:n]
        self.counters["host_to_disk_pages"] += len(stored)
        self.counters["host_to_disk_bytes"] += sum(sum(len(p) for p in parts) for _, parts in stored)
        for e in entries[:n]:
            e.on_disk = True

    def _encode_raw(self, jobs: list[tuple[HostEntry, int]]) -> list[EncodedPage]:
        """Each ``(entry, group)``'s raw host bytes encoded with the group's configured codec
        (the encoded payloads are new host tensors: the slots may be reused afterwards). The
        built-in lossless codec is thread-safe and encodes on a few threads; any other codec
        page by page."""
        def one(job: tuple[HostEntry, int]) -> EncodedPage:
            e, gi = job
            h = e.headers[gi]
            raw = self.host.payload(e, gi).view(canonical_dtype(h.dtype)).view(h.shape)
            return self.codecs[gi].encode(raw)
        if len(jobs) > 1 and all(type(self.codecs[gi]) is LosslessCodec for _, gi in jobs):
            return list(_encoder_pool().map(one, jobs))
        return [one(job) for job in jobs]

    # -- promotion ----------------------------------------------------------------------------------
    def _check_ns(self, namespace: Namespace) -> None:
        diffs = namespace.compatible(self.namespace)
        if diffs:
            raise ValueError(f"namespace differs from the tier manager's: {'; '.join(diffs)}")

    def lookup_prefix(self, namespace: Namespace, hashes: Sequence[bytes]) -> int:
        """Consecutive pages from ``hashes[0]`` found in the host or disk tier (one pass)."""
        self._check_ns(namespace)
        self._flush_write_through()
        self.host.settle()
        n = 0
        rest: list[bytes] = []
        for i, h in enumerate(hashes):
            if self.host.get(h) is None:
                rest = list(hashes[i:])
                break
            n += 1
        self.counters["host_hits"] += n
        if not rest:
            return n
        self.counters["host_misses"] += 1
        if self.disk is None:
            return n
        # Past the host's run, later pages may sit on either tier: check both, page by page.
        on_disk = self.disk.contains(rest)
        for h, d in zip(rest, on_disk):
            if d:
                self.counters["disk_hits"] += 1
            elif self.host.get(h) is not None:
                self.counters["host_hits"] += 1
            else:
                self.counters["disk_misses"] += 1
                break
            n += 1
        return n

    def load_prefix(self, namespace: Namespace, pages: Sequence[PageInfo],
                    page_ids: Sequence[int]) -> int:
        """Decode ``pages`` into device pages ``page_ids``; returns the verified leading count."""
        self._check_ns(namespace)
        if len(pages) != len(page_ids):
            raise ValueError(f"load_prefix got {len(pages)} pages and {len(page_ids)} page ids")
        self.host.settle()
        done = 0
        for k in range(0, len(pages), self.batch):
            chunk = list(pages[k:k + self.batch])
            entries = self._stage(chunk)
            if entries:
                self.mover.up(entries, page_ids[k:k + len(entries)])
                self.counters["h2d_pages"] += len(entries)
                self.counters["h2d_bytes"] += sum(e.nbytes for e in entries)
            done += len(entries)
            if len(entries) < len(chunk):
                break
        return done

    def _stage(self, chunk: list[PageInfo]) -> list[HostEntry]:
        """Host entries for the leading pages of ``chunk``, reading the missing ones from disk."""
        keep = frozenset(i.hash for i in chunk)
        entries: list[HostEntry | None] = []
        for info in chunk:
            e = self.host.get(info.hash)
            entries.append(e if e is not None and e.info.token_ids == tuple(info.token_ids)
                           and e.ns == self.ns_digest else None)
        missing = [j for j, e in enumerate(entries) if e is None]
        if missing and self.disk is not None:
            got = self._from_disk([chunk[j] for j in missing], keep)
            for j, e in zip(missing, got):
                entries[j] = e
        out = []
        for e in entries:
            if e is None:
                break
            out.append(e)
        self.host.touch(e.info.hash for e in out)
        return out

    def _from_disk(self, infos: list[PageInfo], keep: frozenset[bytes]) -> list[HostEntry | None]:
        """Read, verify and copy records into host slots. Stops at the first miss or bad record."""
        slots, victims = self.host.take_slots(len(infos), keep)
        self._spill(victims)
        self.mover.fence_host_writes()
        out: list[HostEntry | None] = []
        bad: list[bytes] = []
        read = 0
        with self.disk.reader() as get:
            for info, slot in zip(infos, slots):
                buf = get(info.hash)
                if buf is None:
                    break
                try:
                    rec = verify_record(buf, self.ns_digest, info, self.specs, self.codecs,
                                        self.pool.page_size)
                    headers, sizes = self._fill_slot(slot, rec.header["groups"], rec.payloads)
                except CorruptPageError as e:
                    key = "mismatches" if isinstance(e, RecordMismatch) else "checksum_failures"
                    self.counters[key] += 1
                    log.warning("disk tier: page %s is unusable (%s); deleted", info.hash.hex(), e)
                    bad.append(info.hash)
                    break
                read += sum(len(p) for p in rec.payloads)
                out.append(HostEntry(info, self.ns_digest, slot, headers, sizes, on_disk=True))
        self.host.give_back(slots[len(out):])
        self.host.add([e for e in out if e is not None])
        if bad:
            self.disk.delete(bad)
        self.disk.touch([e.info.hash for e in out])
        self.counters["disk_to_host_pages"] += len(out)
        self.counters["disk_to_host_bytes"] += read
        return out + [None] * (len(infos) - len(out))

    def _fill_slot(self, slot: int, groups: list[dict], payloads: Sequence[memoryview]
                   ) -> tuple[list[EncodedPage], list[int]]:
        """Copy a verified record's payloads into host slot ``slot`` in each group's host
        format: as they are, or decoded to raw bytes (CPU) for groups kept raw on the host.
        Returns the entry's headers and sizes; raises CorruptPageError if a payload does not
        decode."""
        headers, sizes = [], []
        for gi, (g, p) in enumerate(zip(groups, payloads)):
            off = self.host.offsets[gi]
            if gi in self._disk_coded:
                enc = EncodedPage(g["codec"], int(g["version"]), tuple(g["shape"]), g["dtype"],
                                  torch.frombuffer(bytearray(p), dtype=torch.uint8) if len(p)
                                  else torch.empty(0, dtype=torch.uint8),
                                  None, dict(g["meta"] or {}))   # payload CRC verified already
                t0 = time.perf_counter()
                raw = self.codecs[gi].decode(enc).contiguous().reshape(-1).view(torch.uint8)
                self.mover.timings["decode_s"] += time.perf_counter() - t0
                nb = self.host.max_sizes[gi]
                if raw.numel() != nb:
                    raise CorruptPageError(f"group {self.names[gi]!r}: decoded page has "
                                           f"{raw.numel()} bytes, the host slot holds {nb}")
                self.host.buf[slot, off:off + nb].copy_(raw)
                headers.append(self.mover.host_header(gi))
                sizes.append(nb)
                continue
            np.copyto(self.host.buf[slot, off:off + len(p)].numpy(),
                      np.frombuffer(p, dtype=np.uint8))
            headers.append(EncodedPage(g["codec"], int(g["version"]), tuple(g["shape"]),
                                       g["dtype"], torch.empty(0, dtype=torch.uint8),
                                       g["checksum"], dict(g["meta"] or {})))
            sizes.append(len(p))
        return headers, sizes

    # -- reporting --------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters per tier and direction, codec time, disk errors and evictions.

        Host-side byte counts (``host_bytes``, ``d2h_bytes``, ``h2d_bytes``) are the bytes in
        host slots: raw for groups whose CPU codec runs at the disk boundary (``lossless``);
        ``host_to_disk_bytes`` / ``disk_to_host_bytes`` are record bytes (encoded). ``encode_s`` /
        ``decode_s`` include the disk boundary's CPU codec time."""
        out = dict(self.counters)
        out.update(self.mover.collect_timings())
        out["host_pages"] = len(self.host)
        out["host_bytes"] = self.host.stored_bytes
        out["host_capacity_bytes"] = self.host.capacity_bytes
        if self.disk is not None:
            d = self.disk.stats
            out.update({"disk_pages": len(self.disk), "disk_bytes": self.disk.stored_bytes(),
                        "disk_evictions": d["evictions"], "disk_write_errors": d["write_errors"],
                        "disk_deleted": d["deleted"]})
        return out

    def close(self) -> None:
        """Write host pages back to disk (write-back would lose them otherwise), then close it."""
        if self.disk is not None:
            self.drain_host()
            self.flush()
            self.disk.close()

    def __repr__(self) -> str:
        disk = os.fspath(self.disk.path) if self.disk is not None else None
        return (f"TierManager(host={len(self.host)}/{self.host.num_slots} slots, disk={disk!r}, "
                f"write_through={self.write_through})")
