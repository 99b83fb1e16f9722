"""Training of kvstrata's shipped small models (top layer: imports anything, imported by nothing).

- :mod:`.corpus`: the stdlib source corpus, the held-out module list, held-out prompts
- :mod:`.target`: the Qwen3 target (``transformers``), next-byte cross-entropy
- :mod:`.dflash_dense` / :mod:`.drafter`: a dense DFlash drafter in the z-lab layout + its trainer
- :mod:`.evaluate`: dense greedy acceptance length of a target + drafter pair

Run ``python -m kvstrata.training OUT_DIR`` (or ``scripts/train_tiny_pair.sh``); needs the
``train`` extra (transformers, safetensors). See ``docs/training.md``.
"""
