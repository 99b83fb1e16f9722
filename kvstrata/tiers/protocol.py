"""The Tier protocol: what every tier below the device pool implements (host, disk, remote, peer).

A tier is a batched key-value store of **page records** (:mod:`kvstrata.tiers.record`): the key is
a page's 16-byte chain hash, the value the record's bytes. Policy (which page goes where, when,
write-back or write-through) lives in :class:`~kvstrata.tiers.manager.TierManager`; a tier only
stores, finds and forgets records, and counts what it did. The same protocol is what an outside
engine's connector (vLLM, SGLang) calls, together with :class:`~kvstrata.pagepool.PoolView`.

Types::

    Key    = bytes                          # a page chain hash, HASH_BYTES (16) long
    Parts  = Sequence[bytes-like]           # one record: [head, payload_0, ...] or [whole record]

Every method takes and answers a *batch* (one LMDB transaction, one Redis pipeline, ...), answers
per key in the order given, and never raises for a storage fault (server gone, I/O error, full
store): a fault reads as a miss or a failed write and is counted in :meth:`Tier.counters`. Bad
*arguments* (a wrong key type, a malformed part list) raise ``ValueError`` at once.

Semantics:

``exists(keys) -> list[bool]``
    Per key, whether the tier holds a record now. Per-key answers, not longest-prefix: the caller
    derives the prefix with :func:`leading`. Cheap (no payload moves) and may be stale by the time
    of a later ``get`` (another writer evicts it): a ``get`` miss after ``exists`` is normal.
``get(keys) -> list[Parts | None]``
    Per key, the record's parts as stored, or ``None`` for a miss (absent, or unreadable because
    of a fault). The tier does **not** verify the bytes: the reader calls
    :func:`~kvstrata.tiers.record.verify_record` with the page it expects, and a record that fails
    (garbage, another namespace's record, a torn or flipped byte) is a miss the reader counts and
    removes with ``delete``. Returned buffers stay valid as long as the caller holds them and are
    never rewritten by the tier; a caller that keeps them past the next call copies them only if
    it wants to own them (they may be read-only).
``put(items) -> list[bool]``
    ``items`` are ``(key, parts)``; per item, ``True`` once the record is stored and visible to
    every later ``get`` (of this or another process, where the tier is shared), ``False`` when it
    was not stored (capacity, fault). A record is never visible half-written: a concurrent reader
    sees the old record, the new one, or nothing. A key already present is refreshed (its value
    may be replaced by the new, equal-meaning record). The tier reads ``parts`` only during the
    call (it copies or writes them before returning).
``delete(keys) -> int``
    Remove records (found corrupt, or no longer wanted); returns how many existed. Missing keys
    are ignored.
``touch(keys) -> None``
    A read-access hint for the tier's own eviction order (LRU); it may be applied lazily or be a
    no-op where the store keeps its own order (Redis).
``counters() -> dict[str, int | float]``
    A snapshot of the counters since the tier was opened. Every tier reports at least :data:`COUNTERS`; tiers add
    their own keys (``evictions``, ``write_errors``, ...).
``close() -> None``
    Flush what is pending and release the tier's resources; idempotent.

A tier also has ``name`` (``"host"``, ``"disk"``, ``"remote"``, ``"peer"``): the key of
``cached_by_tier`` and of the manager's per-tier counters.
"""

from __future__ import annotations

from typing import Protocol, Sequence, Union, runtime_checkable

Buffer = Union[bytes, bytearray, memoryview]
#: One record: ``[head, payload_0, payload_1, ...]`` (head = prefix + header) or ``[record]``.
Parts = Sequence[Buffer]

#: The counters every tier's ``counters()`` holds (others may follow).
COUNTERS = (
    "hits",            # get: keys answered with a record
    "misses",          # get: keys answered None (absent or a fault)
    "puts",            # put: records stored
    "put_failures",    # put: records not stored (capacity or fault)
    "deletes",         # delete: records removed
    "read_bytes",      # bytes of the records returned by get
    "written_bytes",   # bytes of the records stored by put
    "errors",          # faults met (each also reads as a miss or a failed put)
)


@runtime_checkable
class Tier(Protocol):
    """A batched store of page records (see the module doc for the exact semantics)."""

    name: str

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key: the tier holds a record for it now."""

    def get(self, keys: Sequence[bytes]) -> list[Parts | None]:
        """Per key: the stored record's parts (unverified), or ``None`` for a miss."""

    def put(self, items: Sequence[tuple[bytes, Parts]]) -> list[bool]:
        """Store ``(key, parts)`` records; per item: stored and visible."""

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove records; returns how many existed."""

    def touch(self, keys: Sequence[bytes]) -> None:
        """Read-access hint for the tier's eviction order."""

    def counters(self) -> dict[str, int | float]:
        """A snapshot of the counters since open (at least :data:`COUNTERS`)."""

    def close(self) -> None:
        """Flush and release resources (idempotent)."""


def leading(flags: Sequence[bool]) -> int:
    """How many leading ``True`` answers: the longest prefix an ``exists`` answer covers."""
    n = 0
    for f in flags:
        if not f:
            break
        n += 1
    return n


def new_counters(*extra: str) -> dict[str, int]:
    """Zeroed :data:`COUNTERS` plus ``extra`` keys."""
    return dict.fromkeys((*COUNTERS, *extra), 0)


def record_nbytes(parts: Parts) -> int:
    """Bytes of a record given as its parts."""
    return sum(memoryview(p).nbytes for p in parts)


def check_key(key: object) -> bytes:
    """``key`` as bytes, or ValueError: keys are page chain hashes (bytes)."""
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise ValueError(f"tier keys are page hashes (bytes), got {type(key).__name__}")
    return bytes(key)
