"""NVFP4 kernels: Triton (through the interpreter) against the torch reference, and the element /
scale rounding against independent oracles (ml_dtypes' float4_e2m1fn, torch's float8_e4m3fn)."""

import re

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.kernels.nvfp4 import (E2M1_GRID, e2m1_code, e2m1_value, e4m3_round, e4m3_value,
                                    nvfp4_decode_ref, nvfp4_encode_ref, nvfp4_layout)
from kvstrata.kernels.nvfp4_triton import (DecodeLaunch, EncodeLaunch, _launch_decode,
                                           _launch_encode, nvfp4_encode)

# Example counts scale with the hypothesis profile (ci: bounded; nightly: ~50x more).
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _pages(shape, dtype, seed, kind="gauss"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if kind == "wide":  # many binades, incl. values that land in E4M3 subnormal scales
        x = x * torch.exp2(torch.randint(-20, 12, shape, generator=g).float())
    elif kind == "tiny":  # fp32/bf16 subnormals and slabs below MIN_GLOBAL_SCALE
        x = x * torch.exp2(torch.randint(-140, -100, shape, generator=g).float())
        x[0] *= 2.0**90  # page 0: normal slab scales with subnormal elements in them
    elif kind == "outlier":
        x[..., 0, :, :] *= 3000.0  # one token (row) per page, every layer
    return x.to(dtype)


def _enc(pages, page_ids=None, *, out=None, **launch):
    """The encoder launched as a variant (kvstrata's own calls use the default launch)."""
    return _launch_encode(pages, page_ids, EncodeLaunch(**launch), out=out)


def _dec(payload, out, page_ids=None, **launch):
    return _launch_decode(payload, out, page_ids, DecodeLaunch(**launch))


def _both(x, ids=None, block_r=4):
    a, fa = nvfp4_encode_ref(x, ids)
    b, fb = _enc(x, ids, block_r=block_r, num_warps=1)
    return a, b, fa, fb


def _special_pages(dtype, kind, shape=(2, 2, 2, 3, 5, 48), seed=0):
    x = _pages(shape, dtype, seed=seed, kind=kind)
    x[1, 1, 0] = 0  # an all-zero slab
    x[0, 0, 1, 1, 2, 16:32] = 0  # an all-zero block
    return x


# block_r None: the whole slab in registers (one pass); 4: row tiles, amax pass + quantize pass.
@pytest.mark.parametrize("block_r", [None, 4])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["gauss", "wide", "outlier", "tiny"])
def test_triton_matches_reference_bit_for_bit(dtype, kind, block_r):
    if kind == "tiny" and dtype == torch.float16:
        return  # fp16 has no such values
    # head_dim 48 is not a power of two (masked blocks); 3*5=15 rows is not a multiple of
    # block_r; payload rows of 1636 bytes are not 8-byte aligned (byte-wise code stores)
    x = _special_pages(dtype, kind, seed=10 * DTYPES.index(dtype) + len(kind))
    a, b, fa, fb = _both(x, block_r=block_r)
    assert torch.equal(a, b)
    assert fa.all() and fb.all()
    o_ref, o_tri = torch.empty_like(x), torch.empty_like(x)
    nvfp4_decode_ref(a, o_ref)
    _dec(a, o_tri, block_r=4, num_warps=1)
    assert torch.equal(o_ref.view(torch.uint8), o_tri.view(torch.uint8))
    assert torch.isfinite(o_ref).all()
    assert (o_ref[1, 1, 0] == 0).all() and (o_ref[0, 0, 1, 1, 2, 16:32] == 0).all()


@settings(max_examples=max(6, settings.default.max_examples // 8))
@given(seed=st.integers(0, 2**16), dtype=st.sampled_from(DTYPES), layers=st.integers(1, 2),
       heads=st.integers(1, 3), psize=st.sampled_from([1, 2, 4]), dblocks=st.integers(1, 3),
       kind=st.sampled_from(["gauss", "wide"]))
def test_triton_matches_reference_property(seed, dtype, layers, heads, psize, dblocks, kind):
    x = _pages((2, layers, 2, heads, psize, 16 * dblocks), dtype, seed, kind)
    a, b, _, _ = _both(x, block_r=2)
    assert torch.equal(a, b)
    assert torch.equal(a, _both(x, block_r=None)[1])
    o1, o2 = torch.empty_like(x), torch.empty_like(x)
    assert torch.equal(nvfp4_decode_ref(a, o1).view(torch.uint8),
                       _dec(a, o2, block_r=2, num_warps=1).view(torch.uint8))


@pytest.mark.parametrize("block_r", [None, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_aligned_payload_rows_use_word_io(dtype, block_r):
    # 2 layers, 2 heads x 4 tokens, head_dim 64: 1168-byte rows, 8-byte aligned (int64 words)
    x = _special_pages(dtype, "wide", shape=(3, 2, 2, 2, 4, 64), seed=7)
    a, b, _, _ = _both(x, block_r=block_r)
    assert a.shape[1] % 8 == 0 and torch.equal(a, b)
    o1, o2 = torch.empty_like(x), torch.empty_like(x)
    nvfp4_decode_ref(a, o1)
    _dec(a, o2, block_r=4, num_warps=1)
    assert torch.equal(o1.view(torch.uint8), o2.view(torch.uint8))


@pytest.mark.parametrize("wpt,flat", [(1, False), (2, True), (4, False), (4, True)])
@pytest.mark.parametrize("head_dim", [48, 64])  # 6 words per row (padded tile), 8 (dense)
def test_decode_variants_match_reference(wpt, flat, head_dim):
    # words_per_thread / flat tiles (the GPU sweep's knobs) give the reference's values; 2 x 3
    # rows is not a multiple of the tile; head_dim 48 gives unaligned payload rows (byte I/O)
    x = _special_pages(torch.bfloat16, "wide", shape=(2, 2, 2, 2, 3, head_dim), seed=5)
    a, _ = nvfp4_encode_ref(x)
    o1, o2 = torch.empty_like(x), torch.empty_like(x)
    nvfp4_decode_ref(a, o1)
    _dec(a, o2, block_r=4, num_warps=1, words_per_thread=wpt, flat=flat, lanes=False)
    assert torch.equal(o1.view(torch.uint8), o2.view(torch.uint8))


@pytest.mark.parametrize("block_r,persistent,stages", [(4, 0, 2), (8, 0, 2), (2, 1, 1),
                                                       (1, 2, 2), (4, 1, 3)])
@pytest.mark.parametrize("head_dim", [48, 64])  # a partial last tile (masks) / whole tiles
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_lanes_and_persistent_match_reference(block_r, persistent, stages, head_dim,
                                                     dtype):
    # lanes (a thread decodes the words it loaded), with and without the persistent tile loop;
    # head_dim 48: unaligned payload rows (byte I/O) and 2 x 3 x 6 words per slab
    x = _special_pages(dtype, "wide", shape=(2, 2, 2, 2, 3, head_dim), seed=6)
    a, _ = nvfp4_encode_ref(x)
    o1, o2 = torch.empty_like(x), torch.empty_like(x)
    nvfp4_decode_ref(a, o1)
    _dec(a, o2, block_r=block_r, num_warps=1, lanes=True, persistent=persistent, stages=stages)
    assert torch.equal(o1.view(torch.uint8), o2.view(torch.uint8))


@pytest.mark.parametrize("block_r,stages", [(None, 1), (None, 2), (4, 2)])
def test_encode_persistent_matches_reference(block_r, stages):
    # a grid-stride loop over slabs (fewer programs than slabs), pipelined or not
    x = _special_pages(torch.bfloat16, "outlier", shape=(2, 2, 2, 2, 4, 32), seed=12)
    a, fa = nvfp4_encode_ref(x)
    b, fb = _enc(x, block_r=block_r, num_warps=1, asm=False, persistent=1, stages=stages)
    assert torch.equal(a, b) and torch.equal(fa, fb)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [3, 4])   # 2 heads x 3 tokens: a partial last warp (masks)
@pytest.mark.parametrize("variant", [dict(lanes=True), dict(lanes=False),
                                     dict(persistent=1, lanes=False)])
def test_encode_variants_pool_order_and_flags(dtype, rows, variant):
    # Pages in a pool order (page_ids) with a NaN slab in the middle, through each encoder:
    # lanes (a thread per half block), a thread per block, and the grid-stride loop (2
    # programs, 30 slabs). Flags and the good pages' bytes equal the reference's.
    x = _special_pages(dtype, "wide", shape=(6, 3, 2, 2, rows, 32), seed=13)
    x[2, 1, 0, 1, 0, 5] = float("nan")
    ids = torch.tensor([4, 2, 0, 5, 1])
    a, fa = nvfp4_encode_ref(x[ids])
    assert fa.tolist() == [True, False, True, True, True]
    b, fb = _enc(x, ids, num_warps=1, asm=False, **variant)
    assert torch.equal(fb, fa)
    ok = fa.nonzero().flatten()
    assert torch.equal(a[ok], b[ok])


def test_encode_tiles_and_asm_switch():
    # the pure-Triton twin of the inline-asm path (asm=False) is what the interpreter runs; a
    # tile that divides the slab evenly drops the masks (EVEN): both must give the same bytes
    x = _special_pages(torch.bfloat16, "outlier", shape=(2, 2, 2, 2, 4, 32), seed=9)
    a, _ = nvfp4_encode_ref(x)
    for block_r in (None, 4, 8):
        assert torch.equal(_enc(x, block_r=block_r, num_warps=1, asm=False)[0], a)


@pytest.mark.parametrize("pad", [0, 8, 5])  # 8: word I/O on strided rows; 5: byte I/O
def test_strided_payload_rows_staging_layout(pad):
    # Encode straight into columns of a staging buffer laid out like host slots, and decode from
    # them: the same bytes and values as the dense payload; the bytes around stay untouched.
    x = _special_pages(torch.bfloat16, "wide", shape=(3, 2, 2, 2, 4, 64), seed=11)
    dense, _ = nvfp4_encode_ref(x)
    total = dense.shape[1]
    stage = torch.full((3, 16 + total + pad), 0xAB, dtype=torch.uint8)
    view = stage[:, 16:16 + total]
    _, ok = _enc(x, out=view, block_r=2, num_warps=1)
    assert ok.all() and torch.equal(view, dense)
    assert (stage[:, :16] == 0xAB).all() and (stage[:, 16 + total:] == 0xAB).all()
    o1, o2 = torch.empty_like(x), torch.empty_like(x)
    nvfp4_decode_ref(dense, o1)
    for lanes in (True, False):
        o2.zero_()
        _dec(view, o2, block_r=4, num_warps=1, lanes=lanes)
        assert torch.equal(o1.view(torch.uint8), o2.view(torch.uint8))
    for kw in (dict(persistent=1), dict(lanes=True)):
        view.zero_()
        _, ok = _enc(x, out=view, block_r=None, num_warps=1, **kw)
        assert ok.all() and torch.equal(view, dense)
    assert (stage[:, :16] == 0xAB).all() and (stage[:, 16 + total:] == 0xAB).all()
    with pytest.raises(ValueError, match="uint8"):
        nvfp4_encode(x, out=stage[:, :total - 1])


def test_e2m1_min_of_rounded_lines_equals_round_to_nearest_even():
    # The kernels' formula: code = min(RN(2y + C), RN(y + 2 + C), RN(y/2 + 4 + C), C + 7) - C
    lattice = torch.arange(0, 10 * 4096, dtype=torch.float32) / 4096
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0])
    y = torch.cat([lattice, mids, torch.nextafter(mids, torch.tensor(0.0)),
                   torch.nextafter(mids, torch.tensor(9.0)), torch.tensor([1e-40, 2.0**-126, 9.5])])
    c = 12582912.0
    u = torch.minimum(torch.minimum(y * 2.0 + c, y + (c + 2)),
                      torch.minimum(y * 0.5 + (c + 4), torch.tensor(c + 7)))
    assert torch.equal(u.view(torch.int32) - 0x4B400000, e2m1_code(y))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["gauss", "wide", "outlier", "tiny"])
def test_cuda_triton_matches_cpu_reference(dtype, kind):
    # The oracle runs on CPU copies: the GPU's kernels must give the CPU reference's bytes.
    if kind == "tiny" and dtype == torch.float16:
        return
    shapes = [(3, 2, 2, 8, 16, 128), (2, 2, 2, 3, 5, 48)]  # Qwen3-like slab; odd unaligned one
    for i, shape in enumerate(shapes):
        x = _special_pages(dtype, kind, shape=shape, seed=100 * i + DTYPES.index(dtype))
        ref, fr = nvfp4_encode_ref(x)
        o_ref = nvfp4_decode_ref(ref, torch.empty_like(x))
        xc = x.cuda()
        for kw in (dict(), dict(lanes=False), dict(block_r=4), dict(num_warps=8)):
            for asm in (None, False):  # None: inline PTX where the GPU has it (sm_89+)
                got, fg = _enc(xc, asm=asm, **kw)
                assert torch.equal(got.cpu(), ref) and torch.equal(fg.cpu(), fr), kw
        for pad in (8, 5):  # strided payload rows, int32 / byte stores
            stage = torch.zeros(ref.shape[0], 16 + ref.shape[1] + pad, dtype=torch.uint8,
                                device="cuda")
            got, fg = nvfp4_encode(xc, out=stage[:, 16:16 + ref.shape[1]])
            assert torch.equal(got.cpu(), ref) and torch.equal(fg.cpu(), fr)
        for block_r, wpt, flat in ((8, 1, False), (32, 4, False), (16, 2, True), (64, 4, True)):
            o = _dec(ref.cuda(), torch.empty_like(xc), block_r=block_r,
                     words_per_thread=wpt, flat=flat)
            assert torch.equal(o.cpu().view(torch.uint8), o_ref.view(torch.uint8))
        ids = torch.tensor([1, 0], device="cuda")
        got, _ = nvfp4_encode(xc, ids)
        assert torch.equal(got.cpu(), nvfp4_encode_ref(x, ids.cpu())[0])


def test_page_ids_gather_and_scatter_match_dense():
    pool = _pages((6, 1, 2, 2, 4, 32), torch.bfloat16, seed=3)
    ids = torch.tensor([4, 0, 5])
    dense, _ = nvfp4_encode_ref(pool[ids])
    for fn in (nvfp4_encode_ref, lambda p, i: _enc(p, i, block_r=4, num_warps=1),
               lambda p, i: _enc(p, i, num_warps=1)):
        got, _ = fn(pool, ids)
        assert torch.equal(got, dense)
    for fn in (nvfp4_decode_ref, lambda p, o, i: _dec(p, o, i, block_r=4, num_warps=1)):
        out = torch.full_like(pool, 7.0)
        fn(dense, out, ids)
        assert (out[[1, 2, 3]] == 7.0).all()  # untouched pages stay untouched
        ref = nvfp4_decode_ref(dense, torch.empty_like(pool[:3]))
        assert torch.equal(out[ids], ref)


def test_nonfinite_and_huge_pages_are_flagged():
    x = _pages((4, 1, 2, 1, 2, 16), torch.float32, seed=1)
    x[1, 0, 1, 0, 1, 3] = float("nan")
    x[2, 0, 0, 0, 0, 0] = float("-inf")
    x[3, 0, 0, 0, 0, 1] = 2.0**127  # MAX_AMAX: decode could overflow fp32
    x[0, 0, 0, 0, 0, 1] = 2.0**126
    for fn in (nvfp4_encode_ref, lambda p: _enc(p, block_r=2, num_warps=1)):
        _, ok = fn(x)
        assert ok.tolist() == [True, False, False, False]


def test_tiny_slabs_store_zeros():
    x = torch.full((1, 1, 2, 1, 1, 16), 2.0**-110)  # amax / 2688 < 2**-115
    x[0, 0, 1] = 2.0**-100  # the V slab's scale 2**-100 / 2688 is kept
    payload, _ = nvfp4_encode_ref(x)
    out = nvfp4_decode_ref(payload, torch.empty_like(x))
    assert (out[0, 0, 0] == 0).all()
    assert torch.allclose(out[0, 0, 1], x[0, 0, 1], rtol=2**-4)


def test_layout_and_bad_shapes():
    assert nvfp4_layout(72, 128, 128) == (0, 288, 288 + 589824, 288 + 589824 + 73728)
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4_encode_ref(torch.zeros(1, 1, 2, 1, 1, 24))
    with pytest.raises(ValueError, match="head_dim"):
        nvfp4_encode_ref(torch.zeros(1, 2, 1, 1, 16))
    with pytest.raises(ValueError, match="bfloat16/float16/float32"):
        nvfp4_encode_ref(torch.zeros(1, 1, 2, 1, 1, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        nvfp4_encode_ref(torch.zeros(1, 1, 2, 1, 16, 2).transpose(-1, -2))
    payload, _ = nvfp4_encode_ref(torch.zeros(1, 1, 2, 1, 1, 16))
    with pytest.raises(ValueError, match="uint8"):
        nvfp4_decode_ref(payload[:, :-1], torch.zeros(1, 1, 2, 1, 1, 16))


@pytest.mark.parametrize("cls, kw, msg", [
    (EncodeLaunch, dict(block_r=3), "EncodeLaunch.block_r must be a power of two or None, got 3"),
    (EncodeLaunch, dict(num_warps=0), "EncodeLaunch.num_warps must be a power of two, got 0"),
    (EncodeLaunch, dict(persistent=-1), "EncodeLaunch.persistent must be an integer >= 0"),
    (EncodeLaunch, dict(stages=True), "EncodeLaunch.stages must be an integer >= 1, got True"),
    (DecodeLaunch, dict(block_r=None), "DecodeLaunch.block_r must be a power of two, got None"),
    (DecodeLaunch, dict(words_per_thread=6), "DecodeLaunch.words_per_thread must be a power of two"),
])
def test_bad_launch_is_refused_naming_the_field(cls, kw, msg):
    with pytest.raises(ValueError, match=re.escape(msg)):
        cls(**kw)


def test_e2m1_grid_matches_ml_dtypes_on_every_rounding():
    # Every fp32 in [0, 8) on a 2**-12 lattice (hits every tie exactly) plus 1-ulp neighbours of
    # each midpoint and values far above the top of the grid.
    lattice = np.arange(0, 8 * 4096, dtype=np.float32) / 4096
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], dtype=np.float32)
    near = np.concatenate([np.nextafter(mids, 0), mids, np.nextafter(mids, 100)])
    big = np.array([6.5, 7.0, 1e3, 3.4e38], dtype=np.float32)
    y = np.concatenate([lattice, near, big]).astype(np.float32)
    ours = e2m1_value(e2m1_code(torch.from_numpy(y))).numpy()
    oracle = y.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(ours, oracle)
    assert sorted(set(ours.tolist())) == list(E2M1_GRID)


def test_e4m3_round_matches_torch_float8():
    # every bf16 bit pattern in [0, 448] (all E4M3 ties included), plus fp32 neighbours
    b = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    b = b[b <= 448.0]
    v = torch.cat([b, torch.nextafter(b, torch.tensor(0.0)), torch.nextafter(b, torch.tensor(1e9))])
    v = v[(v >= 0) & (v <= 448.0)].contiguous()
    q, code = e4m3_round(v)
    oracle = v.to(torch.float8_e4m3fn)
    assert torch.equal(q, oracle.float())
    assert torch.equal(code, oracle.view(torch.uint8).to(torch.int32))
    assert torch.equal(e4m3_value(code), q)


def test_e4m3_ties_to_even():
    v = torch.tensor([1.0625, 1.1875, 1.5 * 2**-9, 2.5 * 2**-9, 0.5 * 2**-9, 7.5 * 2**-9, 440.0])
    q, code = e4m3_round(v)
    assert q.tolist() == [1.0, 1.25, 2 * 2**-9, 2 * 2**-9, 0.0, 8 * 2**-9, 448.0]
    assert code.tolist() == [0x38, 0x3A, 0x02, 0x02, 0x00, 0x08, 0x7E]
