"""StoreConfig: which tiers an engine integration stores pages in, and the process's open stores.

An engine passes a plain dict (vLLM's ``kv_connector_extra_config``, SGLang's
``--hicache-storage-backend-extra-config``); :meth:`StoreConfig.from_dict` validates it with one
actionable error per bad key. Keys:

=================  ===========================================================================
``host_bytes``     host tier capacity in bytes (0: none). Default 0.
``disk_path``      directory of a disk tier (created if missing). Default: none.
``disk_bytes``     disk tier capacity in bytes. Default 8 GiB.
``remote_url``     ``redis://host:port/db`` (``rediss://`` for TLS) of a shared remote tier.
``remote_prefix``  key prefix in the remote tier. Default ``"kvstrata"``.
``codec``          codec of the model's K/V pages: ``lossless`` (default, bit-exact),
                   ``identity`` or ``nvfp4`` (lossy, 3.56x smaller than bf16).
``fingerprint``    the model fingerprint bound into every key (default: the engine's model name
                   and revision); set it when two model names mean the same weights.
=================  ===========================================================================
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, fields
from typing import Any

from ..codecs import available_codecs, get_codec
from ..pagepool import Namespace
from ..tiers import DiskTier, HostTier, Tier
from .store import PageStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreConfig:
    host_bytes: int = 0
    disk_path: str | None = None
    disk_bytes: int = 8 << 30
    remote_url: str | None = None
    remote_prefix: str = "kvstrata"
    codec: str = "lossless"
    fingerprint: str | None = None

    def __post_init__(self) -> None:
        for name in ("host_bytes", "disk_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"kvstrata: {name} must be a number of bytes >= 0, got {v!r}")
        if self.disk_path is not None and (not isinstance(self.disk_path, str) or not self.disk_path):
            raise ValueError(f"kvstrata: disk_path must be a directory path, got {self.disk_path!r}")
        if self.disk_path is not None and self.disk_bytes < (1 << 20):
            raise ValueError(f"kvstrata: disk_bytes={self.disk_bytes} is below 1 MiB; give the "
                             f"disk tier room for at least a few pages")
        if self.remote_url is not None:
            from ..tiers.remote import check_url
            check_url(self.remote_url)
        if self.codec not in available_codecs():
            raise ValueError(f"kvstrata: codec {self.codec!r} is unknown; use one of "
                             f"{available_codecs()}")
        if not (self.host_bytes or self.disk_path or self.remote_url):
            raise ValueError("kvstrata: no tier configured; set at least one of host_bytes, "
                             "disk_path, remote_url")

    def namespace(self, default_fingerprint: str, groups, page_size: int, shard: str = ""
                  ) -> Namespace:
        """The namespace of an engine's pages: the model fingerprint (``fingerprint`` or the
        engine's), the groups and the page size. The groups' codecs are bound too (a group spec's
        fingerprint leaves them out): a record of another codec would fail a reader's codec check
        and be deleted as a mismatch, so engines configured with different codecs on one shared
        tier keep apart instead of removing each other's records. ``shard`` names the part of
        the model's KV a rank holds (tensor parallelism), when it is not all of it."""
        codecs = ",".join(f"{g.name}={g.codec}" for g in groups)
        target = f"{self.fingerprint or default_fingerprint}|{codecs}" + (f"|{shard}" if shard
                                                                          else "")
        return Namespace(target, tuple(groups), page_size)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "StoreConfig":
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"kvstrata: unknown option(s) {unknown}; known: {sorted(known)}")
        return cls(**d)


def open_tiers(cfg: StoreConfig, namespace: Namespace) -> list[Tier]:
    """The configured tiers, fastest first. A remote server that cannot be reached now is left
    out (said once in the log): the engine runs on the other tiers, or none."""
    tiers: list[Tier] = []
    try:
        if cfg.host_bytes:
            specs = list(namespace.groups)
            tiers.append(HostTier(specs, [get_codec(g.codec) for g in specs],
                                  namespace.page_size, cfg.host_bytes))
        if cfg.disk_path is not None:
            tiers.append(_open_disk(cfg))
        if cfg.remote_url is not None:
            from ..tiers.remote import RemoteTier    # redis-py only when a remote is configured
            remote = RemoteTier.connect(cfg.remote_url, namespace.with_salt(None).digest,
                                        prefix=cfg.remote_prefix)
            if remote is not None:
                tiers.append(remote)
    except BaseException:
        for t in tiers:
            t.close()
        raise
    return tiers


def _open_disk(cfg: StoreConfig) -> DiskTier:
    path = os.path.abspath(cfg.disk_path)
    try:
        # the map is address space, not disk: LMDB wants room for copy-on-write
        return DiskTier(path, map_size=2 * cfg.disk_bytes, capacity_bytes=cfg.disk_bytes)
    except ValueError as e:
        if "another DiskTier" not in str(e):
            raise
    # One writer per disk tier: a second engine on this machine reads what the first wrote.
    log.warning("kvstrata: disk tier %s has another writer; this process opens it read-only "
                "(hits are served, new pages are not written there)", path)
    return DiskTier(path, readonly=True)


# An engine's scheduler-side and worker-side objects live in one process for a single-device
# engine (vLLM's EngineCore with its in-process executor): both must use *one* store, because LMDB
# allows one open environment per file per process and a host tier is only visible through the
# object that holds it. Stores are shared by configuration and namespace, refcounted.
_stores: dict[tuple, list] = {}
_stores_lock = threading.Lock()


def acquire_store(cfg: StoreConfig, namespace: Namespace) -> PageStore:
    key = (cfg, namespace.with_salt(None).digest)
    with _stores_lock:
        entry = _stores.get(key)
        if entry is None:
            entry = _stores[key] = [PageStore(namespace, open_tiers(cfg, namespace)), 0]
        entry[1] += 1
        return entry[0]


def release_store(store: PageStore) -> None:
    with _stores_lock:
        for key, entry in list(_stores.items()):
            if entry[0] is store:
                entry[1] -= 1
                if entry[1] == 0:
                    del _stores[key]
                    store.close()
                return
