"""NVFP4 page encode/decode: Triton kernels and a plain-torch reference with the same signatures.

Format of one encoded page of a group with ``S = num_layers * 2`` slabs (one per layer and K/V),
``R = num_kv_heads * page_size`` rows per slab and ``D = head_dim`` (a multiple of 16):

=========  ====================  =================================================================
offset     size (bytes)          content
=========  ====================  =================================================================
0          ``4 * S``             FP32 slab scale ``g = amax(|slab|) / (6 * 448)``, little endian
``4S``     ``S * R * D / 2``     E2M1 codes, ``[S, R, D/2]``; element ``2i`` in the low nibble,
                                 ``2i+1`` in the high nibble; sign in bit 3; zero is always ``0x0``
``..``     ``S * R * D / 16``    E4M3 block scales, ``[S, R, D/16]`` (linear, one per 16 elements
                                 along ``head_dim``)
=========  ====================  =================================================================

A value decodes as ``e2m1 * e4m3 * g`` computed in fp32 (``e2m1 * e4m3`` is exact, so there is a
single rounding) and is then rounded to the output dtype. Encoding: block scale
``e4m3 = RN_e4m3(min(blockmax / (6 g), 448))``, element ``RNE_e2m1(|x| / (e4m3 * g))`` saturating
at 6; a zero scale encodes its block as zeros.

Bit-exactness between the kernels and the reference (and between GPU and interpreter) rests on:
every float operation is one IEEE-rounded multiply or ``div_rn`` divide (no sums a compiler could
fuse into an FMA); E4M3 and bf16 rounding are integer arithmetic; bf16 is widened and narrowed by
hand (the interpreter's bf16 casts mishandle subnormals and truncate). Triton's libdevice runs with
flush-to-zero on GPUs, so no subnormal may matter: a slab with ``g < 2**-115`` is stored as zeros
(amax below ~1.1e-31), which makes every ``d = e4m3 * g >= 2**-124``; an fp32-subnormal ``|x|`` then
has ``|x| / d <= 0.25`` and encodes as 0 whether or not it is flushed. Slabs with NaN, Inf or
``amax >= 2**127`` (whose decode could overflow fp32) are flagged as not encodable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

E2M1_MAX = 6.0
E4M3_MAX = 448.0
#: ``g = amax / GLOBAL_DIV`` maps the slab's amax onto the largest E2M1 value at the largest scale.
GLOBAL_DIV = E2M1_MAX * E4M3_MAX
#: E2M1 magnitudes by 3-bit code.
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: Below this slab scale the slab is stored as zeros (see the module doc).
MIN_GLOBAL_SCALE = 2.0 ** -115
#: A slab amax at or above this is not encodable (its decode could round past the fp32 range).
MAX_AMAX = 2.0 ** 127
_E4M3_MIN_NORMAL = 2.0 ** -6


def nvfp4_layout(num_slabs: int, rows: int, head_dim: int) -> tuple[int, int, int, int]:
    """Byte offsets ``(gscale, codes, scales, total)`` of one encoded page (see module doc)."""
    if head_dim % 16:
        raise ValueError(f"NVFP4 needs head_dim to be a multiple of 16, got {head_dim}")
    n = num_slabs * rows * head_dim
    codes = 4 * num_slabs
    scales = codes + n // 2
    return 0, codes, scales, scales + n // 16


def _check_pages(pages: torch.Tensor, page_ids: torch.Tensor | None) -> tuple[int, int, int, int]:
    if pages.dim() != 6 or pages.shape[2] != 2:
        raise ValueError(f"pages must be [N, num_layers, 2, num_kv_heads, page_size, head_dim], "
                         f"got shape {tuple(pages.shape)}")
    if pages.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"NVFP4 encodes bfloat16/float16/float32 pages, got {pages.dtype}")
    inner = torch.empty(pages.shape[1:], device="meta").stride()
    if pages.numel() and tuple(pages.stride()[1:]) != inner:
        raise ValueError("each page must be contiguous (index a page-first pool, do not transpose)")
    if page_ids is not None and (page_ids.dim() != 1 or page_ids.dtype not in (torch.int32,
                                                                                 torch.int64)):
        raise ValueError("page_ids must be a 1-D int32/int64 tensor")
    _, l, _, h, p, d = pages.shape
    if d % 16:
        raise ValueError(f"NVFP4 needs head_dim to be a multiple of 16, got {d}")
    return l * 2, h * p, d, (pages.shape[0] if page_ids is None else page_ids.numel())


def _check_payload(payload: torch.Tensor, m: int, total: int) -> None:
    if payload.dtype != torch.uint8 or payload.dim() != 2 or tuple(payload.shape) != (m, total):
        raise ValueError(f"payload must be [{m}, {total}] uint8 for this page shape, got "
                         f"{tuple(payload.shape)} {payload.dtype}")


# ---------------------------------------------------------------------------------------------
# Torch reference (CPU path and test oracle)
# ---------------------------------------------------------------------------------------------

def e4m3_round(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round fp32 ``v`` in ``[0, 448]`` to E4M3 (nearest, ties to even).

    Returns ``(value fp32, code int32 in [0, 126])``; integer arithmetic only, so it is exact.
    """
    bits = v.view(torch.int32)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).view(torch.float32)
    t = v * 512.0  # exact: a power-of-two scaling of a value below 2**-6
    n = torch.floor(t)
    f = t - n
    up = (f > 0.5) | ((f == 0.5) & (torch.remainder(n, 2.0) == 1.0))
    sub = (n + up.to(torch.float32)) * (1.0 / 512.0)
    q = torch.where(v < _E4M3_MIN_NORMAL, sub, normal)
    code = torch.where(q < _E4M3_MIN_NORMAL, (q * 512.0).to(torch.int32),
                       (q.view(torch.int32) >> 20) - (120 << 3))
    return q, code


def e4m3_value(code: torch.Tensor) -> torch.Tensor:
    """fp32 value of E4M3 codes (int32 tensor in ``[0, 126]``)."""
    e = code >> 3
    m = code & 7
    normal = (((e + 120) << 23) | (m << 20)).view(torch.float32)
    return torch.where(e == 0, m.to(torch.float32) * (1.0 / 512.0), normal)


def e2m1_code(y: torch.Tensor) -> torch.Tensor:
    """3-bit E2M1 magnitude code of fp32 ``y >= 0``: nearest, ties to even, saturating at 6."""
    c = (y > 0.25).to(torch.int32)
    c += y >= 0.75
    c += y > 1.25
    c += y >= 1.75
    c += y > 2.5
    c += y >= 3.5
    c += y > 5.0
    return c


def e2m1_value(code: torch.Tensor) -> torch.Tensor:
    """fp32 magnitude of 3-bit E2M1 codes (int32)."""
    big = ((((code >> 1) + 126) << 23) | ((code & 1) << 22)).view(torch.float32)
    return torch.where(code < 2, code.to(torch.float32) * 0.5, big)


def nvfp4_encode_ref(pages: torch.Tensor, page_ids: torch.Tensor | None = None, **_: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode pages to NVFP4 (reference; tuning keywords of the Triton version are ignored).

    pages: ``[N, num_layers, 2, num_kv_heads, page_size, head_dim]`` bf16/fp16/fp32, each page
    contiguous. page_ids: optional ``[M]`` int; encode ``pages[page_ids]`` (e.g. from a pool).
    Returns ``(payload [M, nbytes] uint8, ok [M] bool)``; a row whose page holds NaN/Inf or an
    amax >= 2**127 is flagged ``False`` and its payload is meaningless.
    """
    s, r, d, m = _check_pages(pages, page_ids)
    src = pages if page_ids is None else pages.index_select(0, page_ids.to(pages.device).long())
    x = src.reshape(m, s, r, d).to(torch.float32)
    a = x.abs()
    ok = (torch.isfinite(a) & (a < MAX_AMAX)).reshape(m, -1).all(dim=1)
    amax = a.reshape(m, s, -1).amax(dim=2) if a.numel() else a.new_zeros(m, s)
    g = amax / GLOBAL_DIV
    g = torch.where(g >= MIN_GLOBAL_SCALE, g, 0.0)
    denom = g * E2M1_MAX
    bmax = a.reshape(m, s, r, d // 16, 16).amax(dim=4)
    pos = (denom > 0)[..., None, None]
    bs = torch.where(pos, torch.clamp(bmax / torch.where(pos, denom[..., None, None], 1.0),
                                      max=E4M3_MAX), 0.0)
    bs = torch.nan_to_num(bs, nan=0.0)  # only reachable for pages flagged not ok
    bq, bcode = e4m3_round(bs)
    dq = (bq * g[..., None, None])[..., None]
    y = torch.where(dq > 0, a.reshape(m, s, r, d // 16, 16) / torch.where(dq > 0, dq, 1.0), 0.0)
    c = e2m1_code(y)
    neg = (x.reshape(c.shape) < 0) & (c != 0)
    c = (c | (neg.to(torch.int32) << 3)).reshape(m, s, r, d // 2, 2)
    packed = (c[..., 0] | (c[..., 1] << 4)).to(torch.uint8)
    _, o_codes, o_scales, total = nvfp4_layout(s, r, d)
    out = torch.empty(m, total, dtype=torch.uint8, device=pages.device)
    out[:, :o_codes] = g.contiguous().view(torch.uint8).reshape(m, -1)
    out[:, o_codes:o_scales] = packed.reshape(m, -1)
    out[:, o_scales:] = bcode.to(torch.uint8).reshape(m, -1)
    return out, ok


def nvfp4_decode_ref(payload: torch.Tensor, out: torch.Tensor,
                     page_ids: torch.Tensor | None = None, **_: int) -> torch.Tensor:
    """Decode NVFP4 pages into ``out`` (reference).

    payload: ``[M, nbytes]`` uint8. out: ``[N, num_layers, 2, num_kv_heads, page_size, head_dim]``
    bf16/fp16/fp32; row ``i`` is written to ``out[page_ids[i]]`` (or ``out[i]``). Returns ``out``.
    """
    s, r, d, m = _check_pages(out, page_ids)
    _, o_codes, o_scales, total = nvfp4_layout(s, r, d)
    _check_payload(payload, m, total)
    pl = payload.to(out.device)
    gbytes = torch.empty(m, o_codes, dtype=torch.uint8, device=out.device)
    gbytes.copy_(pl[:, :o_codes])  # a fresh buffer: payload rows need not be 4-byte aligned
    g = gbytes.view(torch.float32).reshape(m, s, 1, 1, 1)
    packed = pl[:, o_codes:o_scales].to(torch.int32).reshape(m, s, r, d // 2)
    c = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(m, s, r, d // 16, 16)
    bs = e4m3_value(pl[:, o_scales:].to(torch.int32).reshape(m, s, r, d // 16))[..., None]
    mag = (e2m1_value(c & 7) * bs) * g
    val = torch.where((c & 8) != 0, -mag, mag).to(out.dtype).reshape(m, *out.shape[1:])
    if page_ids is None:
        out[:m] = val
    else:
        out[page_ids.to(out.device).long()] = val
    return out


# ---------------------------------------------------------------------------------------------
# Triton kernels (GPU path; the tests run them through the interpreter)
# ---------------------------------------------------------------------------------------------

@triton.jit
def _load_f32(ptrs, mask, IS_BF16: tl.constexpr):
    if IS_BF16:  # int16 bits widened by hand: exact for subnormals on every backend
        b = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
        return (b << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _e4m3_round_tl(v):
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    t = v * 512.0
    n = tl.floor(t)
    f = t - n
    half_n = n * 0.5
    odd = half_n != tl.floor(half_n)
    up = (f > 0.5) | ((f == 0.5) & odd)
    sub = (n + up.to(tl.float32)) * (1.0 / 512.0)
    q = tl.where(v < 0.015625, sub, normal)
    code = tl.where(q < 0.015625, (q * 512.0).to(tl.int32),
                    (q.to(tl.int32, bitcast=True) >> 20) - 960)
    return q, code


@triton.jit
def _nvfp4_encode_kernel(x_ptr, ids_ptr, out_ptr, bad_ptr, page_stride, out_stride,
                         S: tl.constexpr, R, D: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_D: tl.constexpr, HAS_IDS: tl.constexpr, IS_BF16: tl.constexpr):
    # One program per slab. Pass 1 reads the slab for its amax; pass 2 re-reads it (a slab is
    # tens of KiB, so from L2) and quantizes: HBM sees each input byte about once.
    pid = tl.program_id(0).to(tl.int64)
    m = pid // S
    s = pid % S
    if HAS_IDS:
        page = tl.load(ids_ptr + m).to(tl.int64)
    else:
        page = m
    slab = x_ptr + page * page_stride + s * R * D
    out = out_ptr + m * out_stride
    rows = tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D

    amax = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    bad = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.int32)
    for r0 in range(0, R, BLOCK_R):
        rr = r0 + rows
        mask = (rr < R)[:, None] & cmask[None, :]
        a = tl.abs(_load_f32(slab + rr[:, None].to(tl.int64) * D + cols[None, :], mask, IS_BF16))
        bad = bad | (a != a).to(tl.int32) | (a >= 1.7014118346046923e38).to(tl.int32)
        amax = tl.maximum(amax, a)
    amax_s = tl.max(tl.max(amax, axis=1), axis=0)
    g = tl.div_rn(amax_s, 2688.0)
    g = tl.where(g >= 2.407412430484045e-35, g, 0.0)  # MIN_GLOBAL_SCALE = 2**-115
    denom = g * 6.0
    tl.store(bad_ptr + m * S + s, tl.max(tl.max(bad, axis=1), axis=0))
    gbits = g.to(tl.int32, bitcast=True)
    for k in tl.static_range(4):
        tl.store(out + s * 4 + k, ((gbits >> (8 * k)) & 0xFF).to(tl.uint8))

    NB: tl.constexpr = BLOCK_D // 16
    code_base = out + 4 * S + s * R * (D // 2)
    scale_base = out + 4 * S + S * R * (D // 2) + s * R * (D // 16)
    hcols = tl.arange(0, BLOCK_D // 2)
    bcols = tl.arange(0, NB)
    ok = denom > 0.0
    for r0 in range(0, R, BLOCK_R):
        rr = r0 + rows
        mask = (rr < R)[:, None] & cmask[None, :]
        x = _load_f32(slab + rr[:, None].to(tl.int64) * D + cols[None, :], mask, IS_BF16)
        a3 = tl.reshape(tl.abs(x), (BLOCK_R, NB, 16))
        bmax = tl.max(a3, axis=2)
        bs = tl.where(ok, tl.minimum(tl.div_rn(bmax, tl.where(ok, denom, 1.0)), 448.0), 0.0)
        bs = tl.where(bs == bs, bs, 0.0)  # NaN only in pages already flagged bad
        bq, bcode = _e4m3_round_tl(bs)
        dq = bq * g
        dpos = dq > 0.0
        y = tl.div_rn(a3, tl.where(dpos, dq, 1.0)[:, :, None])
        y = tl.where(dpos[:, :, None], y, 0.0)
        c = ((y > 0.25).to(tl.int32) + (y >= 0.75).to(tl.int32) + (y > 1.25).to(tl.int32)
             + (y >= 1.75).to(tl.int32) + (y > 2.5).to(tl.int32) + (y >= 3.5).to(tl.int32)
             + (y > 5.0).to(tl.int32))
        neg = (tl.reshape(x, (BLOCK_R, NB, 16)) < 0.0) & (c != 0)
        c = c | (neg.to(tl.int32) << 3)
        lo, hi = tl.split(tl.reshape(c, (BLOCK_R, BLOCK_D // 2, 2)))
        packed = (lo | (hi << 4)).to(tl.uint8)
        rmask = (rr < R)[:, None]
        tl.store(code_base + rr[:, None].to(tl.int64) * (D // 2) + hcols[None, :], packed,
                 mask=rmask & (hcols < D // 2)[None, :])
        tl.store(scale_base + rr[:, None].to(tl.int64) * (D // 16) + bcols[None, :],
                 bcode.to(tl.uint8), mask=rmask & (bcols < D // 16)[None, :])


@triton.jit
def _nvfp4_decode_kernel(in_ptr, ids_ptr, out_ptr, in_stride, page_stride,
                         S: tl.constexpr, R, D: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_D: tl.constexpr, HAS_IDS: tl.constexpr, OUT_BF16: tl.constexpr):
    # grid (M * S, cdiv(R, BLOCK_R)): decode has no reduction, so row tiles are independent.
    pid = tl.program_id(0).to(tl.int64)
    rblk = tl.program_id(1)
    m = pid // S
    s = pid % S
    if HAS_IDS:
        page = tl.load(ids_ptr + m).to(tl.int64)
    else:
        page = m
    src = in_ptr + m * in_stride
    g0 = tl.load(src + s * 4).to(tl.int32)
    g1 = tl.load(src + s * 4 + 1).to(tl.int32)
    g2 = tl.load(src + s * 4 + 2).to(tl.int32)
    g3 = tl.load(src + s * 4 + 3).to(tl.int32)
    g = (g0 | (g1 << 8) | (g2 << 16) | (g3 << 24)).to(tl.float32, bitcast=True)

    NB: tl.constexpr = BLOCK_D // 16
    rr = rblk * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = (rr < R)[:, None]
    hcols = tl.arange(0, BLOCK_D // 2)
    bcols = tl.arange(0, NB)
    code_base = src + 4 * S + s * R * (D // 2)
    scale_base = src + 4 * S + S * R * (D // 2) + s * R * (D // 16)
    packed = tl.load(code_base + rr[:, None].to(tl.int64) * (D // 2) + hcols[None, :],
                     mask=rmask & (hcols < D // 2)[None, :], other=0).to(tl.int32)
    bcode = tl.load(scale_base + rr[:, None].to(tl.int64) * (D // 16) + bcols[None, :],
                    mask=rmask & (bcols < D // 16)[None, :], other=0).to(tl.int32)
    e = bcode >> 3
    bs = tl.where(e == 0, (bcode & 7).to(tl.float32) * (1.0 / 512.0),
                  (((e + 120) << 23) | ((bcode & 7) << 20)).to(tl.float32, bitcast=True))
    c = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_R, NB, 16))
    mc = c & 7
    big = ((((mc >> 1) + 126) << 23) | ((mc & 1) << 22)).to(tl.float32, bitcast=True)
    mag = tl.where(mc < 2, mc.to(tl.float32) * 0.5, big)
    mag = (mag * bs[:, :, None]) * g
    val = tl.reshape(tl.where((c & 8) != 0, -mag, mag), (BLOCK_R, BLOCK_D))
    cols = tl.arange(0, BLOCK_D)
    dst = out_ptr + page * page_stride + s * R * D + rr[:, None].to(tl.int64) * D + cols[None, :]
    omask = rmask & (cols < D)[None, :]
    if OUT_BF16:  # round to bf16 bits by hand (nearest even) and store them through int16
        vb = val.to(tl.int32, bitcast=True)
        vb = (vb + 0x7FFF + ((vb >> 16) & 1)) >> 16
        tl.store(dst, vb.to(tl.int16), mask=omask)
    else:
        tl.store(dst, val.to(out_ptr.dtype.element_ty), mask=omask)


def _ids(page_ids: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if page_ids is None:
        return torch.zeros(1, dtype=torch.int64, device=like.device)
    return page_ids.to(device=like.device, dtype=torch.int64).contiguous()


def _int16_if_bf16(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def nvfp4_encode(pages: torch.Tensor, page_ids: torch.Tensor | None = None, *,
                 block_r: int = 16, num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode pages to NVFP4 in one launch (Triton); same contract as :func:`nvfp4_encode_ref`.

    pages: ``[N, num_layers, 2, num_kv_heads, page_size, head_dim]`` bf16/fp16/fp32.
    page_ids: optional ``[M]`` int; encodes ``pages[page_ids]`` without gathering them first.
    block_r: rows (tokens x heads) per tile, a power of two. Returns ``(payload [M, nbytes]
    uint8, ok [M] bool)`` on ``pages.device``.
    """
    s, r, d, m = _check_pages(pages, page_ids)
    total = nvfp4_layout(s, r, d)[3]
    out = torch.empty(m, total, dtype=torch.uint8, device=pages.device)
    bad = torch.zeros(m, s, dtype=torch.int32, device=pages.device)
    if m and r:
        _nvfp4_encode_kernel[(m * s,)](
            _int16_if_bf16(pages), _ids(page_ids, pages), out, bad, pages.stride(0), total,
            S=s, R=r, D=d, BLOCK_R=block_r, BLOCK_D=triton.next_power_of_2(d),
            HAS_IDS=page_ids is not None, IS_BF16=pages.dtype == torch.bfloat16,
            num_warps=num_warps)
    return out, bad.amax(dim=1) == 0 if m else torch.ones(0, dtype=torch.bool,
                                                           device=pages.device)


def nvfp4_decode(payload: torch.Tensor, out: torch.Tensor, page_ids: torch.Tensor | None = None,
                 *, block_r: int = 16, num_warps: int = 4) -> torch.Tensor:
    """Decode NVFP4 pages into ``out`` in one launch (Triton); contract of :func:`nvfp4_decode_ref`.

    payload: ``[M, nbytes]`` uint8 on ``out.device``. out: ``[N, num_layers, 2, num_kv_heads,
    page_size, head_dim]`` bf16/fp16/fp32 (a pool works: pass ``page_ids [M]``). Returns ``out``.
    """
    s, r, d, m = _check_pages(out, page_ids)
    _check_payload(payload, m, nvfp4_layout(s, r, d)[3])
    if payload.device != out.device:
        raise ValueError(f"payload is on {payload.device}, out on {out.device}; copy it first")
    payload = payload.contiguous()
    if m and r:
        _nvfp4_decode_kernel[(m * s, triton.cdiv(r, block_r))](
            payload, _ids(page_ids, out), _int16_if_bf16(out), payload.stride(0), out.stride(0),
            S=s, R=r, D=d, BLOCK_R=block_r, BLOCK_D=triton.next_power_of_2(d),
            HAS_IDS=page_ids is not None, OUT_BF16=out.dtype == torch.bfloat16,
            num_warps=num_warps)
    return out
