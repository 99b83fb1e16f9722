"""One-row products streamed through shared memory by bulk copies (Hopper, CUDA C++).

At batch 1 a product reads each weight byte once, and what separates a chain of them from the
copy rate is each launch's ramp and tail: the Triton :func:`~.gemv.gemv` can read only its
first weight tile before it waits for the previous kernel (``griddepcontrol.wait``), so every
product starts with its loads' latency exposed (docs/benchmarks.md, runner sessions 5-11:
the Triton chain 1.10-1.13x the read floor, a bulk-copy stream alone 0.99x).

:func:`stream_gemv` is one launch of one block per SM (each block owns a contiguous range of
weight rows, the ranges balanced to within one row). Every warp's lane 0 starts bulk copies
(``cp.async.bulk``) of its first rows into a ring of shared-memory stages (one row, or a gate
and an up row, per stage, about 192 KB per block) *before* the wait, so a product streams up
to 25 MB of its weights while the previous kernel finishes. A block holds most of its SM's
shared memory, so the next kernel's blocks can only start where a block of this one has left;
where the next kernel is itself a stream product (after down) the blocks let it launch at once,
elsewhere (after q/k/v: its q/k norm + RoPE, then the decode segment, whose attention ran
slower for an early start) only when they complete. After the wait the input row goes to shared
memory and each warp takes the stages ``warp, warp + NW, ...`` (a stage's phases in order, by
one warp): 8 inputs per lane and step, float32 sums, the warp's sum by shuffles, then the stage
is refilled with the warp's row ``NS`` further on.

Epilogues as :func:`~.gemv.gemv`'s: ``RMS_IN`` (the row scaled by the previous norm's
``rsqrt``, :class:`~.gemv.RowRms`), ``GATED`` (``silu(gate) * up``, each rounded as the separate
ops round), ``ADD_NORM`` (``h = residual + product``, ``norm_weight * h`` and the block's sum of
squares of ``h``: one part per block). Sums run in a fixed order: deterministic, graph replay
equals eager bit for bit; values differ from the Triton kernel's by the summation order only.

Shipped for q/k/v and down (:data:`VARIANT`): the batch-1 plain decode step 0.05-0.06 ms faster
at 1k and 8k on the H200; the gated gate/up product stays on Triton, whose 384 programs read
its 201 MB at the copy rate (docs/benchmarks.md, twenty-sixth runner session). 2-16 rows:
:mod:`.stream_rows`. :func:`stream_gemv_ok` says where it serves (sm_90, one bf16 row, no bias,
``K`` a multiple of 256 and a ring that fits); ``KVSTRATA_STREAM_GEMV=0`` keeps every product
(of any row count) on Triton. The kernel's CUDA C++: ``cuda/stream_gemv.cu`` (built by
:func:`~._cuda.cuda_source`).
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch
from torch import Tensor

from ._cuda import Kernel, compiles, cuda_source, variant
from ._device import num_sms, pdl_ok

#: ``KVSTRATA_STREAM_GEMV=0``: one-row products stay on the Triton kernel.
STREAM_ENV = "KVSTRATA_STREAM_GEMV"
#: the switches as shipped: consumer warps; ring KB per block; the products that let the next
#: kernel launch once every block has issued its first copies (the others: when they
#: complete); the products served. The last two are masks of 1 (plain, e.g. q/k/v), 2 (gated:
#: gate/up) and 4 (the add-norm epilogue: down). Measured on the H200 (docs/benchmarks.md,
#: twenty-sixth runner session): the gated product lost to Triton's (52 against 48.5 us per
#: layer); an early launch of the kernel after q/k/v (its norm + RoPE, then the segment) made
#: the decode segment slower, after down (q/k/v) it pays.
VARIANT = (8, 192, 4, 5)
#: for benchmarks: colon-separated switches replacing :data:`VARIANT`'s first ones
VARIANT_ENV = "KVSTRATA_STREAM_GEMV_VARIANT"
#: the most dynamic shared memory a block of an H100/H200 may take
_SMEM_MAX = 227 * 1024


def _env_variant() -> tuple[int, ...]:
    return variant(os.environ.get(VARIANT_ENV, ""), VARIANT, VARIANT_ENV)


def stages(k: int, gated: bool, nw: int, ring_kb: int) -> int:
    """Ring stages: the most multiples of ``nw`` whose rows fit ``ring_kb`` (at least ``nw``)."""
    per = k * 2 * (2 if gated else 1)
    return min(128, max(nw, (ring_kb * 1024 // per) // nw * nw))


def smem_bytes(k: int, gated: bool, ns: int, nw: int, maxr: int) -> int:
    """Dynamic shared memory: the mbarriers (1 KB), the ring, the input row, the epilogue's
    rows and sums."""
    return 1024 + ns * k * 2 * (2 if gated else 1) + k * 2 + (2 * maxr + nw + 1) * 4


def build(k: int, n: int, blocks: int, gated: bool, rms_in: bool, add_norm: bool, nw: int,
          ring_kb: int, trigger: int, pdl: int) -> tuple[str, int]:
    """The source of one shape and epilogue, and its dynamic shared memory."""
    ns = stages(k, gated, nw, ring_kb)
    maxr = -(-n // blocks)
    while ns > nw and smem_bytes(k, gated, ns, nw, maxr) > _SMEM_MAX:
        ns -= nw
    src = cuda_source("stream_gemv.cu", {
        "K_IN": k, "GATED": gated, "RMS_IN": rms_in, "ADD_NORM": add_norm, "NW": nw, "NS": ns,
        "MAXR": maxr, "PDL": pdl, "TRIGGER": trigger})
    return src, smem_bytes(k, gated, ns, nw, maxr)


@functools.lru_cache(maxsize=None)
def _kernel(device: torch.device, k: int, n: int, gated: bool, rms_in: bool, add_norm: bool,
            nw: int, ring_kb: int, trigger: int, pdl: int) -> Kernel:
    blocks = num_sms(device, 132)
    trigger = int(bool(trigger & (2 if gated else 4 if add_norm else 1)))
    src, smem = build(k, n, blocks, gated, rms_in, add_norm, nw, ring_kb, trigger, pdl)
    with torch.cuda.device(device):
        return Kernel(src, "stream_gemv", smem, nw * 32, blocks=blocks, cooperative=False)


def operands_ok(x: Tensor, weight: Tensor, bias: Tensor | None, impl: str) -> bool:
    """What both stream products ask of their operands: ``impl="auto"`` on an sm_90 GPU
    (``KVSTRATA_STREAM_GEMV`` not ``0``), no bias, a 2-D bf16 input with contiguous columns and
    a contiguous bf16 weight of as many columns, both 16-byte aligned, no autograd."""
    return not (impl != "auto" or x.device.type != "cuda"
                or os.environ.get(STREAM_ENV, "1") == "0" or bias is not None or x.dim() != 2
                or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16
                or x.stride(1) != 1 or not weight.is_contiguous() or weight.dim() != 2
                or weight.shape[1] != x.shape[1] or x.data_ptr() % 16 or weight.data_ptr() % 16
                or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
                or torch.cuda.get_device_capability(x.device)[0] != 9)


def stream_gemv_ok(x: Tensor, weight: Tensor, bias: Tensor | None, gated: bool,
                   impl: str = "auto", add_norm: bool = False) -> bool:
    """Whether :func:`stream_gemv` serves ``F.linear(x, weight)``: one row whose operands are
    :func:`operands_ok`, a product served by the switches, a weight that :func:`fits`, and
    the shape compiles."""
    if not operands_ok(x, weight, bias, impl) or x.shape[0] != 1:
        return False
    n, k = weight.shape
    n //= 2 if gated else 1
    if (not _env_variant()[3] & (2 if gated else 4 if add_norm else 1)
            or not fits(k, n, gated, num_sms(x.device, 132))):
        return False
    return _compiled(x.device, k, n, gated)


def fits(k: int, n: int, gated: bool, blocks: int) -> bool:
    """``K`` a multiple of 256, at least a row per block, and the ring (at least one stage per
    warp) with the rest in a block's shared memory, with the switches in force."""
    nw, ring_kb = _env_variant()[:2]
    if k % 256 or n < blocks:
        return False
    maxr = -(-n // blocks)
    return smem_bytes(k, gated, stages(k, gated, nw, ring_kb), nw, maxr) <= _SMEM_MAX


@functools.lru_cache(maxsize=None)
def _compiled(device: torch.device, k: int, n: int, gated: bool) -> bool:
    v = _env_variant()
    return compiles(
        lambda: [_kernel(device, k, n, gated, r, a, *v[:3], int(pdl_ok(device, "gemv")))
                 for r in (False, True)
                 for a in ((False,) if gated else (False, True))],
        f"kernels.stream_gemv: not compiled for [{n}, {k}]{' gated' if gated else ''} on "
        f"{device}", "one-row products keep the Triton kernel")


def stream_gemv(x: Tensor, weight: Tensor, *, gated: bool = False, rms=None,
                add_norm: tuple[Tensor, Tensor, float] | None = None):
    """:func:`~.gemv.gemv` / :func:`~.gemv.gemv_add_norm` of one row where
    :func:`stream_gemv_ok` holds: ``out [1, N]``, or ``(out, h, parts [1, blocks])`` with
    ``add_norm`` (the caller wraps the parts in a :class:`~.gemv.RowRms`)."""
    k = x.shape[1]
    n = weight.shape[0] // (2 if gated else 1)
    dev = x.device
    pdl = pdl_ok(dev, "gemv")
    kern = _kernel(dev, k, n, gated, rms is not None, add_norm is not None,
                   *_env_variant()[:3], int(pdl))
    return _run(kern, lambda out: [x, weight, out, ctypes.c_int32(n)], x, 1, n, rms, add_norm,
                pdl)


def _run(kern: Kernel, head, x: Tensor, m: int, n: int, rms, add_norm, pdl: bool):
    """One launch of either build: ``head(out)`` its first arguments, then the input's row
    scale and the add-norm epilogue's operands; ``out [m, n]`` or ``(out, h, parts)``."""
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ss_in = rms.parts.contiguous() if rms is not None else out
    args = head(out) + [ss_in, ctypes.c_int32(ss_in.shape[1] if rms is not None else 0),
                        ctypes.c_float(rms.eps if rms is not None else 0.0)]
    if add_norm is None:
        kern(args + [out, out, out, out], pdl=pdl)
        return out
    residual, g, _ = add_norm
    h = torch.empty((m, n), dtype=x.dtype, device=x.device)
    parts = torch.empty((m, kern.blocks), dtype=torch.float32, device=x.device)
    kern(args + [residual.contiguous(), g.contiguous(), h, parts], pdl=pdl)
    return out, h, parts


__all__ = ["STREAM_ENV", "operands_ok", "stream_gemv", "stream_gemv_ok"]
