"""Batch-1 decode: attention and the o_proj product in one persistent launch (Hopper, CUDA C++).

(:func:`decode_attention` is phases 2-3 alone: batch-1 decode attention in one launch, what
:func:`~.attention.paged_attention` runs for it on such a GPU, built with the pages dealt round
robin, each page loaded then used and each query head merged once its own KV head's splits are in
instead of after a grid barrier, :data:`ATTENTION_VARIANT`.)

At batch 1 a decoder layer's attention reads ~1 MB of K/V per 1k tokens and takes ~12 us in a
step, nearly all latency, and o_proj (``gemv_add_norm``) cannot start streaming its weights until
attention is done: Triton cannot keep weights in shared memory across a PDL wait, and attention's
programs fill every SM (docs/benchmarks.md, runner sessions 4-14). :func:`decode_segment` runs
both as one launch of 128 blocks, one per SM, all resident (a cooperative launch):

1. each block starts Hopper bulk copies of its first ``RS`` o_proj weight rows into shared memory
   (they depend on nothing) once its warp 0 has issued the loads of its last K/V page (issued
   among the pages they slowed the pages at 8k: docs/benchmarks.md, twentieth runner session);
2. each block computes one (KV head, split) of split-KV attention (``128 / num_kv_heads`` splits
   per head; 8 warps over the split's pages, the next page's K/V loaded while one is computed,
   each page's two products on tensor cores (``mma`` m16n8k16: K q^T with the tokens as rows
   and the query heads as columns, then V^T P^T, P rounded to bf16 as the Triton kernel rounds
   it), online softmax in float32) and stores the split's normalised partial and its
   log-sum-exp (base 2);
3. a grid barrier; blocks 0 .. num_q_heads-1 merge one query head each into the bf16 attention
   output; a second grid barrier;
4. each block multiplies its ``N / 128`` o_proj rows (``RS`` from shared memory, the rest from
   memory) by the output held in registers, and writes what :func:`~.gemv.gemv_add_norm` writes:
   ``h = residual + product`` (bf16), ``norm_weight * h`` and each block's sum of squares of
   ``h`` (the next product's :class:`~.gemv.RowRms`).

The grid barriers count on one int32 per (device, stream) that only grows (128 arrivals per
barrier, and 2**32 is a multiple of 128), so CUDA-graph replays need no reset. Sums run in a
fixed order and no float atomics are used: a launch is deterministic, so graph replay equals
eager bit for bit.
The values differ from the Triton attention + ``gemv_add_norm`` path only by summation order
(the CUDA tests bound it).

The source is compiled once per shape with NVRTC through ``torch.cuda._compile_kernel`` (torch's
bundled NVRTC; no other dependency) and launched as a cooperative launch; where
:func:`~._device.pdl_ok` allows (family ``segment``) also as a programmatic dependent launch:
each warp's first page (unless it holds the step's new token, which the kernel before writes)
and the weight rows are issued before ``griddepcontrol.wait``, q and the residual after it
(plain decode b1 0.03 ms faster, docs/benchmarks.md, twenty-fourth runner session).
:func:`decode_segment_ok` says where it applies (sm_90, >= 128 SMs, one query of one sequence, a
bf16 page-major pool of 16-token pages and 128-dim heads, no sliding window or o_proj bias, shapes
below); ``KVSTRATA_DECODE_SEGMENT=0`` turns it off. Measured: docs/benchmarks.md, fifteenth runner
session. The kernel's CUDA C++: ``cuda/decode_segment.cu`` (built by :func:`~._cuda.cuda_source`).
"""

from __future__ import annotations

import ctypes
import functools
import math
import os

import torch
from torch import Tensor

from ._cuda import BLOCKS, Kernel, compiles, cuda_source, enabled, grid_counter, variant
from ._device import pdl_ok
from .attention_plan import AttentionMetadata
from .gemv import RowRms

#: ``KVSTRATA_DECODE_SEGMENT=0`` keeps batch-1 decode on the Triton attention + ``gemv_add_norm``
#: launches (``1``: this kernel where it applies).
SEGMENT_ENV = "KVSTRATA_DECODE_SEGMENT"
WARPS = 8
#: o_proj rows per block kept in shared memory (measured: 16 of 32 rows beat 0 and 24 at 1k
#: and 8k, docs/benchmarks.md fifteenth runner session)
SMEM_ROWS = 16
#: :func:`source`'s switches as shipped: ``rs, rreg, rlate, pdl, pages, unroll, hwait`` (pages
#: and unroll as :data:`ATTENTION_VARIANT` made the plain decode step no faster:
#: docs/benchmarks.md, thirty-fourth runner session)
VARIANT = (SMEM_ROWS, 0, 2, 1, 0, 0, 0)
#: :func:`decode_attention`'s ``pages, unroll, hwait``: the pages dealt round robin and the page
#: loop two pages per trip (batch-1 decode attention 9.9 -> 9.4 us at 1k, 19.6 -> 19.3 at 8k,
#: 47.9 -> 46.8 at 32k, 78.5 -> 77.6 at 64k; docs/benchmarks.md, thirty-fourth runner session),
#: each query head merged once its KV head's splits are in (9.5 -> 9.4, 19.3 -> 19.2, 46.9 ->
#: 46.8; the segment's step no faster with it: thirty-fifth runner session); ``warps`` per
#: block (12 made it no faster: H100, thirty-ninth runner session); ``unroll`` now 2, each
#: page loaded then used, no next page in registers (bit-equal; H100, three runs: 8k
#: 1.23-1.24 -> 1.21-1.22 x the floor, 4k 1.34 -> 1.31, 0.5k to 64k otherwise within 0.2 us:
#: docs/benchmarks.md, thirty-ninth runner session)
ATTENTION_VARIANT = (1, 2, 1, WARPS)
#: for benchmarks of the step (``benchmarks/gpu_runner.sh``): colon-separated switches that
#: replace :data:`VARIANT`'s first ones, e.g. ``16:0:1``
VARIANT_ENV = "KVSTRATA_DECODE_SEGMENT_VARIANT"
_LOG2E = math.log2(math.e)
#: :func:`decode_attention` serves contexts up to this many tokens; longer ones keep the Triton
#: kernel (32 splits per KV head where this kernel has 16). H200, one layer, cold L2, graph
#: replay, us, this kernel / Triton: 1k 9.4 / 13.3, 8k 19.3 / 22.2, 32k 46.8 / 51.5, 64k 77.6 /
#: 84.5; 128k 137.2 / 152.0 (``attention_bench.py``); docs/benchmarks.md, thirty-fourth runner
#: session. Longer contexts were not measured.
ATTENTION_MAX_CONTEXT = 131072


def _env_variant() -> tuple[int, ...]:
    return variant(os.environ.get(VARIANT_ENV, ""), VARIANT, VARIANT_ENV)


def _switches(given: tuple[int, ...] | None) -> tuple[int, ...]:
    """A launch's switches: ``given`` (those left out as :data:`VARIANT`), else the
    environment's."""
    return tuple(given) + VARIANT[len(given):] if given else _env_variant()


def source(nkv: int, group: int, k_in: int, n_out: int, rs: int = SMEM_ROWS, rreg: int = 0,
           rlate: int = 2, pdl: int = 0, pages: int = 0, unroll: int = 0, hwait: int = 0,
           stamps: bool = False, attn_only: bool = False, warps: int = WARPS) -> str:
    """The kernel's CUDA source for one shape (``rs`` rows per block in shared memory, a
    multiple of 8; ``rreg``: the other rows loaded into registers after the first barrier
    (with ``hwait``: once the block has merged, at once where it merges nothing);
    ``rlate``: the rows' copies started after warp 0's first page's loads (0), once it has
    read its pages (1), or once its last page's loads are issued (2); ``pdl``: a programmatic
    dependent launch, the first page's loads issued before the wait; ``pages``: each split a
    contiguous run of pages (0) or the pages dealt to the splits' warps round robin, their
    first ids read beside the length instead of after it (1); ``unroll``: the page loop one
    page per trip, the next page's buffers copied to the current ones (0: the copy waits for
    the next page's loads), two pages per trip with the buffers' roles swapped (1: the
    same products in the same order), or each page loaded and then used, no next page in
    registers (2: the same products); ``hwait``: the
    splits' merge after a grid barrier of all blocks (0), or each query head merged by one of
    its KV head's blocks once that head's splits have arrived on its own counter, the other
    blocks going on at once (1: the same sums);
    ``stamps``: per-block phase timestamps, ``benchmarks/segment_proto.py``;
    ``attn_only``: phases 2-3 alone, the merged attention written to ``xbuf``,
    :func:`decode_attention`; ``warps`` per block)."""
    rows = n_out // BLOCKS
    if rows % warps:
        raise ValueError(f"decode_segment.source: {rows} o_proj rows per block do not divide "
                         f"among {warps} warps")
    return cuda_source("decode_segment.cu", {
        "NW": warps, "NKV": nkv, "GROUP": group, "SPLITS": BLOCKS // nkv, "K_IN": k_in,
        "RPW": rows // warps,
        "RS": min(rs, rows), "RREG": rreg, "RLATE": rlate, "PDL": pdl, "STAMPS": stamps,
        "ATTN_ONLY": attn_only, "PAGES": pages, "UNROLL": unroll, "HWAIT": hwait})


def smem_bytes(group: int, k_in: int, rs: int, warps: int = WARPS) -> int:
    """Dynamic shared memory: the ``rs`` weight rows, the warps' partial states and the
    mbarrier."""
    return rs * k_in * 2 + (warps * group * 128 + 2 * warps * group + warps) * 4 + 16


def build(nkv: int, group: int, k_in: int, n_out: int, rs: int, rreg: int, rlate: int,
          pdl: int, pages: int, unroll: int, hwait: int, stamps: bool,
          attn_only: bool = False, warps: int = WARPS) -> tuple[str, int]:
    """The source a launch compiles (for the device's own ``sm_90``) and the shared-memory rows
    it keeps (``rs``, at most the block's rows)."""
    rs = min(rs, n_out // BLOCKS)
    return source(nkv, group, k_in, n_out, rs, rreg, rlate, pdl, pages, unroll, hwait,
                  stamps, attn_only, warps), rs


@functools.lru_cache(maxsize=None)
def _kernel(device: torch.device, nkv: int, group: int, k_in: int, n_out: int,
            v: tuple[int, ...], stamps: bool, attn_only: bool = False,
            warps: int = WARPS) -> Kernel:
    src, rs = build(nkv, group, k_in, n_out, *v, stamps, attn_only, warps)
    with torch.cuda.device(device):
        return Kernel(src, "decode_segment", smem_bytes(group, k_in, rs, warps), warps * 32)


def decode_segment_ok(q: Tensor, kv_cache: Tensor, meta: AttentionMetadata, weight: Tensor,
                      bias: Tensor | None, sliding_window: int | None, impl: str = "auto"
                      ) -> bool:
    """Whether :func:`decode_segment` serves this layer: ``impl="auto"`` on an sm_90 GPU with
    >= 128 SMs (and ``KVSTRATA_DECODE_SEGMENT`` not ``0``) for the shapes
    :func:`segment_shapes_ok` takes."""
    if not (enabled(impl, q.device, SEGMENT_ENV, "1")
            and segment_shapes_ok(q, kv_cache, meta, weight, bias, sliding_window)):
        return False
    hkv = kv_cache.shape[3]
    return _compiled(q.device, hkv, q.shape[1] // hkv, weight.shape[1], weight.shape[0])


@functools.lru_cache(maxsize=None)
def _compiled(device: torch.device, nkv: int, group: int, k_in: int, n_out: int) -> bool:
    """Compiles the shape's kernel (once, before any graph capture needs it); a failure warns
    once and leaves the layer on the Triton path."""
    return compiles(lambda: _kernel(device, nkv, group, k_in, n_out, _env_variant(), False),
                    f"kernels.decode_segment: not compiled for {nkv} KV heads x {group}, o_proj "
                    f"[{n_out}, {k_in}] on {device}",
                    "batch-1 decode keeps the Triton attention + o_proj launches")


def attention_shapes_ok(q: Tensor, kv_cache: Tensor, meta: AttentionMetadata,
                        sliding_window: int | None) -> bool:
    """The attention the kernel takes (any device): one causal query of one sequence, bf16 ``q
    [1, Hq, 128]`` (heads 128 apart) over a contiguous pool ``[pages, layers, 2, Hkv, 16,
    128]``, Hkv dividing 128 with at most 8 query heads each and ``Hq * 128 <= 4096`` a
    multiple of 256, no sliding window, a block-table row of consecutive ids."""
    if (meta.num_seqs != 1 or meta.max_query_len != 1 or not meta.causal
            or sliding_window is not None or meta.block_tables.stride(1) != 1):
        return False
    if (q.dim() != 3 or q.shape[0] != 1 or q.shape[2] != 128 or q.dtype != torch.bfloat16
            or q.stride(2) != 1 or q.stride(1) != 128):
        return False
    hq = q.shape[1]
    if (kv_cache.dim() != 6 or kv_cache.dtype != torch.bfloat16 or not kv_cache.is_contiguous()
            or kv_cache.shape[2] != 2 or kv_cache.shape[4] != 16 or kv_cache.shape[5] != 128):
        return False
    hkv = kv_cache.shape[3]
    return (BLOCKS % hkv == 0 and hq % hkv == 0 and hq // hkv <= 8 and hq * 128 % 256 == 0
            and hq * 128 <= 4096)


def segment_shapes_ok(q: Tensor, kv_cache: Tensor, meta: AttentionMetadata, weight: Tensor,
                      bias: Tensor | None, sliding_window: int | None) -> bool:
    """The shapes the kernel takes (any device): one causal query of one sequence, bf16 ``q [1,
    Hq, 128]`` (heads 128 apart) and a contiguous pool ``[pages, layers, 2, Hkv, 16, 128]``,
    Hkv dividing 128 with at most 8 query heads each, a contiguous o_proj weight ``[N, Hq *
    128]`` with ``Hq * 128 <= 4096`` a multiple of 256 and ``N`` a multiple of 1024 up to 4096,
    no bias, no sliding window."""
    if bias is not None or not attention_shapes_ok(q, kv_cache, meta, sliding_window):
        return False
    n, k = weight.shape if weight.dim() == 2 else (0, 0)
    return (k == q.shape[1] * 128 and n % 1024 == 0 and 0 < n <= 4096
            and weight.dtype == torch.bfloat16 and weight.is_contiguous())


def decode_segment(q: Tensor, kv_cache: Tensor, layer: int, meta: AttentionMetadata, *,
                   sm_scale: float, weight: Tensor, residual: Tensor, norm_weight: Tensor,
                   eps: float, _variant: tuple[int, ...] | None = None,
                   _stamps: Tensor | None = None) -> tuple[Tensor, Tensor, RowRms]:
    """``gemv_add_norm(paged_attention(q, ...).reshape(1, -1), weight, None, residual,
    norm_weight, eps)`` in one launch, where :func:`decode_segment_ok` holds: returns
    ``(norm_weight * h, h, RowRms)`` with ``h = residual + o_proj(attention)``.

    ``_variant`` (:func:`source`'s ``rs, rreg, rlate, pdl, pages, unroll, hwait``, those left
    out as shipped; ``None``: :data:`VARIANT` or what ``KVSTRATA_DECODE_SEGMENT_VARIANT``
    says) and ``_stamps`` (int64, ``BLOCKS * 16``: per-block phase timestamps) are for
    ``benchmarks/segment_proto.py``."""
    n, k_in = weight.shape
    hq, hkv = q.shape[1], kv_cache.shape[3]
    if residual.shape != (1, n) or norm_weight.shape != (n,):
        raise ValueError(f"decode_segment: residual {tuple(residual.shape)} and norm weight "
                         f"{tuple(norm_weight.shape)} must be [1, {n}] and [{n}]")
    dev = q.device
    v = _switches(_variant)
    kern = _kernel(dev, hkv, hq // hkv, k_in, n, v, _stamps is not None)
    splits = BLOCKS // hkv
    part_o = torch.empty(splits * hq * 128, dtype=torch.float32, device=dev)
    part_lse = torch.empty(splits * hq, dtype=torch.float32, device=dev)
    xbuf = torch.empty(k_in, dtype=torch.bfloat16, device=dev)
    out = torch.empty((1, n), dtype=torch.bfloat16, device=dev)
    h = torch.empty((1, n), dtype=torch.bfloat16, device=dev)
    ss = torch.empty((1, BLOCKS), dtype=torch.float32, device=dev)
    s = kv_cache.stride()
    kern([q, kv_cache, ctypes.c_int64(layer * s[1]), ctypes.c_int64(s[0]), ctypes.c_int64(s[2]),
          ctypes.c_int64(s[3]), meta.block_tables, meta.seq_lens, weight, residual.contiguous(),
          norm_weight.contiguous(), out, h, ss, part_o, part_lse, xbuf, grid_counter(dev),
          ctypes.c_float(sm_scale * _LOG2E),
          _stamps if _stamps is not None else ctypes.c_void_p(0),
          ctypes.c_int32(meta.block_tables.shape[1])],
         pdl=bool(v[3]) and pdl_ok(dev, "segment"))
    return out, h, RowRms(ss, n, eps)


def decode_attention_ok(q: Tensor, kv_cache: Tensor, meta: AttentionMetadata,
                        sliding_window: int | None, impl: str = "auto") -> bool:
    """Whether :func:`decode_attention` serves this call: ``impl="auto"`` on an sm_90 GPU with
    >= 128 SMs (``KVSTRATA_DECODE_SEGMENT`` not ``0``), a plan of at most
    :data:`ATTENTION_MAX_CONTEXT` tokens, for the shapes :func:`attention_shapes_ok` takes."""
    if not (enabled(impl, q.device, SEGMENT_ENV, "1") and meta.max_seq_len
            <= ATTENTION_MAX_CONTEXT and attention_shapes_ok(q, kv_cache, meta, sliding_window)):
        return False
    hkv = kv_cache.shape[3]
    return _attn_compiled(q.device, hkv, q.shape[1] // hkv, *ATTENTION_VARIANT)


def _attn_args(nkv: int, group: int, pages: int, unroll: int, hwait: int, warps: int
               ) -> tuple[int, int, tuple[int, ...]]:
    """The attention-only build's ``k_in, n_out`` and switches: no o_proj rows (``n_out``
    only sizes the unused phase 4, one row per warp); ``pages``, ``unroll``, ``hwait`` and
    ``warps`` as :func:`source` says."""
    return nkv * group * 128, BLOCKS * warps, (0, 0, 2, 0, pages, unroll, hwait)


def attention_build(nkv: int, group: int, pages: int, unroll: int, hwait: int,
                    warps: int = WARPS) -> tuple[str, int]:
    """:func:`build` of :func:`decode_attention`'s kernel (for the CPU compile tests)."""
    k_in, n_out, v = _attn_args(nkv, group, pages, unroll, hwait, warps)
    return build(nkv, group, k_in, n_out, *v, False, True, warps)


def _attn_kernel(device: torch.device, nkv: int, group: int, pages: int, unroll: int,
                 hwait: int, warps: int) -> Kernel:
    k_in, n_out, v = _attn_args(nkv, group, pages, unroll, hwait, warps)
    return _kernel(device, nkv, group, k_in, n_out, v, stamps=False, attn_only=True,
                   warps=warps)


@functools.lru_cache(maxsize=None)
def _attn_compiled(device: torch.device, nkv: int, group: int, pages: int, unroll: int,
                   hwait: int, warps: int) -> bool:
    return compiles(lambda: _attn_kernel(device, nkv, group, pages, unroll, hwait, warps),
                    f"kernels.decode_segment: attention not compiled for {nkv} KV heads x "
                    f"{group} on {device}", "batch-1 decode attention keeps the Triton kernel")


def decode_attention(q: Tensor, kv_cache: Tensor, layer: int, meta: AttentionMetadata, *,
                     sm_scale: float, _variant: tuple[int, ...] | None = None) -> Tensor:
    """Batch-1 decode attention in one launch, where :func:`decode_attention_ok` holds: the
    segment's attention and merge (phases 2-3 above) without o_proj: 128 blocks, one (KV
    head, split) each, then one block per query head merges the splits once its KV head's
    splits are in.
    Returns ``[1, Hq, 128]`` bf16, what :func:`~.attention.paged_attention` returns up to
    summation order. ``_variant``: ``pages, unroll, hwait, warps`` (:func:`source`; those left
    out as shipped) for tests and benchmarks; ``None``: :data:`ATTENTION_VARIANT`."""
    v = tuple(_variant or ()) + ATTENTION_VARIANT[len(_variant or ()):]
    hq, hkv = q.shape[1], kv_cache.shape[3]
    dev = q.device
    kern = _attn_kernel(dev, hkv, hq // hkv, *v)
    splits = BLOCKS // hkv
    part_o = torch.empty(splits * hq * 128, dtype=torch.float32, device=dev)
    part_lse = torch.empty(splits * hq, dtype=torch.float32, device=dev)
    out = torch.empty((1, hq, 128), dtype=torch.bfloat16, device=dev)
    s = kv_cache.stride()
    null = ctypes.c_void_p(0)   # o_proj's operands: never read or written in this mode
    kern([q, kv_cache, ctypes.c_int64(layer * s[1]), ctypes.c_int64(s[0]), ctypes.c_int64(s[2]),
          ctypes.c_int64(s[3]), meta.block_tables, meta.seq_lens, null, null, null, null, null,
          null, part_o, part_lse, out, grid_counter(dev), ctypes.c_float(sm_scale * _LOG2E),
          null, ctypes.c_int32(meta.block_tables.shape[1])])
    return out


__all__ = ["ATTENTION_VARIANT", "SEGMENT_ENV", "attention_shapes_ok", "decode_attention",
           "decode_attention_ok", "decode_segment", "decode_segment_ok", "segment_shapes_ok"]
