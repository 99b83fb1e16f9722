"""L2 prefetch of a weight the next bandwidth-bound kernel will read.

At batch 1 a decoder layer alternates between phases that stream weights at the copy rate (the
linear layers) and phases that barely touch memory (q/k norm + RoPE, attention over a short
context, its split merge: ~10-15 us per layer on the H200). :func:`l2_prefetch` fills the GPU's
L2 with a tensor's bytes during such a phase, so that the product which follows reads them from
L2 rather than from HBM. It is one small launch: every thread issues Hopper bulk prefetches
(``cp.async.bulk.prefetch.L2``, fire-and-forget, no registers held, nothing written), so the
launch retires in a few microseconds while the memory system keeps filling L2 behind it.

Under programmatic dependent launch (:func:`~._device.pdl_ok`, family ``"prefetch"``) the
prefetches are issued before the kernel waits on its predecessor (they read only weights) and
the next kernel is released at once. Where it cannot run (CPU, the interpreter, GPUs before
compute capability 9.0, ``KVSTRATA_L2_PREFETCH=0``) it does nothing: it never changes a value.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from ._device import gdc_launch_dependents, gdc_wait, pdl_launch  # noqa: F401 - in kernels

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None

#: ``KVSTRATA_L2_PREFETCH=0`` turns :func:`l2_prefetch` off (a no-op).
PREFETCH_ENV = "KVSTRATA_L2_PREFETCH"
#: bytes of one bulk prefetch instruction, and instructions per program (one per thread).
_CHUNK = 16384
_PER_PROGRAM = 128

if triton is not None:
    @triton.jit
    def _l2_prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr, PER_PROGRAM: tl.constexpr,
                            PDL: tl.constexpr):
        # One bulk prefetch per thread: chunk i covers bytes [i * CHUNK, min(+CHUNK, nbytes)).
        i = (tl.program_id(0) * PER_PROGRAM + tl.arange(0, PER_PROGRAM)).to(tl.int64)
        lo = i * CHUNK
        size = tl.minimum(nbytes - lo, CHUNK)
        ok = size > 0
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $3; mov.u32 $0, 0; }",
            "=r,l,r,r", [ptr.to(tl.int64) + tl.where(ok, lo, 0), ok.to(tl.int32),
                         tl.where(ok, size, 16).to(tl.int32)],
            dtype=tl.int32, is_pure=False, pack=1)
        if PDL:
            # Release the next kernel first; wait before exiting so that this kernel's
            # completion still implies its predecessors' (kernels/_device.pdl_ok).
            gdc_launch_dependents()
            gdc_wait()


@functools.lru_cache(maxsize=None)
def _capable(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def l2_prefetch_ok(t: Tensor) -> bool:
    """Whether :func:`l2_prefetch` issues anything for ``t``: a contiguous CUDA tensor (compute
    capability 9.0+) whose bytes start 16-byte aligned and are a multiple of 16, Triton compiled (not the
    interpreter), and ``KVSTRATA_L2_PREFETCH`` not ``0``."""
    return (triton is not None and t.device.type == "cuda" and t.is_contiguous()
            and t.data_ptr() % 16 == 0 and t.numel() * t.element_size() % 16 == 0 and os.environ.get("TRITON_INTERPRET") != "1"
            and os.environ.get(PREFETCH_ENV, "1").strip() != "0" and _capable(t.device))


def l2_prefetch(t: Tensor) -> None:
    """Ask the GPU to bring ``t``'s bytes into L2 (16 KiB bulk prefetches, nothing past its
    end); a no-op where it cannot run (:func:`l2_prefetch_ok`). Values never change; only the
    next reader's speed does."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0 or not l2_prefetch_ok(t):
        return
    grid = (triton.cdiv(triton.cdiv(nbytes, _CHUNK), _PER_PROGRAM),)
    _l2_prefetch_kernel[grid](t, nbytes, CHUNK=_CHUNK, PER_PROGRAM=_PER_PROGRAM, num_warps=4,
                              **pdl_launch(t.device, "prefetch"))


__all__ = ["PREFETCH_ENV", "l2_prefetch", "l2_prefetch_ok"]
