"""Device facts the kernels' launch choices need (host-side queries, never a device sync)."""

from __future__ import annotations

import functools
import os

import torch


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device, cpu: int) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (queried once per device), or ``cpu`` for
    any other device (the interpreter's stand-in: small grids for tests, a GPU-sized default for
    plans made on the host)."""
    if device.type != "cuda":
        return cpu
    return torch.cuda.get_device_properties(device).multi_processor_count


#: ``KVSTRATA_PDL=0`` turns programmatic dependent launch off (it is on where it works).
PDL_ENV = "KVSTRATA_PDL"

try:  # Triton >= 3.4: grid dependency control (programmatic dependent launch)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    _HAS_GDC = True
except ImportError:  # pragma: no cover - older Triton, or none
    gdc_launch_dependents = gdc_wait = None
    _HAS_GDC = False


@functools.lru_cache(maxsize=None)
def _pdl_device(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_ok(device: torch.device) -> bool:
    """Whether kernels launched on ``device`` use programmatic dependent launch: a CUDA device
    of compute capability 9.0+ (Hopper), a Triton with grid dependency control, not the
    interpreter, and not turned off with ``KVSTRATA_PDL=0``.

    With it, a kernel's programs start while the previous kernel's last programs still run;
    each kernel first reads only what no earlier kernel writes (weights), then waits
    (``gdc_wait``) for the previous kernel's writes. Every program of a PDL kernel waits before
    it exits, so a kernel's completion implies its predecessors' (the ordering is transitive).
    """
    if device.type != "cuda" or not _HAS_GDC or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if os.environ.get(PDL_ENV, "1") == "0":
        return False
    return _pdl_device(device)
