"""kvstrata.nn: model building blocks shared by the target (``runtime``), the drafter and training.

A leaf (it imports only torch): ``runtime`` and ``drafter`` both build on it, and the drafter sits
below ``runtime``, so the Qwen3 layers and the checkpoint loader live here rather than in either.

- :mod:`.layers`: RMSNorm, RoPE, SwiGLU MLP, Qwen3 attention projections
- :mod:`.loader`: ``config.json`` and safetensors checkpoint directories
"""
