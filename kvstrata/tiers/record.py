"""The self-describing stored page: one record per page hash, every group's encoded payload.

Layout (all integers little-endian)::

    b"KVSR" | u32 header_len | u32 crc32(header) | header (msgpack) | payload_0 | payload_1 | ...

A record travels either as that one buffer (``kvstrata inspect``, tests) or as its parts
``[head, payload_0, payload_1, ...]`` where ``head`` is everything up to the end of the header:
the disk tier keeps the head in LMDB and writes the payloads to a segment file straight from the
host slot, without joining them first. Both forms parse to the same :class:`Record`.

The header holds the format version, namespace digest, page hash, parent hash, the page's token
ids, the time it was written, and per group: name, codec name + version, dtype, shape, payload
length, payload CRC32 and the codec's metadata. The header has its own CRC so that a flipped byte
anywhere in a record (header or payload) is caught: CRC32 detects every error burst up to 32 bits.

A record that does not match what the reader expects (namespace, format or codec version, token
ids, shape) or whose checksums fail raises :class:`RecordMismatch` / :class:`ChecksumError` /
:class:`CorruptPageError`; tiers count those, delete the record and report a miss.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from typing import Any, Sequence

import msgpack

from ..codecs import ChecksumError, Codec, CorruptPageError, EncodedPage, crc32, get_codec
from ..dtypes import dtype_name
from ..pagepool import KVGroupSpec, PageInfo, PageKey, hash_page

#: Bump whenever the record layout or header schema changes; older records become misses.
#: 2: the disk tier stores head and payloads as separate values (version 1 joined them).
#: 3: the disk tier keeps heads in LMDB and payloads in append-only segment files.
FORMAT_VERSION = 3
MAGIC = b"KVSR"
_PREFIX = struct.Struct("<4sII")


class RecordMismatch(CorruptPageError):
    """A well-formed record that is not the page the reader asked for (namespace, version, ...)."""


@dataclass(slots=True)
class Record:
    """A parsed record. ``payloads`` are zero-copy views into the buffer it was parsed from."""

    header: dict[str, Any]
    payloads: list[memoryview]
    header_len: int = 0

    @property
    def page_hash(self) -> bytes:
        return self.header["hash"]

    @property
    def nbytes(self) -> int:
        return _PREFIX.size + self.header_len + sum(len(p) for p in self.payloads)

    def encoded(self) -> list[EncodedPage]:
        """One :class:`EncodedPage` per group (payloads still alias the source buffer)."""
        # from_header copies: the source buffer may be read-only (an LMDB map) or short-lived.
        return [EncodedPage.from_header(g, p) for g, p in zip(self.header["groups"], self.payloads)]


def build_record(ns_digest: bytes, info: PageKey | PageInfo, names: Sequence[str],
                 pages: Sequence[EncodedPage], payloads: Sequence[memoryview | bytes],
                 created: float | None = None) -> list[bytes | memoryview]:
    """Record parts ``[head, payload_0, ...]`` (head = prefix + header), ready to be written as
    they are (the disk tier) or joined. Payloads are passed through, never copied.

    ``pages`` give each group's codec header; ``payloads`` the host bytes (they may differ from
    ``pages[i].payload`` when the payload sits in a host-tier slot). Checksums are computed here
    when the encoded page does not carry one yet.
    """
    groups = []
    for name, enc, pl in zip(names, pages, payloads):
        checksum = enc.checksum if enc.checksum is not None else crc32(pl)
        groups.append({"name": name, "codec": enc.codec, "version": enc.version,
                       "dtype": enc.dtype, "shape": list(enc.shape), "nbytes": len(pl),
                       "checksum": checksum, "meta": enc.meta})
    header = msgpack.packb({
        "v": FORMAT_VERSION, "ns": ns_digest, "hash": info.hash, "parent": info.parent_hash,
        "tokens": list(info.token_ids), "created": time.time() if created is None else created,
        "groups": groups}, use_bin_type=True)
    return [_PREFIX.pack(MAGIC, len(header), crc32(header)) + header, *payloads]


def parse_record(data: bytes | memoryview | Sequence[bytes | memoryview]) -> Record:
    """Parse and structurally check a record: magic, header CRC, version, lengths.

    ``data`` is the whole record as one buffer, or its parts ``[head, payload_0, ...]`` as the
    disk tier stores them; a single part is a whole record. With parts, the head must end where
    the header does and there must be exactly one part of the described length per group, so a
    head whose payloads are missing (or a payload too many) is a :class:`CorruptPageError`.
    Payload CRCs are checked by :func:`check_payloads` (they cost a pass over the data).
    """
    if isinstance(data, (list, tuple)):
        parts = [memoryview(p) for p in data]
        if len(parts) == 1:
            return parse_record(parts[0])
        if not parts:
            raise CorruptPageError("record has no parts")
    else:
        parts = [memoryview(data)]
    mv = parts[0]
    header, end, sizes = _read_head(mv)
    if len(parts) > 1:
        got = [len(p) for p in parts[1:]]
        if len(mv) != end or got != sizes:
            raise CorruptPageError(f"record parts are a {len(mv)}-byte head and payloads of {got} "
                                   f"bytes; its header describes {end} and {sizes}")
        return Record(header, parts[1:], end - _PREFIX.size)
    if end + sum(sizes) != len(mv):
        raise CorruptPageError(f"record is {len(mv)} bytes; its header describes {end + sum(sizes)}")
    payloads, off = [], end
    for n in sizes:
        payloads.append(mv[off:off + n])
        off += n
    return Record(header, payloads, end - _PREFIX.size)


def payload_sizes(head: bytes | memoryview) -> list[int]:
    """Each group's payload length, from a record's head (prefix + header) alone; raises a
    CorruptPageError subclass as :func:`parse_record` does."""
    return _read_head(memoryview(head))[2]


def _read_head(mv: memoryview) -> tuple[dict, int, list[int]]:
    """``(header, end of the header, payload sizes)``: magic, header CRC, version, group table."""
    if len(mv) < _PREFIX.size:
        raise CorruptPageError(f"record of {len(mv)} bytes is shorter than its {_PREFIX.size}-byte prefix")
    magic, hlen, hcrc = _PREFIX.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CorruptPageError(f"bad record magic {bytes(magic)!r}")
    end = _PREFIX.size + hlen
    if end > len(mv):
        raise CorruptPageError(f"header length {hlen} runs past the {len(mv)}-byte record")
    hbytes = mv[_PREFIX.size:end]
    if crc32(hbytes) != hcrc:
        raise ChecksumError("record header checksum mismatch")
    try:
        header = msgpack.unpackb(hbytes, raw=False)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise CorruptPageError(f"unreadable record header: {e}") from None
    if not isinstance(header, dict) or header.get("v") != FORMAT_VERSION:
        v = header.get("v") if isinstance(header, dict) else None
        raise RecordMismatch(f"record format version {v!r}; this reader speaks {FORMAT_VERSION}")
    try:
        sizes = [int(g["nbytes"]) for g in header["groups"]]
    except (KeyError, TypeError, ValueError):
        raise CorruptPageError("record header has no valid group table") from None
    return header, end, sizes


def check_payloads(rec: Record) -> None:
    """Raise :class:`ChecksumError` naming the first group whose payload CRC does not match."""
    for g, p in zip(rec.header["groups"], rec.payloads):
        if crc32(p) != g["checksum"]:
            raise ChecksumError(f"group {g['name']!r}: payload checksum mismatch")


def check_identity(rec: Record, ns_digest: bytes, info: PageKey | PageInfo | None) -> None:
    """The record is the page ``info`` (or, with ``info=None``, *a* page) under ``ns_digest``:
    namespace, hash chain link and token ids all agree."""
    h = rec.header
    if h.get("ns") != ns_digest:
        raise RecordMismatch("record was written under another namespace")
    tokens = h.get("tokens")
    if not isinstance(tokens, list) or not isinstance(h.get("parent"), bytes):
        raise CorruptPageError("record header lacks token ids or parent hash")
    if hash_page(h["parent"], tokens) != h.get("hash"):
        raise RecordMismatch("record's hash is not H(parent || tokens)")
    if info is not None:
        if h["hash"] != info.hash or h["parent"] != info.parent_hash:
            raise RecordMismatch("record holds another page (hash or parent differ)")
        if tuple(tokens) != tuple(info.token_ids):
            raise RecordMismatch("record's token ids differ from the page asked for")


def check_record_groups(rec: Record, specs: Sequence[KVGroupSpec],
                        codecs: Sequence[Codec], page_size: int) -> None:
    """Each group's name, codec name + version, dtype and shape are what this process writes."""
    got = rec.header["groups"]
    if [g.get("name") for g in got] != [s.name for s in specs]:
        raise RecordMismatch(f"record groups {[g.get('name') for g in got]} != "
                             f"{[s.name for s in specs]}")
    for g, spec, codec in zip(got, specs, codecs):
        if g.get("codec") != codec.name or g.get("version") != codec.version:
            raise RecordMismatch(f"group {spec.name!r}: record codec {g.get('codec')!r} "
                                 f"v{g.get('version')}, this process uses {codec.name!r} "
                                 f"v{codec.version}")
        if g.get("dtype") != dtype_name(spec.dtype) or \
                tuple(g.get("shape") or ()) != spec.page_shape(page_size):
            raise RecordMismatch(f"group {spec.name!r}: record holds {g.get('dtype')} "
                                 f"{g.get('shape')}, expected {dtype_name(spec.dtype)} "
                                 f"{list(spec.page_shape(page_size))}")



def check_stored(rec: Record, key: bytes, ns_digest: bytes | None = None) -> None:
    """What an offline check (``kvstrata inspect --verify``) can know of a stored record without
    the page it was asked for: stored under its own hash (and namespace), a valid hash link,
    payload CRCs, and every group decodes to its shape. Raises a CorruptPageError subclass."""
    if rec.page_hash != key:
        raise RecordMismatch("stored under another key than its hash")
    if ns_digest is not None and rec.header.get("ns") != ns_digest:
        raise RecordMismatch("stored under another namespace than its own")
    check_identity(rec, rec.header["ns"], None)
    check_payloads(rec)
    for g, enc in zip(rec.header["groups"], rec.encoded()):
        try:
            page = get_codec(g["codec"]).decode(enc)
        except (KeyError, ValueError) as e:
            raise CorruptPageError(f"group {g['name']!r} does not decode: {e}") from None
        if tuple(page.shape) != tuple(g["shape"]):
            raise CorruptPageError(f"group {g['name']!r} decodes to {tuple(page.shape)}")


def verify_record(data: bytes | memoryview | Sequence[bytes | memoryview], ns_digest: bytes,
                  info: PageKey | PageInfo, specs: Sequence[KVGroupSpec], codecs: Sequence[Codec],
                  page_size: int) -> Record:
    """Everything a promotion needs before trusting a record (one buffer or its parts, as
    :func:`parse_record` takes them); raises a CorruptPageError subclass."""
    rec = parse_record(data)
    check_identity(rec, ns_digest, info)
    check_record_groups(rec, specs, codecs, page_size)
    check_payloads(rec)
    return rec
