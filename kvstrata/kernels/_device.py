"""Device facts the kernels' launch choices need (host-side queries, never a device sync)."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device, cpu: int) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (queried once per device), or ``cpu`` for
    any other device (the interpreter's stand-in: small grids for tests, a GPU-sized default for
    plans made on the host)."""
    if device.type != "cuda":
        return cpu
    return torch.cuda.get_device_properties(device).multi_processor_count
