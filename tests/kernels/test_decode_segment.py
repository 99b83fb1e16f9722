"""kernels.decode_segment: batch-1 decode attention + o_proj in one launch.

CPU: which shapes and plans it takes (everything else keeps the Triton path). CUDA (sm_90): its
outputs against the Triton attention + ``gemv_add_norm`` path and a float32 reference, over
contexts that leave pages, splits and a warp's 32-page id window partly filled; graph replay ==
eager bit for bit; the switch; a Qwen3 model's batch-1 decode through it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvstrata.kernels import decode_segment as ds
from kvstrata.kernels.attention import paged_attention
from kvstrata.kernels.attention_plan import plan_attention
from kvstrata.kernels.gemv import gemv_add_norm

from segment_checks import graph_replay_equals_eager

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and (
    torch.cuda.get_device_properties(0).multi_processor_count >= ds.BLOCKS)
cuda = [pytest.mark.gpu, pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU, >= 128 SMs")]


def _case(device, ctx, hq=32, hkv=8, n=4096, layers=2, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    pages = -(-ctx // 16) + 3

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16).to(device)

    kv = rnd(pages, layers, 2, hkv, 16, 128)
    bt = torch.randperm(pages, generator=g)[None].to(torch.int32).to(device)
    meta = plan_attention(bt, [ctx], [1], page_size=16, num_kv_heads=hkv)
    q = rnd(1, hq, 128)
    w = rnd(n, hq * 128, scale=0.02)
    res = rnd(1, n)
    gam = (1 + rnd(n, scale=0.1).float()).to(torch.bfloat16)
    return q, kv, meta, w, res, gam


def test_shapes_it_takes_and_refuses():
    q, kv, meta, w, res, gam = _case("cpu", 100)
    assert ds.segment_shapes_ok(q, kv, meta, w, None, None)
    # the CPU never runs it, whatever the shapes
    assert not ds.decode_segment_ok(q, kv, meta, w, None, None)
    refused = {
        "two queries": (q, kv, dataclasses.replace(meta, max_query_len=2), w, None, None),
        "block mode": (q, kv, dataclasses.replace(meta, causal=False), w, None, None),
        "sliding window": (q, kv, meta, w, None, 64),
        "o_proj bias": (q, kv, meta, w, torch.zeros(4096), None),
        "fp16 q": (q.half(), kv, meta, w, None, None),
        "head dim 64": (q[..., :64], kv, meta, w, None, None),
        "page of 32": (q, kv.reshape(-1, 2, 2, 8, 32, 128), meta, w, None, None),
        "N not a multiple of 1024": (q, kv, meta, w[:3072 + 512], None, None),
        "N above 4096": (q, kv, meta, torch.cat([w, w]), None, None),
        "weight not contiguous": (q, kv, meta, w.t().contiguous().t(), None, None),
        "16 query heads per KV head": (q, kv[:, :, :, :2].contiguous(), meta, w, None, None),
        "block-table row with a stride": (q, kv, dataclasses.replace(
            meta, block_tables=torch.zeros((1, 32), dtype=torch.int32)[:, ::2]), w, None, None),
    }
    for why, args in refused.items():
        assert not ds.segment_shapes_ok(*args), why
    two = plan_attention(torch.zeros((2, 8), dtype=torch.int32), [5, 5], [1, 1], page_size=16)
    assert not ds.segment_shapes_ok(q, kv, two, w, None, None)


def test_attention_alone_shapes():
    """The attention-only launch takes what the segment takes, less the o_proj operands."""
    q, kv, meta, w, res, gam = _case("cpu", 100)
    assert ds.attention_shapes_ok(q, kv, meta, None)
    assert not ds.decode_attention_ok(q, kv, meta, None)      # the CPU never runs it
    for why, args in {
            "two queries": (q, kv, dataclasses.replace(meta, max_query_len=2), None),
            "sliding window": (q, kv, meta, 64), "fp16 q": (q.half(), kv, meta, None),
            "page of 32": (q, kv.reshape(-1, 2, 2, 8, 32, 128), meta, None),
            "16 query heads per KV head": (q, kv[:, :, :, :2].contiguous(), meta, None)}.items():
        assert not ds.attention_shapes_ok(*args), why


def test_shared_memory_fits_a_hopper_block():
    for group, k in ((4, 4096), (8, 4096), (2, 2048), (1, 256)):
        assert ds.smem_bytes(group, k, ds.SMEM_ROWS) <= 227 * 1024


def _triton(q, kv, layer, meta, w, res, gam):
    o = paged_attention(q, kv, layer, meta, sm_scale=128 ** -0.5)
    return gemv_add_norm(o.reshape(1, -1), w, None, res, gam, 1e-6)


def _segment(q, kv, layer, meta, w, res, gam):
    return ds.decode_segment(q, kv, layer, meta, sm_scale=128 ** -0.5, weight=w, residual=res,
                             norm_weight=gam, eps=1e-6)


@pytest.mark.parametrize("ctx", [1, 5, 16, 17, 255, 1000, 4097, 8192, 70001])
@pytest.mark.parametrize("shape", [(32, 8, 4096), (16, 8, 1024)])
@pytest.mark.parametrize("mark", [pytest.param(0, marks=cuda)])
def test_cuda_equals_the_triton_path(ctx, shape, mark, monkeypatch):
    monkeypatch.setenv(ds.SEGMENT_ENV, "1")
    hq, hkv, n = shape
    q, kv, meta, w, res, gam = _case("cuda", ctx, hq, hkv, n, seed=ctx)
    assert ds.decode_segment_ok(q, kv, meta, w, None, None)
    x, h, rms = _segment(q, kv, 1, meta, w, res, gam)
    tx, th, trms = _triton(q, kv, 1, meta, w, res, gam)
    # float32 reference of h: the two kernels differ from it by their summation orders
    o = paged_attention(q.float(), kv.float(), 1, meta, sm_scale=128 ** -0.5, impl="torch")
    ref = res.float() + o.reshape(1, -1).to(torch.bfloat16).float() @ w.float().t()
    err, terr = (h.float() - ref).abs().max().item(), (th.float() - ref).abs().max().item()
    assert err <= max(2 * terr, 2e-2), (err, terr)
    torch.testing.assert_close(h.float(), th.float(), atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(x.float(), tx.float(), atol=6e-2, rtol=2e-2)
    assert rms.parts.shape == (1, ds.BLOCKS) and rms.dim == n
    torch.testing.assert_close(rms.rstd(), trms.rstd(), atol=0, rtol=2e-3)
    # what it writes is what it computes from its own h: g * h and the sums of squares
    assert torch.equal(x, (gam.float() * h.float()).to(torch.bfloat16))
    torch.testing.assert_close(rms.parts.sum(), h.float().square().sum(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("mark", [pytest.param(0, marks=cuda)])
def test_cuda_nan_past_the_sequence(mark):
    """Pool slots past the sequence (the last page's tail) may hold anything, NaN too."""
    q, kv, meta, w, res, gam = _case("cuda", 1000)
    page = meta.block_tables[0, 1000 // 16].item()
    kv[page, :, :, :, 1000 % 16:] = float("nan")
    x, h, _ = _segment(q, kv, 1, meta, w, res, gam)
    tx, th, _ = _triton(q, kv, 1, meta, w, res, gam)
    assert torch.isfinite(h).all() and torch.isfinite(x).all()
    torch.testing.assert_close(h.float(), th.float(), atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("mark", [pytest.param(0, marks=cuda)])
def test_cuda_graph_replay_equals_eager_bit_for_bit(mark):
    q, kv, meta, w, res, gam = _case("cuda", 3000)
    graph_replay_equals_eager(lambda m: _segment(q, kv, 1, m, w, res, gam), meta)


@pytest.mark.parametrize("ctx", [1, 5, 16, 17, 255, 1000, 4097, 8192, 70001])
@pytest.mark.parametrize("shape", [(32, 8), (16, 8), (8, 2)])
@pytest.mark.parametrize("mark", [pytest.param(0, marks=cuda)])
def test_cuda_attention_alone_equals_the_triton_kernel(ctx, shape, mark, monkeypatch):
    """``paged_attention`` at batch-1 decode runs the one-launch CUDA kernel (``impl="auto"``)
    and matches the Triton kernel and a float32 reference; NaN past the sequence is ignored;
    plans longer than ``ATTENTION_MAX_CONTEXT`` (here 64k, for the 70,001-token case) keep the
    Triton kernel."""
    monkeypatch.setenv(ds.SEGMENT_ENV, "1")
    monkeypatch.setattr(ds, "ATTENTION_MAX_CONTEXT", 65536)
    hq, hkv = shape
    q, kv, meta, *_ = _case("cuda", ctx, hq, hkv, seed=ctx)
    if ctx % 16:
        kv[meta.block_tables[0, ctx // 16].item(), :, :, :, ctx % 16:] = float("nan")
    served = ctx <= ds.ATTENTION_MAX_CONTEXT
    assert ds.decode_attention_ok(q, kv, meta, None) == served
    calls = []
    real = ds.decode_attention
    monkeypatch.setattr(ds, "decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    via = paged_attention(q, kv, 1, meta, sm_scale=128 ** -0.5)
    assert calls == ([1] if served else [])
    got = via if served else real(q, kv, 1, meta, sm_scale=128 ** -0.5)   # the kernel alone
    assert got.shape == q.shape and got.dtype == torch.bfloat16
    tri = paged_attention(q, kv, 1, meta, sm_scale=128 ** -0.5, impl="triton")
    assert calls == ([1] if served else [])
    ref = paged_attention(q.float(), kv.float(), 1, meta, sm_scale=128 ** -0.5, impl="torch")
    assert torch.isfinite(got).all()
    err, terr = (got.float() - ref).abs().max().item(), (tri.float() - ref).abs().max().item()
    assert err <= max(2 * terr, 4e-3), (err, terr)
    torch.testing.assert_close(got.float(), tri.float(), atol=8e-3, rtol=2e-2)


@pytest.mark.parametrize("mark", [pytest.param(0, marks=cuda)])
def test_cuda_attention_alone_graph_replay_equals_eager(mark):
    q, kv, meta, *_ = _case("cuda", 3000)

    def run(m):
        o = ds.decode_attention(q, kv, 1, m, sm_scale=128 ** -0.5)
        return o, o
    graph_replay_equals_eager(run, meta)


@pytest.mark.parametrize("mark", [pytest.param(0, marks=cuda)])
def test_cuda_switch_turns_it_off(mark, monkeypatch):
    monkeypatch.setenv(ds.SEGMENT_ENV, "1")
    q, kv, meta, w, *_ = _case("cuda", 100)
    assert ds.decode_segment_ok(q, kv, meta, w, None, None)
    assert not ds.decode_segment_ok(q, kv, meta, w, None, None, impl="triton")
    monkeypatch.setenv(ds.SEGMENT_ENV, "0")
    assert not ds.decode_segment_ok(q, kv, meta, w, None, None)
    assert not ds.decode_attention_ok(q, kv, meta, None)


@pytest.mark.parametrize("mark", [pytest.param(0, marks=cuda)])
def test_cuda_qwen3_batch1_decode_takes_it(mark, tmp_path, monkeypatch):
    """A Qwen3 with 128-dim heads (8 query, 2 KV heads, hidden 1024) decodes at batch 1 through
    the segment, one launch per layer, and its hidden states match those of the Triton path
    (the same tokens fed to both); prefill never takes it."""
    transformers = pytest.importorskip("transformers")
    from kvstrata.runtime import qwen3
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=256, hidden_size=1024, intermediate_size=1536, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1e6, max_position_embeddings=4096, tie_word_embeddings=True,
        torch_dtype="bfloat16")
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    model = qwen3.Qwen3Model.from_pretrained(tmp_path, device="cuda", dtype="bfloat16")
    calls = []
    real = qwen3.decode_segment
    monkeypatch.setattr(qwen3, "decode_segment", lambda *a, **k: calls.append(1) or real(*a, **k))
    tokens = torch.randint(0, 256, (310,), generator=torch.Generator().manual_seed(1)).cuda()
    bt = torch.arange(40, dtype=torch.int32, device="cuda")[None]

    def run(flag):
        monkeypatch.setenv(ds.SEGMENT_ENV, flag)
        kv = torch.zeros((40, 2, 2, 2, 16, 128), dtype=torch.bfloat16, device="cuda")
        pos = torch.arange(310, device="cuda")
        hs = []
        with torch.no_grad():
            model(tokens[:300], pos[:300], plan_attention(bt, [300], [300], page_size=16),
                  pos[:300], kv)
            for t in range(300, 310):
                h, _ = model(tokens[t:t + 1], pos[t:t + 1],
                             plan_attention(bt, [t + 1], [1], page_size=16), pos[t:t + 1], kv)
                hs.append(h)
        return torch.cat(hs)

    off = run("0")
    assert not calls
    on = run("1")
    assert len(calls) == 10 * 2
    torch.testing.assert_close(on.float(), off.float(), atol=6e-2, rtol=3e-2)


# the builds of the switches ``pages, unroll, hwait``: each split's pages contiguous or dealt
# round robin (their ids read beside the length), the page loop one or two pages per trip or
# each page loaded then used (2), the merge after a grid barrier or after the KV head's splits
# alone; the attention-only build ships ``1, 1, 1`` with 8 warps, the segment ``0, 0, 0``
BUILDS = [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (1, 1, 1), (0, 0, 1), (1, 2, 1)]
SHIPPED = ds.ATTENTION_VARIANT
# the attention-only build also takes ``warps`` per block (more with the page loop of unroll 2)
SWITCHES = [b for b in BUILDS if b + SHIPPED[len(b):] != SHIPPED] + [(1, 2, 1, 12),
                                                                      (0, 2, 1, 12)]
SEG_SHIPPED = ds.VARIANT[4:]


def _attention(q, kv, layer, meta, switches):
    return ds.decode_attention(q, kv, layer, meta, sm_scale=128 ** -0.5, _variant=switches)


def test_shipped_switches():
    """As measured (docs/benchmarks.md, thirty-fourth and thirty-ninth runner sessions)."""
    assert SHIPPED == (1, 2, 1, 8) and SEG_SHIPPED == (0, 0, 0)


@pytest.mark.parametrize("ctx", [1, 17, 1000, 4097, 8192, 70001])
@pytest.mark.parametrize("shape", [(32, 8), (8, 2)])
@pytest.mark.parametrize("switches", SWITCHES)
@pytest.mark.parametrize("mark", [pytest.param(0, marks=cuda)])
def test_cuda_attention_switches_equal_the_shipped_build(ctx, shape, switches, mark):
    """Each other build of the attention-only kernel against the shipped build and a float32
    reference, NaN past the sequence; the loop one page per trip or unrolled (the same
    products in the same order) is bit-equal to the shipped one where the pages per split
    and the warps are the same."""
    hq, hkv = shape
    q, kv, meta, *_ = _case("cuda", ctx, hq, hkv, seed=ctx)
    if ctx % 16:
        kv[meta.block_tables[0, ctx // 16].item(), :, :, :, ctx % 16:] = float("nan")
    shipped = _attention(q, kv, 1, meta, SHIPPED)
    got = _attention(q, kv, 1, meta, switches)
    assert torch.isfinite(got).all()
    if switches[0] == SHIPPED[0] and (switches + SHIPPED[len(switches):])[3] == SHIPPED[3]:
        assert torch.equal(got, shipped)
    ref = paged_attention(q.float(), kv.float(), 1, meta, sm_scale=128 ** -0.5, impl="torch")
    err, serr = (got.float() - ref).abs().max().item(), (shipped.float() - ref).abs().max().item()
    assert max(err, serr) <= max(2 * min(err, serr), 4e-3), (err, serr)


@pytest.mark.parametrize("switches", SWITCHES)
@pytest.mark.parametrize("mark", [pytest.param(0, marks=cuda)])
def test_cuda_attention_switches_graph_replay_equals_eager(switches, mark):
    q, kv, meta, *_ = _case("cuda", 3000)

    def run(m):
        o = _attention(q, kv, 1, m, switches)
        return o, o
    graph_replay_equals_eager(run, meta)


# the segment's builds: its switches ``pages, unroll, hwait`` as above, and the rows past the
# shared-memory ones in registers (``rreg``) after the grid barrier or, with ``hwait``, once a
# block has merged
SEG_BUILDS = ([ds.VARIANT[:4] + b for b in BUILDS if b != SEG_SHIPPED]
              + [ds.VARIANT[:1] + (1,) + ds.VARIANT[2:6] + (w,) for w in (0, 1)])


@pytest.mark.parametrize("ctx", [17, 4097, 70001])
@pytest.mark.parametrize("switches", SEG_BUILDS)
@pytest.mark.parametrize("mark", [pytest.param(0, marks=cuda)])
def test_cuda_segment_switches_equal_the_shipped_build(ctx, switches, mark):
    """The segment (attention + o_proj, a PDL launch as shipped) in each other build: within
    the Triton path's bounds of the shipped build, bit-equal with the same pages per split;
    graph replay == eager."""
    q, kv, meta, w, res, gam = _case("cuda", ctx, seed=ctx)

    def run(v, m=meta):
        return ds.decode_segment(q, kv, 1, m, sm_scale=128 ** -0.5, weight=w, residual=res,
                                 norm_weight=gam, eps=1e-6, _variant=v)
    x0, h0, _ = run(ds.VARIANT)
    x, h, _ = run(switches)
    if switches[4] == ds.VARIANT[4]:
        assert torch.equal(h, h0) and torch.equal(x, x0)
    torch.testing.assert_close(h.float(), h0.float(), atol=3e-2, rtol=2e-2)
    if ctx == 4097:
        graph_replay_equals_eager(lambda m: run(switches, m), meta)


def test_the_segment_refuses_warps_its_rows_do_not_divide_among():
    """The segment's 32 o_proj rows per block (Qwen3-8B's 4096) go 4 to each of 8 warps; 12
    warps are for the attention-only build (its phase 4 never runs)."""
    with pytest.raises(ValueError, match="32 o_proj rows per block do not divide among 12"):
        ds.source(8, 4, 4096, 4096, warps=12)
    assert "#define NW 12" in ds.source(8, 4, 4096, ds.BLOCKS * 12, attn_only=True, warps=12)


def test_variant_from_the_environment(monkeypatch):
    monkeypatch.delenv(ds.VARIANT_ENV, raising=False)
    assert ds._env_variant() == ds.VARIANT
    monkeypatch.setenv(ds.VARIANT_ENV, "16:0:1")
    assert ds._env_variant() == (16, 0, 1) + ds.VARIANT[3:]
    monkeypatch.setenv(ds.VARIANT_ENV, "8")
    assert ds._env_variant() == (8,) + ds.VARIANT[1:]
    # when the rows start is a switch of the source: the shipped build starts them once warp
    # 0's last page loads are issued
    assert "#define RLATE 2" in ds.source(8, 4, 4096, 4096, *ds.VARIANT)
    assert "#define RLATE 1" in ds.source(8, 4, 4096, 4096, 16, 0, 1)
    assert "#define RLATE 0" in ds.source(8, 4, 4096, 4096, 16, 0, 0)
