"""The bulk-copy products (kernels/stream_gemv.py: one row; kernels/stream_rows.py: 2-16 rows):
every epilogue's source compiles on the CPU without spills (NVRTC, as test_cuda_sources does
for the segments); on an H200/H100 against the float32 product and the Triton kernel's
epilogues (bf16, within rounding), h bit for bit add_rms_norm's, deterministic, CUDA-graph
replay == eager bit for bit, PDL on == off, and the switch that keeps the Triton kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvstrata.kernels import _device
from kvstrata.kernels import stream_gemv as sg
from kvstrata.kernels import stream_rows as sr
from kvstrata.kernels.gemv import GemvLaunch, RowRms, _gemv, gemv, gemv_add_norm
from kvstrata.kernels.layer_ops import add_rms_norm

from test_cuda_sources import _check, _compile

# (out rows, in): Qwen3-8B's q/k/v, gate/up (gated), down, o_proj; a drafter-sized and an
# uneven one (rows not a multiple of the blocks)
SHAPES = [(6144, 4096, False), (12288, 4096, True), (4096, 12288, False), (4096, 4096, False),
          (1000, 512, False), (1333, 768, True)]


@pytest.mark.parametrize("n,k,gated", SHAPES)
@pytest.mark.parametrize("rms_in,add_norm", [(False, False), (True, False), (False, True)])
def test_sources_compile_without_spills(n, k, gated, rms_in, add_norm):
    """Every epilogue, each with the early launch of the next kernel and without."""
    if gated and add_norm:
        pytest.skip("the gated product has no add-norm epilogue")
    src, smem = sg.build(k, n, 132, gated, rms_in, add_norm, *sg.VARIANT[:3], 1)
    assert smem <= 227 * 1024
    _check(_compile(src, "90"), "stream_gemv", sg.VARIANT[0] * 32)
    for trigger in (0, 1):
        src, _ = sg.build(k, n, 132, gated, rms_in, add_norm, 8, 192, trigger, 1)
        _check(_compile(src, "90"), "stream_gemv", 256)


def test_ring_fits_shared_memory():
    # every stage a whole row (or gate + up row); the ring a multiple of the warps
    for k, gated in ((4096, False), (4096, True), (12288, False), (256, False)):
        ns = sg.stages(k, gated, 8, 192)
        assert ns % 8 == 0 and ns >= 8
        _, smem = sg.build(k, 4096, 132, gated, True, False, 8, 192, 1, 1)
        assert smem <= 227 * 1024 and sg.fits(k, 4096, gated, 132)
    assert sg.stages(4096, False, 8, 192) == 24 and sg.stages(12288, False, 8, 192) == 8
    assert not sg.fits(16384, 4096, True, 132)          # 8 stages of 64 KB do not fit
    assert not sg.fits(4096, 100, False, 132)           # fewer rows than blocks
    assert not sg.fits(4000, 4096, False, 132)          # K not a multiple of 256


def test_not_served_off_hopper_or_for_other_operands(monkeypatch):
    x, w = torch.randn(1, 256).bfloat16(), torch.randn(512, 256).bfloat16()
    assert not sg.stream_gemv_ok(x, w, None, False)                 # CPU
    assert not sg.stream_gemv_ok(x, w, None, False, impl="triton")
    with pytest.raises(ValueError, match="colon-separated"):
        monkeypatch.setenv(sg.VARIANT_ENV, "8:x")
        sg._env_variant()
    monkeypatch.setenv(sg.VARIANT_ENV, "4")
    assert sg._env_variant() == (4,) + sg.VARIANT[1:]


cuda = pytest.mark.skipif(not (torch.cuda.is_available()
                               and torch.cuda.get_device_capability()[0] == 9),
                          reason="needs a Hopper GPU")


def _ops(n, k, gated, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, k, generator=g, **bf)
    w = torch.randn(n * (2 if gated else 1), k, generator=g, **bf) * k ** -0.5
    return x, w


def _close(got, want):
    torch.testing.assert_close(got.float(), want.float(), rtol=0,
                               atol=2e-2 * want.float().abs().max().item())


TRITON = GemvLaunch(32, 128, 3, 4)      # an explicit tile keeps _gemv on the Triton kernel


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("n,k,gated", SHAPES)
def test_cuda_products_against_float32_and_the_triton_kernel(n, k, gated, monkeypatch):
    """Every kind of product, the gated one (not served as shipped) by its switch."""
    monkeypatch.setenv(sg.VARIANT_ENV, "8:192:4:7")
    x, w = _ops(n, k, gated, seed=n + k)
    assert sg.stream_gemv_ok(x, w, None, gated)
    y = gemv(x, w, gated=gated)
    assert torch.equal(y, gemv(x, w, gated=gated))                 # deterministic
    ref = _gemv(x, w, None, TRITON, gated=gated)
    _close(y, ref)
    if not gated:
        _close(y, F.linear(x.float(), w.float()))
    # the input's row scale (a previous norm's rsqrt) in the epilogue
    parts = torch.rand(1, 128, device="cuda") * k
    rms = RowRms(parts, k, 1e-6)
    _close(gemv(x, w, gated=gated, rms=rms), _gemv(x, w, None, TRITON, gated=gated, rms=rms))


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4096, 12288), (1000, 512)])
def test_cuda_add_norm_epilogue(n, k):
    x, w = _ops(n, k, False, seed=n)
    g = torch.Generator(device="cuda").manual_seed(1)
    res = torch.randn(1, n, generator=g, device="cuda", dtype=torch.bfloat16)
    gamma = 1 + 0.1 * torch.randn(n, generator=g, device="cuda", dtype=torch.bfloat16)
    _check_add_norm(x, w, res, gamma)


def _check_add_norm(x, w, res, gamma):
    """h bit for bit add_rms_norm's, g * h as rounded, one part per block and row, the parts'
    rstd within 1e-5, deterministic."""
    xg, h, rms = gemv_add_norm(x, w, None, res, gamma, 1e-6)
    blocks = torch.cuda.get_device_properties(0).multi_processor_count
    assert rms.parts.shape == (x.shape[0], blocks)
    x_ref, h_ref = add_rms_norm(gemv(x, w), gamma, 1e-6, residual=res)
    assert torch.equal(h, h_ref)
    assert torch.equal(xg, (gamma.float() * h.float()).to(torch.bfloat16))
    torch.testing.assert_close(rms.rstd(), h.float().square().mean(1).add(1e-6).rsqrt(),
                               rtol=1e-5, atol=0)
    xg2, h2, rms2 = gemv_add_norm(x, w, None, res, gamma, 1e-6)
    assert torch.equal(xg, xg2) and torch.equal(h, h2) and torch.equal(rms.parts, rms2.parts)


def _check_graph(chain, xd, monkeypatch):
    """``chain`` captured in a graph: replays over three inputs equal eager launches bit for
    bit, and so do launches without PDL."""
    eager = chain(xd)
    xs = xd.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(xs)
    for seed in range(3):
        g = torch.Generator(device="cuda").manual_seed(seed)
        xs.copy_(torch.randn(xd.shape, generator=g, device="cuda", dtype=xd.dtype)
                 if seed else xd)
        graph.replay()
        want = chain(xs)
        assert all(torch.equal(a, b) for a, b in zip(out, want))
    assert all(torch.equal(a, b) for a, b in zip(chain(xd), eager))
    monkeypatch.setenv(_device.PDL_ENV, "0")
    assert all(torch.equal(a, b) for a, b in zip(chain(xd), eager))
    return out


@cuda
@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager_and_pdl_off(monkeypatch):
    """A layer's three products chained (down -> q/k/v -> gate/up), captured in a graph:
    replays equal the eager launches bit for bit, and so do launches without PDL."""
    xd, wd = _ops(4096, 12288, False, seed=3)
    _, wq = _ops(6144, 4096, False, seed=4)
    _, wgu = _ops(12288, 4096, True, seed=5)
    res = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    gamma = torch.ones(4096, device="cuda", dtype=torch.bfloat16)

    def chain(xin):
        xg, h, rms = gemv_add_norm(xin, wd, None, res, gamma, 1e-6)
        q = gemv(xg, wq, rms=rms)
        return q, gemv(xg, wgu, gated=True, rms=rms)

    out = _check_graph(chain, xd, monkeypatch)
    assert not sg.stream_gemv_ok(out[0][:, :4096].contiguous(), wgu, None, True)  # as shipped
    monkeypatch.setenv(sg.STREAM_ENV, "0")
    assert not sg.stream_gemv_ok(xd, wd, None, False)


# the rows build (2-16 rows, mma consumers): q/k/v, down, the drafter's k/v and fc, gate/up
# (gated), uneven ones
ROW_SHAPES = [(6144, 4096, False), (4096, 12288, False), (2048, 4096, False),
              (4096, 20480, False), (12288, 4096, True), (1000, 512, False), (1333, 768, True),
              (1320, 640, False)]


@pytest.mark.parametrize("n,k,gated", ROW_SHAPES)
@pytest.mark.parametrize("kc", [64, 128])
def test_rows_sources_compile_without_spills(n, k, gated, kc):
    for rms_in, add_norm in ((False, False), (True, False), (False, True)):
        if (gated and add_norm) or sr.rows_layout(k, n, 132, 8, 192, kc, add_norm,
                                                  gated) is None:
            continue
        src, smem = sr.build_rows(k, n, 132, rms_in, add_norm, 8, 192, kc, 1, 1, gated)
        assert smem <= 227 * 1024
        _check(_compile(src, "90"), "stream_rows", 256)


def test_rows_layout_and_switches(monkeypatch):
    # q/k/v: 47 rows per block -> 3 m-tiles; 64 columns a stage: 8 KB, 24 stages in 192 KB
    assert sr.rows_layout(4096, 6144, 132, 8, 192, 64, False) == (24, 3, 2048 + 24 * 8192 + 64)
    assert sr.rows_layout(4096, 6144, 132, 8, 192, 128, False)[0] == 8   # 16 KB: 12 -> 8
    assert sr.rows_layout(12288, 4096, 132, 8, 192, 64, True)[:2] == (32, 2)
    assert sr.rows_layout(4000, 4096, 132, 8, 192, 64, False) is None     # K % columns
    assert sr.rows_layout(4096, 100, 132, 8, 192, 64, False) is None      # fewer rows
    assert sr.rows_layout(4096, 6144, 132, 8, 192, 96, False) is None     # not 64 columns
    assert sr.rows_layout(4096, 40000, 132, 8, 192, 64, False) is None    # > 255 rows
    with pytest.raises(ValueError, match="does not fit"):
        sr.build_rows(4096, 6144, 132, False, False, 8, 192, 4096, 1, 1)
    x, w = torch.randn(4, 256).bfloat16(), torch.randn(512, 256).bfloat16()
    assert not sr.stream_rows_ok(x, w, None, False)                     # CPU
    monkeypatch.setenv(sr.ROWS_VARIANT_ENV, "4:96")
    assert sr._rows_variant() == (4, 96) + sr.ROWS_VARIANT[2:]


def _rows_ops(m, n, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    return (torch.randn(m, k, generator=g, **bf),
            torch.randn(n, k, generator=g, **bf) * k ** -0.5)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("n,k,gated", ROW_SHAPES)
@pytest.mark.parametrize("m", [2, 5, 16])
def test_cuda_rows_against_float32_and_the_triton_kernel(n, k, gated, m, monkeypatch):
    """Every kind of product, the gated one by its switch."""
    monkeypatch.setenv(sr.ROWS_VARIANT_ENV, "8:192:64:4:7")
    x, w = _rows_ops(m, n * (2 if gated else 1), k, seed=n + k + m)
    assert sr.stream_rows_ok(x, w, None, gated)
    y = gemv(x, w, gated=gated)
    assert y.shape == (m, n) and torch.equal(y, gemv(x, w, gated=gated))   # deterministic
    if not gated:
        _close(y, F.linear(x.float(), w.float()))
    _close(y, _gemv(x, w, None, TRITON, gated=gated))
    parts = torch.rand(m, 128, device="cuda") * k
    rms = RowRms(parts, k, 1e-6)
    _close(gemv(x, w, gated=gated, rms=rms), _gemv(x, w, None, TRITON, gated=gated, rms=rms))
    # a strided input (a view of wider rows) reads the same rows
    wide = torch.zeros(m, k + 64, device="cuda", dtype=torch.bfloat16)
    wide[:, :k] = x
    assert torch.equal(gemv(wide[:, :k], w, gated=gated), y)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("n,k,m", [(4096, 12288, 16), (1000, 512, 3)])
def test_cuda_rows_add_norm_epilogue(n, k, m):
    x, w = _rows_ops(m, n, k, seed=n + m)
    g = torch.Generator(device="cuda").manual_seed(2)
    res = torch.randn(m, n, generator=g, device="cuda", dtype=torch.bfloat16)
    gamma = 1 + 0.1 * torch.randn(n, generator=g, device="cuda", dtype=torch.bfloat16)
    _check_add_norm(x, w, res, gamma)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kinds", ["5", "7"])
def test_cuda_rows_graph_replay_equals_eager_and_pdl_off(kinds, monkeypatch):
    """16 rows: down -> q/k/v (rows build) -> gate/up (Triton as shipped, or the rows build)
    captured in a graph."""
    monkeypatch.setenv(sr.ROWS_VARIANT_ENV, f"8:192:64:4:{kinds}")
    xd, wd = _rows_ops(16, 4096, 12288, seed=3)
    _, wq = _rows_ops(16, 6144, 4096, seed=4)
    _, wgu = _rows_ops(16, 24576, 4096, seed=5)
    res = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    gamma = torch.ones(4096, device="cuda", dtype=torch.bfloat16)

    def chain(xin):
        xg, h, rms = gemv_add_norm(xin, wd, None, res, gamma, 1e-6)
        return gemv(xg, wq, rms=rms), gemv(xg, wgu, gated=True, rms=rms), h

    _check_graph(chain, xd, monkeypatch)
    monkeypatch.setenv(sg.STREAM_ENV, "0")
    assert not sr.stream_rows_ok(xd, wd, None, False)


def test_tensor_map_refuses_what_it_cannot_map():
    """Checked before the driver is asked (no GPU needed): the dtype, the box, and views whose
    rows are not 16-byte aligned."""
    from kvstrata.kernels._cuda import tensor_map_2d
    with pytest.raises(ValueError, match="bf16"):
        tensor_map_2d(torch.zeros(16, 64), 16, 64)
    with pytest.raises(ValueError, match="1-256 rows"):
        tensor_map_2d(torch.zeros(16, 64, dtype=torch.bfloat16), 300, 64)
    with pytest.raises(ValueError, match="64-column boxes"):
        tensor_map_2d(torch.zeros(16, 64, dtype=torch.bfloat16), 16, 32)
    with pytest.raises(ValueError, match="aligned rows"):
        tensor_map_2d(torch.zeros(16, 70, dtype=torch.bfloat16)[:, :64], 16, 64)
