"""Shared training-loop helpers: devices, autocast, a time-capped cosine schedule, logging.

The learning-rate schedule runs on *progress* = ``max(step / steps, elapsed / max_seconds)``, so a
run that is slower than planned still finishes its cosine decay inside the time cap instead of
being cut off at a high learning rate. With the default caps the step count is the binding limit
on an H200, and the result is reproducible from the seed; :class:`Clock` reports which one bound.
"""

from __future__ import annotations

import contextlib
import math
import random
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..devices import resolve_device


def seed_everything(seed: int) -> torch.Generator:
    """Seed python, numpy and torch; returns a CPU generator for data sampling."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def autocast(device: torch.device):
    """bf16 autocast on CUDA; a no-op on the CPU (fp32, for exact smoke tests)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def make_optimizer(params, lr: float, weight_decay: float, device: torch.device):
    """AdamW (betas 0.9/0.95), decay only on matrices, fused on CUDA."""
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    kw = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, **kw)


@dataclass
class Clock:
    """Step/time budget and the schedule that follows it."""

    steps: int
    max_seconds: float
    lr: float
    warmup: int = 50
    min_lr_frac: float = 0.1
    start: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        if self.steps < 1 or self.max_seconds <= 0 or self.lr <= 0:
            raise ValueError(f"need steps >= 1, max_seconds > 0, lr > 0; got steps={self.steps}, "
                             f"max_seconds={self.max_seconds}, lr={self.lr}")

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def progress(self, step: int) -> float:
        return min(1.0, max(step / self.steps, self.elapsed / self.max_seconds))

    def done(self, step: int) -> bool:
        return step >= self.steps or self.elapsed >= self.max_seconds

    def lr_at(self, step: int) -> float:
        warm = min(1.0, (step + 1) / max(1, self.warmup))
        cos = 0.5 * (1 + math.cos(math.pi * self.progress(step)))
        return self.lr * warm * (self.min_lr_frac + (1 - self.min_lr_frac) * cos)

    def bound(self, step: int) -> str:
        return "steps" if step >= self.steps else "time cap"


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr


def optimizer_step(opt: torch.optim.Optimizer, loss: torch.Tensor, params,
                   max_grad_norm: float = 1.0) -> None:
    """Backward of ``loss``, gradient clipping of ``params`` to ``max_grad_norm``, one step."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    opt.step()


def log(msg: str) -> None:
    print(msg, file=sys.stdout, flush=True)


__all__ = ["Clock", "autocast", "log", "make_optimizer", "optimizer_step", "resolve_device",
           "seed_everything", "set_lr"]
