"""Training of kvstrata's shipped small models (top layer: imports anything, imported by nothing).

- :mod:`.target`: the Qwen3 target (``transformers``), next-byte cross-entropy
- :mod:`.dflash_dense` / :mod:`.drafter`: a dense DFlash drafter in the z-lab layout + its trainer
- :mod:`.evaluate`: dense greedy acceptance length of a target + drafter pair

The corpus and its held-out split live in :mod:`kvstrata.assets.corpus` (the benchmarks, the demo
and the launcher draw prompts from it without importing the trainers).

Run ``python -m kvstrata.training OUT_DIR`` (or ``scripts/train_tiny_pair.sh``); needs the ``ref``
extra (transformers, safetensors). See ``docs/training.md``.
"""
