"""Device facts the kernels' launch choices need (host-side queries, never a device sync)."""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device, cpu: int) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (queried once per device), or ``cpu`` for
    any other device (the interpreter's stand-in: small grids for tests, a GPU-sized default for
    plans made on the host)."""
    if device.type != "cuda":
        return cpu
    return torch.cuda.get_device_properties(device).multi_processor_count


try:
    import triton
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None


def use_triton(x: Tensor, impl: str) -> bool:
    """Whether an element-wise or step kernel runs its Triton launch for ``x``: ``impl="auto"``
    on CUDA, ``"triton"`` wherever Triton runs (the CPU interpreter included), ``"torch"``
    never; never for a tensor autograd tracks (the kernels have no backward)."""
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    if torch.is_grad_enabled() and x.requires_grad:
        return False
    return triton is not None and (impl == "triton" or (impl == "auto"
                                                        and x.device.type == "cuda"))


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


#: Every kernel family with a PDL switch, and those that use it by default. Measured on the
#: H200 (docs/benchmarks.md, runner section, batch 1 at 1k, one call): the products and the
#: element-wise kernels chained this way take the plain decode step from 5.15 to 4.68 ms and
#: verify-16 from 5.05 to 4.91 ms; the attention and split-merge launches as PDL secondaries
#: lose (every family on: 4.89 / 5.32 ms), so they stay off. (Letting the split merge, not
#: itself a PDL launch, start the o_proj product early lost too: speculative step 6.71 ms
#: against 6.38.) Attention as a secondary lost again with the fused decode merge, its plan read
#: before the wait, and its trigger early or after the K/V loop: plain decode b1 4.91-5.00 ms
#: against 4.68-4.76 (fifth runner session). Attention not a secondary but triggering o_proj
#: early (sixth session, five processes in three calls): plain decode b1 at 1k 4.59-4.74 ms
#: against 4.54-4.78 without, no gain; removed. ``segment``: the CUDA attention + o_proj
#: segments (:mod:`.decode_segment`, :mod:`.verify_segment`) launched as cooperative PDL
#: launches, their pages and weights issued before the wait: plain decode b1 -0.03 ms,
#: verify-16 -0.04-0.05 ms at 1k and 8k (twenty-fourth runner session).
PDL_FAMILIES = ("gemv", "norm", "rope", "silu", "attn", "reduce", "segment")
PDL_DEFAULT = ("gemv", "norm", "rope", "silu", "segment")


def pdl_ok(device: torch.device, family: str) -> bool:
    """Whether kernels of ``family`` (one of :data:`PDL_FAMILIES`) launched on ``device`` use
    programmatic dependent launch: a CUDA device of compute capability 9.0+ (Hopper), a Triton
    with grid dependency control, not the interpreter, and the family on in ``KVSTRATA_PDL``
    (unset or ``1``: :data:`PDL_DEFAULT`; ``0``: none; or a comma-separated list of families).

    With it, a kernel's programs start while the previous kernel's last programs still run;
    each kernel first reads only what no earlier kernel writes (weights), then waits
    (``gdc_wait``) for the previous kernel's writes. Every program of a PDL kernel waits before
    it exits, so a kernel's completion implies its predecessors' (the ordering is transitive).
    """
    if family not in PDL_FAMILIES:
        raise ValueError(f"unknown PDL kernel family {family!r}; one of {PDL_FAMILIES}")
    if device.type != "cuda" or not _HAS_GDC or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return family in _pdl_families(os.environ.get(PDL_ENV, "1")) and _pdl_device(device)


def pdl_launch(device: torch.device, family: str) -> dict:
    """Launch arguments of a kernel with a ``PDL`` constexpr: ``PDL`` and, when on (see
    :func:`pdl_ok`), Triton's ``launch_pdl``."""
    return {"PDL": True, "launch_pdl": True} if pdl_ok(device, family) else {"PDL": False}


@functools.lru_cache(maxsize=None)
def _pdl_families(value: str) -> frozenset:
    v = value.strip()
    if v in ("", "1"):
        return frozenset(PDL_DEFAULT)
    if v == "0":
        return frozenset()
    fams = frozenset(f.strip() for f in v.split(",") if f.strip())
    bad = sorted(fams - set(PDL_FAMILIES))
    if bad:
        raise ValueError(f"{PDL_ENV}={value!r}: unknown families {bad}; use 0, 1 or a "
                         f"comma-separated list of {PDL_FAMILIES}")
    return fams
