"""Every codec: registry entries, header round trip, and damaged pages raising the specific errors."""

import pytest
import torch

from kvstrata.codecs import (ChecksumError, CodecVersionError, CorruptPageError, EncodedPage,
                             available_codecs, get_codec)
from kvstrata.pagepool.spec import KVGroupSpec

CODECS = ["identity", "nvfp4", "lossless"]


def _page():
    return torch.randn(2, 2, 2, 4, 32, generator=torch.Generator().manual_seed(7)).to(
        torch.bfloat16)


def test_registry_lists_and_describes_builtin_codecs():
    assert set(CODECS) <= set(available_codecs())
    spec = KVGroupSpec("g", 2, 2, 32, codec="nvfp4")
    for name in CODECS:
        c = get_codec(name)
        assert c.name == name and c.version >= 1
        assert c.lossless == (name != "nvfp4")
        n = c.encoded_nbytes(spec, 4)
        assert n is None or n <= spec.bytes_per_page(4)
    with pytest.raises(ValueError, match="unknown codec 'zfp'"):
        get_codec("zfp")


@pytest.mark.parametrize("name", CODECS)
def test_header_round_trip_decodes_the_same(name):
    c = get_codec(name)
    enc = c.encode(_page()).to_host()
    back = EncodedPage.from_header(enc.header(), bytes(enc.payload.numpy()))
    assert torch.equal(c.decode(back), c.decode(enc))


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("where", [0, -1, "middle"])
def test_flipped_payload_bit_raises_checksum_error(name, where):
    c = get_codec(name)
    enc = c.encode(_page()).to_host()
    payload = enc.payload.clone()
    i = payload.numel() // 2 if where == "middle" else where
    payload[i] ^= 0x10
    bad = EncodedPage.from_header(enc.header(), payload)
    with pytest.raises(ChecksumError, match="checksum mismatch"):
        c.decode(bad)
    assert issubclass(ChecksumError, CorruptPageError)


@pytest.mark.parametrize("name", CODECS)
def test_version_or_codec_mismatch_raises_version_error(name):
    c = get_codec(name)
    enc = c.encode(_page()).to_host()
    h = enc.header()
    with pytest.raises(CodecVersionError, match=f"v{c.version + 1}"):
        c.decode(EncodedPage.from_header({**h, "version": c.version + 1}, enc.payload))
    other = "lossless" if name != "lossless" else "nvfp4"
    with pytest.raises(CodecVersionError):
        c.decode(EncodedPage.from_header({**h, "codec": other}, enc.payload))
    assert issubclass(CodecVersionError, CorruptPageError)


@pytest.mark.parametrize("name", ["nvfp4", "lossless"])
def test_truncated_payload_or_bad_meta_is_corrupt(name):
    c = get_codec(name)
    enc = c.encode(_page()).to_host()
    short = EncodedPage.from_header({**enc.header(), "checksum": None}, enc.payload[:-3].clone())
    with pytest.raises(CorruptPageError):
        c.decode(short)
    if name == "lossless":
        meta = {"planes": [[1, 1]]}
        with pytest.raises(CorruptPageError, match="planes"):
            c.decode(EncodedPage.from_header({**enc.header(), "meta": meta}, enc.payload))
        # a valid checksum over garbage zstd bytes: the decompressor's failure is a CorruptPageError
        p = enc.payload.clone()
        p[:8] = 0xFF
        garbage = EncodedPage.from_header({**enc.header(), "checksum": None}, p)
        with pytest.raises(CorruptPageError):
            c.decode(garbage)
