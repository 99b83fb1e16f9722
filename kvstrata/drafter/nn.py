"""Tiny drafter-local building blocks (RMSNorm, RoPE, SwiGLU MLP, safetensors loading).

The drafter sits below ``runtime`` and must not import it, so it keeps these few lines itself
instead of importing ``runtime.layers``. They follow the Hugging Face Qwen3 order of operations
(float32 norm, cast back before the weight multiply; cos/sin built in float32 and cast to the
activation dtype) so a float32 drafter matches the reference bit for bit.
"""

from __future__ import annotations

import glob
import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x: ``[..., dim]``; weight ``[dim]``."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype
                 ) -> tuple[Tensor, Tensor]:
    """cos/sin ``[T, head_dim]`` for absolute ``positions [T]`` (default RoPE)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64,
                                        device=positions.device).float() / head_dim))
    freqs = positions.float()[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x ``[T, H, D]``; cos/sin ``[T, D]`` (rotate-half convention)."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def load_safetensors_dir(path: str | os.PathLike) -> dict[str, Tensor]:
    """Every tensor of every ``*.safetensors`` file in ``path`` (CPU, checkpoint dtype)."""
    try:
        from safetensors.torch import load_file
    except ImportError as e:  # pragma: no cover - safetensors ships with the ref extra
        raise ImportError("loading checkpoints needs the 'safetensors' package "
                          "(pip install safetensors)") from e
    files = sorted(glob.glob(os.path.join(os.fspath(path), "*.safetensors")))
    if not files:
        raise ValueError(f"{os.fspath(path)!r} holds no *.safetensors file")
    out: dict[str, Tensor] = {}
    for fn in files:
        out.update(load_file(fn))
    return out
