"""Batch-1 verify: attention of 2-16 query tokens and the o_proj product in one persistent launch
(Hopper, CUDA C++ with tensor-core products).

A batch-1 verify-16 step (the target's forward over the last token and the drafts) spends ~27
us per layer at 1k in attention, the merge of its splits and o_proj, three launches that each
wait for the previous one (H200, docs/benchmarks.md, sixteenth runner session).
:func:`verify_segment` runs them as one launch of 128 blocks, one per SM, all resident (a
cooperative launch), the batch-1 decode segment's plan (:mod:`.decode_segment`) with matrix
products:

1. a producer warp per block brings the pages of one (KV head, split) into a ring of
   shared-memory stages with Hopper tensor copies (128-byte swizzle) and the block's first 16
   o_proj weight rows with bulk copies, one after every second page and the rest after the
   last (all after the pages left ~3 us of weight traffic in flight when the split's partial
   is stored, which delayed it; twenty-eighth runner session);
2. eight warps compute the split's attention, a warp per query head's 16 (token) rows, two
   warps per head over every other page, online softmax in float32 (the running maxima move
   only when one grows by more than 2^8, so most pages skip the rescale of the output state;
   pages wholly before every query skip the masks; two pages per iteration with one vote
   were 0.06 ms slower per step at 8k, twenty-ninth runner session), causal and length
   masks, V rows past the sequence zeroed. With 4 query heads per KV head the four warps of
   a head group are a warpgroup and multiply a page straight from the ring (``wgmma``, sm_90a):
   ``QK^T`` as eight m64n16k16, ``PV`` as one m64n128k16; other groupings use per-warp
   ``mma.m16n8k16`` with ``ldmatrix``. A head's first warp merges the other warps' states
   (through shared memory) in its registers and stores the split's normalised partial and
   log-sum-exp (base 2);
3. a grid barrier; each block merges ``16 * Hq / 128`` (token, head) rows of the splits into
   the bf16 attention output; a second grid barrier;
4. each block multiplies its ``N / 128`` o_proj rows by the 16 output rows (``mma``, the eight
   warps split K, a fixed-order sum): with 32 rows, 0-15 from shared memory, 16-23 from the
   ring (bulk copies issued once attention is done, landing over the merge and the barriers)
   and 24-31 from registers (loaded after the merge, in flight through barrier 2); it
   writes what :func:`~.gemv.gemv_add_norm` writes: ``h = residual + product`` (bf16),
   ``norm_weight * h`` and each block's per-row sums of squares of ``h``.

Both grid barriers' arrivals come from the producer warp's first lane, which has no memory
operations in flight (thread 0 arrives with the partial's stores, then the weight loads, in
flight: each barrier took ~1 us longer in a layer, docs/benchmarks.md, twenty-third runner
session).

Where :func:`~._device.pdl_ok` allows (family ``segment``) it is also a programmatic dependent
launch: the producer issues the pages without any of the last 16 positions (the kernel before
writes this step's K/V) and the first 16 weight rows before ``griddepcontrol.wait``; q, the
residual and the newest pages come after it (verify-16 0.04-0.05 ms faster at 1k and 8k,
twenty-fourth runner session).

No float atomics, fixed summation orders: graph replay equals eager bit for bit. The values
differ from the Triton attention + ``gemv_add_norm`` path only by summation order (the CUDA
tests bound it). :func:`verify_segment_ok` says where it applies (sm_90, >= 128 SMs, one
sequence, 2-16 causal queries, a bf16 page-major pool of 16-token pages and 128-dim heads, no
sliding window or o_proj bias, shapes below) for the query counts of :data:`DEFAULT_QUERIES`
(4 query heads per KV head) or :data:`DEFAULT_QUERIES_MMA` (``KVSTRATA_VERIFY_SEGMENT=1``:
every count from 2 to 16; ``0``: none). Measured in the step (docs/benchmarks.md, nineteenth
and twentieth runner sessions, Qwen3-8B shape): verify-16 graph 4.62-4.63 ms against the Triton
path's 4.77 at 1k, 5.01-5.02 against 5.01 at 8k; the speculative step at width 8 5.91 against
6.03 ms at 8k, at widths 2 and 4 0.07-0.12 ms faster than on the Triton path at 1k and 8k (the
``mma`` build lost there from 4k). The kernel's CUDA C++: ``cuda/verify_segment.cu`` (built by
:func:`~._cuda.cuda_source`).
"""

from __future__ import annotations

import ctypes
import functools
import math
import os

import torch
from torch import Tensor

from ._cuda import (BLOCKS, Kernel, compiles, cuda_source, enabled, grid_counter,
                    tensor_map_2d, variant)
from ._device import pdl_ok
from .attention_plan import AttentionMetadata
from .gemv import RowRms

#: ``KVSTRATA_VERIFY_SEGMENT=1`` puts every batch-1 verify on this kernel where it applies, ``0``
#: none (the Triton attention + merge + ``gemv_add_norm`` launches); unset: the query counts of
#: :data:`DEFAULT_QUERIES`.
SEGMENT_ENV = "KVSTRATA_VERIFY_SEGMENT"
#: query rows of a launch (an mma tile)
MAX_QUERIES = 16
#: query tokens per launch the warpgroup build (4 query heads per KV head) serves unless
#: ``KVSTRATA_VERIFY_SEGMENT`` says otherwise: every count (see the module: verify widths 2, 4,
#: 8 and 16 measured)
DEFAULT_QUERIES = frozenset(range(2, MAX_QUERIES + 1))
#: the same for the ``mma`` build (other groupings; measured in the eighteenth session)
DEFAULT_QUERIES_MMA = frozenset({8})
WARPS = 8           # compute warps; one more warp issues the copies
THREADS = (WARPS + 1) * 32
#: ring stages of one page (K and V, 8 KB) each
STAGES = 8
#: :func:`source`'s switches as shipped: ``stages, pref, wg, pdl, lazy, spread``
VARIANT = (STAGES, 0, 1, 1, 1, 1)
#: for benchmarks of the step (``benchmarks/gpu_runner.sh``): colon-separated switches that
#: replace :data:`VARIANT`'s first ones, e.g. ``10:1``
VARIANT_ENV = "KVSTRATA_VERIFY_SEGMENT_VARIANT"
_LOG2E = math.log2(math.e)


def _env_variant() -> tuple[int, ...]:
    return variant(os.environ.get(VARIANT_ENV, ""), VARIANT, VARIANT_ENV)


def source(nkv: int, group: int, k_in: int, n_out: int, stages: int = STAGES,
           pref: int = 0, wg: int = 1, pdl: int = 0, lazy: int = 0, spread: int = 0,
           stamps: bool = False) -> str:
    """The kernel's CUDA source for one shape (``pref``: an L2 prefetch of the weight rows not
    in shared memory after the first barrier; ``wg``: attention by warpgroup products, sm_90a,
    4 query heads per KV head only; ``pdl``: a programmatic dependent launch, the pages and the
    first weight rows issued before the wait; ``lazy``: the page loop's running maxima move
    only by more than 2^8 (most pages skip the rescale), the scale folded into the exponent,
    no masks on whole pages before every query; ``spread``: the first 16 weight rows one
    after every second page, not all after the last; ``stamps``: per-block phase
    timestamps)."""
    return cuda_source("verify_segment.cu", {
        "NKV": nkv, "GROUP": group, "SPLITS": BLOCKS // nkv, "K_IN": k_in,
        "MT": n_out // (BLOCKS * 16), "NST": stages, "PREF": pref, "STAMPS": stamps,
        "BLOCKS": BLOCKS, "WG": wg, "PDL": pdl, "LAZY": lazy, "SPREAD": spread})


def smem_bytes(k_in: int, n_out: int, stages: int = STAGES) -> int:
    """Dynamic shared memory: 1 KB of alignment slack, the ring and 128 bytes (o_proj rows
    16-23 after attention), 16 weight rows (16-byte pad), the mbarriers, the warps' row maxima
    and sums, the squares of the epilogue."""
    mt = n_out // (BLOCKS * 16)
    return (1024 + stages * 8192 + 128 + 16 * (k_in * 2 + 16) + (2 * stages + 2) * 8
            + 2 * WARPS * 16 * 4 + 16 * 16 * mt * 4)


def build(nkv: int, group: int, k_in: int, n_out: int, stages: int, pref: int, wg: int,
          pdl: int, lazy: int, spread: int, stamps: bool) -> tuple[str, str]:
    """The source a launch compiles and its NVRTC target: the warpgroup build (4 query heads
    per KV head only) for ``sm_90a``, the ``mma`` build for ``sm_90``."""
    wg = int(bool(wg) and group == 4)
    src = source(nkv, group, k_in, n_out, stages, pref, wg, pdl, lazy, spread, stamps)
    return src, "90a" if wg else "90"


@functools.lru_cache(maxsize=None)
def _kernel(device: torch.device, nkv: int, group: int, k_in: int, n_out: int, stages: int,
            pref: int, wg: int, pdl: int, lazy: int, spread: int, stamps: bool) -> Kernel:
    src, arch = build(nkv, group, k_in, n_out, stages, pref, wg, pdl, lazy, spread, stamps)
    with torch.cuda.device(device):
        return Kernel(src, "verify_segment", smem_bytes(k_in, n_out, stages), THREADS,
                      arch=arch if arch == "90a" else None)


def verify_segment_ok(q: Tensor, kv_cache: Tensor, meta: AttentionMetadata, weight: Tensor,
                      bias: Tensor | None, sliding_window: int | None, impl: str = "auto"
                      ) -> bool:
    """Whether :func:`verify_segment` serves this layer: ``impl="auto"`` on an sm_90 GPU with
    >= 128 SMs, ``meta.max_query_len`` in :data:`DEFAULT_QUERIES` (4 query heads per KV
    head) or :data:`DEFAULT_QUERIES_MMA` (any with ``KVSTRATA_VERIFY_SEGMENT=1``, none with
    ``0``), for the shapes :func:`segment_shapes_ok` takes."""
    if not (enabled(impl, q.device, SEGMENT_ENV, "")
            and segment_shapes_ok(q, kv_cache, meta, weight, bias, sliding_window)):
        return False
    hkv = kv_cache.shape[3]
    default = DEFAULT_QUERIES if q.shape[1] == 4 * hkv else DEFAULT_QUERIES_MMA
    if not (os.environ.get(SEGMENT_ENV) == "1" or meta.max_query_len in default):
        return False
    return _compiled(q.device, hkv, q.shape[1] // hkv, weight.shape[1], weight.shape[0])


@functools.lru_cache(maxsize=None)
def _compiled(device: torch.device, nkv: int, group: int, k_in: int, n_out: int) -> bool:
    """Compiles the shape's kernel (once, before any graph capture needs it); a failure warns
    once and leaves the layer on the Triton path."""
    return compiles(lambda: _kernel(device, nkv, group, k_in, n_out, *_env_variant(), False),
                    f"kernels.verify_segment: not compiled for {nkv} KV heads x {group}, o_proj "
                    f"[{n_out}, {k_in}] on {device}",
                    "batch-1 verify keeps the Triton attention + o_proj launches")


def segment_shapes_ok(q: Tensor, kv_cache: Tensor, meta: AttentionMetadata, weight: Tensor,
                      bias: Tensor | None, sliding_window: int | None) -> bool:
    """The shapes the kernel takes (any device): 2-16 causal queries of one sequence, bf16
    ``q [T, Hq, 128]`` (heads 128 apart, tokens 8-byte aligned), a contiguous pool ``[pages,
    layers, 2, Hkv, 16, 128]`` below 2**31 rows of 128, Hkv >= 2 dividing 128 with 1, 2, 4 or 8
    query heads each and ``Hq`` a multiple of 8, a contiguous o_proj weight ``[N, Hq * 128]``
    with ``N`` 2048 or 4096, ``Hq * 128 <= 4096``, no bias, no sliding window, a block-table
    row of consecutive ids."""
    if (meta.num_seqs != 1 or not 2 <= meta.max_query_len <= MAX_QUERIES or not meta.causal
            or sliding_window is not None or bias is not None
            or meta.block_tables.stride(1) != 1):
        return False
    if (q.dim() != 3 or q.shape[0] != meta.max_query_len or q.shape[2] != 128
            or q.dtype != torch.bfloat16 or q.stride(2) != 1 or q.stride(1) != 128
            or q.stride(0) % 4 or q.data_ptr() % 16):
        return False
    hq = q.shape[1]
    if (kv_cache.dim() != 6 or kv_cache.dtype != torch.bfloat16 or not kv_cache.is_contiguous()
            or kv_cache.shape[2] != 2 or kv_cache.shape[4] != 16 or kv_cache.shape[5] != 128
            or kv_cache.numel() // 128 >= 2 ** 31 or kv_cache.data_ptr() % 16):
        return False
    hkv = kv_cache.shape[3]
    if BLOCKS % hkv or hq % hkv or hq // hkv not in (1, 2, 4, 8) or hq % 8 or hkv < 2:
        return False
    n, k = weight.shape if weight.dim() == 2 else (0, 0)
    return (k == hq * 128 and k % 512 == 0 and k <= 4096 and n in (2048, 4096)
            and weight.dtype == torch.bfloat16 and weight.is_contiguous())


def verify_segment(q: Tensor, kv_cache: Tensor, layer: int, meta: AttentionMetadata, *,
                   sm_scale: float, weight: Tensor, residual: Tensor, norm_weight: Tensor,
                   eps: float, _variant: tuple[int, ...] | None = None,
                   _stamps: Tensor | None = None) -> tuple[Tensor, Tensor, RowRms]:
    """``gemv_add_norm(paged_attention(q, ...).reshape(T, -1), weight, None, residual,
    norm_weight, eps)`` in one launch, where :func:`verify_segment_ok` holds: returns
    ``(norm_weight * h, h, RowRms)`` with ``h = residual + o_proj(attention)``. Rows past the
    plan's ``query_lens`` (a shortened block) take a zero attention output.

    ``_variant`` (:func:`source`'s ``stages, pref``; ``None``: :data:`VARIANT`, or what
    ``KVSTRATA_VERIFY_SEGMENT_VARIANT`` says) and ``_stamps`` (int64, ``BLOCKS * 16``:
    per-block phase timestamps) are for ``benchmarks/segment_proto.py``."""
    n, k_in = weight.shape
    t, hq, hkv = q.shape[0], q.shape[1], kv_cache.shape[3]
    if residual.shape != (t, n) or norm_weight.shape != (n,):
        raise ValueError(f"verify_segment: residual {tuple(residual.shape)} and norm weight "
                         f"{tuple(norm_weight.shape)} must be [{t}, {n}] and [{n}]")
    dev = q.device
    v = _variant or _env_variant()
    kern = _kernel(dev, hkv, hq // hkv, k_in, n, *v, _stamps is not None)
    splits = BLOCKS // hkv
    part_o = torch.empty(splits * MAX_QUERIES * hq * 128, dtype=torch.float32, device=dev)
    part_lse = torch.empty(splits * MAX_QUERIES * hq, dtype=torch.float32, device=dev)
    xbuf = torch.empty((MAX_QUERIES, k_in), dtype=torch.bfloat16, device=dev)
    out = torch.empty((t, n), dtype=torch.bfloat16, device=dev)
    h = torch.empty((t, n), dtype=torch.bfloat16, device=dev)
    ss = torch.empty((t, BLOCKS), dtype=torch.float32, device=dev)
    kern([tensor_map_2d(kv_cache, 16, 64), q, ctypes.c_int64(q.stride(0)),
          ctypes.c_int32(layer), ctypes.c_int32(kv_cache.shape[1]), ctypes.c_int32(t),
          meta.block_tables, meta.seq_lens,
          meta.query_lens if meta.query_lens is not None else ctypes.c_void_p(0),
          weight, residual.contiguous(), norm_weight.contiguous(), out, h, ss, part_o, part_lse,
          xbuf, grid_counter(dev), ctypes.c_float(sm_scale * _LOG2E),
          _stamps if _stamps is not None else ctypes.c_void_p(0)],
         pdl=bool(v[3]) and pdl_ok(dev, "segment"))
    return out, h, RowRms(ss, n, eps)


__all__ = ["DEFAULT_QUERIES", "DEFAULT_QUERIES_MMA", "SEGMENT_ENV", "segment_shapes_ok",
           "verify_segment", "verify_segment_ok"]
