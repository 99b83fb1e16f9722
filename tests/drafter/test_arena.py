"""The arena baseline on its own: per-request dense buffers outside the pool."""

from __future__ import annotations

import pytest
import torch

from kvstrata.drafter import DFlashDrafter, DraftArena


@pytest.fixture(scope="module")
def drafter():
    from kvstrata.assets import resolve_model
    return DFlashDrafter.from_pretrained(resolve_model("kvstrata-tiny-py/drafter"),
                                         dtype=torch.float32)


def test_buffers_open_fill_and_close(drafter):
    a = DraftArena(drafter, capacity=8)
    c = drafter.cfg
    a.open("x", first_position=5)
    per_req = c.num_hidden_layers * 2 * c.num_key_value_heads * 8 * c.head_dim * 4
    assert a.nbytes == per_req
    taps = torch.randn(3, c.hidden_size * len(c.target_layer_ids))
    a.append("x", taps, torch.arange(5, 8))
    a.append("x", taps[:2], torch.arange(8, 10))
    with pytest.raises(ValueError, match="arena of 8 tokens is full for 'x'"):
        a.append("x", torch.cat([taps, taps[:1]]), torch.arange(10, 14))
    # What it holds is the drafter's context K/V of those taps at those positions.
    (k0, v0), *_ = drafter.context_kv(taps, torch.arange(5, 8))
    buf = a._buf["x"]
    assert torch.equal(buf[0, 0, :, :3], k0.transpose(0, 1))
    assert torch.equal(buf[0, 1, :, :3], v0.transpose(0, 1))
    a.close("x")
    assert a.nbytes == 0


def test_after_a_prefix_hit_the_block_sees_only_itself(drafter):
    """Opened at position 32 with nothing appended (a prefix hit of 32 tokens): the attention of
    a block is softmax over the block's own K/V, exactly (the cached context is invisible)."""
    a = DraftArena(drafter, capacity=64)
    a.open("x", first_position=32)
    c = drafter.cfg
    layer = next(i for i, causal in enumerate(c.layer_causal) if not causal) if \
        not all(c.layer_causal) else 0
    B, Hq, Hkv, D = 4, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    q, k, v = torch.randn(B, Hq, D), torch.randn(B, Hkv, D), torch.randn(B, Hkv, D)
    out = a.attention(["x"], [32], [B])(layer, q, k, v)
    g = Hq // Hkv
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * drafter.sm_scale
    if c.layer_causal[layer]:
        s = s.masked_fill(torch.ones(B, B, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
