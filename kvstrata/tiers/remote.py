"""The remote tier: page records in Redis 7 (standalone or Redis Cluster), shared by engines.

Values are the disk tier's record bytes (header, per-group payloads, CRCs: :mod:`.record`), one
value per page, keyed ``<prefix>:<namespace digest hex>:<page hash hex>`` (the digest of the
unsalted namespace: models, groups, page size, layout; the salt is bound by the chain hash). Keys
spread over a cluster's nodes by Redis' own slot hashing. Every batch is one pipeline (no
transaction: each command stands alone), so a batch of pages costs one round trip per node.

Nothing read back is trusted: the :class:`~kvstrata.tiers.manager.TierManager` verifies each
record against the page it asked for (namespace, hash link, tokens, codec, CRCs), so a value
overwritten with garbage or another namespace's record is a counted miss that is deleted, never
decoded. A ``SET`` replaces a value atomically: two engines writing the same page leave one whole
record, and a reader gets the old one, the new one, or nothing.

Sizing belongs to the server: give it ``maxmemory`` and ``maxmemory-policy allkeys-lru`` (the
least recently read pages go first; a ``GET`` refreshes a key's clock, so :meth:`touch` has
nothing to do). kvstrata never changes a server's configuration; it logs once when the server
has no memory limit or a policy that refuses writes when full (then writes fail and are
counted).

Faults never reach the engine: a refused connection, a timeout, a server killed in the middle of
a batch, a cluster that is down are counted (``errors``), reads answer misses and writes fail
(``put_failures``). After a connection fault the tier stays quiet for ``retry_after_s`` (calls
answer at once, counted as ``skipped``) and then tries again; redis-py reconnects by itself. The
first fault of an outage is logged, and so is the recovery.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterator, Sequence
from urllib.parse import urlsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from .protocol import Parts, check_key, new_counters, record_nbytes

log = logging.getLogger(__name__)

#: Faults that mean the server (or a node) is not reachable now.
_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError, RedisClusterException)
_FAULTS = (RedisError, OSError, RedisClusterException)
_GOOD_POLICIES = ("allkeys-lru", "allkeys-lfu", "allkeys-random")


class RemoteUnavailable(ConnectionError):
    """The server could not be reached when the tier was opened."""


def redact(url: str) -> str:
    """``url`` without its password (for logs and reprs)."""
    u = urlsplit(url)
    if u.password is None:
        return url
    netloc = f"{u.username or ''}:***@{u.hostname}" + (f":{u.port}" if u.port else "")
    return u._replace(netloc=netloc).geturl()


def check_url(url: object) -> str:
    """A ``redis://[user:password@]host:port/db`` (``rediss://``: TLS) URL, or ValueError."""
    if not isinstance(url, str):
        raise ValueError(f"the remote tier takes a redis:// URL, got {type(url).__name__}")
    u = urlsplit(url)
    if u.scheme not in ("redis", "rediss"):
        raise ValueError(f"remote tier URL {redact(url)!r}: the scheme must be redis:// or "
                         f"rediss:// (TLS)")
    try:
        port = u.port
    except ValueError:
        raise ValueError(f"remote tier URL {redact(url)!r}: the port is not a number") from None
    if not u.hostname:
        raise ValueError(f"remote tier URL {redact(url)!r} names no host "
                         f"(redis://host:port/db)")
    db = u.path.strip("/")
    if db and not db.isdigit():
        raise ValueError(f"remote tier URL {redact(url)!r}: the database must be a number, "
                         f"got {db!r}")
    del port
    return url


class RemoteTier:
    """A :class:`~kvstrata.tiers.protocol.Tier` on a Redis server or Redis Cluster.

    Args:
        url: ``redis://[user:password@]host:port/db`` (``rediss://`` for TLS). A cluster is
            detected (``cluster_enabled``) unless ``cluster`` says which.
        namespace_digest: the unsalted namespace digest every key carries; ``None`` opens the
            tier for inspection only (:meth:`scan` / :meth:`get_raw`; the protocol methods
            refuse).
        prefix: first key field (several deployments may share a server).
        socket_timeout, connect_timeout: seconds a command / a connection may take.
        retries: retries of a command after a connection fault (exponential backoff).
        retry_after_s: after a connection fault, answer at once (misses, failed writes) for
            this long before trying the server again.
        get_batch: keys per ``GET`` pipeline (bounds the bytes one round trip carries).
        put_batch_bytes: record bytes per ``SET`` pipeline (the size of the staging arena
            :meth:`put` copies records into, allocated on the first put).
        ttl_s: expire stored pages after this many seconds (``None``: the server's eviction
            alone).
        cluster: ``True`` / ``False`` to skip detection.

    Raises ValueError for bad arguments, :class:`RemoteUnavailable` when the server cannot be
    reached now (:meth:`connect` turns that into ``None`` and one log line).
    """

    name = "remote"

    def __init__(self, url: str, namespace_digest: bytes | None, *, prefix: str = "kvstrata",
                 socket_timeout: float = 2.0, connect_timeout: float = 2.0, retries: int = 1,
                 retry_after_s: float = 1.0, get_batch: int = 32,
                 put_batch_bytes: int = 32 << 20, ttl_s: int | None = None,
                 cluster: bool | None = None):
        self.url = check_url(url)
        for what, v in (("socket_timeout", socket_timeout), ("connect_timeout", connect_timeout),
                        ("retry_after_s", retry_after_s)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                raise ValueError(f"RemoteTier {what} must be a number of seconds >= 0, got {v!r}")
        for what, v in (("retries", retries), ("get_batch", get_batch),
                        ("put_batch_bytes", put_batch_bytes)):
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if what == "retries" else 1):
                raise ValueError(f"RemoteTier {what} must be a "
                                 f"{'non-negative' if what == 'retries' else 'positive'} "
                                 f"integer, got {v!r}")
        if ttl_s is not None and (not isinstance(ttl_s, int) or ttl_s <= 0):
            raise ValueError(f"RemoteTier ttl_s must be a positive number of seconds, got {ttl_s!r}")
        if not isinstance(prefix, str) or not prefix or ":" in prefix:
            raise ValueError(f"RemoteTier prefix must be a non-empty string without ':', got "
                             f"{prefix!r}")
        if namespace_digest is not None and not isinstance(namespace_digest, bytes):
            raise ValueError("RemoteTier namespace_digest must be bytes (Namespace.digest)")
        self.prefix = prefix
        self.ns = namespace_digest
        self._key0 = (f"{prefix}:{namespace_digest.hex()}:".encode()
                      if namespace_digest is not None else None)
        self.retry_after_s = float(retry_after_s)
        self.get_batch, self.put_batch_bytes, self.ttl_s = get_batch, put_batch_bytes, ttl_s
        self._kw = dict(socket_timeout=socket_timeout, socket_connect_timeout=connect_timeout,
                        retry=Retry(ExponentialBackoff(cap=0.5, base=0.02), retries),
                        retry_on_error=[RedisConnectionError, RedisTimeoutError])
        self._c = new_counters("skipped", "outages")
        self._down_until = 0.0
        self._faults = 0          # faults in the current outage (0: the server answers)
        self._staging: memoryview | None = None
        self.client = None
        try:
            self.client, self.cluster = self._open(cluster)
        except _UNREACHABLE as e:
            raise RemoteUnavailable(f"remote tier {redact(url)} cannot be reached: {e}") from None
        self._check_policy()

    @classmethod
    def connect(cls, url: str, namespace_digest: bytes, **options) -> "RemoteTier | None":
        """A tier on ``url``, or ``None`` (said once in the log) when the server cannot be
        reached now: the engine then runs without a remote tier. Bad arguments still raise."""
        try:
            return cls(url, namespace_digest, **options)
        except RemoteUnavailable as e:
            log.warning("%s; the engine runs without the remote tier", e)
            return None

    def _open(self, cluster: bool | None):
        plain = redis.Redis.from_url(self.url, **self._kw)
        try:
            if cluster is None:
                cluster = bool(plain.info("cluster").get("cluster_enabled"))
            else:
                plain.ping()
        except BaseException:
            plain.close()
            raise
        if not cluster:
            return plain, False
        plain.close()
        return RedisCluster.from_url(self.url, **self._kw), True

    def _check_policy(self) -> None:
        try:
            infos = ([self.client.info("memory")] if not self.cluster else
                     list(self.client.info("memory", target_nodes=RedisCluster.PRIMARIES)
                          .values()))
        except _FAULTS:
            return
        for mem in infos:
            limit, policy = int(mem.get("maxmemory", 0)), mem.get("maxmemory_policy", "")
            if not limit or policy not in _GOOD_POLICIES:
                log.warning("remote tier %s: the server has maxmemory=%s and maxmemory-policy "
                            "%s; pages will %s. kvstrata never changes a server's "
                            "configuration: set maxmemory and maxmemory-policy allkeys-lru "
                            "(docs/remote.md)", redact(self.url), limit or "0 (no limit)",
                            policy, "grow without bound" if not limit else
                            "fail to be written once it is full")
                return

    def __repr__(self) -> str:
        kind = "cluster" if getattr(self, "cluster", False) else "standalone"
        return f"RemoteTier({redact(self.url)!r}, {kind}, prefix={self.prefix!r})"

    # -- keys -----------------------------------------------------------------------------------
    def key(self, page_hash: bytes) -> bytes:
        """The Redis key of a page: ``<prefix>:<namespace digest hex>:<page hash hex>``."""
        if self._key0 is None:
            raise ValueError("this RemoteTier was opened for inspection (no namespace)")
        return self._key0 + check_key(page_hash).hex().encode()

    # -- faults -----------------------------------------------------------------------------------
    def _pipeline(self, build: Callable, n: int) -> list | None:
        """Run one pipeline; ``None`` on a fault (counted, logged once per outage). Commands
        that failed alone come back as exceptions in the list."""
        if self._faults and time.monotonic() < self._down_until:
            self._c["skipped"] += n
            return None
        try:
            pipe = self.client.pipeline(transaction=False)
            build(pipe)
            res = pipe.execute(raise_on_error=False)
        except _FAULTS as e:
            self._fault(e, unreachable=isinstance(e, _UNREACHABLE))
            return None
        errs = [r for r in res if isinstance(r, Exception)]
        if errs:
            self._fault(errs[0], unreachable=any(isinstance(r, _UNREACHABLE) for r in errs),
                        count=len(errs))
        elif self._faults:
            log.warning("remote tier %s answers again (after %d faults)", redact(self.url),
                        self._faults)
            self._faults = 0
        return res

    def _fault(self, e: BaseException, unreachable: bool, count: int = 1) -> None:
        self._c["errors"] += count
        if not self._faults:
            self._c["outages"] += 1
            log.warning("remote tier %s: %s: %s; reads are misses and writes are dropped "
                        "(counted) until it answers again", redact(self.url), type(e).__name__, e)
        self._faults += count
        if unreachable:
            self._down_until = time.monotonic() + self.retry_after_s

    # -- the Tier protocol ------------------------------------------------------------------------
    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        ks = [self.key(k) for k in keys]
        if not ks:
            return []
        res = self._pipeline(lambda p: [p.exists(k) for k in ks], len(ks))
        if res is None:
            return [False] * len(ks)
        return [r is not None and not isinstance(r, Exception) and r > 0 for r in res]

    def get(self, keys: Sequence[bytes]) -> list[Parts | None]:
        """Per key ``[record bytes]`` or ``None`` (absent, or a fault)."""
        ks = [self.key(k) for k in keys]
        out: list[Parts | None] = []
        for i in range(0, len(ks), self.get_batch):
            batch = ks[i:i + self.get_batch]
            res = self._pipeline(lambda p: [p.get(k) for k in batch], len(batch))
            for r in res if res is not None else [None] * len(batch):
                if isinstance(r, bytes):
                    out.append([r])
                    self._c["hits"] += 1
                    self._c["read_bytes"] += len(r)
                else:
                    out.append(None)
                    self._c["misses"] += 1
        return out

    def put(self, items: Sequence[tuple[bytes, Parts]]) -> list[bool]:
        """``SET`` each record. Redis stores one value per key, so a record's parts are copied
        back to back into the tier's staging arena (``put_batch_bytes``, allocated once and
        reused: a fresh buffer per page would cost a page fault per 4 KiB, more than the copy)
        and sent from there; a pipeline goes out whenever the arena is full."""
        ok: list[bool] = []
        batch: list[tuple[bytes, memoryview | bytes]] = []
        arena = self._arena()
        at = 0

        def flush() -> None:
            nonlocal at
            if not batch:
                return
            res = self._pipeline(lambda p: [p.set(k, v, ex=self.ttl_s) for k, v in batch],
                                 len(batch))
            for (_, v), r in zip(batch, res if res is not None else [None] * len(batch)):
                good = r is True
                ok.append(good)
                self._c["puts" if good else "put_failures"] += 1
                self._c["written_bytes"] += len(v) if good else 0
            batch.clear()
            at = 0

        for k, parts in items:
            key = self.key(k)
            if not parts:
                raise ValueError(f"page {bytes(k).hex()}: a record has at least one part")
            n = record_nbytes(parts)
            if n > len(arena):
                batch.append((key, b"".join(parts)))      # larger than the arena: its own copy
                continue
            if at + n > len(arena):
                flush()
            start = at
            for part in parts:
                m = memoryview(part).cast("B")
                arena[at:at + len(m)] = m
                at += len(m)
            batch.append((key, arena[start:at]))
        flush()
        return ok

    def _arena(self) -> memoryview:
        if self._staging is None:
            self._staging = memoryview(bytearray(self.put_batch_bytes))
        return self._staging

    def delete(self, keys: Sequence[bytes]) -> int:
        ks = [self.key(k) for k in keys]
        if not ks:
            return 0
        res = self._pipeline(lambda p: [p.delete(k) for k in ks], len(ks))
        n = sum(r for r in res if isinstance(r, int)) if res is not None else 0
        self._c["deletes"] += n
        return n

    def touch(self, keys: Sequence[bytes]) -> None:
        """Nothing to do: the server's LRU clock already moved when the page was read."""

    def counters(self) -> dict[str, int | float]:
        return {**self._c, "available": int(not self._faults)}

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None

    # -- inspection -----------------------------------------------------------------------------
    def scan(self, namespace_digest: bytes | None = None, count: int = 1000
             ) -> Iterator[tuple[bytes, bytes]]:
        """``(namespace digest, page hash)`` of every record under this prefix (one namespace
        with ``namespace_digest``), on every node of a cluster. Raises on a fault (an
        inspection wants to know)."""
        ns = "*" if namespace_digest is None else namespace_digest.hex()
        for k in self.client.scan_iter(match=f"{self.prefix}:{ns}:*", count=count):
            parts = bytes(k).split(b":")
            if len(parts) != 3:
                continue
            try:
                yield bytes.fromhex(parts[1].decode()), bytes.fromhex(parts[2].decode())
            except ValueError:
                continue        # not one of ours

    def get_raw(self, keys: Sequence[tuple[bytes, bytes]]) -> list[bytes | None]:
        """Values stored under ``(namespace digest, page hash)`` keys, as :meth:`scan` yields
        them (raises on a fault)."""
        ks = [f"{self.prefix}:{ns.hex()}:{h.hex()}".encode() for ns, h in keys]
        pipe = self.client.pipeline(transaction=False)
        for k in ks:
            pipe.get(k)
        return pipe.execute()

    def server_info(self) -> dict:
        """Memory limit, eviction policy and key count (summed over a cluster's primaries)."""
        if self.cluster:
            mems = list(self.client.info("memory", target_nodes=RedisCluster.PRIMARIES).values())
            d = self.client.dbsize(target_nodes=RedisCluster.PRIMARIES)
            keys = sum(d.values()) if isinstance(d, dict) else int(d)
        else:
            mems, keys = [self.client.info("memory")], self.client.dbsize()
        return {"url": redact(self.url), "cluster": self.cluster, "nodes": len(mems),
                "keys": keys, "used_memory": sum(int(m.get("used_memory", 0)) for m in mems),
                "maxmemory": sum(int(m.get("maxmemory", 0)) for m in mems),
                "maxmemory_policy": sorted({m.get("maxmemory_policy", "") for m in mems})}
