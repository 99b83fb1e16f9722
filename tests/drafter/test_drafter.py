"""DFlash drafter parity with the z-lab reference (``dflash.model.DFlashDraftModel``), fp32.

The reference keeps the draft context in a growing DynamicCache; kvstrata writes it into the
``draft`` group of pool pages (or the arena baseline). Both must give the same block hidden states
for the same taps, positions and cache growth, including sliding-window (causal) layers.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
dflash_model = pytest.importorskip("dflash.model")

from kvstrata.drafter import DFlashConfig, DFlashDrafter, DraftArena, PagedDraftAttention  # noqa: E402
from kvstrata.pagepool.pool import PagePool  # noqa: E402

PAGE = 4
H = 64


def _save_drafter(path, *, block=4, layer_types=None, window=None, is_causal=None, seed=0):
    kw = dict(hidden_size=H, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=300, rms_norm_eps=1e-6,
              rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=False,
              block_size=block, num_target_layers=4,
              dflash_config={"mask_token_id": 299, "target_layer_ids": [0, 2]})
    if layer_types is not None:
        kw.update(layer_types=layer_types, sliding_window=window, use_sliding_window=True,
                  max_window_layers=0)
    if is_causal is not None:
        kw["is_causal"] = is_causal
    cfg = transformers.Qwen3Config(**kw)
    torch.manual_seed(seed)
    ref = dflash_model.DFlashDraftModel(cfg).eval()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.08)
    ref.save_pretrained(path, safe_serialization=True)
    return ref


VARIANTS = {
    "full": {},
    "sliding": dict(layer_types=["sliding_attention", "full_attention"], window=5),
    "causal": dict(is_causal=True),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("drafter")
    ref = _save_drafter(d, **VARIANTS[request.param])
    return ref, DFlashDrafter.from_pretrained(d), d


def _ref_steps(ref, steps):
    """steps: list of (ctx [1, m, 2H], noise [1, B, H]); returns the block hidden per step."""
    cache = transformers.DynamicCache(config=ref.config)
    cache.activate_past_recording()
    start, outs = 0, []
    for ctx, noise in steps:
        m, b = ctx.shape[1], noise.shape[1]
        start += m
        pos = torch.arange(start - m, start + b)[None]
        with torch.no_grad():
            out = ref(target_hidden=ctx, noise_embedding=noise, position_ids=pos,
                      past_key_values=cache, use_cache=True)
        cache.crop(-(cache.get_seq_length() - start))
        outs.append(out[0])
    return outs


def _steps(seed, lens, block):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, m, 2 * H, generator=g), torch.randn(1, block, H, generator=g))
            for m in lens]


def test_config_reads_reference_fields(pair):
    ref, ours, d = pair
    cfg = ours.cfg
    assert cfg.block_size == 4 and cfg.mask_token_id == 299 and cfg.target_layer_ids == (0, 2)
    want = [m.self_attn.is_causal for m in ref.layers]
    assert list(cfg.layer_causal) == want
    assert list(cfg.layer_window) == [m.self_attn.sliding_window for m in ref.layers]
    spec = ours.kv_spec()
    assert (spec.name, spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.codec) == (
        "draft", 2, 2, 16, "lossless")


def test_paged_blocks_match_reference_batched(pair):
    """Two sequences of different lengths drafted together, over three growth steps each."""
    ref, ours, _ = pair
    B = 4
    plans = {"a": _steps(1, [7, 3, 1], B), "b": _steps(2, [13, 2, 4], B)}
    want = {k: _ref_steps(ref, v) for k, v in plans.items()}
    pool = PagePool([ours.kv_spec()], num_pages=32, page_size=PAGE)
    pages = {k: pool.allocate(8) for k in plans}
    kv = pool.kv["draft"]

    def slots(k, a, b):
        return torch.tensor([pages[k][i // PAGE] * PAGE + i % PAGE for i in range(a, b)])

    n = {k: 0 for k in plans}
    for step in range(3):
        for k, st in plans.items():
            ctx = st[step][0][0]
            ours.write_context(ctx, torch.arange(n[k], n[k] + len(ctx)),
                               slots(k, n[k], n[k] + len(ctx)), kv)
            n[k] += len(ctx)
        keys = list(plans)
        bt = torch.tensor([pages[k] for k in keys], dtype=torch.int32)
        noise = torch.cat([plans[k][step][1][0] for k in keys])
        pos = torch.cat([torch.arange(n[k], n[k] + B) for k in keys])
        bslots = torch.cat([slots(k, n[k], n[k] + B) for k in keys])
        attn = PagedDraftAttention(ours, kv, bt, [n[k] for k in keys], [B] * 2, bslots, PAGE)
        got = ours(noise, pos, attn)
        # only positions 1..2 of each block through the last layer's o_proj + MLP
        part = ours(noise, pos, attn, rows=(B, 1, 3))
        assert part.shape == (2 * 2, H)
        for i, k in enumerate(keys):
            torch.testing.assert_close(got[i * B:(i + 1) * B], want[k][step], atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(part[2 * i:2 * i + 2], want[k][step][1:3], atol=2e-5,
                                       rtol=1e-4)


def test_arena_matches_reference(pair):
    ref, ours, _ = pair
    B = 4
    st = _steps(3, [9, 2], B)
    want = _ref_steps(ref, st)
    arena = DraftArena(ours, capacity=32)
    arena.open("s", 0)
    n = 0
    for (ctx, noise), w in zip(st, want):
        arena.append("s", ctx[0], torch.arange(n, n + ctx.shape[1]))
        n += ctx.shape[1]
        got = ours(noise[0], torch.arange(n, n + B), arena.attention(["s"], [n], [B]))
        torch.testing.assert_close(got, w, atol=2e-5, rtol=1e-4)
    assert arena.nbytes == 2 * 2 * 2 * 32 * 16 * 4
    arena.close("s")
    assert arena.nbytes == 0


def _write_config(d, **changes):
    p = d / "config.json"
    cfg = json.loads(p.read_text())
    cfg.update(changes)
    p.write_text(json.dumps(cfg))


def test_config_errors(tmp_path):
    _save_drafter(tmp_path)
    base = json.loads((tmp_path / "config.json").read_text())
    cases = [
        (dict(dflash_config={"target_layer_ids": [0, 9], "mask_token_id": 1}), "target_layer_ids"),
        (dict(dflash_config={"target_layer_ids": [0]}), "mask_token_id"),
        (dict(num_target_layers=None), "num_target_layers"),
        (dict(layer_types=["full_attention"]), "layer_types"),
        (dict(layer_types=["sliding_attention"] * 2, sliding_window=2, is_causal=False),
         "window >= 4"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1.0}), "yarn"),
    ]
    for change, msg in cases:
        d = dict(base)
        d.update(change)
        with pytest.raises(ValueError, match=msg):
            DFlashConfig.from_dict(d)
    with pytest.raises(ValueError, match="no config.json"):
        DFlashDrafter.from_pretrained(tmp_path / "nope")


def test_loading_needs_no_safetensors_package(monkeypatch):
    # safetensors is an optional (ref) dependency: the drafter reads checkpoints with kvstrata.nn.
    from kvstrata.assets import resolve_model

    path = resolve_model("kvstrata-tiny-py", part="drafter")
    want = DFlashDrafter.from_pretrained(path, dtype=torch.float32)
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    got = DFlashDrafter.from_pretrained(path, dtype=torch.float32)
    assert got.fingerprint() == want.fingerprint()
    for (n, a), (_, b) in zip(want.state_dict().items(), got.state_dict().items()):
        assert torch.equal(a, b), n


def test_fingerprint_text_is_pinned_not_the_class_layout():
    """The drafter's namespace must not move when DFlashConfig's fields are re-arranged: its
    config part is the pinned FINGERPRINT_FIELDS text, equal to what the dataclass repr gave
    when stored pages were first keyed by it (the shipped drafter's config, literally)."""
    import dataclasses

    from kvstrata.assets import resolve_model
    from kvstrata.drafter.config import FINGERPRINT_FIELDS, DFlashConfig
    from kvstrata.drafter.model import DFlashDrafter

    cfg = DFlashDrafter.from_pretrained(resolve_model("kvstrata-tiny-py/drafter")).cfg
    assert cfg.fingerprint_text() == (
        "DFlashConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=2, "
        "num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=320, "
        "rms_norm_eps=1e-06, rope_theta=10000.0, max_position_embeddings=4096, block_size=16, "
        "num_target_layers=6, mask_token_id=259, target_layer_ids=(1, 2, 3, 4), "
        "layer_causal=(False, False), layer_window=(None, None), attention_bias=False, "
        "input_embedding_scale=1.0, output_multiplier=1.0, final_logit_softcapping=None, "
        "dtype=torch.bfloat16)")
    # every field of the class is in the pinned list (a new field must be added there on purpose)
    assert {f.name for f in dataclasses.fields(DFlashConfig)} == set(FINGERPRINT_FIELDS)
