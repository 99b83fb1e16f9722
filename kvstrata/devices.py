"""Devices by name, checked against the machine (a leaf every layer may use, like ``dtypes``)."""

from __future__ import annotations

import torch


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``"cpu"``, ``"cuda"``, ``"cuda:1"``, a ``torch.device``, or ``None``/``"auto"`` (CUDA when
    present) as a device this machine has. ``ValueError`` names what is wrong and what there is:
    a malformed name, CUDA asked for where torch sees no CUDA device, an index past the last
    one; never a traceback from deep inside a model load."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not a device name (auto, cpu, cuda, cuda:N)"
                         ) from None
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            why = ("this torch is built without CUDA" if torch.version.cuda is None
                   else "torch sees no CUDA device")
            raise ValueError(f"device {str(device)!r}: {why} (torch {torch.__version__}); "
                             f"use cpu")
        if dev.index is not None and dev.index >= n:
            raise ValueError(f"device {str(device)!r}: this machine has {n} CUDA device"
                             f"{'s' if n > 1 else ''} (cuda:0{f'..cuda:{n - 1}' if n > 1 else ''})")
    return dev
