"""TierManager: the policy over the tiers below the device (host, then disk and remote).

Wiring::

    pool = PagePool(groups, num_pages, page_size, device)
    tiers = TierManager.from_config(pool, namespace, dict(
        host_bytes=8 << 30, disk="/var/cache/kvstrata", remote="redis://cache:6379/0"))
    mgr = KVCacheManager(pool, namespace, tiers=tiers)   # admit() promotes from the tiers

Given a :class:`~kvstrata.pagepool.PagePool`, the manager subscribes to its ``on_evict`` (and, with
``write_through=True``, ``on_hashed``) hooks; given a :class:`~kvstrata.pagepool.PoolView` (an
outside engine's pages), the engine calls :meth:`TierManager.on_evict` / :meth:`on_hashed` itself.

The manager holds policy only: *which* page goes *where* and *when*. It reaches device pages
through the :class:`~kvstrata.pagepool.PoolView` (copies by the
:class:`~kvstrata.tiers.transfer.Mover`), host slots through :class:`~kvstrata.tiers.host.HostTier`'s
methods, and the lower tiers (``disk``, ``remote``: anything implementing
:class:`~kvstrata.tiers.protocol.Tier`) through the protocol alone, with records built and
verified here (:mod:`kvstrata.tiers.record`). The lower tiers are asked in order (disk before
remote: the nearer first); a page is written to every lower tier that lacks it.

Records carry the digest of the *unsalted* namespace (models, groups, page size, layout): a page's
salt is already bound by its chain hash (the key), so a reader checks the unsalted digest, the hash
link ``H(parent || tokens)`` and the token ids.

Codecs and tiers: host slots hold device-codec output (identity or NVFP4, encoded by the
:class:`~kvstrata.tiers.transfer.Mover` straight into its staging rows) or the raw page bytes for
a CPU-only lossless codec (``lossless``), whose host header says identity. CPU codecs run at the
boundary to the lower tiers: :meth:`HostTier.records` encodes such a group's raw host bytes
with the configured codec into the record (records in lower tiers always hold the configured
codec's output, so ``check_record_groups`` and ``kvstrata inspect --verify`` see the same
records everywhere), and :meth:`HostTier.fill` decodes them back into raw host bytes. Eviction
and promotion through the host therefore never wait for the device nor run a CPU codec; host byte counters
(``host_bytes``, ``d2h_bytes``, ``h2d_bytes``) count raw bytes for those groups.

The host tier is inclusive: a page promoted from a lower tier keeps its host copy, and a page
demoted again that is still on the host costs nothing. Pages go to the lower tiers when the host
evicts them (write-back, default), as soon as they are hashed (``write_through=True``: what
engines sharing a remote tier want, so others find a prefix while it is still hot here), and on
:meth:`TierManager.write_back` (every device and host page, e.g. at shutdown).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Sequence

import torch

from ..codecs import CorruptPageError, get_codec
from ..pagepool import Namespace, PageInfo, PageKey, PagePool, PoolView, namespace_differences
from .disk import DiskTier
from .host import HostEntry, HostTier, slot_layout
from .protocol import Parts, Tier, leading
from .record import RecordMismatch, verify_record
from .transfer import Mover

log = logging.getLogger(__name__)

_COUNTERS = ("host_hits", "host_misses", "d2h_pages", "d2h_bytes", "h2d_pages", "h2d_bytes",
             "checksum_failures", "mismatches", "host_evictions", "dropped_pages")
#: Per lower tier NAME: NAME_hits, NAME_misses, host_to_NAME_pages, ...
_TIER_COUNTERS = ("{}_hits", "{}_misses", "host_to_{}_pages", "host_to_{}_bytes",
                  "{}_to_host_pages", "{}_to_host_bytes", "{}_put_failures")
#: ``CacheConfig(tiers=dict(...))`` keys :meth:`TierManager.from_config` takes.
CONFIG_KEYS = ("host_bytes", "disk", "disk_bytes", "remote", "remote_options", "write_through",
               "batch_pages", "chunk_pages")


class TierManager:
    """The tiers below the device pool and the policy over them; a
    :class:`~kvstrata.pagepool.PrefixSource`.

    Args:
        pool: the device pages: a :class:`PoolView`, or a :class:`PagePool` (viewed with
            :meth:`PoolView.of`; with ``attach`` its eviction hooks call this manager).
        namespace: the base namespace (its unsalted digest goes into every record).
        host_bytes: host tier capacity (at least one page slot).
        disk: an open :class:`DiskTier` (any :class:`Tier` named ``"disk"``), or ``None``.
        remote: a :class:`Tier` shared with other engines (:class:`~kvstrata.tiers.remote.
            RemoteTier`), or ``None``. Asked after the disk.
        write_through: also write a page to the host and every lower tier as soon as it is
            hashed.
        flush_after_s: write-through pages are written in batches: when ``batch_pages`` are
            queued, when a queued page has waited this long (checked as pages are hashed), and
            on every lookup, eviction, :meth:`flush` and :meth:`write_back`. Engines sharing a
            remote tier see each other's pages within about this delay of steady work.
        batch_pages: most pages per copy batch (capped by the host slots). Each batch costs
            fixed host work (Python per page, launches per chunk); on an H200, NVFP4 evictions
            streamed at 3.25x the raw PCIe figure in batches of 256 and 2.6x in batches of 64
            (docs/benchmarks.md, Tiers).
        chunk_pages: pages per pipelined chunk of a batch (two staging buffers of this many
            pages per direction; chunk k's copy overlaps chunk k+1's encode/decode). Default:
            about 16 MiB of host slots (``transfer.default_chunk_pages``); ``>= batch_pages``:
            no pipelining within a batch.
    """

    def __init__(self, pool: PoolView | PagePool, namespace: Namespace, host_bytes: int = 1 << 30,
                 disk: Tier | None = None, write_through: bool = False,
                 batch_pages: int = 256, attach: bool = True, chunk_pages: int | None = None,
                 remote: Tier | None = None, flush_after_s: float = 0.1):
        view = pool if isinstance(pool, PoolView) else PoolView.of(pool)
        if namespace.page_size != view.page_size:
            raise ValueError(f"namespace page_size {namespace.page_size} != pool page_size "
                             f"{view.page_size}")
        if not isinstance(batch_pages, int) or batch_pages <= 0:
            raise ValueError(f"batch_pages must be a positive integer, got {batch_pages!r}")
        for what, t in (("disk", disk), ("remote", remote)):
            if t is not None and not isinstance(t, Tier):
                raise ValueError(f"{what} must implement the Tier protocol (exists/get/put/"
                                 f"delete/touch/counters/close), got {type(t).__name__}")
        if disk is not None and remote is not None and disk.name == remote.name:
            raise ValueError(f"disk and remote are both tiers named {disk.name!r}; their "
                             f"counters would mix")
        self.view = view
        self.namespace = namespace.with_salt(None)
        self.ns_digest = self.namespace.digest
        self.specs = view.specs
        self.names = [g.name for g in self.specs]
        self.codecs = [get_codec(g.codec) for g in self.specs]
        pin = view.device.type == "cuda" and torch.cuda.is_available()
        self.host = HostTier(self.specs, self.codecs, view.page_size, host_bytes, pin=pin)
        if self.host.num_slots == 0:
            raise ValueError("the tier stack needs a host tier of at least one page slot "
                             f"({self.host.slot_bytes} bytes): it stages every transfer")
        self.batch = min(batch_pages, self.host.num_slots)
        self.mover = Mover(view, self.host, self.codecs, self.batch, chunk_pages)
        self.disk = disk
        self.remote = remote
        #: the lower tiers, nearest first
        self.lower: list[Tier] = [t for t in (disk, remote) if t is not None]
        self.write_through = write_through
        self._wt_queue: list[PageInfo] = []
        self._wt_since = 0.0
        self.flush_after_s = flush_after_s
        self._counters = dict.fromkeys(_COUNTERS, 0)
        for name in ("disk", *(t.name for t in self.lower)):
            self._counters.update(dict.fromkeys((c.format(name) for c in _TIER_COUNTERS), 0))
        #: pages per tier of the last :meth:`load_prefix` (``{"host": n, "disk": n, ...}``)
        self.last_load: dict[str, int] = {}
        self._closed = False
        if attach and isinstance(pool, PagePool):
            self.attach(pool)

    @classmethod
    def from_config(cls, pool: PoolView | PagePool, namespace: Namespace, spec: dict
                    ) -> "TierManager":
        """The tiers ``CacheConfig(tiers=dict(...))`` describes, checked now (a bad value is a
        ValueError naming the key). Keys (:data:`CONFIG_KEYS`):

        - ``host_bytes`` (int, default 1 GiB), ``write_through`` (bool), ``batch_pages``,
          ``chunk_pages``: as in the constructor;
        - ``disk``: a directory (str / PathLike; opened as a :class:`DiskTier` of ``disk_bytes``,
          default 16 GiB) or an open :class:`DiskTier`;
        - ``remote``: a ``redis://[user:password@]host:port/db`` URL (``rediss://`` for TLS;
          a Redis Cluster is detected) or a :class:`Tier`; ``remote_options``: keyword
          arguments of :class:`~kvstrata.tiers.remote.RemoteTier` (timeouts, retries, prefix).
          A server that cannot be reached now leaves the engine without the remote tier, said
          once in the log; a malformed URL is a ValueError.
        """
        if not isinstance(spec, dict):
            raise ValueError(f"CacheConfig.tiers must be a dict of {', '.join(CONFIG_KEYS)}, "
                             f"got {type(spec).__name__}")
        unknown = sorted(set(spec) - set(CONFIG_KEYS))
        if unknown:
            raise ValueError(f"CacheConfig.tiers: unknown key(s) {unknown}; valid keys: "
                             f"{', '.join(CONFIG_KEYS)}")
        kw = {k: spec[k] for k in ("host_bytes", "write_through", "batch_pages", "chunk_pages")
              if k in spec}
        if "write_through" in kw and not isinstance(kw["write_through"], bool):
            raise ValueError(f"CacheConfig.tiers['write_through'] must be a bool, got "
                             f"{kw['write_through']!r}")
        disk = spec.get("disk")
        opened: DiskTier | None = None
        if isinstance(disk, (str, os.PathLike)):
            cap = spec.get("disk_bytes", 16 << 30)
            if not isinstance(cap, int) or isinstance(cap, bool) or cap <= 0:
                raise ValueError(f"CacheConfig.tiers['disk_bytes'] must be a positive number of "
                                 f"bytes, got {cap!r}")
            disk = opened = DiskTier(disk, map_size=max(2 * cap, 1 << 26), capacity_bytes=cap)
        elif "disk_bytes" in spec:
            raise ValueError("CacheConfig.tiers['disk_bytes'] sizes a disk tier given as a path; "
                             "an open DiskTier has its own capacity")
        elif disk is not None and not isinstance(disk, DiskTier):
            raise ValueError(f"CacheConfig.tiers['disk'] must be a directory path or a DiskTier, "
                             f"got {type(disk).__name__}")
        remote = None
        try:
            remote = _remote_from_config(spec.get("remote"), spec.get("remote_options"),
                                         namespace.with_salt(None).digest)
            return cls(pool, namespace, disk=disk, remote=remote, **kw)
        except BaseException:
            # what this call opened is closed again; tiers the caller passed in stay open
            if opened is not None:
                opened.close()
            if remote is not None and isinstance(spec.get("remote"), str):
                remote.close()
            raise

    def attach(self, pool: PagePool) -> None:
        """Subscribe to a :class:`PagePool`'s eviction (and, with write-through, hashing) hooks."""
        pool.on_evict = self.on_evict
        if self.write_through:
            pool.on_hashed = self.on_hashed

    @staticmethod
    def slot_bytes_for(pool: PoolView | PagePool) -> int:
        """Host bytes one page takes (every group's largest encoded payload, aligned): size
        ``host_bytes`` as a multiple of this."""
        specs = pool.specs if isinstance(pool, PoolView) else list(pool.groups)
        codecs = [get_codec(g.codec) for g in specs]
        return slot_layout(specs, codecs, pool.page_size)[2]

    # -- demotion ---------------------------------------------------------------------------------
    def on_evict(self, infos: list[PageInfo]) -> None:
        """Eviction hook: copy evicted pages (content intact during the call) down."""
        self._flush_write_through()
        self._demote(infos)

    def on_hashed(self, info: PageInfo) -> None:
        """Hashing hook (write-through): queue a freshly hashed page; written in batches."""
        if not self._wt_queue:
            self._wt_since = time.monotonic()
        self._wt_queue.append(info)
        if (len(self._wt_queue) >= self.batch
                or time.monotonic() - self._wt_since >= self.flush_after_s):
            self._flush_write_through()

    def flush(self) -> None:
        """Finish queued write-through pages and pending copies; persist disk access order."""
        self._flush_write_through()
        self.host.settle()
        if isinstance(self.disk, DiskTier):
            self.disk.flush()

    def _flush_write_through(self) -> None:
        if not self._wt_queue:
            return
        # A queued page is still in the pool and indexed: it can only leave through on_evict,
        # which flushes this queue first, so its content is intact here. A page the engine
        # replaced meanwhile (its index moved) is skipped.
        q, self._wt_queue = self._wt_queue, []
        if self.view.lookup is not None:
            q = [i for i in q if self.view.lookup(i.hash) == i.page_id]
        self._demote(q)
        self.host.settle()
        entries = [self.host.entry(i.hash) for i in q]
        self._write_lower([e for e in entries if e is not None and not e.on_disk])

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
                self._counters["dropped_pages"] += len(chunk) - len(slots)
                chunk = chunk[:len(slots)]
                if not chunk:
                    continue
            entries, ev, refused = self.mover.demote(self.ns_digest, chunk, slots)
            self.host.add(entries, ev, refused)
            self._counters["d2h_pages"] += len(entries)
            self._counters["d2h_bytes"] += sum(e.nbytes for e in entries)

    def drain_host(self) -> int:
        """Write every host page the lower tiers lack down and empty the host tier (shutdown,
        or to make a restart find everything). Returns how many host pages were drained."""
        self._flush_write_through()
        self.host.settle()
        victims = self.host.evict_all()
        self._spill(victims)
        self.host.give_back(v.slot for v in victims)
        return len(victims)

    def write_back(self, pages: Sequence[PageInfo] | None = None) -> int:
        """Write every device page whose content is final (``pages``, default: the view's
        ``hashed_pages()``) and every host page down to the lower tiers (disk, remote), keeping
        them where they are; ``LLM.close()`` calls it so that a restart, or another engine,
        finds everything. Device pages pass through the host (as evictions do). Returns how
        many pages some lower tier newly stored; 0 without lower tiers (nothing to do)."""
        if not self.lower:
            return 0
        self._flush_write_through()
        if pages is None:
            pages = self.view.hashed_pages() if self.view.hashed_pages is not None else []
        before = sum(self._counters[f"host_to_{t.name}_pages"] for t in self.lower)
        self._demote(list(pages))
        self.host.settle()
        entries = [self.host.entry(h) for h in self.host.lru()]
        self._write_lower([e for e in entries if e is not None and not e.on_disk])
        self.flush()
        return sum(self._counters[f"host_to_{t.name}_pages"] for t in self.lower) - before

    def _spill(self, victims: list[HostEntry]) -> None:
        """Host evictions: write the ones the lower tiers lack (write-back); then their slots
        may be reused."""
        self._counters["host_evictions"] += len(victims)
        if not victims:
            return
        if not self.lower:
            self._counters["dropped_pages"] += len(victims)
            return
        self._write_lower(victims)

    def _write_lower(self, entries: Sequence[HostEntry]) -> None:
        """Write host entries as records to every lower tier that lacks them (one ``exists``
        and one ``put`` batch per tier); an entry no tier holds afterwards is counted dropped."""
        if not entries or not self.lower:
            return
        keys = [e.info.hash for e in entries]
        held = [0] * len(entries)
        need: list[list[int]] = []
        for t in self.lower:
            have = t.exists(keys)
            need.append([j for j, h in enumerate(have) if not h])
            for j, h in enumerate(have):
                held[j] += bool(h)
        todo = sorted(set().union(*need))
        records = dict(zip(todo, self.host.records([entries[j] for j in todo])))
        for t, js in zip(self.lower, need):
            if not js:
                continue
            ok = t.put([(keys[j], records[j]) for j in js])
            stored = [j for j, o in zip(js, ok) if o]
            for j in stored:
                held[j] += 1
            self._counters[f"host_to_{t.name}_pages"] += len(stored)
            self._counters[f"host_to_{t.name}_bytes"] += sum(
                sum(len(p) for p in records[j]) for j in stored)
            self._counters[f"{t.name}_put_failures"] += len(js) - len(stored)
        for e, n in zip(entries, held):
            e.on_disk = n == len(self.lower)
            if not n:
                self._counters["dropped_pages"] += 1

    # -- promotion ----------------------------------------------------------------------------------
    def _check_ns(self, namespace: Namespace) -> None:
        diffs = namespace_differences(namespace.shared_fields(), self.namespace.shared_fields(),
                                      "the caller", "the tier manager")
        if diffs:
            raise ValueError(f"namespace differs from the tier manager's: {'; '.join(diffs)}")

    def lookup_prefix(self, namespace: Namespace, hashes: Sequence[bytes]) -> int:
        """Consecutive pages from ``hashes[0]`` found in the host or a lower tier (one
        ``exists`` batch per lower tier)."""
        self._check_ns(namespace)
        self._flush_write_through()
        self.host.settle()
        n = leading(self.host.exists(hashes))
        self._counters["host_hits"] += n
        rest = list(hashes[n:])
        if not rest:
            return n
        self._counters["host_misses"] += 1
        if not self.lower:
            return n
        # Past the host's run, later pages may sit on any tier: check each, page by page.
        flags = [t.exists(rest) for t in self.lower]
        for j, h in enumerate(rest):
            where = next((t.name for t, f in zip(self.lower, flags) if f[j]), None)
            if where is None and self.host.entry(h) is not None:
                where = "host"
            if where is None:
                for t in self.lower:
                    self._counters[f"{t.name}_misses"] += 1
                break
            self._counters[f"{where}_hits"] += 1
            n += 1
        return n

    def load_prefix(self, namespace: Namespace, pages: Sequence[PageKey],
                    page_ids: Sequence[int]) -> int:
        """Decode ``pages`` into device pages ``page_ids``; returns the verified leading count
        (:attr:`last_load` says how many came from each tier)."""
        self._check_ns(namespace)
        if len(pages) != len(page_ids):
            raise ValueError(f"load_prefix got {len(pages)} pages and {len(page_ids)} page ids")
        self.host.settle()
        self.last_load = {}
        done = 0
        for k in range(0, len(pages), self.batch):
            chunk = list(pages[k:k + self.batch])
            entries = self._stage(chunk)
            if entries:
                self.mover.promote(entries, page_ids[k:k + len(entries)])
                self._counters["h2d_pages"] += len(entries)
                self._counters["h2d_bytes"] += sum(e.nbytes for e in entries)
            done += len(entries)
            if len(entries) < len(chunk):
                break
        return done

    def _stage(self, chunk: list[PageKey]) -> list[HostEntry]:
        """Host entries for the leading pages of ``chunk``, reading the missing ones from the
        lower tiers."""
        keep = frozenset(i.hash for i in chunk)
        entries: list[HostEntry | None] = []
        for info in chunk:
            e = self.host.entry(info.hash)
            entries.append(e if e is not None and e.info.token_ids == tuple(info.token_ids)
                           and e.ns == self.ns_digest else None)
        lead = leading([e is not None for e in entries])
        self.last_load["host"] = self.last_load.get("host", 0) + lead
        missing = [j for j, e in enumerate(entries) if e is None]
        if missing and self.lower:
            got = self._from_lower([chunk[j] for j in missing], keep)
            for j, e in zip(missing, got):
                entries[j] = e
        out = []
        for e in entries:
            if e is None:
                break
            out.append(e)
        self.host.touch(e.info.hash for e in out)
        return out

    def _from_lower(self, infos: list[PageKey], keep: frozenset[bytes]
                    ) -> list[HostEntry | None]:
        """Read, verify and copy records into host slots, each from the nearest tier holding
        it. Stops at the first page no tier holds or whose record fails (deleted there)."""
        slots, victims = self.host.take_slots(len(infos), keep)
        self._spill(victims)
        self.mover.fence_host_writes()
        infos = infos[:len(slots)]
        found: list[tuple[Tier, Parts] | None] = [None] * len(infos)
        todo = list(range(len(infos)))
        for t in self.lower:
            if not todo:
                break
            got = t.get([infos[j].hash for j in todo])
            todo = [j for j, parts in zip(todo, got) if parts is None
                    or found.__setitem__(j, (t, parts))]
        out: list[HostEntry] = []
        bad: dict[str, list[bytes]] = {}
        served: dict[str, list[bytes]] = {}
        for info, slot, hit in zip(infos, slots, found):
            if hit is None:
                break
            t, parts = hit
            try:
                rec = verify_record(parts, self.ns_digest, info, self.specs, self.codecs,
                                    self.view.page_size)
                e = self.host.fill(slot, info, self.ns_digest, rec)
            except CorruptPageError as err:
                key = "mismatches" if isinstance(err, RecordMismatch) else "checksum_failures"
                self._counters[key] += 1
                log.warning("%s tier: page %s is unusable (%s); deleted", t.name,
                            info.hash.hex(), err)
                bad.setdefault(t.name, []).append(info.hash)
                break
            e.on_disk = len(self.lower) == 1
            out.append(e)
            served.setdefault(t.name, []).append(info.hash)
            self._counters[f"{t.name}_to_host_pages"] += 1
            self._counters[f"{t.name}_to_host_bytes"] += sum(len(p) for p in rec.payloads)
        self.host.give_back(slots[len(out):])
        self.host.add(out)
        for t in self.lower:
            if t.name in bad:
                t.delete(bad[t.name])
            if t.name in served:
                t.touch(served[t.name])
                self.last_load[t.name] = self.last_load.get(t.name, 0) + len(served[t.name])
        return out + [None] * (len(infos) - len(out))

    # -- reporting --------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters per tier and direction, codec time, disk errors and evictions.

        Host-side byte counts (``host_bytes``, ``d2h_bytes``, ``h2d_bytes``) are the bytes in
        host slots: raw for groups whose CPU codec runs at the boundary to the lower tiers
        (``lossless``); ``host_to_disk_bytes`` / ``disk_to_host_bytes`` (and ``remote``'s) are
        record payload bytes (encoded). ``encode_s`` / ``decode_s`` include that boundary's CPU
        codec time. ``remote_*`` keys (``remote_errors``, ...) are the remote tier's own
        counters."""
        out = dict(self._counters)
        hs = self.host.counters()
        out["unencodable_pages"] = hs["rejected_pages"]
        out["d2h_pages"] -= hs["rejected_pages"]
        out["d2h_bytes"] -= hs["rejected_bytes"]
        out.update(self.mover.collect_timings())
        out["decode_s"] += hs["decode_s"]
        out["encode_s"] += hs["encode_s"]
        out["host_pages"] = hs["pages"]
        out["host_bytes"] = hs["stored_bytes"]
        out["host_capacity_bytes"] = hs["capacity_bytes"]
        if isinstance(self.disk, DiskTier):
            d = self.disk.counters()
            out.update({"disk_pages": len(self.disk), "disk_bytes": self.disk.stored_bytes(),
                        "disk_evictions": d["evictions"], "disk_write_errors": d["write_errors"],
                        "disk_deleted": d["deleted"]})
        elif self.disk is not None:
            out.update({f"disk_{k}": v for k, v in self.disk.counters().items()})
        if self.remote is not None:
            out.update({f"remote_{k}": v for k, v in self.remote.counters().items()})
        return out

    def close(self) -> None:
        """Write host pages down (write-back would lose them otherwise), then close the lower
        tiers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.lower:
            self.drain_host()
            self.flush()
        for t in self.lower:
            t.close()

    def __repr__(self) -> str:
        disk = os.fspath(self.disk.path) if isinstance(self.disk, DiskTier) else self.disk
        return (f"TierManager(host={len(self.host)}/{self.host.num_slots} slots, disk={disk!r}, "
                f"remote={self.remote!r}, write_through={self.write_through})")


def _remote_from_config(remote, options, ns_digest: bytes) -> Tier | None:
    """``CacheConfig.tiers['remote']``: a URL (connected now; unreachable: ``None``, logged
    once) or a Tier."""
    if remote is None:
        if options is not None:
            raise ValueError("CacheConfig.tiers['remote_options'] needs a 'remote' URL")
        return None
    if isinstance(remote, str):
        from .remote import RemoteTier    # redis-py is imported only when a remote is configured
        return RemoteTier.connect(remote, ns_digest, **dict(options or {}))
    if options is not None:
        raise ValueError("CacheConfig.tiers['remote_options'] applies to a URL; a Tier object "
                         "carries its own options")
    if not isinstance(remote, Tier):
        raise ValueError(f"CacheConfig.tiers['remote'] must be a redis:// or rediss:// URL or a "
                         f"Tier, got {type(remote).__name__}")
    return remote
