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
``e4m3 = RN_e4m3(min(blockmax / (6 g), 448))``, step ``d = RN(e4m3 * g)``, element
``RNE_e2m1(|x| * RN(1 / d))`` saturating at 6 (the element is scaled by the reciprocal step, as
NVFP4 quantizers do: one multiply per element instead of a divide); a zero step encodes its block
as zeros. Every rounding above is an fp32 IEEE round-to-nearest-even.

Bit-exactness between the kernels and the reference (and between GPU and interpreter) rests on:
every float operation is one IEEE-rounded multiply, add or ``div_rn`` divide whose operands make
an FMA contraction harmless (products by powers of two are exact); E4M3 rounding is integer
arithmetic; bf16 inputs are widened by hand. The reference divides tensor by tensor, never by a
Python scalar: on CUDA, torch turns ``t / scalar`` into ``t * (1 / scalar)``, which is not the
correctly rounded quotient (that made the reference differ between CPU and GPU). Triton runs with
flush-to-zero on GPUs, so no subnormal may matter: a slab with ``g < 2**-115`` is stored as zeros
(amax below ~1.1e-31), which makes every nonzero ``d >= 2**-124`` and ``1/d <= 2**124``; an
fp32-subnormal ``|x|`` then has ``|x| / d < 0.25`` and encodes as 0 whether or not it is flushed,
and every decoded magnitude is 0 or at least ``2**-125`` (normal). Slabs with NaN, Inf or
``amax >= 2**127`` (whose decode could overflow fp32) are flagged as not encodable.

Kernels (GPU path). Encode: one program per slab (page, layer, K/V); when the slab fits
(``rows * head_dim <= ONE_PASS_ELEMS``) it is loaded once into registers, its amax reduced and
then quantized from registers, so HBM sees each input byte once. Each thread owns whole 16-element
blocks (two 8-element halves), so block maxima, scales and nibble packing need no shuffles; the
E2M1 code is ``min(RN(2y + C), RN(y + 2 + C), RN(y/2 + 4 + C)) - C`` with ``C = 1.5 * 2**23``
(FMA-pipe work instead of seven compares; saturation and the sign are applied to the packed
word), and the 16 nibbles of a block leave as one 8-byte store. Decode: a program per ``block_r``
rows of a slab; each thread turns one 32-bit word of codes into one 16-byte store (bf16), so
neighbouring threads fill whole sectors.
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
#: Largest slab (rows x head_dim, padded to powers of two) the encoder keeps in registers; larger
#: slabs are read twice (the second read mostly from L2).
ONE_PASS_ELEMS = 16384


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
    amax >= 2**127 is flagged ``False`` and its payload is meaningless. Gives the same bytes on
    every device (run it on CPU copies as the test oracle).
    """
    s, r, d, m = _check_pages(pages, page_ids)
    src = pages if page_ids is None else pages.index_select(0, page_ids.to(pages.device).long())
    x = src.reshape(m, s, r, d).to(torch.float32)
    a = x.abs()
    ok = (torch.isfinite(a) & (a < MAX_AMAX)).reshape(m, -1).all(dim=1)
    amax = a.reshape(m, s, -1).amax(dim=2) if a.numel() else a.new_zeros(m, s)
    g = amax / torch.full_like(amax, GLOBAL_DIV)  # tensor / tensor: IEEE division on CUDA too
    g = torch.where(g >= MIN_GLOBAL_SCALE, g, 0.0)
    denom = g * E2M1_MAX
    bmax = a.reshape(m, s, r, d // 16, 16).amax(dim=4)
    pos = (denom > 0)[..., None, None]
    bs = torch.where(pos, torch.clamp(bmax / torch.where(pos, denom[..., None, None], 1.0),
                                      max=E4M3_MAX), 0.0)
    bs = torch.nan_to_num(bs, nan=0.0)  # only reachable for pages flagged not ok
    bq, bcode = e4m3_round(bs)
    dq = bq * g[..., None, None]
    rcp = torch.where(dq > 0, torch.ones_like(dq) / torch.where(dq > 0, dq, 1.0), 0.0)
    y = a.reshape(m, s, r, d // 16, 16) * rcp[..., None]
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
# Triton kernels (GPU path; the tests also run them through the interpreter)
# ---------------------------------------------------------------------------------------------
# Tiles are [rows, blocks, 8]: the two 8-element halves of each 16-element block are loaded as
# separate tensors of the same layout, so one thread holds a whole block (16-byte loads of bf16).

_MAGIC = 12582912.0  # 1.5 * 2**23: x + _MAGIC rounds x to an integer (RNE); bits 0x4B400000


@triton.jit
def _load_half(slab, off, mask, IS_BF16: tl.constexpr):
    """8 consecutive elements per [row, block] at element offsets ``off`` [R, B, 1] (+ 0..7).

    bf16 pages arrive through an int32 view (``slab`` counts int32s): each word holds elements
    2i (low half) and 2i + 1, widened with one shift or one mask instead of extend + shift."""
    if IS_BF16:
        w = tl.load(slab + off // 2 + tl.arange(0, 4)[None, None, :], mask=mask, other=0)
        even = (w << 16).to(tl.float32, bitcast=True)
        odd = (w & -0x10000).to(tl.float32, bitcast=True)
        return tl.reshape(tl.join(even, odd), (off.shape[0], off.shape[1], 8))
    else:
        return tl.load(slab + off + tl.arange(0, 8)[None, None, :], mask=mask,
                       other=0.0).to(tl.float32)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _block_max(x_lo, x_hi):
    """[R, B, 8] x2 -> [R, B] max |x| of each 16-element block (NaN propagates)."""
    return tl.reduce(_max_nan(tl.abs(x_lo), tl.abs(x_hi)), 2, _max_nan)


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
def _block_scales(bmax, g):
    """Per block: (E4M3 code int32, reciprocal step RN(1 / RN(e4m3 * g)) or 0)."""
    denom = g * 6.0
    ok = denom > 0.0
    bs = tl.where(ok, tl.minimum(tl.div_rn(bmax, tl.where(ok, denom, 1.0)), 448.0), 0.0)
    bs = tl.where(bs == bs, bs, 0.0)  # NaN only in pages already flagged bad
    bq, bcode = _e4m3_round_tl(bs)
    dq = bq * g
    pos = dq > 0.0
    rcp = tl.where(pos, tl.div_rn(tl.zeros_like(dq) + 1.0, tl.where(pos, dq, 1.0)), 0.0)
    return bcode, rcp


@triton.jit
def _e2m1_pack8(x, rcp):
    """x [R, B, 8] fp32, rcp [R, B] -> [R, B] int32 holding the 8 nibbles (element j at 4j)."""
    # v = 4y with y = RN(|x| * rcp): scaling rcp by 4 is exact. RNE onto the E2M1 grid: the grid
    # {0,.5,1,1.5,2,3,4,6} maps to the codes 0..7 under min(2y, y + 2, y/2 + 4); each line is
    # rounded once (+ 1.5 * 2**23 rounds to an integer), and rounding commutes with min because
    # it is monotonic (ties go to even codes = even mantissas). No line adds v itself: the GPU
    # fuses v * k + c into an FMA, harmless only because every v * k here is exact.
    v = tl.abs(x) * (rcp * 4.0)[:, :, None]
    u = tl.minimum(v * 0.5 + 12582912.0, tl.minimum(v * 0.25 + 12582914.0,
                                                     v * 0.125 + 12582916.0))
    j4 = 4 * tl.arange(0, 8)[None, None, :]
    # code 0..8 in nibble j: sum of bits(u) << 4j minus the magic's bits summed the same way
    # (arithmetic mod 2**32); nibbles cannot carry into each other
    cw = tl.sum(u.to(tl.int32, bitcast=True) << j4, axis=2) - 0x3F400000
    # saturate codes 8, 9 (y >= 7.5, only under an E4M3-subnormal step) to 7
    sat = (cw >> 3) & 0x11111111
    cw = (cw & ~(sat * 15)) | (sat * 7)
    sw = tl.sum((x.to(tl.uint32, bitcast=True) >> 31).to(tl.int32) << (j4 + 3), axis=2)
    nz = (cw + 0x77777777) & -0x77777778  # bit 3 of each nibble: code != 0 (0x88888888)
    return cw | (sw & nz)  # the sign only on nonzero codes: zero is always 0x0


@triton.jit
def _encode_rows(x_lo, x_hi, g, out_ptr, outw_ptr, m, s, rr, bb, out_stride, out_stride_w,
                 S: tl.constexpr, R, D: tl.constexpr, WORDS: tl.constexpr):
    NB: tl.constexpr = D // 16
    bcode, rcp = _block_scales(_block_max(x_lo, x_hi), g)
    w_lo = _e2m1_pack8(x_lo, rcp)
    w_hi = _e2m1_pack8(x_hi, rcp)
    smask = (rr < R)[:, None] & (bb < NB)[None, :]
    row = rr[:, None].to(tl.int64)
    if WORDS:  # the block's 16 nibbles as one 8-byte word (payload rows are 8-byte aligned)
        w = (w_hi.to(tl.int64) << 32) | (w_lo.to(tl.int64) & 0xFFFFFFFF)
        wbase = outw_ptr + m * out_stride_w + S // 2 + s * R * (D // 16)
        tl.store(wbase + row * NB + bb[None, :], w, mask=smask)
    else:
        cbase = out_ptr + m * out_stride + 4 * S + s * R * (D // 2) + row * (D // 2) + bb[None, :] * 8
        for k in tl.static_range(4):
            tl.store(cbase + k, ((w_lo >> (8 * k)) & 0xFF).to(tl.uint8), mask=smask)
            tl.store(cbase + 4 + k, ((w_hi >> (8 * k)) & 0xFF).to(tl.uint8), mask=smask)
    sbase = out_ptr + m * out_stride + 4 * S + S * R * (D // 2) + s * R * NB
    tl.store(sbase + row * NB + bb[None, :], bcode.to(tl.uint8), mask=smask)


@triton.jit
def _nvfp4_encode_kernel(x_ptr, ids_ptr, out_ptr, outw_ptr, bad_ptr, page_stride, out_stride,
                         out_stride_w, S: tl.constexpr, R, D: tl.constexpr, BLOCK_R: tl.constexpr,
                         NBP: tl.constexpr, ONE_PASS: tl.constexpr, HAS_IDS: tl.constexpr,
                         IS_BF16: tl.constexpr, WORDS: tl.constexpr):
    # One program per slab; see the module doc for the layout and the one-pass scheme.
    pid = tl.program_id(0).to(tl.int64)
    m = pid // S
    s = pid % S
    if HAS_IDS:
        page = tl.load(ids_ptr + m).to(tl.int64)
    else:
        page = m
    # page_stride counts elements; for bf16 x_ptr is an int32 view (two elements per word)
    if IS_BF16:
        slab = x_ptr + (page * page_stride + s * R * D) // 2
    else:
        slab = x_ptr + page * page_stride + s * R * D
    NB: tl.constexpr = D // 16
    rows = tl.arange(0, BLOCK_R)
    bb = tl.arange(0, NBP)
    col = bb[None, :, None] * 16
    bmask = (bb < NB)[None, :, None]
    if ONE_PASS:
        mask = (rows < R)[:, None, None] & bmask
        off = rows[:, None, None] * D + col
        x_lo = _load_half(slab, off, mask, IS_BF16)
        x_hi = _load_half(slab, off + 8, mask, IS_BF16)
        amax = tl.reduce(tl.reduce(_block_max(x_lo, x_hi), 1, _max_nan), 0, _max_nan)
    else:
        acc = tl.zeros((BLOCK_R, NBP), dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            rr = r0 + rows
            mask = (rr < R)[:, None, None] & bmask
            off = rr[:, None, None].to(tl.int64) * D + col
            acc = _max_nan(acc, _block_max(_load_half(slab, off, mask, IS_BF16),
                                           _load_half(slab, off + 8, mask, IS_BF16)))
        amax = tl.reduce(tl.reduce(acc, 1, _max_nan), 0, _max_nan)
    g = tl.div_rn(amax, 2688.0)
    g = tl.where(g >= 2.407412430484045e-35, g, 0.0)  # MIN_GLOBAL_SCALE = 2**-115; NaN -> 0
    bad = (amax != amax) | (amax >= 1.7014118346046923e38)
    tl.store(bad_ptr + m * S + s, bad.to(tl.int32))
    gbits = g.to(tl.int32, bitcast=True)
    for k in tl.static_range(4):
        tl.store(out_ptr + m * out_stride + s * 4 + k, ((gbits >> (8 * k)) & 0xFF).to(tl.uint8))
    if ONE_PASS:
        _encode_rows(x_lo, x_hi, g, out_ptr, outw_ptr, m, s, rows, bb, out_stride, out_stride_w,
                     S, R, D, WORDS)
    else:
        for r0 in range(0, R, BLOCK_R):
            rr = r0 + rows
            mask = (rr < R)[:, None, None] & bmask
            off = rr[:, None, None].to(tl.int64) * D + col
            _encode_rows(_load_half(slab, off, mask, IS_BF16),
                         _load_half(slab, off + 8, mask, IS_BF16), g,
                         out_ptr, outw_ptr, m, s, rr, bb, out_stride, out_stride_w, S, R, D, WORDS)


@triton.jit
def _e2m1_unpack8(w, bs, g):
    """w [R, W] int32 of 8 nibbles, bs [R, W] E4M3 values, g -> [R, W, 8] fp32 values."""
    j4 = 4 * tl.arange(0, 8)[None, None, :]
    c = (w[:, :, None] >> j4) & 7
    # c/2 for c < 2, else 2**(c//2 - 1) * (1 + (c & 1) / 2): bits (c + 252) << 22 give that for
    # c >= 2 and 0.5, 0.75 for c = 0, 1, which 2q - 1 maps to 0, 0.5 (and 2q - 1 >= q for q >= 1)
    q = (c * 4194304 + 0x3F000000).to(tl.float32, bitcast=True)
    q = tl.minimum(q, q * 2.0 - 1.0)
    mag = (q * bs[:, :, None]) * g  # q * bs is exact: one rounding, as in the reference
    sign = (w[:, :, None] << (28 - j4)) & -0x80000000
    return (mag.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _store_out(ptrs, v, mask, OUT_KIND: tl.constexpr):
    if OUT_KIND == 1:  # bf16 through int16 bits, rounded by hand (the interpreter's cast truncates)
        vb = v.to(tl.int32, bitcast=True)
        vb = (vb + 0x7FFF + ((vb >> 16) & 1)) >> 16
        tl.store(ptrs, vb.to(tl.int16), mask=mask)
    else:  # fp32, fp16, and bf16 on a GPU: the hardware cast rounds to nearest even
        tl.store(ptrs, v.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _nvfp4_decode_kernel(in_ptr, inw_ptr, ids_ptr, out_ptr, in_stride, in_stride_w, page_stride,
                         S: tl.constexpr, R, D: tl.constexpr, BLOCK_R: tl.constexpr,
                         NWP: tl.constexpr, HAS_IDS: tl.constexpr, OUT_KIND: tl.constexpr,
                         WORDS: tl.constexpr):
    # grid (M * S, cdiv(R, BLOCK_R)): decode has no reduction, so row tiles are independent.
    # A thread decodes one 32-bit word of codes (8 elements) into one 16-byte store (bf16), and
    # neighbouring threads hold neighbouring words: every store instruction fills whole sectors.
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

    NW: tl.constexpr = D // 8
    rr = rblk * BLOCK_R + tl.arange(0, BLOCK_R)
    ww = tl.arange(0, NWP)
    wmask = (rr < R)[:, None] & (ww < NW)[None, :]
    row = rr[:, None].to(tl.int64)
    if WORDS:
        wbase = inw_ptr + m * in_stride_w + S + s * R * (D // 8)
        w = tl.load(wbase + row * NW + ww[None, :], mask=wmask, other=0)
    else:
        cbase = src + 4 * S + s * R * (D // 2) + row * (D // 2) + ww[None, :] * 4
        w = tl.zeros((BLOCK_R, NWP), dtype=tl.int32)
        for k in tl.static_range(4):
            w |= tl.load(cbase + k, mask=wmask, other=0).to(tl.int32) << (8 * k)
    sbase = src + 4 * S + S * R * (D // 2) + s * R * (D // 16)
    bcode = tl.load(sbase + row * (D // 16) + ww[None, :] // 2, mask=wmask, other=0).to(tl.int32)
    e = bcode >> 3
    bs = tl.where(e == 0, (bcode & 7).to(tl.float32) * (1.0 / 512.0),
                  (((e + 120) << 23) | ((bcode & 7) << 20)).to(tl.float32, bitcast=True))
    dst = (out_ptr + page * page_stride + s * R * D + row[:, :, None] * D
           + ww[None, :, None] * 8 + tl.arange(0, 8)[None, None, :])
    _store_out(dst, _e2m1_unpack8(w, bs, g), wmask[:, :, None], OUT_KIND)


def _ids(page_ids: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if page_ids is None:
        return torch.zeros(1, dtype=torch.int64, device=like.device)
    return page_ids.to(device=like.device, dtype=torch.int64).contiguous()


def _words(payload: torch.Tensor, nbytes: int) -> torch.Tensor | None:
    """An int view of ``payload [M, total]`` (``nbytes``-byte words; rows may be strided) when
    every row is aligned to them, else None (the kernels then move codes byte by byte)."""
    if (payload.shape[1] % nbytes or payload.data_ptr() % nbytes or payload.shape[0] == 0
            or payload.stride(0) % nbytes):
        return None
    return payload.view(torch.int64 if nbytes == 8 else torch.int32)


def _check_rows(t: torch.Tensor, m: int, total: int, device: torch.device, what: str) -> None:
    """``t`` must be ``[m, total]`` uint8 on ``device`` with contiguous (possibly strided) rows."""
    _check_payload(t, m, total)
    if t.device != device:
        raise ValueError(f"{what} is on {t.device}, the pages on {device}")
    if m and total and (t.stride(1) != 1 or t.stride(0) < total):
        raise ValueError(f"{what} rows must be contiguous and must not overlap, got strides "
                         f"{t.stride()}")


def nvfp4_encode(pages: torch.Tensor, page_ids: torch.Tensor | None = None, *,
                 out: torch.Tensor | None = None, block_r: int | None = None,
                 num_warps: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode pages to NVFP4 in one launch (Triton); same contract as :func:`nvfp4_encode_ref`.

    pages: ``[N, num_layers, 2, num_kv_heads, page_size, head_dim]`` bf16/fp16/fp32.
    page_ids: optional ``[M]`` int; encodes ``pages[page_ids]`` without gathering them first.
    block_r: rows (tokens x heads) per tile, a power of two; ``None`` (default) keeps the whole
    slab in registers when it has at most ``ONE_PASS_ELEMS`` elements, else tiles of that size.
    A ``block_r`` >= the slab's rows also means one pass. out: optional ``[M, nbytes]`` uint8
    on ``pages.device`` to encode into; its rows may be strided (e.g. columns of a staging buffer
    laid out like host slots). Returns ``(payload [M, nbytes] uint8, ok [M] bool)`` on
    ``pages.device``; nothing here waits for the device (``ok`` is a device tensor).
    """
    s, r, d, m = _check_pages(pages, page_ids)
    total = nvfp4_layout(s, r, d)[3]
    if out is None:
        out = torch.empty(m, total, dtype=torch.uint8, device=pages.device)
    else:
        _check_rows(out, m, total, pages.device, "out")
    bad = torch.zeros(m, s, dtype=torch.int32, device=pages.device)
    if m and r:
        nbp = triton.next_power_of_2(d // 16)
        full = triton.next_power_of_2(r)
        if block_r is None:
            block_r = max(1, min(full, ONE_PASS_ELEMS // (16 * nbp)))
        one_pass = block_r >= r
        words = _words(out, 8)
        _nvfp4_encode_kernel[(m * s,)](
            pages.view(torch.int32) if pages.dtype == torch.bfloat16 else pages,
            _ids(page_ids, pages), out, out if words is None else words, bad, pages.stride(0),
            out.stride(0), out.stride(0) // 8, S=s, R=r, D=d, BLOCK_R=full if one_pass else block_r, NBP=nbp,
            ONE_PASS=one_pass, HAS_IDS=page_ids is not None,
            IS_BF16=pages.dtype == torch.bfloat16, WORDS=words is not None, num_warps=num_warps)
    return out, bad.amax(dim=1) == 0 if m else torch.ones(0, dtype=torch.bool,
                                                           device=pages.device)


def nvfp4_decode(payload: torch.Tensor, out: torch.Tensor, page_ids: torch.Tensor | None = None,
                 *, block_r: int = 8, num_warps: int = 2) -> torch.Tensor:
    """Decode NVFP4 pages into ``out`` in one launch (Triton); contract of :func:`nvfp4_decode_ref`.

    payload: ``[M, nbytes]`` uint8 on ``out.device``; its rows may be strided (e.g. columns of
    a staging buffer). out: ``[N, num_layers, 2, num_kv_heads, page_size, head_dim]``
    bf16/fp16/fp32 (a pool works: pass ``page_ids [M]``). block_r: rows per program, a power of
    two. Returns ``out``.
    """
    s, r, d, m = _check_pages(out, page_ids)
    _check_payload(payload, m, nvfp4_layout(s, r, d)[3])
    if payload.device != out.device:
        raise ValueError(f"payload is on {payload.device}, out on {out.device}; copy it first")
    if payload.stride(1) != 1:
        payload = payload.contiguous()
    if m and r:
        words = _words(payload, 4)
        bf16 = out.dtype == torch.bfloat16
        # the interpreter's fp32 -> bf16 cast truncates, so CPU rounds by hand (same result)
        kind = 1 if bf16 and out.device.type == "cpu" else 0
        _nvfp4_decode_kernel[(m * s, triton.cdiv(r, block_r))](
            payload, payload if words is None else words, _ids(page_ids, out),
            out.view(torch.int16) if kind == 1 else out, payload.stride(0),
            payload.stride(0) // 4, out.stride(0), S=s, R=r, D=d, BLOCK_R=block_r,
            NWP=triton.next_power_of_2(d // 8), HAS_IDS=page_ids is not None, OUT_KIND=kind,
            WORDS=words is not None, num_warps=num_warps)
    return out
