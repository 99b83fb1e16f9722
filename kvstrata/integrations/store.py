"""PageStore: kvstrata's lower tiers as a page store for an outside engine.

An engine (vLLM, SGLang) keeps its own device KV cache and its own scheduler; what it borrows from
kvstrata is everything below the device: the tiers (host, disk, remote; any
:class:`~kvstrata.tiers.protocol.Tier`), the self-describing record (namespace digest, chain hash,
parent, token ids, per-group codec, CRCs) and the per-group codecs. ``PageStore`` is that borrowed
part with no policy beyond write-through:

- :meth:`lookup` answers how many leading pages of a hash chain some tier holds (cheap: no payload
  moves; a later :meth:`load` may still fail, which the engine must handle as a recompute);
- :meth:`save` encodes pages read through a :class:`~kvstrata.pagepool.PoolView` with each group's
  codec and puts one record per page into *every* tier;
- :meth:`load` gets records tier by tier (first tier first), verifies each against the page it
  must be (:func:`~kvstrata.tiers.record.verify_record`: namespace, chain link, token ids, codec,
  shape, header and payload CRCs), decodes and writes the longest verified prefix into the view.
  A record that fails verification is counted, deleted from the tier that held it, and read from
  the next tier if one has it; otherwise the load stops there and the caller recomputes the rest.
  A page found in a lower tier is copied into the tiers above it (promotion).

Records carry the digest of the *unsalted* namespace; a request's ``cache_salt`` is bound by the
chain hashes themselves (the keys), exactly as :class:`~kvstrata.tiers.TierManager` does, so the
records an engine writes read back in kvstrata's own engine and in ``kvstrata inspect``.
"""

from __future__ import annotations

import logging
import threading
from functools import wraps
from typing import Sequence

import torch

from ..codecs import CorruptPageError, UnencodablePageError, get_codec
from ..pagepool import Namespace, PageKey, PoolView
from ..tiers import HostTier
from ..tiers.protocol import Tier, leading
from ..tiers.record import build_record, verify_record

log = logging.getLogger(__name__)

COUNTERS = ("lookups", "lookup_pages", "saved_pages", "saved_bytes", "save_failures",
            "unencodable_pages", "loaded_pages", "loaded_bytes", "load_misses", "corrupt_records",
            "promoted_pages")


def _locked(method):
    @wraps(method)
    def run(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return run


class PageStore:
    """Write-through page store over ``tiers`` (searched in order on a load).

    Args:
        namespace: what the pages' bytes depend on (models, groups with their codecs, page size);
            its ``cache_salt`` is ignored here: callers hash each request under
            ``namespace.with_salt(request_salt)``.
        tiers: the tiers, fastest first (e.g. host, disk, remote). None at all is allowed (a
            remote tier that could not be reached): every lookup then misses.
    """

    def __init__(self, namespace: Namespace, tiers: Sequence[Tier]):
        for t in tiers:
            if not isinstance(t, Tier):
                raise ValueError(f"{type(t).__name__} does not implement the Tier protocol "
                                 f"(exists/get/put/delete/touch/counters/close)")
        self.namespace = namespace.with_salt(None)
        self.ns_digest = self.namespace.digest
        self.specs = list(self.namespace.groups)
        self.names = [s.name for s in self.specs]
        self.codecs = [get_codec(s.codec) for s in self.specs]
        self.page_size = self.namespace.page_size
        self.tiers = list(tiers)
        self.counters = dict.fromkeys(COUNTERS, 0)
        # One store may serve an engine's scheduler and its worker (the same process); the tiers
        # are not thread-safe, so calls are serialized.
        self._lock = threading.RLock()

    # -- queries --------------------------------------------------------------------------------
    @_locked
    def lookup(self, hashes: Sequence[bytes]) -> int:
        """How many leading pages of ``hashes`` some tier holds (per page: any tier)."""
        self.counters["lookups"] += 1
        present = [False] * len(hashes)
        for t in self.tiers:
            n = leading(present)
            if n == len(present):
                break
            todo = [i for i in range(n, len(hashes)) if not present[i]]
            for i, ok in zip(todo, t.exists([hashes[i] for i in todo])):
                present[i] = present[i] or ok
        n = leading(present)
        self.counters["lookup_pages"] += n
        return n

    # -- save -----------------------------------------------------------------------------------
    @_locked
    def save(self, view: PoolView, page_ids: Sequence[int], infos: Sequence[PageKey]
             ) -> list[bool]:
        """Encode pages ``page_ids`` of ``view`` (holding the pages ``infos``) and put them into
        every tier. Per page: whether some tier stored it."""
        if len(page_ids) != len(infos):
            raise ValueError(f"save: {len(page_ids)} page ids for {len(infos)} pages")
        if not infos:
            return []
        self._check_view(view)
        items = self._records(view, page_ids, infos)
        stored = self._put(items, self.tiers)
        n = sum(stored)
        self.counters["saved_pages"] += n
        self.counters["saved_bytes"] += sum(_nbytes(parts) for (_, parts), ok in zip(items, stored)
                                            if ok)
        self.counters["save_failures"] += len(items) - n
        ok = dict(zip((h for h, _ in items), stored))
        return [ok.get(info.hash, False) for info in infos]

    def _records(self, view: PoolView, page_ids: Sequence[int], infos: Sequence[PageKey]
                 ) -> list[tuple[bytes, list]]:
        ids = torch.as_tensor(list(page_ids), dtype=torch.int64, device=view.device)
        # [n, L, 2, H, P, D] per group, on the host (codecs' CPU paths and the CRCs need it there)
        pages = [view.read(g, ids).cpu() for g in range(len(self.specs))]
        items = []
        for i, info in enumerate(infos):
            try:
                encs = [c.encode(pages[g][i]).to_host() for g, c in enumerate(self.codecs)]
            except UnencodablePageError as e:
                # e.g. NVFP4 refuses non-finite values: such a page is not stored (never stored
                # wrong); the engine recomputes it when it is needed again.
                self.counters["unencodable_pages"] += 1
                log.debug("page %s not stored: %s", info.hash.hex(), e)
                continue
            items.append((info.hash, build_record(self.ns_digest, info, self.names, encs,
                                                  [e.payload.numpy().data for e in encs])))
        return items

    @staticmethod
    def _put(items: Sequence[tuple[bytes, Sequence]], tiers: Sequence[Tier]) -> list[bool]:
        stored = [False] * len(items)
        if items:
            for t in tiers:
                for j, ok in enumerate(t.put(items)):
                    stored[j] = stored[j] or ok
        return stored

    # -- load -----------------------------------------------------------------------------------
    @_locked
    def load(self, view: PoolView, page_ids: Sequence[int], infos: Sequence[PageKey]) -> int:
        """Write the longest verified prefix of the pages ``infos`` into ``page_ids`` of ``view``.

        Returns how many leading pages were written; pages from there on were not touched and
        must be recomputed by the caller.
        """
        if len(page_ids) != len(infos):
            raise ValueError(f"load: {len(page_ids)} page ids for {len(infos)} pages")
        if not infos:
            return 0
        self._check_view(view)
        found: list[list[torch.Tensor] | None] = [None] * len(infos)
        # page index -> (tier index, verified record parts): pages from a lower tier go up
        lower: dict[int, tuple[int, Sequence]] = {}
        for ti, t in enumerate(self.tiers):
            todo = [i for i in range(leading([f is not None for f in found]), len(infos))
                    if found[i] is None]
            if not todo:
                break
            got = t.get([infos[i].hash for i in todo])
            # the host tier keeps a CPU-only lossless group raw: its records say identity
            codecs = t.host_codecs if isinstance(t, HostTier) else self.codecs
            bad = []
            for i, parts in zip(todo, got):
                if parts is None:
                    continue
                try:
                    rec = verify_record(parts, self.ns_digest, infos[i], self.specs, codecs,
                                        self.page_size)
                    found[i] = [c.decode(e) for c, e in zip(codecs, rec.encoded())]
                except CorruptPageError as e:
                    self.counters["corrupt_records"] += 1
                    log.warning("kvstrata: %s tier record %s failed verification (%s); "
                                "counted as a miss and deleted", t.name, infos[i].hash.hex(), e)
                    bad.append(infos[i].hash)
                    continue
                self.counters["loaded_bytes"] += rec.nbytes
                if ti:
                    lower[i] = (ti, parts)
            if bad:
                t.delete(bad)
            t.touch([infos[i].hash for i in todo if found[i] is not None])
        n = leading([f is not None for f in found])
        self.counters["load_misses"] += len(infos) - n
        if n:
            ids = torch.as_tensor(list(page_ids[:n]), dtype=torch.int64, device=view.device)
            for g in range(len(self.specs)):
                view.write(g, ids, torch.stack([found[i][g] for i in range(n)]))
            self.counters["loaded_pages"] += n
        for ti in range(1, len(self.tiers)):
            # verified bytes go up as they are: no re-encode
            items = [(infos[i].hash, parts) for i, (f, parts) in lower.items() if f == ti and i < n]
            self.counters["promoted_pages"] += sum(self._put(items, self.tiers[:ti]))
        return n

    def _check_view(self, view: PoolView) -> None:
        if view.page_size != self.page_size or [g.spec.fingerprint_fields() for g in view.groups] \
                != [s.fingerprint_fields() for s in self.specs]:
            raise ValueError(f"PoolView groups {[g.spec for g in view.groups]} (page size "
                             f"{view.page_size}) differ from the store's {self.specs} (page size "
                             f"{self.page_size})")

    # -- bookkeeping ----------------------------------------------------------------------------
    @_locked
    def stats(self) -> dict:
        return {"store": dict(self.counters), **{t.name: t.counters() for t in self.tiers}}

    @_locked
    def close(self) -> None:
        for t in self.tiers:
            t.close()


def _nbytes(parts: Sequence) -> int:
    return sum(memoryview(p).nbytes for p in parts)
