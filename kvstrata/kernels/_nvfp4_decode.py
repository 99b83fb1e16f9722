"""NVFP4 page decode: the Triton kernels (rows/flat tiles, and the ``lanes`` kernel, where a
thread decodes the code words it loaded) and their jit helpers. Launched by
:func:`kvstrata.kernels.nvfp4_triton.nvfp4_decode`; the format is in :mod:`kvstrata.kernels.nvfp4`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._nvfp4_encode import _slab_page

@triton.jit
def _e2m1_unpack8(w, bs, g):
    """w [A, B, C] int32 of 8 nibbles, bs [A, B, C] E4M3 values, g -> [A, B, C, 8] fp32."""
    j4 = 4 * tl.arange(0, 8)[None, None, None, :]
    c = (w[:, :, :, None] >> j4) & 7
    # c/2 for c < 2, else 2**(c//2 - 1) * (1 + (c & 1) / 2): bits (c + 252) << 22 give that for
    # c >= 2 and 0.5, 0.75 for c = 0, 1, which 2q - 1 maps to 0, 0.5 (and 2q - 1 >= q for q >= 1)
    q = (c * 4194304 + 0x3F000000).to(tl.float32, bitcast=True)
    q = tl.minimum(q, q * 2.0 - 1.0)
    mag = (q * bs[:, :, :, None]) * g  # q * bs is exact: one rounding, as in the reference
    sign = (w[:, :, :, None] << (28 - j4)) & -0x80000000
    return (mag.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_value_tl(bcode):
    e = bcode >> 3
    return tl.where(e == 0, (bcode & 7).to(tl.float32) * (1.0 / 512.0),
                    (((e + 120) << 23) | ((bcode & 7) << 20)).to(tl.float32, bitcast=True))


@triton.jit
def _store_out(ptrs, v, mask, OUT_KIND: tl.constexpr):
    if OUT_KIND == 1:  # bf16 through int16 bits, rounded by hand (the interpreter's cast truncates)
        vb = v.to(tl.int32, bitcast=True)
        vb = (vb + 0x7FFF + ((vb >> 16) & 1)) >> 16
        tl.store(ptrs, vb.to(tl.int16), mask=mask)
    else:  # fp32, fp16, and bf16 on a GPU: the hardware cast rounds to nearest even
        tl.store(ptrs, v.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _decode_slab(ms, in_ptr, inw_ptr, ids_ptr, in_stride, in_stride_w, S: tl.constexpr,
                 HAS_IDS: tl.constexpr, WORDS: tl.constexpr):
    """Payload row m and slab s of program ``ms``: (m, s, output page, row start, scale g)."""
    m, s, page = _slab_page(ms, ids_ptr, S, HAS_IDS)
    src = in_ptr + m * in_stride
    if WORDS:
        g = tl.load(inw_ptr + m * in_stride_w + s).to(tl.float32, bitcast=True)
    else:
        g = (tl.load(src + s * 4).to(tl.int32) | (tl.load(src + s * 4 + 1).to(tl.int32) << 8)
             | (tl.load(src + s * 4 + 2).to(tl.int32) << 16)
             | (tl.load(src + s * 4 + 3).to(tl.int32) << 24)).to(tl.float32, bitcast=True)
    return m, s, page, src, g


@triton.jit
def _nvfp4_decode_kernel(in_ptr, inw_ptr, ids_ptr, out_ptr, in_stride, in_stride_w, page_stride,
                         S: tl.constexpr, R, D: tl.constexpr, BLOCK_R: tl.constexpr,
                         NWP: tl.constexpr, WPT: tl.constexpr, FLAT: tl.constexpr,
                         HAS_IDS: tl.constexpr, OUT_KIND: tl.constexpr, WORDS: tl.constexpr):
    # grid (M * S, tiles): decode has no reduction, so tiles are independent. The tile is
    # [BLOCK_R, NWP / WPT, WPT] words of codes (8 elements each); a thread holds WPT neighbouring
    # words (one 4 * WPT-byte load, WPT 16-byte stores for bf16). FLAT: the tile covers
    # BLOCK_R * NWP consecutive words of the slab (no row padding); else BLOCK_R rows.
    tile = tl.program_id(1)
    m, s, page, src, g = _decode_slab(tl.program_id(0), in_ptr, in_ptr, ids_ptr, in_stride, 0, S,
                                      HAS_IDS, False)

    NW: tl.constexpr = D // 8  # words per row (even: D is a multiple of 16)
    G: tl.constexpr = NWP // WPT
    r3 = tl.arange(0, BLOCK_R)[:, None, None]
    g3d = tl.arange(0, G)[None, :, None]
    if FLAT:
        widx = tile * (BLOCK_R * NWP) + (r3 * NWP + g3d * WPT + tl.arange(0, WPT)[None, None, :])
        wmask = widx < R * NW
    else:
        ww = g3d * WPT + tl.arange(0, WPT)[None, None, :]
        rr = tile * BLOCK_R + r3
        widx = rr * NW + ww
        wmask = (rr < R) & (ww < NW)
    if WORDS:
        wbase = inw_ptr + m * in_stride_w + S + s * R * NW
        w = tl.load(wbase + widx, mask=wmask, other=0)
    else:
        cbase = src + 4 * S + s * R * (D // 2) + widx * 4
        w = tl.zeros(widx.shape, dtype=tl.int32)
        for k in tl.static_range(4):
            w |= tl.load(cbase + k, mask=wmask, other=0).to(tl.int32) << (8 * k)
    sbase = src + 4 * S + S * R * (D // 2) + s * R * (D // 16)
    if WPT == 1:
        bs = _e4m3_value_tl(tl.load(sbase + widx // 2, mask=wmask, other=0).to(tl.int32))
    else:  # a word pair shares its block's scale: load each scale byte once, then duplicate
        widx2, _ = tl.split(tl.reshape(widx, (BLOCK_R, G, WPT // 2, 2)))
        wmask2, _ = tl.split(tl.reshape(wmask, (BLOCK_R, G, WPT // 2, 2)))
        bs2 = _e4m3_value_tl(tl.load(sbase + widx2 // 2, mask=wmask2, other=0).to(tl.int32))
        bs = tl.reshape(tl.join(bs2, bs2), (BLOCK_R, G, WPT))
    dst = (out_ptr + page * page_stride + s * R * D + widx[:, :, :, None] * 8
           + tl.arange(0, 8)[None, None, None, :])
    _store_out(dst, _e2m1_unpack8(w, bs, g), wmask[:, :, :, None], OUT_KIND)


@triton.jit
def _join8(v0, v1, v2, v3, v4, v5, v6, v7):
    """Eight [N] tensors -> [N, 8] (element j from vj) without leaving the thread: each join adds
    a minor in-thread dimension, the first join the most significant bit of j."""
    t = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)),
                tl.join(tl.join(v1, v5), tl.join(v3, v7)))
    return tl.reshape(t, (v0.shape[0], 8))


@triton.jit
def _lane_value(w, J: tl.constexpr, bsg, OUT_KIND: tl.constexpr):
    """Element J of the words ``w`` ([N] int32 of 8 nibbles) with ``bsg = (bs, g)`` applied, in
    the output type (int16 bits for OUT_KIND 1; see ``_store_out``)."""
    c = (w >> (4 * J)) & 7
    q = (c * 4194304 + 0x3F000000).to(tl.float32, bitcast=True)  # see _e2m1_unpack8
    q = tl.minimum(q, q * 2.0 - 1.0)
    mag = (q * bsg[0]) * bsg[1]
    v = (mag.to(tl.int32, bitcast=True) | ((w << (28 - 4 * J)) & -0x80000000)).to(
        tl.float32, bitcast=True)
    if OUT_KIND == 1:
        vb = v.to(tl.int32, bitcast=True)
        return ((vb + 0x7FFF + ((vb >> 16) & 1)) >> 16).to(tl.int16)
    else:
        return v


@triton.jit
def _ld(p, mask, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(p)
    else:
        return tl.load(p, mask=mask, other=0)


@triton.jit
def _decode_lanes_tile(t, in_ptr, inw_ptr, ids_ptr, out_ptr, in_stride, in_stride_w, page_stride,
                       tiles, S: tl.constexpr, R, D: tl.constexpr, BLOCK_W: tl.constexpr,
                       HAS_IDS: tl.constexpr, OUT_KIND: tl.constexpr, WORDS: tl.constexpr,
                       EVEN: tl.constexpr):
    NW: tl.constexpr = D // 8
    t = tl.cast(t, tl.int64)
    tile = t % tiles
    m, s, page, src, g = _decode_slab(t // tiles, in_ptr, inw_ptr, ids_ptr, in_stride,
                                      in_stride_w, S, HAS_IDS, WORDS)
    # one word (8 elements) per thread and step: contiguity 1 keeps the loads 32-bit, so every
    # thread holds exactly the words whose outputs it stores (no exchange through shared memory)
    q = tl.max_contiguous(tile * BLOCK_W + tl.arange(0, BLOCK_W), [1])
    if EVEN:  # the slab is a whole number of tiles: no masks
        mask = None
        smask = None
    else:
        mask = q < R * NW
        smask = mask[:, None]
    if WORDS:
        w = _ld(inw_ptr + m * in_stride_w + S + s * R * NW + q, mask, EVEN)
    else:
        cb = src + 4 * S + s * R * (D // 2) + q * 4
        w = (_ld(cb, mask, EVEN).to(tl.int32)
             | (_ld(cb + 1, mask, EVEN).to(tl.int32) << 8)
             | (_ld(cb + 2, mask, EVEN).to(tl.int32) << 16)
             | (_ld(cb + 3, mask, EVEN).to(tl.int32) << 24))
    sb = src + 4 * S + S * R * (D // 2) + s * R * (D // 16)
    bsg = (_e4m3_value_tl(_ld(sb + q // 2, mask, EVEN).to(tl.int32)), g)
    v = _join8(_lane_value(w, 0, bsg, OUT_KIND), _lane_value(w, 1, bsg, OUT_KIND),
               _lane_value(w, 2, bsg, OUT_KIND), _lane_value(w, 3, bsg, OUT_KIND),
               _lane_value(w, 4, bsg, OUT_KIND), _lane_value(w, 5, bsg, OUT_KIND),
               _lane_value(w, 6, bsg, OUT_KIND), _lane_value(w, 7, bsg, OUT_KIND))
    dst = out_ptr + page * page_stride + s * R * D + q[:, None] * 8 + tl.arange(0, 8)[None, :]
    tl.store(dst, v.to(dst.dtype.element_ty), mask=smask)


@triton.jit
def _nvfp4_decode_lanes_kernel(in_ptr, inw_ptr, ids_ptr, out_ptr, in_stride, in_stride_w,
                               page_stride, tiles, n_tiles, S: tl.constexpr, R, D: tl.constexpr,
                               BLOCK_W: tl.constexpr, HAS_IDS: tl.constexpr,
                               OUT_KIND: tl.constexpr, WORDS: tl.constexpr, EVEN: tl.constexpr,
                               PERSIST: tl.constexpr, STAGES: tl.constexpr):
    # ``lanes`` decode: tiles of BLOCK_W consecutive code words of a slab (``tiles`` per slab,
    # ``n_tiles`` in all); a program per tile, or (PERSIST) a grid-stride loop over them,
    # software-pipelined over STAGES stages.
    if PERSIST:
        for t in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=STAGES):
            _decode_lanes_tile(t, in_ptr, inw_ptr, ids_ptr, out_ptr, in_stride, in_stride_w,
                               page_stride, tiles, S, R, D, BLOCK_W, HAS_IDS, OUT_KIND, WORDS,
                               EVEN)
    else:
        _decode_lanes_tile(tl.program_id(0), in_ptr, inw_ptr, ids_ptr, out_ptr,
                           in_stride, in_stride_w, page_stride, tiles, S, R, D, BLOCK_W,
                           HAS_IDS, OUT_KIND, WORDS, EVEN)
