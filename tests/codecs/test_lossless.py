"""Lossless codec: bit-exact round trips of every bit pattern, plane layout, raw fallback, ratio."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.codecs import LosslessCodec, get_codec, synthetic_kv
from kvstrata.codecs.lossless import join_planes, split_planes
from kvstrata.pagepool.spec import KVGroupSpec

# Example counts scale with the hypothesis profile (ci: bounded; nightly: ~50x more).
INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def _bits(t):
    return t.reshape(-1).view(INT_VIEW[t.dtype])


@pytest.mark.parametrize("dtype,man", [(torch.bfloat16, 7), (torch.float16, 10)])
def test_planes_exhaustive_for_16_bit_dtypes(dtype, man):
    bits = np.arange(1 << 16, dtype=np.uint16)
    planes = split_planes(bits, 16, man)
    assert len(planes) == (2 if dtype == torch.bfloat16 else 3)
    assert np.array_equal(join_planes(planes, np.dtype(np.uint16), 16, man), bits)
    # the exponent plane is the exponent field and nothing else
    exp_bits = 8 if dtype == torch.bfloat16 else 5
    assert np.array_equal(planes[0], (bits >> man) & ((1 << exp_bits) - 1))
    # every 16-bit pattern (NaNs, infs, subnormals, +-0) survives the codec bit for bit
    page = torch.from_numpy(bits.view(np.int16)).view(dtype).reshape(16, 2, 1, 16, 128)
    c = get_codec("lossless")
    assert torch.equal(_bits(c.decode(c.encode(page))), _bits(page))


def test_bf16_plane_layout_pinned():
    x = torch.tensor([-1.5, 2.0 ** -130, -0.0, 3.0], dtype=torch.bfloat16)
    exp, sm = split_planes(_bits(x).numpy().view(np.uint16), 16, 7)
    assert exp.tolist() == [127, 0, 0, 128]
    assert sm.tolist() == [0x80 | 0x40, 0x08, 0x80, 0x40]


def _pattern_pages(dtype):
    width = 16 if dtype != torch.float32 else 32
    lo, hi = -(1 << (width - 1)), (1 << (width - 1)) - 1
    special = st.sampled_from([0, lo, 1, lo + 1, 3, 0x3F80 if width == 16 else 0x3F800000])
    elem = st.one_of(st.integers(lo, hi), special)
    return st.lists(elem, min_size=1, max_size=64)


@settings(max_examples=settings.default.max_examples)
@given(data=st.data(), dtype=st.sampled_from(list(INT_VIEW)), level=st.sampled_from([None, 1, -3]),
       compress=st.sampled_from(["auto", "all"]))
def test_round_trip_bit_exact_arbitrary_patterns(data, dtype, level, compress):
    vals = data.draw(_pattern_pages(dtype))
    raw = torch.tensor(vals, dtype=torch.int64).to(INT_VIEW[dtype])
    reps = 16 * 2 * 16  # a page [1, 2, 1, 16, 16*k] made of the drawn patterns, repeated
    page = raw.repeat(reps)[: 2 * 16 * 16 * len(vals)].view(dtype).reshape(1, 2, 1, 16, -1)
    c = LosslessCodec(level=level, compress=compress)
    enc = c.encode(page)
    assert enc.nbytes <= page.numel() * page.element_size()
    out = c.decode(enc)
    assert out.dtype == dtype and out.shape == page.shape
    assert torch.equal(_bits(out), _bits(page))


@settings(max_examples=max(15, settings.default.max_examples // 2))
@given(seed=st.integers(0, 2**20), dtype=st.sampled_from(list(INT_VIEW)),
       kind=st.sampled_from(["normal", "subnormal", "zeros"]))
def test_round_trip_finite_floats(seed, dtype, kind):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 2, 2, 16, 32, generator=g)
    if kind == "subnormal":  # the dtype's subnormal range, with signed zeros mixed in
        tiny = {torch.bfloat16: 2.0**-130, torch.float16: 2.0**-20, torch.float32: 2.0**-140}
        x = x * tiny[dtype]
        x[0, 0, 0, 0, :8] = -0.0
    elif kind == "zeros":
        x = torch.where(x > 0, 0.0, -0.0)
    x = x.to(dtype)
    c = get_codec("lossless")
    assert torch.equal(_bits(c.decode(c.encode(x))), _bits(x))


def test_incompressible_page_is_stored_raw():
    g = torch.Generator().manual_seed(0)
    page = torch.randint(-2**15, 2**15, (2, 2, 2, 16, 64), generator=g, dtype=torch.int16)
    page = page.view(torch.bfloat16)
    enc = get_codec("lossless").encode(page)
    assert enc.meta["planes"] == [] and enc.nbytes == page.numel() * 2
    assert torch.equal(_bits(get_codec("lossless").decode(enc)), _bits(page))


@pytest.mark.parametrize("kind", ["gaussian", "key"])
def test_bf16_ratio_meets_the_goal(kind):
    pages = synthetic_kv(kind, 2, 4, 8, 16, 128, seed=1)
    c = get_codec("lossless")
    raw = enc = 0
    for p in pages:
        e = c.encode(p)
        raw, enc = raw + p.numel() * 2, enc + e.nbytes
        assert e.meta["planes"][0][1] == 1 and e.meta["planes"][1][1] == 0  # exp zstd, sm raw
    assert raw / enc >= 1.35


def test_options_validated_and_size_bound():
    with pytest.raises(ValueError, match="zstd level"):
        LosslessCodec(level=99)
    with pytest.raises(ValueError, match="compress"):
        LosslessCodec(compress="mantissa")
    with pytest.raises(ValueError, match="not supported"):
        get_codec("lossless").encode(torch.zeros(1, 2, 1, 1, 16, dtype=torch.float64))
    spec = KVGroupSpec("draft", 5, 8, 128, codec="lossless")
    assert get_codec("lossless").encoded_nbytes(spec, 16) is None  # data-dependent: raw bounds it
