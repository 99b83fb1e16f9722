"""kernels.verify_segment: batch-1 verify attention (2-16 queries) + o_proj in one launch.

CPU: which shapes and plans it takes (everything else keeps the Triton path) and that its
shared memory fits. CUDA (sm_90): its outputs against the Triton attention + ``gemv_add_norm``
path and a float32 reference over contexts that leave pages and splits partly filled, widths
2-16, 4 query heads per KV head (the warpgroup build) and 2 (the ``mma`` build), a shortened
block (``query_lens``), NaN in the pool past the sequence; graph replay ==
eager bit for bit; the switch; a Qwen3 model's batch-1 verify steps through it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvstrata.kernels import verify_segment as vs
from kvstrata.kernels.attention import paged_attention
from kvstrata.kernels.attention_plan import plan_attention
from kvstrata.kernels.gemv import gemv_add_norm

from segment_checks import graph_replay_equals_eager

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and (
    torch.cuda.get_device_properties(0).multi_processor_count >= 128)
cuda = [pytest.mark.gpu, pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU, >= 128 SMs")]


def _case(device, ctx, t=16, hq=32, hkv=8, n=4096, layers=2, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    pages = -(-ctx // 16) + 3

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16).to(device)

    kv = rnd(pages, layers, 2, hkv, 16, 128)
    bt = torch.randperm(pages, generator=g)[None].to(torch.int32).to(device)
    meta = plan_attention(bt, [ctx], [t], page_size=16, num_kv_heads=hkv)
    # q as the q/k/v product's view: tokens (hq + 2 hkv) * 128 apart
    q = rnd(t, hq + 2 * hkv, 128)[:, :hq]
    w = rnd(n, hq * 128, scale=0.02)
    res = rnd(t, n)
    gam = (1 + rnd(n, scale=0.1).float()).to(torch.bfloat16)
    return q, kv, meta, w, res, gam


def test_shapes_it_takes_and_refuses():
    q, kv, meta, w, res, gam = _case("cpu", 100)
    assert vs.segment_shapes_ok(q, kv, meta, w, None, None)
    assert vs.segment_shapes_ok(q[:2], kv, dataclasses.replace(meta, max_query_len=2), w,
                                None, None)
    # the CPU never runs it, whatever the shapes
    assert not vs.verify_segment_ok(q, kv, meta, w, None, None)
    refused = {
        "one query (the decode segment's)": (q[:1], kv, dataclasses.replace(meta,
                                             max_query_len=1), w, None, None),
        "17 queries": (torch.cat([q, q[:1]]), kv, dataclasses.replace(meta, max_query_len=17),
                       w, None, None),
        "rows != max_query_len": (q[:8], kv, meta, w, None, None),
        "block mode": (q, kv, dataclasses.replace(meta, causal=False), w, None, None),
        "sliding window": (q, kv, meta, w, None, 64),
        "o_proj bias": (q, kv, meta, w, torch.zeros(4096), None),
        "fp16 q": (q.half(), kv, meta, w, None, None),
        "head dim 64": (q[..., :64], kv, meta, w, None, None),
        "page of 32": (q, kv.reshape(-1, 2, 2, 8, 32, 128), meta, w, None, None),
        "N 3072": (q, kv, meta, w[:3072], None, None),
        "weight not contiguous": (q, kv, meta, w.t().contiguous().t(), None, None),
        "16 query heads per KV head": (q, kv[:, :, :, :2].contiguous(), meta, w, None, None),
        "one KV head": (q[:, :8], kv[:, :, :, :1].contiguous(), meta, w[:, :1024], None, None),
        "block-table row with a stride": (q, kv, dataclasses.replace(
            meta, block_tables=torch.zeros((1, 32), dtype=torch.int32)[:, ::2]), w, None, None),
    }
    for why, args in refused.items():
        assert not vs.segment_shapes_ok(*args), why
    two = plan_attention(torch.zeros((2, 8), dtype=torch.int32), [20, 20], [8, 8], page_size=16)
    assert not vs.segment_shapes_ok(q[:16], kv, two, w, None, None)


def test_shared_memory_fits_a_hopper_block():
    for k, n in ((4096, 4096), (2048, 2048), (4096, 2048)):
        assert vs.smem_bytes(k, n) <= 227 * 1024


def _triton(q, kv, layer, meta, w, res, gam):
    o = paged_attention(q, kv, layer, meta, sm_scale=128 ** -0.5)
    return gemv_add_norm(o.reshape(q.shape[0], -1), w, None, res, gam, 1e-6)


def _segment(q, kv, layer, meta, w, res, gam):
    return vs.verify_segment(q, kv, layer, meta, sm_scale=128 ** -0.5, weight=w, residual=res,
                             norm_weight=gam, eps=1e-6)


def _check(q, kv, meta, w, res, gam, rows=None, ref_meta=None):
    """The segment against the Triton path and a float32 reference (over ``ref_meta``, the
    plan of the first ``rows`` queries alone, when given), on the first ``rows``."""
    x, h, rms = _segment(q, kv, 1, meta, w, res, gam)
    tx, th, trms = _triton(q, kv, 1, meta, w, res, gam)
    r = q.shape[0] if rows is None else rows
    o = paged_attention(q[:r].float(), kv.float(), 1, ref_meta or meta, sm_scale=128 ** -0.5,
                        impl="torch")
    ref = res[:r].float() + o.reshape(r, -1).to(torch.bfloat16).float() @ w.float().t()
    err = (h[:r].float() - ref).abs().max().item()
    terr = (th[:r].float() - ref).abs().max().item()
    assert err <= max(2 * terr, 2e-2), (err, terr)
    torch.testing.assert_close(h[:r].float(), th[:r].float(), atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(x[:r].float(), tx[:r].float(), atol=6e-2, rtol=2e-2)
    assert rms.parts.shape == (q.shape[0], 128) and rms.dim == w.shape[0]
    torch.testing.assert_close(rms.rstd()[:r], trms.rstd()[:r], atol=0, rtol=2e-3)
    # what it writes is what it computes from its own h: g * h and the sums of squares
    assert torch.equal(x, (gam.float() * h.float()).to(torch.bfloat16))
    torch.testing.assert_close(rms.parts.sum(1), h.float().square().sum(1), rtol=1e-5, atol=0)
    return h


@pytest.mark.parametrize("ctx", [16, 17, 40, 255, 1000, 4097, 8192, 33000])
@pytest.mark.parametrize("shape", [(32, 8, 4096), (16, 4, 2048), (16, 8, 2048)])
@pytest.mark.parametrize("mark", [pytest.param(0, marks=cuda)])
def test_cuda_equals_the_triton_path(ctx, shape, mark, monkeypatch):
    monkeypatch.setenv(vs.SEGMENT_ENV, "1")
    hq, hkv, n = shape
    case = _case("cuda", ctx, 16, hq, hkv, n, seed=ctx)
    assert vs.verify_segment_ok(*case[:4], None, None)
    _check(*case)


@pytest.mark.parametrize("t", [2, 4, 8, 13])
@pytest.mark.parametrize("mark", [pytest.param(0, marks=cuda)])
def test_cuda_narrow_blocks(t, mark):
    _check(*_case("cuda", 3001, t, seed=t))


@pytest.mark.parametrize("ramp", [(1.0, 30.0), (30.0, 1.0), (1.0, 1.0)])
@pytest.mark.parametrize("lazy", [1, 0])
@pytest.mark.parametrize("mark", [pytest.param(0, marks=cuda)])
def test_cuda_growing_and_falling_scores(ramp, lazy, mark):
    """K scaled by position from ``ramp[0]`` to ``ramp[1]``: rising scores move every row's
    running maximum by far more than the lazy rescale's threshold again and again along a
    split (the rescale of ``o`` inside the page loop), falling ones never after the first
    page (P up to 2^8); both builds of the page loop against the float32 reference."""
    q, kv, meta, w, res, gam = _case("cuda", 4097, seed=7)
    logical = meta.block_tables[0, :-(-4097 // 16)].long()
    scale = torch.linspace(*ramp, logical.numel(), device="cuda")
    kv[logical, :, 0] = (kv[logical, :, 0].float()
                         * scale[:, None, None, None, None]).to(torch.bfloat16)
    v = list(vs.VARIANT)
    v[4] = lazy
    x, h, _ = vs.verify_segment(q, kv, 1, meta, sm_scale=128 ** -0.5, weight=w, residual=res,
                                norm_weight=gam, eps=1e-6, _variant=tuple(v))
    o = paged_attention(q.float(), kv.float(), 1, meta, sm_scale=128 ** -0.5, impl="torch")
    ref = res.float() + o.reshape(16, -1).to(torch.bfloat16).float() @ w.float().t()
    _, th, _ = _triton(q, kv, 1, meta, w, res, gam)
    terr = (th.float() - ref).abs().max().item()
    assert (h.float() - ref).abs().max().item() <= max(2 * terr, 2e-2)


@pytest.mark.parametrize("mark", [pytest.param(0, marks=cuda)])
def test_cuda_shortened_block_and_nan_past_the_sequence(mark):
    """A graph's plan packs 16 rows and says in ``query_lens`` how many are real; pool slots
    past the sequence (the last page's tail) hold NaN."""
    q, kv, meta, w, res, gam = _case("cuda", 1000)
    meta = dataclasses.replace(meta, query_lens=torch.tensor([5], dtype=torch.int32,
                                                             device="cuda"),
                               seq_lens=torch.tensor([989], dtype=torch.int32, device="cuda"))
    page = meta.block_tables[0, 989 // 16].item()
    kv[page, :, :, :, 989 % 16:] = float("nan")
    ref_meta = plan_attention(meta.block_tables, [989], [5], page_size=16)
    h = _check(q, kv, meta, w, res, gam, rows=5, ref_meta=ref_meta)
    assert torch.isfinite(h).all()


@pytest.mark.parametrize("mark", [pytest.param(0, marks=cuda)])
def test_cuda_graph_replay_equals_eager_bit_for_bit(mark):
    q, kv, meta, w, res, gam = _case("cuda", 3000)
    graph_replay_equals_eager(lambda m: _segment(q, kv, 1, m, w, res, gam), meta)


@pytest.mark.parametrize("mark", [pytest.param(0, marks=cuda)])
def test_cuda_switch_turns_it_off(mark, monkeypatch):
    monkeypatch.setenv(vs.SEGMENT_ENV, "1")
    q, kv, meta, w, *_ = _case("cuda", 100)
    assert vs.verify_segment_ok(q, kv, meta, w, None, None)
    assert not vs.verify_segment_ok(q, kv, meta, w, None, None, impl="triton")
    monkeypatch.setenv(vs.SEGMENT_ENV, "0")
    assert not vs.verify_segment_ok(q, kv, meta, w, None, None)


@pytest.mark.parametrize("mark", [pytest.param(0, marks=cuda)])
def test_cuda_default_query_counts(mark, monkeypatch):
    """Unset, the switch serves every query count with 4 query heads per KV head (the
    warpgroup build) and 8 with other groupings."""
    monkeypatch.delenv(vs.SEGMENT_ENV, raising=False)
    for t in (2, 4, 8, 13, 16):
        q, kv, meta, w, *_ = _case("cuda", 100, t)
        assert vs.verify_segment_ok(q, kv, meta, w, None, None), t
        q, kv, meta, w, *_ = _case("cuda", 100, t, hq=16, hkv=8, n=2048)
        assert vs.verify_segment_ok(q, kv, meta, w, None, None) == (t == 8), t


@pytest.mark.parametrize("mark", [pytest.param(0, marks=cuda)])
def test_cuda_qwen3_batch1_verify_takes_it(mark, tmp_path, monkeypatch):
    """A Qwen3 with 128-dim heads (16 query, 4 KV heads, hidden 2048) runs batch-1 verify
    steps of 16 and 5 tokens through the segment, one launch per layer, and its hidden states
    match those of the Triton path; prefill and decode never take it."""
    transformers = pytest.importorskip("transformers")
    from kvstrata.runtime import qwen3
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=256, hidden_size=2048, intermediate_size=2048, num_hidden_layers=2,
        num_attention_heads=16, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1e6, max_position_embeddings=4096, tie_word_embeddings=True,
        torch_dtype="bfloat16")
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    model = qwen3.Qwen3Model.from_pretrained(tmp_path, device="cuda", dtype="bfloat16")
    calls = []
    real = qwen3.verify_segment
    monkeypatch.setattr(qwen3, "verify_segment", lambda *a, **k: calls.append(1) or real(*a, **k))
    tokens = torch.randint(0, 256, (340,), generator=torch.Generator().manual_seed(1)).cuda()
    bt = torch.arange(40, dtype=torch.int32, device="cuda")[None]

    def run(flag):
        monkeypatch.setenv(vs.SEGMENT_ENV, flag)
        kv = torch.zeros((40, 2, 2, 4, 16, 128), dtype=torch.bfloat16, device="cuda")
        pos = torch.arange(340, device="cuda")
        hs = []
        with torch.no_grad():
            model(tokens[:300], pos[:300], plan_attention(bt, [300], [300], page_size=16),
                  pos[:300], kv)
            start = 300
            for width in (16, 5, 16):
                s = slice(start, start + width)
                h, _ = model(tokens[s], pos[s], plan_attention(bt, [start + width], [width],
                                                               page_size=16), pos[s], kv)
                hs.append(h)
                start += width
        return torch.cat(hs)

    off = run("0")
    assert not calls
    on = run("1")
    assert len(calls) == 3 * 2
    torch.testing.assert_close(on.float(), off.float(), atol=6e-2, rtol=3e-2)


def test_variant_from_the_environment(monkeypatch):
    monkeypatch.delenv(vs.VARIANT_ENV, raising=False)
    assert vs._env_variant() == vs.VARIANT
    monkeypatch.setenv(vs.VARIANT_ENV, "10:1")
    assert vs._env_variant() == (10, 1) + vs.VARIANT[2:]
    monkeypatch.setenv(vs.VARIANT_ENV, "10")
    assert vs._env_variant() == (10,) + vs.VARIANT[1:]
    monkeypatch.setenv(vs.VARIANT_ENV, "8:x")
    with pytest.raises(ValueError, match="colon-separated integers"):
        vs._env_variant()
