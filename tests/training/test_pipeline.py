"""End to end at smoke scale: CLI -> target + drafter dirs -> kvstrata loaders, dflash reference."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from kvstrata import tokenizer as tok  # noqa: E402
from kvstrata.training.__main__ import main  # noqa: E402
from kvstrata.assets.corpus import heldout_prompts  # noqa: E402
from kvstrata.training.drafter import load_drafter  # noqa: E402
from kvstrata.training.evaluate import acceptance_length, load_hf_target  # noqa: E402


POISON = b"HELDOUT_POISON = 1  # must never reach a training batch\n"
RECORD: dict[str, list] = {}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The smoke pipeline over a stdlib root whose held-out modules are replaced by a marker
    line: every token a training step sees (corpus windows of both stages, self-generation
    prompts) is recorded for :func:`test_heldout_split_never_reaches_training`."""
    from kvstrata.assets import corpus
    from kvstrata.training import drafter

    out = tmp_path_factory.mktemp("pair")
    root = tmp_path_factory.mktemp("stdlib")
    real = corpus.stdlib_root()
    size = 0
    for f in corpus.corpus_files("train"):
        if size > 400_000:
            break
        dst = root / f.relative_to(real)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.symlink_to(f)
        size += f.stat().st_size
    for h in corpus.HELDOUT:
        (root / h).parent.mkdir(parents=True, exist_ok=True)
        (root / h).write_bytes(POISON * 100)
    seen: list[torch.Tensor] = []
    sample, line_prompts = corpus.TokenStream.sample, drafter.line_prompts

    def recorded_sample(self, *a, **k):
        seen.append(sample(self, *a, **k).cpu())
        return seen[-1]

    def recorded_prompts(*a, **k):
        p = line_prompts(*a, **k)
        seen.extend(torch.tensor([x]) for x in p)
        return p

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(corpus, "stdlib_root", lambda: root)
        mp.setattr(corpus.TokenStream, "sample", recorded_sample)
        mp.setattr(drafter, "line_prompts", recorded_prompts)
        assert main([str(out), "--device", "cpu", "--smoke", "--steps", "25"]) == 0
        heldout = corpus.heldout_prompts(2, 40, seed=0)
    RECORD.update(seen=seen, heldout=heldout)
    return out


def _has_poison(tokens) -> bool:
    data = bytes(t for t in torch.as_tensor(tokens).flatten().tolist() if t < 256)
    return POISON[:24] in data


def test_heldout_split_never_reaches_training(pair):
    # the marker is what evaluation reads (so the check can fail) ...
    assert all(_has_poison(p) for p in RECORD["heldout"])
    # ... and no corpus window or self-generation prompt of either stage holds any of it
    # a window per target step, a corpus window per drafter step, 8 self-generation prompts
    assert len(RECORD["seen"]) == 25 + 25 + 8
    assert not any(_has_poison(t) for t in RECORD["seen"])


def test_outputs_and_summary(pair):
    summary = json.loads((pair / "summary.json").read_text())
    assert summary["target"]["steps"] == 25 and summary["drafter"]["steps"] == 25
    assert summary["target"]["heldout_bits_per_byte"] < 7.5     # learned something (8.3 = uniform)
    assert 1.0 <= summary["drafter"]["heldout_al"] <= 16.0
    for part in ("target", "drafter"):
        assert (pair / part / "config.json").is_file()
        assert (pair / part / "model.safetensors").is_file()
    assert sum(summary["weights_bytes"].values()) < 20e6


def test_kvstrata_loaders_accept_the_dirs(pair):
    from kvstrata.drafter.config import DFlashConfig
    from kvstrata.nn.loader import load_safetensors_dir
    from kvstrata.runtime.qwen3 import Qwen3Config

    tc = Qwen3Config.from_dir(pair / "target")
    assert (tc.vocab_size, tc.head_dim, tc.tie_word_embeddings) == (tok.VOCAB_SIZE, 64, True)
    assert tc.rope_theta == 10_000.0 and tc.torch_dtype == "bfloat16"
    dc = DFlashConfig.from_dir(pair / "drafter")
    assert dc.block_size == 16 and dc.mask_token_id == tok.MASK
    assert dc.num_target_layers == tc.num_hidden_layers
    assert dc.target_layer_ids == (1, 2) and dc.layer_causal == (False, False)
    w = load_safetensors_dir(pair / "drafter")
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= set(w)
    assert not any("embed" in k or "lm_head" in k for k in w)
    assert all(t.dtype == torch.bfloat16 for t in w.values())
    assert all(t.dtype == torch.bfloat16 for t in load_safetensors_dir(pair / "target").values())


@pytest.mark.parametrize("weights", ["trained", "noisy", "random"])
def test_dense_al_matches_dflash_generate(pair, weights):
    dflash_model = pytest.importorskip("dflash.model")
    target = load_hf_target(pair / "target", torch.device("cpu"))
    ref = dflash_model.DFlashDraftModel.from_pretrained(pair / "drafter", dtype=torch.float32)
    ours = load_drafter(pair / "drafter")
    torch.manual_seed(0)
    if weights == "random":
        ours.reset_parameters(std=0.05)
    elif weights == "noisy":  # partial acceptance: a mix of short and long steps
        with torch.no_grad():
            for p in ours.parameters():
                if p.dim() == 2:
                    p.add_(torch.randn_like(p) * 0.1)
    ref.load_state_dict(ours.state_dict(), strict=False)
    prompts = heldout_prompts(3, 24, seed=5)
    new = 80
    report = acceptance_length(target, ours, prompts, new)
    B = ours.block_size
    for i, p in enumerate(prompts):
        res = _reference_lengths(dflash_model, ref.eval(), target, p, new)
        start, want = len(p), []
        for n in res:
            if start + B < len(p) + new:   # the dense loop scores only full blocks + bonus
                want.append(n)
            start += n
        assert report.lengths[i] == want, (i, report.lengths[i], want)
    assert report.steps == sum(len(x) for x in report.lengths)
    assert report.mean_al == pytest.approx(sum(map(sum, report.lengths)) / report.steps)


def _reference_lengths(dflash_model, ref, target, prompt, new):
    import time
    from unittest import mock

    # dflash times with torch.cuda.synchronize(); make that a no-op on the CPU
    with mock.patch.object(dflash_model, "_cuda_time", time.perf_counter):
        out = dflash_model.dflash_generate(ref, target, torch.tensor([prompt]), new, None,
                                           return_stats=True)
    return list(out.acceptance_lengths)
