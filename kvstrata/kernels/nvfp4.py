"""NVFP4 page encode/decode: Triton kernels (GPU path) and a torch reference (CPU path, test oracle).

Format of one page ``[num_layers, 2, num_kv_heads, page_size, head_dim]`` (call ``L*2`` the number of
*slabs*: one per layer and K/V; a slab is ``S = H*P*D`` contiguous elements):

- elements: E2M1 (±{0, 0.5, 1, 1.5, 2, 3, 4, 6}), round-to-nearest-even, saturating at ±6, sign in
  bit 3 (taken from the input's sign bit, so ``-0.0`` and small negatives give ``0x8``); element
  ``2i`` in the low nibble of byte ``i``, ``2i+1`` in the high nibble;
- one FP8 E4M3 block scale per 16 consecutive elements along head_dim, round-to-nearest-even,
  laid out ``[rows, head_dim/16]`` (``rows = L*2*H*P``);
- one FP32 global scale per slab, ``gs = amax / (6*448)``.

Payload of one page (bytes, row of a ``[N, nbytes]`` uint8 tensor, padded to 16 bytes):
``[gs: float32 [L*2]] [elements: uint8 [L*2*S/2]] [block scales: uint8 [L*2*S/16]] [pad]``.

Every arithmetic step is spelled out so the kernel and the reference agree bit for bit on any
device: all math is fp32; divisions are IEEE round-to-nearest (``tl.math.div_rn``; Triton's ``/``
is approximate on NVIDIA GPUs); each element is quantized by multiplying with one rounded
reciprocal per block; decode computes ``(e2m1 * scale) * gs`` (the first product is exact) and
rounds once to the output dtype. Slabs whose ``gs`` would fall below ``2**-115`` (amax below about
1.1e-31) are stored as zeros: this keeps every intermediate a normal fp32 number, so the result does
not depend on whether a GPU flushes subnormals.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..dtypes import canonical_dtype

try:  # Triton is optional: CPU-only installs use the reference.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None

E2M1_MAX = 6.0
E4M3_MAX = 448.0
#: ``gs = amax / GLOBAL_DIVISOR`` maps the slab's amax onto the largest E2M1 value at the largest scale.
GLOBAL_DIVISOR = E2M1_MAX * E4M3_MAX
#: Smallest global scale kept; below it the slab is stored as zeros (see module docstring).
MIN_GLOBAL_SCALE = 2.0 ** -115
#: Largest slab amax accepted; above it ``(6*448)*gs`` could round past the fp32 range.
MAX_AMAX = 2.0 ** 127
BLOCK_ELEMS = 16
_PAD = 16


@dataclass(frozen=True, slots=True)
class NVFP4Layout:
    """Byte layout of one encoded page (see the module docstring)."""

    num_slabs: int  # L * 2
    slab_elems: int  # S = H * P * D
    q_offset: int  # start of the packed elements
    scale_offset: int  # start of the E4M3 block scales
    nbytes: int  # payload bytes per page, a multiple of 16

    @classmethod
    def for_shape(cls, page_shape: tuple[int, ...]) -> "NVFP4Layout":
        """Layout for a page of shape ``[num_layers, 2, num_kv_heads, page_size, head_dim]``."""
        if len(page_shape) != 5 or page_shape[1] != 2 or min(page_shape) <= 0:
            raise ValueError(
                f"an NVFP4 page has shape [num_layers, 2, num_kv_heads, page_size, head_dim], "
                f"got {list(page_shape)}")
        layers, _, heads, page_size, head_dim = page_shape
        if head_dim % BLOCK_ELEMS:
            raise ValueError(f"NVFP4 needs head_dim to be a multiple of 16, got {head_dim}")
        slabs, s = layers * 2, heads * page_size * head_dim
        q_off = 4 * slabs
        sc_off = q_off + slabs * s // 2
        end = sc_off + slabs * s // BLOCK_ELEMS
        return cls(slabs, s, q_off, sc_off, -(-end // _PAD) * _PAD)


def _check_pages(pages: torch.Tensor, what: str) -> NVFP4Layout:
    """``pages [N, L, 2, H, P, D]``: each page contiguous, any stride between pages."""
    if not isinstance(pages, torch.Tensor) or pages.dim() != 6:
        raise ValueError(f"{what} must be a [num_pages, num_layers, 2, num_kv_heads, page_size, "
                         f"head_dim] tensor, got {getattr(pages, 'shape', type(pages))}")
    canonical_dtype(pages.dtype)
    layout = NVFP4Layout.for_shape(tuple(pages.shape[1:]))
    expect, acc = [], 1
    for size in reversed(pages.shape[1:]):
        expect.append(acc)
        acc *= size
    if list(pages.stride()[1:]) != expect[::-1] and pages[0].numel() > 1:
        raise ValueError(f"each page of {what} must be contiguous (got strides {pages.stride()}); "
                         "pass the pool tensor itself, or .contiguous()")
    return layout


def _check_index(index: torch.Tensor | None, limit: int, device: torch.device) -> None:
    if index is None:
        return
    if index.dim() != 1 or index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"index must be a 1-D int32/int64 tensor, got {index.dtype} {tuple(index.shape)}")
    if index.device != device:
        raise ValueError(f"index is on {index.device}, the pages are on {device}")
    if index.numel():
        lo, hi = (int(v) for v in torch.aminmax(index))
        if lo < 0 or hi >= limit:
            raise ValueError(f"index values must lie in [0, {limit}), got [{lo}, {hi}]")


def _check_payload(payload: torch.Tensor, n: int, layout: NVFP4Layout) -> None:
    if payload.dtype != torch.uint8 or tuple(payload.shape) != (n, layout.nbytes) \
            or not payload.is_contiguous():
        raise ValueError(f"payload must be a contiguous uint8 [{n}, {layout.nbytes}] tensor, got "
                         f"{payload.dtype} {tuple(payload.shape)}")


# ---------------------------------------------------------------------------------------------
# torch reference
# ---------------------------------------------------------------------------------------------

_E2M1_CUTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True),
              (5.0, False))  # (midpoint, tie rounds up): ties go to the even code


def e2m1_codes_ref(q: torch.Tensor, sign_src: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) of fp32 ``q``, RNE, saturating; sign bit from ``sign_src``."""
    a = q.abs()
    code = torch.zeros(q.shape, dtype=torch.uint8, device=q.device)
    for cut, up in _E2M1_CUTS:
        code += (a >= cut) if up else (a > cut)
    return code | (torch.signbit(sign_src).to(torch.uint8) << 3)


def e2m1_values_ref(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of E2M1 codes (any integer tensor, 0..15)."""
    c = codes.to(torch.int32)
    e, m = (c >> 1) & 3, c & 1
    bits = torch.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))
    return (bits | ((c >> 3) << 31)).view(torch.float32)


def encode_nvfp4_ref(pages: torch.Tensor, index: torch.Tensor | None = None, *,
                     block: int = 0, num_warps: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``pages[index]`` (or all pages) to NVFP4 with torch ops, on the pages' device.

    Args:
        pages: ``[num_pages, L, 2, H, P, D]`` bf16/fp16/fp32; each page contiguous.
        index: optional ``[N]`` int32/int64 page indices into ``pages``.
        block, num_warps: ignored (the Triton version's tuning knobs).

    Returns:
        ``(payload [N, nbytes] uint8, amax [N, L, 2] fp32)``; ``amax`` is ``inf`` for a slab that
        holds NaN or Inf (the caller refuses the page; the payload is then meaningless).
    """
    layout = _check_pages(pages, "pages")
    _check_index(index, pages.shape[0], pages.device)
    sel = pages if index is None else pages.index_select(0, index)
    n, slabs, s = sel.shape[0], layout.num_slabs, layout.slab_elems
    x = sel.reshape(n, slabs, s // 16, 16).float()
    a = torch.where(torch.isnan(x), float("inf"), x.abs())
    amax = a.amax(dim=(2, 3))
    gs = amax / GLOBAL_DIVISOR
    gs = torch.where((gs >= MIN_GLOBAL_SCALE) & (amax < float("inf")), gs, 0.0)
    bamax = a.amax(dim=3)
    gsb = gs[..., None]
    t = torch.where(gsb > 0, bamax / torch.where(gsb > 0, gsb * 6.0, 1.0), 0.0)
    sc8 = t.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    sval = sc8.float()
    denom = sval * gsb
    inv = torch.where(denom > 0, 1.0 / torch.where(denom > 0, denom, 1.0), 0.0)
    codes = e2m1_codes_ref(x * inv[..., None], x)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    payload = torch.zeros(n, layout.nbytes, dtype=torch.uint8, device=sel.device)
    payload[:, :layout.q_offset] = gs.contiguous().view(torch.uint8)
    payload[:, layout.q_offset:layout.scale_offset] = packed.reshape(n, -1)
    payload[:, layout.scale_offset:layout.scale_offset + slabs * s // 16] = \
        sc8.view(torch.uint8).reshape(n, -1)
    return payload, amax.reshape(n, slabs // 2, 2)


def decode_nvfp4_ref(payload: torch.Tensor, out: torch.Tensor, index: torch.Tensor | None = None,
                     *, block: int = 0, num_warps: int = 0) -> torch.Tensor:
    """Decode ``payload [N, nbytes] uint8`` into ``out[index[i]]`` (or ``out[i]``) with torch ops.

    ``out``: ``[num_pages, L, 2, H, P, D]`` bf16/fp16/fp32 on the payload's device, each page
    contiguous. Returns ``out``.
    """
    layout = _check_pages(out, "out")
    n = payload.shape[0] if payload.dim() == 2 else -1
    _check_payload(payload, n, layout)
    _check_index(index, out.shape[0], out.device)
    if index is None and n != out.shape[0]:
        raise ValueError(f"{n} encoded pages do not fit out with {out.shape[0]} pages; pass index")
    slabs, s = layout.num_slabs, layout.slab_elems
    gs = payload[:, :layout.q_offset].contiguous().view(torch.float32).reshape(n, slabs, 1, 1)
    packed = payload[:, layout.q_offset:layout.scale_offset].reshape(n, slabs, s // 16, 8)
    codes = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(n, slabs, s // 16, 16)
    sc8 = payload[:, layout.scale_offset:layout.scale_offset + slabs * s // 16]
    sval = sc8.contiguous().view(torch.float8_e4m3fn).float().reshape(n, slabs, s // 16, 1)
    y = ((e2m1_values_ref(codes) * sval) * gs).to(out.dtype).reshape((n,) + tuple(out.shape[1:]))
    if index is None:
        out.copy_(y)
    else:
        out.index_copy_(0, index, y)
    return out


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _load_f32(ptrs, mask, IS_BF16: tl.constexpr):
        # bf16 is widened by hand: exact on every backend (the interpreter's casts are not).
        if IS_BF16:
            b = tl.load(ptrs, mask=mask, other=0)
            return (b.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            return tl.load(ptrs, mask=mask, other=0).to(tl.float32)

    @triton.jit
    def _e4m3_round(t):
        """RNE of ``t`` in [0, 448] to E4M3: (code int32, value fp32)."""
        sub = t < 0.015625  # below 2**-6: subnormal E4M3, a multiple of 2**-9
        sub_code = (t * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
        bits = t.to(tl.int32, bitcast=True)
        r = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # keep 3 mantissa bits, RNE
        norm_code = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
        code = tl.where(sub, sub_code, norm_code)
        val = tl.where(sub, sub_code.to(tl.float32) * 0.001953125, r.to(tl.float32, bitcast=True))
        return code, val

    @triton.jit
    def _nvfp4_encode_kernel(x_ptr, idx_ptr, pay_ptr, gs_ptr, amax_ptr, page_stride,
                             NSLAB: tl.constexpr, S: tl.constexpr, Q_OFF: tl.constexpr,
                             SC_OFF: tl.constexpr, NBYTES: tl.constexpr, IS_BF16: tl.constexpr,
                             HAS_INDEX: tl.constexpr, BLOCK: tl.constexpr):
        # One program per slab: pass 1 reads the slab from HBM for its amax, pass 2 re-reads it
        # (from L2: a slab is tens of KiB) and quantizes, so HBM sees each input byte once.
        pid = tl.program_id(0)
        n = pid // NSLAB
        slab = pid % NSLAB
        if HAS_INDEX:
            page = tl.load(idx_ptr + n).to(tl.int64)
        else:
            page = n.to(tl.int64)
        src = x_ptr + page * page_stride + slab.to(tl.int64) * S
        dst = pay_ptr + n.to(tl.int64) * NBYTES
        offs = tl.arange(0, BLOCK)
        run = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, S, BLOCK):
            x = _load_f32(src + start + offs, start + offs < S, IS_BF16)
            run = tl.maximum(run, tl.where(x == x, tl.abs(x), float("inf")))
        amax = tl.max(run, axis=0)
        gs = tl.math.div_rn(amax, 2688.0)
        gs = tl.where((gs >= MIN_GLOBAL_SCALE) & (amax < float("inf")), gs, 0.0)
        tl.store(amax_ptr + pid, amax)
        tl.store(gs_ptr + n.to(tl.int64) * (NBYTES // 4) + slab, gs)
        gs6 = tl.where(gs > 0, gs * 6.0, 1.0)

        NBLK: tl.constexpr = BLOCK // 16
        blk = tl.arange(0, NBLK)
        j = tl.arange(0, 8)
        k = tl.arange(0, 2)
        eoff = blk[:, None, None] * 16 + j[None, :, None] * 2 + k[None, None, :]
        for start in range(0, S, BLOCK):
            bmask = start // 16 + blk < S // 16
            x = _load_f32(src + start + eoff, bmask[:, None, None], IS_BF16)
            bamax = tl.max(tl.max(tl.abs(x), axis=2), axis=1)
            t = tl.where(gs > 0, tl.math.div_rn(bamax, gs6), 0.0)
            scode, sval = _e4m3_round(tl.minimum(t, 448.0))
            denom = sval * gs
            inv = tl.where(denom > 0, tl.math.div_rn(1.0, tl.where(denom > 0, denom, 1.0)), 0.0)
            a = tl.abs(x * inv[:, None, None])
            c = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
                 + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
                 + (a > 5.0).to(tl.int32))
            c = c | (((x.to(tl.int32, bitcast=True) >> 31) & 1) << 3)
            lo, hi = tl.split(c)
            byte = (lo | (hi << 4)).to(tl.uint8)
            qptr = dst + Q_OFF + slab.to(tl.int64) * (S // 2) + start // 2
            tl.store(qptr + blk[:, None] * 8 + j[None, :], byte, mask=bmask[:, None])
            sptr = dst + SC_OFF + slab.to(tl.int64) * (S // 16) + start // 16
            tl.store(sptr + blk, scode.to(tl.uint8), mask=bmask)

    @triton.jit
    def _nvfp4_decode_kernel(pay_ptr, gs_ptr, idx_ptr, out_ptr, page_stride,
                             NSLAB: tl.constexpr, S: tl.constexpr, Q_OFF: tl.constexpr,
                             SC_OFF: tl.constexpr, NBYTES: tl.constexpr, OUT_KIND: tl.constexpr,
                             HAS_INDEX: tl.constexpr, BLOCK: tl.constexpr):
        # grid (N * NSLAB, cdiv(S, BLOCK)): no reduction on decode, so tiles are independent.
        pid = tl.program_id(0)
        n = pid // NSLAB
        slab = pid % NSLAB
        start = tl.program_id(1) * BLOCK
        if HAS_INDEX:
            page = tl.load(idx_ptr + n).to(tl.int64)
        else:
            page = n.to(tl.int64)
        src = pay_ptr + n.to(tl.int64) * NBYTES
        gs = tl.load(gs_ptr + n.to(tl.int64) * (NBYTES // 4) + slab)
        NBLK: tl.constexpr = BLOCK // 16
        blk = tl.arange(0, NBLK)
        j = tl.arange(0, 8)
        bmask = start // 16 + blk < S // 16
        qptr = src + Q_OFF + slab.to(tl.int64) * (S // 2) + start // 2
        b = tl.load(qptr + blk[:, None] * 8 + j[None, :], mask=bmask[:, None], other=0).to(tl.int32)
        sc = tl.load(src + SC_OFF + slab.to(tl.int64) * (S // 16) + start // 16 + blk,
                     mask=bmask, other=0).to(tl.int32)
        se, sm = sc >> 3, sc & 7
        sval = tl.where(se == 0, sm.to(tl.float32) * 0.001953125,
                        (((se + 120) << 23) | (sm << 20)).to(tl.float32, bitcast=True))
        c = tl.join(b & 15, b >> 4)  # [NBLK, 8, 2]: element 2i from the low nibble
        e = (c >> 1) & 3
        m = c & 1
        vbits = tl.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22)) | ((c >> 3) << 31)
        y = (vbits.to(tl.float32, bitcast=True) * sval[:, None, None]) * gs
        k = tl.arange(0, 2)
        eoff = blk[:, None, None] * 16 + j[None, :, None] * 2 + k[None, None, :]
        optr = out_ptr + page * page_stride + slab.to(tl.int64) * S + start + eoff
        omask = bmask[:, None, None]
        if OUT_KIND == 0:  # bf16, rounded by hand (RNE) for the same reason as _load_f32
            yb = y.to(tl.int32, bitcast=True)
            yb = (yb + 0x7FFF + ((yb >> 16) & 1)) >> 16
            tl.store(optr, yb.to(tl.int16), mask=omask)
        elif OUT_KIND == 1:
            tl.store(optr, y.to(tl.float16), mask=omask)
        else:
            tl.store(optr, y, mask=omask)


def _block_for(s: int, block: int) -> int:
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    return min(block, triton.next_power_of_2(s))


def _require_triton() -> None:
    if triton is None:
        raise RuntimeError("Triton is not installed; use encode_nvfp4_ref / decode_nvfp4_ref")


def encode_nvfp4(pages: torch.Tensor, index: torch.Tensor | None = None, *,
                 block: int = 4096, num_warps: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`encode_nvfp4_ref` (same arguments and results, one launch).

    ``block``: elements per tile (power of two); ``num_warps``: warps per program.
    """
    _require_triton()
    layout = _check_pages(pages, "pages")
    _check_index(index, pages.shape[0], pages.device)
    n = pages.shape[0] if index is None else index.numel()
    payload = torch.zeros(n, layout.nbytes, dtype=torch.uint8, device=pages.device)
    amax = torch.empty(n, layout.num_slabs // 2, 2, dtype=torch.float32, device=pages.device)
    if n == 0:
        return payload, amax
    is_bf16 = pages.dtype == torch.bfloat16
    x = pages.view(torch.int16) if is_bf16 else pages
    _nvfp4_encode_kernel[(n * layout.num_slabs,)](
        x, index if index is not None else payload, payload, payload.view(torch.float32), amax,
        pages.stride(0), NSLAB=layout.num_slabs, S=layout.slab_elems, Q_OFF=layout.q_offset,
        SC_OFF=layout.scale_offset, NBYTES=layout.nbytes, IS_BF16=is_bf16,
        HAS_INDEX=index is not None, BLOCK=_block_for(layout.slab_elems, block),
        num_warps=num_warps)
    return payload, amax


def decode_nvfp4(payload: torch.Tensor, out: torch.Tensor, index: torch.Tensor | None = None, *,
                 block: int = 2048, num_warps: int = 4) -> torch.Tensor:
    """Triton version of :func:`decode_nvfp4_ref` (same arguments and result, one launch)."""
    _require_triton()
    layout = _check_pages(out, "out")
    n = payload.shape[0] if payload.dim() == 2 else -1
    _check_payload(payload, n, layout)
    _check_index(index, out.shape[0], out.device)
    if index is None and n != out.shape[0]:
        raise ValueError(f"{n} encoded pages do not fit out with {out.shape[0]} pages; pass index")
    if payload.device != out.device:
        raise ValueError(f"payload is on {payload.device}, out on {out.device}")
    if n == 0:
        return out
    blk = _block_for(layout.slab_elems, block)
    kind = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}[canonical_dtype(out.dtype)]
    o = out.view(torch.int16) if kind == 0 else out
    grid = (n * layout.num_slabs, triton.cdiv(layout.slab_elems, blk))
    _nvfp4_decode_kernel[grid](
        payload, payload.view(torch.float32), index if index is not None else payload, o,
        out.stride(0), NSLAB=layout.num_slabs, S=layout.slab_elems, Q_OFF=layout.q_offset,
        SC_OFF=layout.scale_offset, NBYTES=layout.nbytes, OUT_KIND=kind,
        HAS_INDEX=index is not None, BLOCK=blk, num_warps=num_warps)
    return out
