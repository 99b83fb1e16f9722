"""Write new tokens' K/V into their slots of one layer of a group's pool tensor.

``slot = page_id * page_size + offset``. The pool tensor is
``[num_pages, num_layers, 2, num_kv_heads, page_size, head_dim]``; the Triton kernel addresses it
with int64 arithmetic, so pools past 2**31 elements are fine.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None

_IMPLS = ("auto", "triton", "torch")


def check_kv_write(kv_cache: Tensor, layer: int, kv_shape: tuple[int, int, int],
                   dtype: torch.dtype, slot_mapping: Tensor) -> None:
    """Validate a K/V write of ``kv_shape = (num_tokens, num_kv_heads, head_dim)`` tensors of
    ``dtype`` into ``layer`` of ``kv_cache`` at ``slot_mapping`` (raises ``ValueError``)."""
    if kv_cache.dim() != 6 or kv_cache.shape[2] != 2:
        raise ValueError("kv_cache must be [num_pages, num_layers, 2, num_kv_heads, page_size, "
                         f"head_dim], got {tuple(kv_cache.shape)}")
    _, num_layers, _, hkv, _, d = kv_cache.shape
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer={layer} is outside the group's {num_layers} layers")
    if tuple(kv_shape[1:]) != (hkv, d):
        raise ValueError(f"k and v must both be [num_tokens, {hkv}, {d}], got {tuple(kv_shape)}")
    if dtype != kv_cache.dtype:
        raise ValueError(f"k/v dtype {dtype} must equal the pool's {kv_cache.dtype}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != kv_shape[0]:
        raise ValueError(f"slot_mapping must be [{kv_shape[0]}] (one slot per token), got "
                         f"{tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slot_mapping must be int64, got {slot_mapping.dtype}")


def _check(kv_cache: Tensor, layer: int, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [num_tokens, num_kv_heads, head_dim], got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if k.dtype != v.dtype:
        raise ValueError(f"k and v must share one dtype (the pool's {kv_cache.dtype}), got "
                         f"{k.dtype} and {v.dtype}")
    check_kv_write(kv_cache, layer, tuple(k.shape), k.dtype, slot_mapping)


def write_kv_ref(kv_cache: Tensor, layer: int, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Torch reference of :func:`write_kv` (same contract)."""
    _check(kv_cache, layer, k, v, slot_mapping)
    page_size = kv_cache.shape[4]
    slots = slot_mapping.long()
    keep = slots >= 0  # negative slot = padding token, skipped (as in the kernel)
    slots, k, v = slots[keep], k[keep], v[keep]
    pages, offs = slots // page_size, slots % page_size
    # Advanced indices separated by a slice: the indexed dims go first -> [T, H, D].
    kv_cache[pages, layer, 0, :, offs] = k
    kv_cache[pages, layer, 1, :, offs] = v


if triton is not None:
    @triton.jit
    def _write_kv_kernel(kv_ptr, k_ptr, v_ptr, slot_ptr, layer,
                         s_page, s_layer, s_kv, s_head, s_tok,
                         s_kt, s_kh, s_vt, s_vh,
                         PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
        # One program per (token, kv head): one row of head_dim elements for K and for V.
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot < 0:  # negative slot = padding token, skipped
            return
        page = slot // PAGE_SIZE
        off = slot % PAGE_SIZE
        d = tl.arange(0, BLOCK_D)
        dm = d < HEAD_DIM
        base = page * s_page + layer * s_layer + h * s_head + off * s_tok
        kk = tl.load(k_ptr + t * s_kt + h * s_kh + d, mask=dm)
        vv = tl.load(v_ptr + t * s_vt + h * s_vh + d, mask=dm)
        tl.store(kv_ptr + base + d, kk, mask=dm)
        tl.store(kv_ptr + base + s_kv + d, vv, mask=dm)


def write_kv(kv_cache: Tensor, layer: int, k: Tensor, v: Tensor, slot_mapping: Tensor,
             impl: str = "auto") -> None:
    """Scatter ``k``/``v`` of new tokens into the pool at ``slot_mapping``.

    Args:
        kv_cache: ``[num_pages, num_layers, 2, num_kv_heads, page_size, head_dim]`` (contiguous in
            its last dim), modified in place.
        layer: layer index inside the group.
        k, v: ``[num_tokens, num_kv_heads, head_dim]``, the pool's dtype.
        slot_mapping: ``[num_tokens] int64``, ``page_id * page_size + offset`` per token;
            negative slots (padding) are skipped.
        impl: ``"auto"`` (Triton on CUDA, torch on CPU), ``"triton"`` or ``"torch"``.
    """
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    if impl == "torch" or (impl == "auto" and kv_cache.device.type != "cuda"):
        write_kv_ref(kv_cache, layer, k, v, slot_mapping)
        return
    if triton is None:
        raise ValueError("impl='triton' needs the triton package")
    _check(kv_cache, layer, k, v, slot_mapping)
    if kv_cache.stride(5) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("write_kv needs kv_cache, k and v contiguous in head_dim")
    n, hkv, d = k.shape
    if n == 0:
        return
    _write_kv_kernel[(n, hkv)](
        kv_cache, k, v, slot_mapping, layer,
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        kv_cache.stride(4), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        PAGE_SIZE=kv_cache.shape[4], HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d))


__all__ = ["check_kv_write", "write_kv", "write_kv_ref"]
