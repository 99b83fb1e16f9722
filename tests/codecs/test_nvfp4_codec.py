"""NVFP4 codec: the pinned byte format, the per-element error bound, error rates, batches."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.codecs import NVFP4Codec, UnencodablePageError, get_codec
from kvstrata.kernels.nvfp4 import e4m3_value, nvfp4_layout
from kvstrata.pagepool.spec import KVGroupSpec

# Example counts scale with the hypothesis profile (ci: bounded; nightly: ~50x more).
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# ulp-relative slack for the final cast to the page dtype (half an ulp, doubled for safety)
CAST_SLACK = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-23}
# the dtype's subnormal spacing: the cast's absolute error below the normal range
ABS_SLACK = {torch.bfloat16: 2.0**-133, torch.float16: 2.0**-24, torch.float32: 2.0**-149}


def _parts(enc):
    """(g [S], codes [S, R, D] int, block step d [S, R, D/16]) from an encoded page."""
    l, _, h, p, d = enc.shape
    s, r = 2 * l, h * p
    _, oc, os_, _ = nvfp4_layout(s, r, d)
    pl = enc.payload.cpu()
    g = pl[:oc].clone().view(torch.float32)
    packed = pl[oc:os_].to(torch.int32).reshape(s, r, d // 2)
    codes = torch.stack((packed & 0xF, packed >> 4), -1).reshape(s, r, d)
    scales = e4m3_value(pl[os_:].to(torch.int32).reshape(s, r, d // 16))
    return g, codes, scales * g[:, None, None]


def _bound(x, enc, dtype):
    """Per-element bound derived from the block step and the E2M1 grid (see codecs/nvfp4.py)."""
    _, _, step = _parts(enc)
    s, r, d = step.shape[0], step.shape[1], step.shape[2] * 16
    a = x.float().abs().reshape(s, r, d // 16, 16)
    dd = step[..., None].expand_as(a)
    y = torch.where(dd > 0, a / torch.where(dd > 0, dd, 1.0), torch.full_like(a, float("inf")))
    half_gap = torch.where(y < 2, 0.25, torch.where(y < 4, 0.5, 1.0))
    b = torch.where(y > 6, a - 6 * dd, half_gap * dd)
    b = torch.where(dd > 0, b, a)  # a zero scale stores the block as zeros
    return (b * (1 + 2.0**-20) + a * CAST_SLACK[dtype] * 2 + ABS_SLACK[dtype]).reshape(x.shape)


def _block_page(values, head_dim=32, dtype=torch.float32):
    """A 1-layer page whose first block holds ``values`` with step exactly 1: the slab max 2688
    (in another row) makes g == 1, so a block whose max is 6 gets e4m3 scale 1."""
    x = torch.zeros(1, 2, 1, 2, head_dim)
    x[0, 0, 0, 1, 0] = 2688.0
    x[0, 0, 0, 0, :len(values)] = torch.tensor(values)
    return x.to(dtype)


def test_ties_round_to_even_and_saturate():
    c = get_codec("nvfp4")
    vals = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5,
            -5.0, -6.0]
    enc = c.encode(_block_page(vals))
    g, codes, step = _parts(enc)
    assert g[0].item() == 1.0 and step[0, 0, 0].item() == 1.0
    assert codes[0, 0, :16].tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 0, 10, 10, 12, 12, 14, 14, 15]
    out = c.decode(enc)[0, 0, 0, 0, :16].tolist()
    assert out == [0, 1, 1, 2, 2, 4, 4, 6, 0, -1, -1, -2, -2, -4, -4, -6]
    # block max 6.3: scale 1.05 rounds down to 1.0 in E4M3, so 6.3 saturates to 6
    enc = c.encode(_block_page([6.3, -6.2, 0.5]))
    _, codes, step = _parts(enc)
    assert step[0, 0, 0].item() == 1.0 and codes[0, 0, :3].tolist() == [7, 15, 1]


def test_nibble_order_and_scale_bytes():
    enc = get_codec("nvfp4").encode(_block_page([0.5, 6.0, -1.0, 0.0, 1.5, -3.0]))
    s, r, d = 2, 2, 32
    _, oc, os_, total = nvfp4_layout(s, r, d)
    pl = enc.payload
    assert pl[:4].tolist() == list(torch.tensor([1.0]).view(torch.uint8).tolist())  # g = 1.0
    assert pl[oc:oc + 3].tolist() == [0x71, 0x0A, 0xD3]  # element 2i low nibble, 2i+1 high
    assert pl[os_] == 0x38  # block scale 1.0 = E4M3 0 0111 000
    assert pl[os_ + 2] == 0x7E  # the 2688 row's block: 2688 / 6 = 448, E4M3 max
    assert enc.nbytes == total == 8 + 64 // 2 * 2 + 64 // 16 * 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_page_and_zero_blocks_decode_to_zeros(dtype):
    c = get_codec("nvfp4")
    z = torch.zeros(2, 2, 2, 4, 32, dtype=dtype)
    enc = c.encode(z)
    assert (enc.payload == 0).all()
    out = c.decode(enc)
    assert torch.equal(out, z) and not out.isnan().any()
    x = torch.randn(2, 2, 2, 4, 32).to(dtype)
    x[0, 1, 1, 2, 16:] = 0
    x[1, 0] = 0
    out = c.decode(c.encode(x))
    assert (out[0, 1, 1, 2, 16:] == 0).all() and (out[1, 0] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_huge_outlier_token(dtype):
    big = 1e4 if dtype != torch.float16 else 3e3
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 2, 4, 16, 64, generator=g)
    x[:, :, :, 7, :] *= big  # one token of every layer and head
    x = x.to(dtype)
    c = get_codec("nvfp4")
    enc = c.encode(x)
    out = c.decode(enc)
    assert torch.isfinite(out).all()
    assert ((out.float() - x.float()).abs() <= _bound(x, enc, dtype)).all()
    rest = torch.ones(16, dtype=torch.bool)
    rest[7] = False
    xr, orr = x[:, :, :, rest].float(), out[:, :, :, rest].float()
    assert ((orr - xr).norm() / xr.norm()).item() < 0.105  # other tokens keep their precision


@settings(max_examples=settings.default.max_examples)
@given(seed=st.integers(0, 2**20), dtype=st.sampled_from(DTYPES),
       shape=st.tuples(st.integers(1, 2), st.integers(1, 2), st.sampled_from([1, 4, 16]),
                       st.sampled_from([16, 48, 128])),
       log_scale=st.integers(-30, 12), spread=st.integers(0, 20))
def test_round_trip_within_the_format_bound(seed, dtype, shape, log_scale, spread):
    l, h, p, d = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(l, 2, h, p, d, generator=g) * 2.0**log_scale
    x = x * torch.exp2(torch.randint(-spread, spread + 1, x.shape, generator=g).float())
    x = x.to(dtype)
    if not torch.isfinite(x).all():
        x = torch.nan_to_num(x, posinf=1.0, neginf=-1.0)
    c = get_codec("nvfp4")
    enc = c.encode(x)
    out = c.decode(enc)
    assert out.dtype == dtype and out.shape == x.shape
    err = (out.float() - x.float()).abs()
    assert (err <= _bound(x, enc, dtype)).all()


@settings(max_examples=max(8, settings.default.max_examples // 5))
@given(seed=st.integers(0, 2**20), dtype=st.sampled_from(DTYPES))
def test_gaussian_relative_rmse(seed, dtype):
    x = torch.randn(4, 2, 8, 16, 128, generator=torch.Generator().manual_seed(seed)).to(dtype)
    c = get_codec("nvfp4")
    out = c.decode(c.encode(x)).float()
    rel = ((out - x.float()).norm() / x.float().norm()).item()
    assert 0.08 <= rel <= 0.105


def test_nonfinite_refused_and_batch_skip():
    c = get_codec("nvfp4")
    x = torch.randn(3, 1, 2, 1, 4, 16)
    x[1, 0, 1, 0, 2, 5] = float("inf")
    with pytest.raises(UnencodablePageError, match="NaN, Inf") as ei:
        c.encode_batch(x)
    assert ei.value.page_indices == [1]
    with pytest.raises(UnencodablePageError):
        c.encode(x[1])
    encs = c.encode_batch(x, errors="skip")
    assert encs[1] is None and encs[0] is not None and encs[2] is not None
    assert torch.equal(c.decode(encs[2]), c.decode(c.encode(x[2])))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_batch_encode_and_decode_into_pool(backend):
    c = NVFP4Codec(backend=backend)
    pool = torch.randn(5, 2, 2, 2, 4, 32).to(torch.bfloat16)
    ids = torch.tensor([3, 1])
    encs = c.encode_batch(pool, ids, to_host=True)
    singles = [get_codec("nvfp4").encode(pool[i]) for i in (3, 1)]
    for e, s in zip(encs, singles):
        assert torch.equal(e.payload, s.payload) and e.checksum == s.checksum
    dst = torch.zeros_like(pool)
    c.decode_rows(torch.stack([e.payload.reshape(-1) for e in encs]), dst, torch.tensor([0, 4]))
    assert torch.equal(dst[0], c.decode(singles[0])) and torch.equal(dst[4], c.decode(singles[1]))
    assert (dst[1:4] == 0).all()
    page = torch.empty_like(pool[2])
    assert c.decode_into(encs[1], page) is page and torch.equal(page, dst[4])
    with pytest.raises(ValueError, match="contiguous tensor of shape"):
        c.decode_into(encs[1], torch.empty(2, 2, 2, 4, 16, dtype=torch.bfloat16))


def test_encoded_nbytes_and_ratio():
    spec = KVGroupSpec("target", num_layers=36, num_kv_heads=8, head_dim=128, codec="nvfp4")
    c = get_codec("nvfp4")
    n = c.encoded_nbytes(spec, 16)
    enc = c.encode(torch.randn(spec.page_shape(16)).to(torch.bfloat16))
    assert enc.nbytes == n == 36 * 2 * 8 * 16 * 128 * 9 // 16 + 36 * 2 * 4
    assert 3.55 < spec.bytes_per_page(16) / n < 3.56
    with pytest.raises(ValueError, match="backend"):
        get_codec("nvfp4", backend="cuda")
