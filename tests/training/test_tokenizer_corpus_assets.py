"""Tokenizer, corpus split, held-out prompts and asset name resolution."""

import json

import pytest
import torch

from kvstrata import assets
from kvstrata import tokenizer as tok
from kvstrata.assets import corpus
from kvstrata.training.dflash_dense import block_mask, gather_blocks, position_weights
from kvstrata.training.drafter import drafter_config, sample_anchors, spread_taps


def test_tokenizer_roundtrip_and_specials():
    s = "def f(x):\n    return 'héllo' ✓\n"
    ids = tok.encode(s)
    assert ids == list(s.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == s
    assert tok.encode("a", bos=True, eos=True) == [tok.BOS, 97, tok.EOS]
    assert tok.decode([tok.BOS, 104, 105, tok.MASK, tok.PAD, tok.EOS]) == "hi"
    assert tok.decode([0xC3]) == "\ufffd"                     # truncated character
    assert (tok.BOS, tok.EOS, tok.PAD, tok.MASK) == (256, 257, 258, 259)
    assert tok.VOCAB_SIZE % 64 == 0 and tok.VOCAB_SIZE > tok.MASK
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.VOCAB_SIZE])
    with pytest.raises(ValueError, match="takes a str"):
        tok.encode(b"bytes")


def test_heldout_split_is_disjoint_and_stable():
    held = corpus.corpus_files("heldout")
    train = corpus.corpus_files("train")
    assert len(held) == len(corpus.HELDOUT) == 20
    assert not set(held) & set(train)
    root = corpus.stdlib_root()
    rel = {p.relative_to(root).as_posix() for p in train}
    assert "textwrap.py" not in rel and "json/decoder.py" not in rel and "os.py" in rel
    assert not any(r.startswith(("encodings/", "pydoc_data/")) or "site-packages" in r
                   for r in rel)
    with pytest.raises(ValueError, match="split"):
        corpus.corpus_files("test")


def test_heldout_prompts_fixed_and_from_heldout_text():
    a = corpus.heldout_prompts(5, 48, seed=7)
    assert a == corpus.heldout_prompts(5, 48, seed=7) != corpus.heldout_prompts(5, 48, seed=8)
    assert all(len(p) == 48 and max(p) < 256 for p in a)
    text = b"".join(f.read_bytes() for f in corpus.corpus_files("heldout"))
    assert all(bytes(p) in text for p in a)


def test_token_stream_documents_and_sampling():
    t = corpus.load_tokens("heldout")
    n_bytes = sum(f.stat().st_size for f in corpus.corpus_files("heldout"))
    assert t.dtype == torch.int16 and t.numel() == n_bytes + 2 * len(corpus.HELDOUT)
    assert int((t == tok.BOS).sum()) == len(corpus.HELDOUT) == int((t == tok.EOS).sum())
    s = corpus.TokenStream(t)
    x = s.sample(3, 17, torch.Generator().manual_seed(0))
    y = s.sample(3, 17, torch.Generator().manual_seed(0))
    assert x.shape == (3, 17) and torch.equal(x, y) and x.dtype == torch.int64
    assert s.windows(4, 10).shape == (4, 10)


def test_block_mask_and_blocks():
    m = block_mask(torch.tensor([[2, 5]]), 6, 3)[0, 0]
    assert m.shape == (6, 12)
    assert m[0, :6].tolist() == [True, True, False, False, False, False]
    assert m[3, :6].tolist() == [True] * 5 + [False]
    assert m[1, 6:].tolist() == [True] * 3 + [False] * 3
    assert m[4, 6:].tolist() == [False] * 3 + [True] * 3
    ids = torch.arange(10)[None]
    inp, lab = gather_blocks(ids, torch.tensor([[2, 6]]), 4, 99)
    assert inp.tolist() == [[[2, 99, 99, 99], [6, 99, 99, 99]]]
    assert lab.tolist() == [[[3, 4, 5], [7, 8, 9]]]
    w = position_weights(16, 7.0)
    assert w[0] == 1.0 and w.shape == (15,)
    assert w[7].item() == pytest.approx(torch.exp(torch.tensor(-1.0)).item())


def test_taps_config_and_anchors():
    assert spread_taps(6, 4) == [1, 2, 3, 4] and spread_taps(36, 5) == [1, 9, 18, 26, 34]
    with pytest.raises(ValueError):
        spread_taps(3, 4)
    cfg = drafter_config({"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 6,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                          "vocab_size": 320, "rope_parameters": {"rope_theta": 1e4}})
    assert cfg["dflash_config"] == {"mask_token_id": 259, "target_layer_ids": [1, 2, 3, 4]}
    assert cfg["num_target_layers"] == 6 and cfg["rope_theta"] == 1e4
    with pytest.raises(ValueError, match="must lie in"):
        drafter_config({**cfg, "num_hidden_layers": 6}, taps=[5])
    a = sample_anchors(8, 3, 40, 10, torch.Generator().manual_seed(1))
    assert a.shape == (8, 10) and int(a.min()) >= 3 and int(a.max()) <= 40
    assert all(len(set(r)) == 10 for r in a.tolist())


def test_assets_resolution(tmp_path, monkeypatch):
    assert "kvstrata-tiny-py/target" in assets.list_models()
    assert assets.resolve_model(tmp_path) == tmp_path            # a directory passes through
    with pytest.raises(ValueError, match="unknown model"):
        assets.resolve_model("no-such-model/target")
    monkeypatch.setattr(assets, "ASSETS_DIR", tmp_path)
    with pytest.raises(ValueError, match="not installed.*train_tiny_pair"):
        assets.resolve_model("kvstrata-tiny-py/drafter")
    for part in ("target", "drafter"):
        d = tmp_path / "kvstrata-tiny-py" / part
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
        (d / "model.safetensors").write_bytes(b"")
    assert assets.resolve_model("kvstrata-tiny-py/target") == tmp_path / "kvstrata-tiny-py/target"
    assert assets.resolve_model("kvstrata-tiny-py") == tmp_path / "kvstrata-tiny-py"
    # a trained pair directory (OUT of train_tiny_pair.sh) resolves per part, like a name
    pair = tmp_path / "kvstrata-tiny-py"
    assert assets.resolve_model(pair, part="drafter") == pair / "drafter"
    assert assets.resolve_model(pair / "target", part="target") == pair / "target"
    assert assets.resolve_model(pair) == pair
    assert assets.load_tokenizer("kvstrata-tiny-py").mask_token_id == tok.MASK
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "Other"}))
    with pytest.raises(ValueError, match="names tokenizer"):
        assets.load_tokenizer(tmp_path)


def test_selfgen_prompt_lengths_are_stratified():
    from kvstrata.training.drafter import DrafterTrainConfig, selfgen_prompt_lengths

    cfg = DrafterTrainConfig()                       # 8 batches of 1024 over 64 .. 3840 tokens
    lens = selfgen_prompt_lengths(cfg)
    assert lens == selfgen_prompt_lengths(cfg) and len(lens) == 8
    lo, hi = cfg.selfgen_prompt_len, cfg.seq_len - cfg.selfgen_new_tokens
    width = (hi - lo) / 8
    assert sorted(int((n - lo) // width) for n in lens) == list(range(8))   # one per slice
    assert lens != sorted(lens)                      # shuffled: a time cap drops random strata
    with pytest.raises(ValueError, match="must fit in seq_len"):
        DrafterTrainConfig(seq_len=256, selfgen_prompt_len=64, selfgen_new_tokens=256)
