"""Tiny random Qwen3 targets and DFlash drafters saved in the Hugging Face / z-lab layouts.

``agree`` > 0 builds a pair whose outputs are pulled towards a few favourite tokens through one
hidden dimension shared by the embeddings (constant there) and the untied LM head, so the drafter
often agrees with the target and multi-token acceptances happen (random models alone give AL ~1).
"""

from __future__ import annotations

import torch

VOCAB, HIDDEN, TARGET_LAYERS, MASK = 300, 64, 4, 299


def target_config(**kw):
    import transformers
    base = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128,
                num_hidden_layers=TARGET_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256,
                tie_word_embeddings=False, torch_dtype="float32")
    base.update(kw)
    return transformers.Qwen3Config(**base)


def drafter_config(block_size=4, num_layers=2, layer_types=None, window=None, **kw):
    import transformers
    base = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96,
                num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256,
                tie_word_embeddings=False, torch_dtype="float32", block_size=block_size,
                num_target_layers=TARGET_LAYERS,
                dflash_config={"mask_token_id": MASK, "target_layer_ids": [0, 2]})
    if layer_types is not None:
        base.update(layer_types=layer_types, sliding_window=window, use_sliding_window=True,
                    max_window_layers=0)
    base.update(kw)
    return transformers.Qwen3Config(**base)


def _randomize(model, seed, std):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in sorted(model.named_parameters()):
            if n.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def make_target(path, seed=0, agree=0.0, **kw):
    import transformers
    hf = transformers.Qwen3ForCausalLM(target_config(**kw)).eval()
    _randomize(hf, seed, 0.1)
    if agree:
        with torch.no_grad():
            hf.model.embed_tokens.weight[:, 0] = agree
            fav = torch.zeros(VOCAB)
            fav[[5, 17, 42]] = torch.tensor([1.0, 0.97, 0.94])
            hf.lm_head.weight[:, 0] = fav * 3
    hf.save_pretrained(path, safe_serialization=True)
    return hf


def make_drafter(path, seed=1, **kw):
    from dflash.model import DFlashDraftModel
    ref = DFlashDraftModel(drafter_config(**kw)).eval()
    _randomize(ref, seed, 0.1)
    ref.save_pretrained(path, safe_serialization=True)
    return ref


def reference_generate(ref, hf, prompt, max_new, block_size=None, stop=None):
    """``dflash_generate`` on the CPU: (generated tokens, acceptance lengths)."""
    import time

    import dflash.model as dm
    old = dm._cuda_time
    dm._cuda_time = time.perf_counter   # the reference times with torch.cuda.synchronize
    try:
        out = dm.dflash_generate(ref, hf, torch.tensor([prompt]), max_new, stop,
                                 block_size=block_size, return_stats=True)
    finally:
        dm._cuda_time = old
    return out.output_ids[0, len(prompt):].tolist(), list(out.acceptance_lengths)


def plain_generate(hf, prompt, max_new):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False)
    return out[0, len(prompt):].tolist()


#: Prompts of the engine tests (odd lengths, two token patterns).
PROMPTS = [[(7 * i + 3) % 290 for i in range(n)] for n in (6, 13, 21)] + [
    [(11 * i + 5) % 290 for i in range(n)] for n in (3, 17)]


def cache_config(**kw):
    """The engine tests' cache: page 4, 96 tokens, 8 seats, lossless identity codecs."""
    from kvstrata.runtime import CacheConfig
    base = dict(page_size=4, max_seq_len=96, max_batch_size=8, target_codec="identity",
                draft_codec="identity")
    base.update(kw)
    return CacheConfig(**base)


def assert_clean(llm) -> None:
    """Nothing left allocated or queued: no page in use, no sequence, no step in flight, no
    running or waiting request."""
    st = llm.stats()
    assert st["pool"]["in_use"] == 0 and not llm.mgr.seqs and llm._flight is None
    assert not llm.sched.running and not llm.sched.waiting and not llm.has_unfinished()
