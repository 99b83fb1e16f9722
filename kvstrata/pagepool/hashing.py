"""Chained BLAKE2b-128 prefix hashes over full pages, under a namespace.

``h_{-1} = H(namespace)`` and ``h_i = H(h_{i-1} || tokens of page i)``, where ``H`` is BLAKE2b with a
16-byte digest and tokens are little-endian int64. Only full pages are hashed. The namespace binds
everything that makes KV bytes differ (models, group specs, page size, layout version) plus the
request's ``cache_salt``; its serialization is tagged and length-prefixed, so two different
namespaces never serialize alike and a page hashed under one is never found under another.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from .spec import LAYOUT_VERSION, KVGroupSpec, check_groups, check_page_size

HASH_BYTES = 16
_TOKEN_DTYPE = np.dtype("<i8")
# ``array("q")`` holds native int64s: the bytes of ``_TOKEN_DTYPE`` on a little-endian host.
_NATIVE_INT64_IS_TOKEN_DTYPE = sys.byteorder == "little" and array("q").itemsize == 8


def blake2b_128(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=HASH_BYTES).digest()


def _field(tag: str, value: bytes) -> bytes:
    t = tag.encode()
    return struct.pack("<H", len(t)) + t + struct.pack("<Q", len(value)) + value


def _encode_value(v) -> bytes:
    """Tagged, length-prefixed encoding of str/int/None/bytes/tuples (recursively)."""
    if v is None:
        return b"N"
    if isinstance(v, bool):
        return b"B" + (b"\x01" if v else b"\x00")
    if isinstance(v, int):
        s = str(v).encode()
        return b"I" + struct.pack("<I", len(s)) + s
    if isinstance(v, str):
        s = v.encode()
        return b"S" + struct.pack("<Q", len(s)) + s
    if isinstance(v, (bytes, bytearray)):
        return b"Y" + struct.pack("<Q", len(v)) + bytes(v)
    if isinstance(v, (tuple, list)):
        parts = [_encode_value(x) for x in v]
        return b"T" + struct.pack("<I", len(parts)) + b"".join(parts)
    raise TypeError(f"cannot serialize {type(v).__name__} into a namespace")


@dataclass(frozen=True)
class Namespace:
    """Everything a page's bytes depend on, plus the request's ``cache_salt``.

    ``target`` and ``drafter`` are fingerprints (e.g. a digest of the config and weights, or a model
    name plus revision); ``drafter="none"`` when speculative decoding is off.
    """

    target: str
    groups: tuple[KVGroupSpec, ...]
    page_size: int
    drafter: str = "none"
    layout_version: int = LAYOUT_VERSION
    cache_salt: str | None = None
    _digest: bytes = field(default=b"", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", check_groups(self.groups))
        check_page_size(self.page_size)
        if not isinstance(self.target, str) or not self.target:
            raise ValueError("Namespace.target must be a non-empty model fingerprint")
        if not isinstance(self.drafter, str) or not self.drafter:
            raise ValueError("Namespace.drafter must be a fingerprint or 'none'")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise ValueError(f"cache_salt must be a string or None, got {type(self.cache_salt).__name__}")
        object.__setattr__(self, "_digest", blake2b_128(self.serialize()))

    def serialize(self) -> bytes:
        """Unambiguous byte encoding (tag + length + value for every field)."""
        return b"kvstrata-ns\x00" + b"".join([
            _field("layout_version", _encode_value(self.layout_version)),
            _field("target", _encode_value(self.target)),
            _field("drafter", _encode_value(self.drafter)),
            _field("groups", _encode_value(tuple(g.fingerprint_fields() for g in self.groups))),
            _field("page_size", _encode_value(self.page_size)),
            _field("cache_salt", _encode_value(self.cache_salt)),
        ])

    @property
    def digest(self) -> bytes:
        """``H(namespace)``: the chain's root ``h_{-1}``."""
        return self._digest

    def with_salt(self, cache_salt: str | None) -> "Namespace":
        if cache_salt == self.cache_salt:
            return self
        return Namespace(self.target, self.groups, self.page_size, self.drafter,
                         self.layout_version, cache_salt)

    def shared_fields(self) -> dict[str, Any]:
        """What two engines (or an engine and a tier) must agree on to exchange pages: every
        field but ``cache_salt`` (a request's), as plain values (the disaggregation handshake
        sends them over the wire)."""
        return {"layout_version": self.layout_version, "page_size": self.page_size,
                "target": self.target, "drafter": self.drafter,
                "groups": [list(g.fingerprint_fields()) for g in self.groups]}


def namespace_differences(mine: Mapping[str, Any], theirs: Mapping[str, Any],
                          ours: str = "this one", other: str = "the other") -> list[str]:
    """One line per field in which two :meth:`Namespace.shared_fields` differ, naming each
    side's value (``ours`` / ``other`` say whose it is)."""
    diffs = []
    for key in ("layout_version", "page_size", "target", "drafter", "groups"):
        a, b = mine.get(key), theirs.get(key)
        if a == b:
            continue
        if key == "drafter" and "none" in (a, b):
            who = ours if a == "none" else other
            diffs.append(f"drafter: {who} has no drafter ({a!r} at {ours} vs {b!r} at {other}); "
                         "the draft KV cannot be shared")
        else:
            diffs.append(f"{key}: {a!r} at {ours} vs {b!r} at {other}")
    return diffs


def tokens_to_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Little-endian int64 bytes of a token list; refuses negative ids."""
    if _NATIVE_INT64_IS_TOKEN_DTYPE and isinstance(token_ids, (list, tuple)):
        # A list of ints (every page a sequence commits) goes through ``array``: numpy's
        # conversion and reduction cost ~20 us a page in the engine loop, this ~1 us. Anything
        # else (floats, nested lists, ids past int64) takes numpy's path and its errors.
        try:
            packed = array("q", token_ids)
        except (TypeError, OverflowError):
            packed = None
        if packed is not None:
            if packed and min(packed) < 0:
                raise ValueError(f"token ids must be non-negative, got {min(packed)}")
            return packed.tobytes()
    arr = np.asarray(token_ids, dtype=_TOKEN_DTYPE)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {arr.shape}")
    if arr.size and int(arr.min()) < 0:
        raise ValueError(f"token ids must be non-negative, got {int(arr.min())}")
    return arr.tobytes()


def hash_page(parent: bytes, page_tokens: Sequence[int]) -> bytes:
    """``H(parent || tokens)`` for one full page."""
    return blake2b_128(parent + tokens_to_bytes(page_tokens))


def page_hashes(namespace: Namespace, token_ids: Sequence[int] | np.ndarray,
                start_page: int = 0, parent: bytes | None = None) -> list[bytes]:
    """Chained hashes of every *full* page of ``token_ids``.

    With ``start_page > 0``, ``parent`` must be the hash of page ``start_page - 1`` (so a growing
    sequence hashes only its new pages).
    """
    P = namespace.page_size
    if start_page == 0:
        parent = namespace.digest
    elif parent is None:
        raise ValueError("page_hashes(start_page>0) needs the parent hash")
    return chain_hashes(parent, token_ids[start_page * P:], P)


def chain_hashes(parent: bytes, token_ids: Sequence[int] | np.ndarray, page_size: int
                 ) -> list[bytes]:
    """Chained hashes of the full pages of ``token_ids`` (which start on a page boundary),
    continuing the chain from ``parent``; the cost is that of these tokens only."""
    raw = tokens_to_bytes(token_ids)
    step = 8 * page_size
    mv = memoryview(raw)
    blake = hashlib.blake2b
    out: list[bytes] = []
    h = parent
    for i in range(len(raw) // step):
        h = blake(h + mv[i * step:(i + 1) * step], digest_size=HASH_BYTES).digest()
        out.append(h)
    return out
