"""The dense training forward equals dflash.model.DFlashDraftModel (weights, layout, semantics)."""

import pytest
import torch
import torch.nn.functional as F

dflash_model = pytest.importorskip("dflash.model")
transformers = pytest.importorskip("transformers")

from kvstrata import tokenizer as tok  # noqa: E402
from kvstrata.training.dflash_dense import DenseDFlash, gather_blocks  # noqa: E402
from kvstrata.training.drafter import drafter_config  # noqa: E402

TARGET = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 5,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "vocab_size": tok.VOCAB_SIZE, "rms_norm_eps": 1e-6, "rope_theta": 10_000.0,
          "max_position_embeddings": 512}


def _pair(seed=0):
    cfg = drafter_config(TARGET, num_layers=2, taps=[0, 2, 3], block_size=8)
    torch.manual_seed(seed)
    dense = DenseDFlash(cfg)
    dense.reset_parameters(std=0.2)
    with torch.no_grad():
        for name, p in dense.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    ref = dflash_model.DFlashDraftModel(transformers.Qwen3Config(**cfg)).eval()
    missing, unexpected = ref.load_state_dict(dense.state_dict(), strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return cfg, dense.eval(), ref


def test_weight_names_match_reference_exactly():
    cfg, dense, ref = _pair()
    ours = set(dense.state_dict())
    theirs = {k for k in ref.state_dict() if "rotary" not in k}
    assert ours == theirs
    assert {"fc.weight", "hidden_norm.weight", "norm.weight",
            "layers.1.self_attn.k_norm.weight"} <= ours
    assert dense.fc.weight.shape == (64, 3 * 64)
    assert cfg["dflash_config"] == {"mask_token_id": tok.MASK, "target_layer_ids": [0, 2, 3]}
    assert cfg["block_size"] == 8 and cfg["num_target_layers"] == 5


@torch.no_grad()
def test_dense_blocks_match_reference_per_anchor():
    cfg, dense, ref = _pair(1)
    g = torch.Generator().manual_seed(3)
    S, B, H = 40, 8, 64
    ids = torch.randint(0, 256, (2, S), generator=g)
    taps = torch.randn(2, S, 3 * H, generator=g)
    embed = torch.randn(tok.VOCAB_SIZE, H, generator=g)
    head = torch.randn(tok.VOCAB_SIZE, H, generator=g) * 0.3
    anchors = torch.tensor([[1, 9, 12, 30], [5, 6, 20, 32]])
    inputs, labels = gather_blocks(ids, anchors, B, tok.MASK)
    assert (inputs[:, :, 1:] == tok.MASK).all()
    assert (inputs[:, :, 0] == ids.gather(1, anchors)).all()
    hidden = dense.forward_blocks(dense.fuse(taps), anchors, F.embedding(inputs, embed))
    ours = F.linear(hidden, head)
    for b in range(2):
        for j, a in enumerate(anchors[b].tolist()):
            assert torch.equal(labels[b, j], ids[b, a + 1:a + B])
            # the reference's first decode step: context = taps strictly before the anchor,
            # block at positions a .. a+B-1, no cache
            noise = F.embedding(inputs[b:b + 1, j], embed)
            out = ref(target_hidden=taps[b:b + 1, :a], noise_embedding=noise,
                      position_ids=torch.arange(a + B)[None])
            theirs = ref.compute_logits(out, lambda h: F.linear(h, head))
            torch.testing.assert_close(ours[b, j], theirs[0], atol=2e-4, rtol=2e-4)


@torch.no_grad()
def test_future_context_does_not_leak():
    _, dense, _ = _pair(2)
    g = torch.Generator().manual_seed(4)
    taps = torch.randn(1, 30, 3 * 64, generator=g)
    emb = torch.randn(1, 2, 8, 64, generator=g)
    anchors = torch.tensor([[10, 20]])
    a = dense.forward_blocks(dense.fuse(taps), anchors, emb)
    taps2 = taps.clone()
    taps2[:, 10:] = torch.randn(1, 20, 3 * 64, generator=g)  # change context at/after anchor 10
    b = dense.forward_blocks(dense.fuse(taps2), anchors, emb)
    torch.testing.assert_close(a[:, 0], b[:, 0])               # block at 10 unaffected
    assert (a[:, 1] - b[:, 1]).abs().max() > 1e-3              # block at 20 sees positions 10..19
