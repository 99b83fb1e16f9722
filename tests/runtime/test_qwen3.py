"""Qwen3 target model: logits parity with transformers (fp32) through the page pool."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvstrata.kernels.attention_plan import plan_attention  # noqa: E402
from kvstrata.pagepool.hashing import Namespace  # noqa: E402
from kvstrata.pagepool.manager import KVCacheManager  # noqa: E402
from kvstrata.pagepool.pool import PagePool  # noqa: E402
from kvstrata.nn.loader import CheckpointError  # noqa: E402
from kvstrata.runtime.qwen3 import Qwen3Config, Qwen3Model  # noqa: E402

PAGE = 4
PROMPTS = [[3, 17, 99, 4, 8], list(range(20, 33)), [(7 * i) % 128 for i in range(1, 22)]]


def _hf_config(tie: bool, **kw):
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=tie,
                torch_dtype="float32")
    base.update(kw)
    return transformers.Qwen3Config(**base)


def _save_tiny(tmp_path, tie: bool, seed: int = 0, **kw):
    torch.manual_seed(seed)
    hf = transformers.Qwen3ForCausalLM(_hf_config(tie, **kw)).eval()
    with torch.no_grad():  # HF inits norms to 1: randomize so the q/k norms are really tested
        for n, p in hf.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    return hf


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def models(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3")
    hf = _save_tiny(d, request.param)
    return hf, Qwen3Model.from_pretrained(d), d


def _hf_logits(hf, prompt):
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].float()


class Runner:
    """Drives the model through a real PagePool + KVCacheManager."""

    def __init__(self, model: Qwen3Model, impl: str = "auto"):
        self.impl = impl
        spec = model.kv_spec(codec="identity")
        self.pool = PagePool([spec], num_pages=64, page_size=PAGE)
        self.mgr = KVCacheManager(self.pool, Namespace(model.fingerprint(), (spec,), PAGE))
        self.model = model

    def step(self, chunks: dict, capture=()):
        """chunks: seq_id -> new token ids; returns logits per seq_id ([len, vocab])."""
        ids, pos, slots, qlens, slens = [], [], [], [], []
        for sid, toks in chunks.items():
            seq = self.mgr.seqs[sid]
            start = seq.num_tokens
            end = start + len(toks)
            self.mgr.reserve(sid, end)
            slots += self.mgr.slots(sid, start, end)
            ids += toks
            pos += list(range(start, end))
            qlens.append(len(toks))
            slens.append(end)
        bt, sl = self.mgr.block_tables(list(chunks), seq_lens=slens)
        meta = plan_attention(bt, sl, qlens, page_size=PAGE)
        hidden, cap = self.model(torch.tensor(ids), torch.tensor(pos), meta,
                                 torch.tensor(slots, dtype=torch.int64), self.pool.kv["target"],
                                 capture_layers=capture, attn_impl=self.impl)
        for sid, toks in chunks.items():
            self.mgr.commit(sid, toks)
        logits = self.model.compute_logits(hidden)
        out, at = {}, 0
        for sid, q in zip(chunks, qlens):
            out[sid] = logits[at:at + q]
            at += q
        return out, cap


def test_full_prefill_logits_match_transformers(models):
    hf, model, _ = models
    r = Runner(model)
    for i, p in enumerate(PROMPTS):
        r.mgr.admit(i, p)
    with torch.no_grad():
        got, _ = r.step({i: p for i, p in enumerate(PROMPTS)})
    for i, p in enumerate(PROMPTS):
        diff = (got[i] - _hf_logits(hf, p)).abs().max().item()
        assert diff <= 1e-4, (i, diff)


def test_chunked_prefill_then_decode_matches_transformers(models):
    hf, model, _ = models
    r = Runner(model)
    extra = [[5, 6, 7], [1, 2, 3], [9, 10, 11]]
    full = [p + e for p, e in zip(PROMPTS, extra)]
    for i, p in enumerate(PROMPTS):
        r.mgr.admit(i, p)
    want = [_hf_logits(hf, f) for f in full]
    got = {i: [] for i in range(3)}
    with torch.no_grad():
        # Chunks of different sizes per sequence, cutting through page boundaries.
        cuts = {0: [2, 3], 1: [6, 7], 2: [5, 11, 5]}
        done = {i: 0 for i in range(3)}
        while any(done[i] < len(PROMPTS[i]) for i in range(3)):
            chunk = {}
            for i, sizes in cuts.items():
                if sizes:
                    n = sizes.pop(0)
                    chunk[i] = PROMPTS[i][done[i]:done[i] + n]
                    done[i] += n
            out, _ = r.step(chunk)
            for i, lg in out.items():
                got[i].append(lg)
        for t in range(3):
            out, _ = r.step({i: [extra[i][t]] for i in range(3)})
            for i, lg in out.items():
                got[i].append(lg)
    for i in range(3):
        diff = (torch.cat(got[i]) - want[i]).abs().max().item()
        assert diff <= 1e-4, (i, diff)


def test_triton_kernel_path_prefill_and_decode_match_transformers(models):
    """The same model through the Triton write_kv + paged attention (interpreter)."""
    hf, model, _ = models
    r = Runner(model, impl="triton")
    for i, p in enumerate(PROMPTS):
        r.mgr.admit(i, p)
    extra = [[5, 6], [1, 2], [9, 10]]
    with torch.no_grad():
        got = {i: [lg] for i, lg in r.step({i: p for i, p in enumerate(PROMPTS)})[0].items()}
        for t in range(2):
            for i, lg in r.step({i: [extra[i][t]] for i in range(3)})[0].items():
                got[i].append(lg)
    for i, p in enumerate(PROMPTS):
        diff = (torch.cat(got[i]) - _hf_logits(hf, p + extra[i])).abs().max().item()
        assert diff <= 1e-4, (i, diff)


def test_capture_layers_match_hf_hidden_states(models):
    hf, model, _ = models
    r = Runner(model)
    r.mgr.admit(0, PROMPTS[1])
    with torch.no_grad():
        _, cap = r.step({0: PROMPTS[1]}, capture=(0, 2, 1))
        hs = hf(torch.tensor([PROMPTS[1]]), output_hidden_states=True).hidden_states
    # hidden_states[l + 1] is decoder layer l's output, except the last entry, which HF
    # returns after the final norm.
    assert (cap[0] - hs[1][0]).abs().max().item() <= 1e-4
    assert (cap[2] - hs[2][0]).abs().max().item() <= 1e-4
    assert (model.norm(cap[1]) - hs[3][0]).abs().max().item() <= 1e-4
    assert (cap[1] - cap[2]).abs().max().item() > 1e-2


def test_fingerprint_stable_and_weight_sensitive(models):
    _, model, d = models
    again = Qwen3Model.from_pretrained(d)
    assert model.fingerprint() == again.fingerprint()
    with torch.no_grad():
        again.layers[1].mlp.up_proj.weight[3, 5] += 1e-3
    again._fingerprint = None
    assert again.fingerprint() != model.fingerprint()


def test_kv_spec_and_dtype_override(models):
    _, model, d = models
    spec = model.kv_spec()
    assert (spec.name, spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype,
            spec.codec) == ("target", 3, 2, 32, torch.float32, "nvfp4")
    bf = Qwen3Model.from_pretrained(d, dtype="bf16")
    assert bf.dtype == torch.bfloat16 and bf.kv_spec().dtype == torch.bfloat16


def test_loader_errors(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        Qwen3Model.from_pretrained(tmp_path / "nope")
    with pytest.raises(ValueError, match="config.json"):
        Qwen3Model.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="not a Qwen3"):
        Qwen3Model.from_pretrained(tmp_path)
    cfg = _hf_config(True).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="safetensors"):
        Qwen3Model.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="head_dim"):
        Qwen3Config.from_dict({**cfg, "head_dim": 40})
    with pytest.raises(ValueError, match="not supported"):
        Qwen3Config.from_dict({**cfg, "torch_dtype": "float64"})


def test_loader_missing_and_misshaped_tensors(tmp_path):
    from safetensors.torch import load_file, save_file
    _save_tiny(tmp_path, tie=True)
    f = tmp_path / "model.safetensors"
    sd = load_file(f)
    sd["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"][:-1].clone()
    save_file(sd, f)
    with pytest.raises(CheckpointError, match="up_proj.*shape"):
        Qwen3Model.from_pretrained(tmp_path)
    del sd["model.norm.weight"]
    save_file(sd, f)
    with pytest.raises(CheckpointError, match="missing.*norm.weight"):
        Qwen3Model.from_pretrained(tmp_path)


def test_sharded_checkpoint_loads_same_weights(tmp_path):
    hf = _save_tiny(tmp_path / "a", tie=False, seed=1)
    hf.save_pretrained(tmp_path / "b", max_shard_size="40KB")
    assert (tmp_path / "b" / "model.safetensors.index.json").is_file()
    a = Qwen3Model.from_pretrained(tmp_path / "a")
    b = Qwen3Model.from_pretrained(tmp_path / "b")
    assert a.fingerprint() == b.fingerprint()
    (tmp_path / "b" / "model-00001-of-00002.safetensors").unlink(missing_ok=True)
    shards = sorted((tmp_path / "b").glob("model-*.safetensors"))
    shards[0].unlink()
    with pytest.raises(CheckpointError, match="shard"):
        Qwen3Model.from_pretrained(tmp_path / "b")


def _unmerge(model):
    """The model with every projection its own tensor again (a copy of the same values)."""
    with torch.no_grad():
        for layer in model.layers:
            for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                        layer.mlp.gate_proj, layer.mlp.up_proj):
                lin.weight = torch.nn.Parameter(lin.weight.detach().clone())
    return model


def test_merged_weights_one_copy_same_state_same_outputs(models):
    """Loading merges q/k/v and gate/up into one matrix each: the separate parameters are views
    of it (no second copy), the state dict and fingerprint are the unmerged model's, and the
    outputs equal the separate products' (bit for bit on this CPU, which computes each output
    column with the same reduction)."""
    import copy
    _, model, d = models
    a, m = model.layers[0].self_attn, model.layers[0].mlp
    base = a.q_proj.weight.untyped_storage().data_ptr()
    assert a.k_proj.weight.untyped_storage().data_ptr() == base
    assert a.v_proj.weight.untyped_storage().data_ptr() == base
    assert m.up_proj.weight.untyped_storage().data_ptr() == \
        m.gate_proj.weight.untyped_storage().data_ptr()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                for p in model.parameters()}
    assert sum(storages.values()) == params                 # one copy of every weight
    plain = _unmerge(copy.deepcopy(model))
    assert not plain.layers[0].self_attn._qkv.holds()       # views broken: separate products
    assert list(plain.state_dict()) == list(model.state_dict())
    plain._fingerprint = None
    assert plain.fingerprint() == model.fingerprint() == Qwen3Model.from_pretrained(d).fingerprint()
    r1, r2 = Runner(model), Runner(plain)
    r1.pool.kv["target"].zero_()
    r2.pool.kv["target"].zero_()
    for i, p in enumerate(PROMPTS):
        r1.mgr.admit(i, p)
        r2.mgr.admit(i, p)
    with torch.no_grad():
        got, _ = r1.step({i: p for i, p in enumerate(PROMPTS)})
        want, _ = r2.step({i: p for i, p in enumerate(PROMPTS)})
        for i in got:
            torch.testing.assert_close(got[i], want[i], atol=1e-5, rtol=1e-5)
            assert torch.equal(got[i], want[i])
        assert torch.equal(r1.pool.kv["target"], r2.pool.kv["target"])
    plain.merge_weights()                                   # merges again, in place
    assert plain.layers[0].self_attn._qkv.holds() and plain.layers[2].mlp._gate_up.holds()
    with torch.no_grad():                                   # an edit through a view is seen
        model.layers[0].self_attn.k_proj.weight[0, 0] += 1.0
        assert model.layers[0].self_attn._qkv.weight[a.q_proj.out_features, 0] == \
            model.layers[0].self_attn.k_proj.weight[0, 0]
        model.layers[0].self_attn.k_proj.weight[0, 0] -= 1.0


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_few_rows_gemv_path_matches_the_torch_path(models, dtype):
    """Steps of at most 16 rows in half precision run every product as one kernels/gemv.py
    launch (here the interpreter: impl "triton"), SiLU-and-multiply inside gate/up's, the
    residual adds and norms inside the products' (two add_rms_norm launches per step); logits,
    captured layers and pool K/V match the torch path (impl "torch": F.linear) up to
    half-precision rounding."""
    import os
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU interpreter case (TRITON_INTERPRET=1)")
    from kvstrata.kernels import gemv as gemv_mod
    from kvstrata.kernels import layer_ops
    _, _, d = models
    m = Qwen3Model.from_pretrained(d, dtype=dtype)
    launches, silu, norms = [], [], []
    real, real_silu = gemv_mod._gemv_kernel, layer_ops._silu_mul_merged_kernel
    real_norm = layer_ops._add_rms_norm_kernel

    class Count:                      # counts kernel launches, then launches for real
        def __init__(self, kernel, into):
            self.kernel, self.into = kernel, into

        def __getitem__(self, grid):
            self.into.append(grid)
            return self.kernel[grid]

    # bf16 keeps 8 mantissa bits (and the interpreter converts float32 -> bf16 by its own
    # rounding): both paths are about that far from float32
    tol, kv_tol = (2e-2, 1e-2) if dtype == "float16" else (6e-2, 0.25)
    fused, plain = Runner(m, impl="triton"), Runner(m, impl="torch")
    for r in (fused, plain):
        r.pool.kv["target"].zero_()
        for i, p in enumerate(PROMPTS[:2]):
            r.mgr.admit(i, p)
    with torch.no_grad():
        steps = [{0: PROMPTS[0]}, {1: PROMPTS[1]}, {0: [5], 1: [6]}, {0: [7], 1: [8]}]
        for chunk in steps:
            launches.clear()
            silu.clear()
            norms.clear()
            gemv_mod._gemv_kernel = Count(real, launches)
            layer_ops._silu_mul_merged_kernel = Count(real_silu, silu)
            layer_ops._add_rms_norm_kernel = Count(real_norm, norms)
            try:
                got, cap_f = fused.step(chunk, capture=(0, 2))
            finally:
                gemv_mod._gemv_kernel, layer_ops._silu_mul_merged_kernel = real, real_silu
                layer_ops._add_rms_norm_kernel = real_norm
            assert len(launches) == 4 * m.config.num_hidden_layers    # q/k/v, o, gate/up, down
            assert not silu                                           # inside gate/up's
            # the layers' norms ride in the products' epilogues: the first and the final only
            assert len(norms) == 2
            want, cap_p = plain.step(chunk, capture=(0, 2))
            for sid in got:
                torch.testing.assert_close(got[sid], want[sid], atol=tol, rtol=0)
            for a, b in zip(cap_f, cap_p):
                torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=0)
    kf, kp = fused.pool.kv["target"].float(), plain.pool.kv["target"].float()
    torch.testing.assert_close(kf, kp, atol=kv_tol, rtol=0)
    assert (kf - kp).abs().mean() < kv_tol / 100
