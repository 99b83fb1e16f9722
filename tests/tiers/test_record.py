"""The stored record format: round trip, and every kind of damage or mismatch is detected."""

from __future__ import annotations

import random

import msgpack
import pytest
import torch

from kvstrata.codecs import ChecksumError, CorruptPageError, get_codec
from kvstrata.pagepool import Namespace, PageInfo, hash_page
from kvstrata.tiers import record
from kvstrata.tiers.record import RecordMismatch, build_record, parse_record, verify_record

from tierutil import PAGE, make_groups, page_content

GROUPS = make_groups()
CODECS = [get_codec(g.codec) for g in GROUPS]
NS = Namespace("t", GROUPS, PAGE, drafter="d")


def _record(tokens=(1, 2, 3, 4), ns=NS):
    parent = ns.digest
    info = PageInfo(0, hash_page(parent, tokens), parent, tuple(tokens))
    encs = [c.encode(page_content(info.hash, g)) for g, c in zip(GROUPS, CODECS)]
    parts = build_record(ns.digest, info, [g.name for g in GROUPS], encs,
                         [e.payload.numpy().data for e in encs])
    return info, encs, b"".join(parts)


def test_round_trip_is_exact():
    info, encs, buf = _record()
    rec = verify_record(buf, NS.digest, info, GROUPS, CODECS, PAGE)
    assert rec.header["tokens"] == [1, 2, 3, 4]
    assert rec.header["v"] == record.FORMAT_VERSION
    assert rec.nbytes == len(buf)
    for g, c, enc in zip(GROUPS, CODECS, rec.encoded()):
        assert torch.equal(c.decode(enc), page_content(info.hash, g))


def test_every_single_byte_flip_is_detected():
    info, _, buf = _record()
    rng = random.Random(0)
    positions = list(range(0, len(buf), max(1, len(buf) // 400))) + [len(buf) - 1]
    for pos in positions:
        bad = bytearray(buf)
        bad[pos] ^= 1 << rng.randrange(8)
        with pytest.raises(CorruptPageError):
            verify_record(bytes(bad), NS.digest, info, GROUPS, CODECS, PAGE)


def test_truncated_and_extended_records_are_detected():
    info, _, buf = _record()
    for cut in (0, 3, 11, 40, len(buf) - 1):
        with pytest.raises(CorruptPageError):
            parse_record(buf[:cut])
    with pytest.raises(CorruptPageError):
        parse_record(buf + b"\0")


def test_mismatches_are_record_mismatch():
    info, _, buf = _record()
    other = Namespace("other-model", GROUPS, PAGE)
    with pytest.raises(RecordMismatch, match="namespace"):
        verify_record(buf, other.digest, info, GROUPS, CODECS, PAGE)
    wrong_tokens = PageInfo(0, info.hash, info.parent_hash, (1, 2, 3, 5))
    with pytest.raises(RecordMismatch, match="token"):
        verify_record(buf, NS.digest, wrong_tokens, GROUPS, CODECS, PAGE)
    with pytest.raises(RecordMismatch, match="codec"):
        verify_record(buf, NS.digest, info, GROUPS, [CODECS[0], get_codec("lossless")], PAGE)


def test_other_format_version_is_a_mismatch(monkeypatch):
    monkeypatch.setattr(record, "FORMAT_VERSION", 99)
    info, _, buf = _record()
    monkeypatch.undo()
    with pytest.raises(RecordMismatch, match="format version 99"):
        verify_record(buf, NS.digest, info, GROUPS, CODECS, PAGE)


def test_forged_hash_link_is_a_mismatch():
    # A header whose CRC is right but whose hash is not H(parent || tokens).
    info, _, buf = _record()
    rec = parse_record(buf)
    h = dict(rec.header, tokens=[9, 9, 9, 9])
    hb = msgpack.packb(h, use_bin_type=True)
    forged = record._PREFIX.pack(record.MAGIC, len(hb), record.crc32(hb)) + hb + b"".join(
        bytes(p) for p in rec.payloads)
    with pytest.raises(RecordMismatch, match="H\\(parent"):
        verify_record(forged, NS.digest, info, GROUPS, CODECS, PAGE)


def _parts(tokens=(1, 2, 3, 4)):
    parent = NS.digest
    info = PageInfo(0, hash_page(parent, tokens), parent, tuple(tokens))
    encs = [c.encode(page_content(info.hash, g)) for g, c in zip(GROUPS, CODECS)]
    parts = build_record(NS.digest, info, [g.name for g in GROUPS], encs,
                         [e.payload.numpy().data for e in encs])
    return info, [bytes(p) for p in parts]


def test_parts_parse_like_the_joined_record():
    info, parts = _parts()
    a = verify_record(parts, NS.digest, info, GROUPS, CODECS, PAGE)
    b = verify_record(b"".join(parts), NS.digest, info, GROUPS, CODECS, PAGE)
    assert a.header == b.header and a.nbytes == b.nbytes == sum(map(len, parts))
    assert [bytes(p) for p in a.payloads] == [bytes(p) for p in b.payloads] == parts[1:]
    assert verify_record(tuple(parts), NS.digest, info, GROUPS, CODECS, PAGE).header == a.header


def test_missing_extra_or_misplaced_parts_are_corrupt():
    info, parts = _parts()
    head, p0, p1 = parts
    for bad in ([head, p0], [head, p0, p1, b""], [head + p0, p1],
                [head, p0 + p1[:1], p1[1:]], [head]):
        with pytest.raises(CorruptPageError):
            parse_record(bad)
    with pytest.raises(CorruptPageError):
        parse_record([])
    flipped = bytearray(p1)
    flipped[len(flipped) // 2] ^= 4
    with pytest.raises(ChecksumError, match="draft"):
        verify_record([head, p0, bytes(flipped)], NS.digest, info, GROUPS, CODECS, PAGE)
    with pytest.raises(ChecksumError):                  # same sizes, swapped: the CRCs catch it
        verify_record([head, p1, p0], NS.digest, info, GROUPS, CODECS, PAGE)


def test_format_3_and_records_of_format_2_are_a_mismatch(monkeypatch):
    assert record.FORMAT_VERSION == 3        # payloads in segment files (the disk tier)
    monkeypatch.setattr(record, "FORMAT_VERSION", 2)
    info, parts = _parts()
    monkeypatch.undo()
    for form in (parts, b"".join(parts), parts[:1]):
        with pytest.raises(RecordMismatch, match="format version 2"):
            parse_record(form)
