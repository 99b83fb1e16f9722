"""NVFP4 page encode/decode: the Triton kernels (the GPU path; CI runs them through the
interpreter). The format, the rounding rules and the plain-torch reference with the same
signatures are in :mod:`kvstrata.kernels.nvfp4`, whose module doc describes these kernels too.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ._device import num_sms
from .nvfp4 import ONE_PASS_ELEMS, _check_pages, _check_payload, nvfp4_layout, rcp_table

# ---------------------------------------------------------------------------------------------
# Triton kernels (GPU path; the tests also run them through the interpreter)
# ---------------------------------------------------------------------------------------------
# The encoder handles [rows, blocks] tiles; a thread owns whole 16-element blocks, and the 16
# elements of a block are 16 separate [rows, blocks] tensors (split out of two or four 16-byte
# loads), so each step below is a fixed, short instruction sequence per element with no shuffles.
# ASM (constexpr) selects PTX for byte permutes (prmt) and E4M3 conversions (sm_89+); the
# interpreter cannot run inline asm and takes the pure-Triton twin of each, which gives the same
# bits (the GPU test checks the asm path against the reference).

#: Input kinds of the encoder (pages are read through an int32 view in every case).
_KIND = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}


@triton.jit
def _prmt(a, b, SEL: tl.constexpr, ASM: tl.constexpr):
    """PTX ``prmt.b32 d, a, b, SEL`` (default mode) on int32 tensors: byte k of d is byte
    ``SEL[4k:4k+3] & 7`` of ``b:a``, or that byte's bit 7 replicated when ``SEL[4k+3]`` is set."""
    if ASM:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r",
                                         [a, b, tl.full(a.shape, SEL, tl.int32)],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        r = tl.zeros_like(a)
        for k in tl.static_range(4):
            if (SEL >> (4 * k)) & 4:
                src = b
            else:
                src = a
            byte = (src >> (8 * ((SEL >> (4 * k)) & 3))) & 0xFF
            if (SEL >> (4 * k)) & 8:
                byte = (byte >> 7) * 0xFF
            r = r | (byte << (8 * k))
        return r


@triton.jit
def _umax16x2(a, b, ASM: tl.constexpr):
    """PTX ``max.u16x2`` (sm_90+): the larger unsigned 16-bit half of a and b, each half."""
    if ASM:
        return tl.inline_asm_elementwise("max.u16x2 $0, $1, $2;", "=r,r,r", [a, b],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        return (tl.maximum(a & -0x10000, b & -0x10000) | tl.maximum(a & 0xFFFF, b & 0xFFFF))


@triton.jit
def _e4m3_code(v, ASM: tl.constexpr):
    """E4M3 code (int32) of fp32 ``v`` in [0, 448], nearest with ties to even."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 c; cvt.rn.satfinite.e4m3x2.f32 c, $1, $1; cvt.u32.u8 $0, c; }",
            "=r,f", [v], dtype=tl.int32, is_pure=True, pack=1)
    else:
        bits = v.to(tl.int32, bitcast=True)
        normal = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
        t = v * 512.0 + 12582912.0  # RNE(v * 2**9) below 2**-6; the product is exact
        return tl.where(v < 0.015625, t.to(tl.int32, bitcast=True) - 0x4B400000,
                        (normal >> 20) - 960)


@triton.jit
def _block_scale(bmax, k, gi, rtab_ptr, ASM: tl.constexpr):
    """Per block: (E4M3 code, reciprocal step ``RN(RN(1 / e4m3) * gi)``, 0 for a zero scale);
    ``k = RN(1 / RN(6 g))``, ``gi = RN(1 / g)``, ``rtab_ptr``: ``RN(1 / e4m3)`` by code."""
    bs = bmax * k
    bs = tl.where(bs == bs, tl.minimum(bs, 448.0), 0.0)  # NaN only in pages already flagged bad
    bcode = _e4m3_code(bs, ASM)
    return bcode, tl.load(rtab_ptr + bcode) * gi


@triton.jit
def _split4(t):
    """[R, B, 4] -> four [R, B] tensors (the thread already holds all four)."""
    a, b = tl.split(tl.reshape(t, (t.shape[0], t.shape[1], 2, 2)))
    w0, w2 = tl.split(a)
    w1, w3 = tl.split(b)
    return w0, w1, w2, w3


@triton.jit
def _widen(w, ODD: tl.constexpr, KIND: tl.constexpr):
    """Element 2i (ODD=0) or 2i+1 of an int32 word of two 16-bit floats, as fp32."""
    if KIND == 1:  # bf16: the high half is already an fp32 with a zero low half
        if ODD:
            return (w & -0x10000).to(tl.float32, bitcast=True)
        else:
            return (w << 16).to(tl.float32, bitcast=True)
    else:
        if ODD:
            h = w >> 16
        else:
            h = w
        return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _neg_nibbles(p0, p1, ASM: tl.constexpr):
    """p0 / p1 hold the signs of elements 0..3 / 4..7 in bit 7 of bytes 0..3 -> bit 3 of nibble j
    set when element j is negative (element 2i in byte i's low nibble)."""
    ev = _prmt(p0, p1, 0xECA8, ASM)  # bytes 0x00 / 0xFF: elements 0, 2, 4, 6
    od = _prmt(p0, p1, 0xFDB9, ASM)  # elements 1, 3, 5, 7
    return (ev & 0x08080808) | (od & -0x7F7F7F80)


@triton.jit
def _load_words(p, mask, EVEN: tl.constexpr):
    if EVEN:  # the tile lies inside the slab: no masks (and no zeroing of masked lanes)
        return tl.load(p)
    else:
        return tl.load(p, mask=mask[:, :, None], other=0)


@triton.jit
def _load_half(slab, base, mask, H: tl.constexpr, KIND: tl.constexpr, ASM: tl.constexpr,
               EVEN: tl.constexpr):
    """Elements 8H..8H+7 of the blocks at int32-word offsets ``base`` [R, B] as eight fp32
    [R, B] tensors, their sign nibbles (see ``_neg_nibbles``) and their max |x| (for bf16 as
    two 16-bit halves of bits; see ``_block_max``)."""
    ar = tl.arange(0, 4)[None, None, :]
    if KIND == 3:
        p = slab + base[:, :, None] + 8 * H + ar
        w0, w1, w2, w3 = _split4(_load_words(p, mask, EVEN))
        w4, w5, w6, w7 = _split4(_load_words(p + 4, mask, EVEN))
        a = _prmt(_prmt(w0, w1, 0x0073, ASM), _prmt(w2, w3, 0x7300, ASM), 0x7610, ASM)
        b = _prmt(_prmt(w4, w5, 0x0073, ASM), _prmt(w6, w7, 0x7300, ASM), 0x7610, ASM)
        return (w0.to(tl.float32, bitcast=True), w1.to(tl.float32, bitcast=True),
                w2.to(tl.float32, bitcast=True), w3.to(tl.float32, bitcast=True),
                w4.to(tl.float32, bitcast=True), w5.to(tl.float32, bitcast=True),
                w6.to(tl.float32, bitcast=True), w7.to(tl.float32, bitcast=True),
                _neg_nibbles(a, b, ASM),
                _amax8(w0.to(tl.float32, bitcast=True), w1.to(tl.float32, bitcast=True),
                       w2.to(tl.float32, bitcast=True), w3.to(tl.float32, bitcast=True),
                       w4.to(tl.float32, bitcast=True), w5.to(tl.float32, bitcast=True),
                       w6.to(tl.float32, bitcast=True), w7.to(tl.float32, bitcast=True)))
    else:
        return _half16(_load_words(slab + base[:, :, None] + 4 * H + ar, mask, EVEN), KIND, ASM)


@triton.jit
def _half16(w, KIND: tl.constexpr, ASM: tl.constexpr):
    """16-bit kinds: ``_load_half``'s results from the half's loaded words ``w`` [R, B, 4]."""
    w0, w1, w2, w3 = _split4(w)
    # byte 1 / byte 3 of a word: the sign bytes of its elements 2i / 2i + 1
    neg = _neg_nibbles(_prmt(w0, w1, 0x7531, ASM), _prmt(w2, w3, 0x7531, ASM), ASM)
    x0, x1 = _widen(w0, 0, KIND), _widen(w0, 1, KIND)
    x2, x3 = _widen(w1, 0, KIND), _widen(w1, 1, KIND)
    x4, x5 = _widen(w2, 0, KIND), _widen(w2, 1, KIND)
    x6, x7 = _widen(w3, 0, KIND), _widen(w3, 1, KIND)
    if KIND == 1:  # |bf16| orders as its bits: a packed max of the words' halves
        hm = _umax16x2(_umax16x2(w0 & 0x7FFF7FFF, w1 & 0x7FFF7FFF, ASM),
                       _umax16x2(w2 & 0x7FFF7FFF, w3 & 0x7FFF7FFF, ASM), ASM)
    else:
        hm = _amax8(x0, x1, x2, x3, x4, x5, x6, x7)
    return x0, x1, x2, x3, x4, x5, x6, x7, neg, hm


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _amax8(x0, x1, x2, x3, x4, x5, x6, x7):
    a = _max_nan(_max_nan(tl.abs(x0), tl.abs(x1)), _max_nan(tl.abs(x2), tl.abs(x3)))
    b = _max_nan(_max_nan(tl.abs(x4), tl.abs(x5)), _max_nan(tl.abs(x6), tl.abs(x7)))
    return _max_nan(a, b)


@triton.jit
def _block_max(hm_a, hm_b, KIND: tl.constexpr, ASM: tl.constexpr):
    """Max |x| of a block (NaN propagates) from the maxima of its two halves."""
    if KIND == 1:
        m = _umax16x2(hm_a, hm_b, ASM)
        return tl.maximum(m << 16, m & -0x10000).to(tl.float32, bitcast=True)
    else:
        return _max_nan(hm_a, hm_b)


@triton.jit
def _load_tile(slab, rr, bb, R, D: tl.constexpr, KIND: tl.constexpr, ASM: tl.constexpr,
               EVEN: tl.constexpr):
    """Blocks ``bb`` of rows ``rr`` of a slab: both halves (see ``_load_half``) and block maxima."""
    EPW: tl.constexpr = 1 if KIND == 3 else 2  # elements per int32 word
    mask = (rr < R)[:, None] & (bb < D // 16)[None, :]
    base = rr[:, None] * (D // EPW) + bb[None, :] * (16 // EPW)
    a0, a1, a2, a3, a4, a5, a6, a7, na, ha = _load_half(slab, base, mask, 0, KIND, ASM, EVEN)
    b0, b1, b2, b3, b4, b5, b6, b7, nb, hb = _load_half(slab, base, mask, 1, KIND, ASM, EVEN)
    return (a0, a1, a2, a3, a4, a5, a6, a7, na, b0, b1, b2, b3, b4, b5, b6, b7, nb,
            _block_max(ha, hb, KIND, ASM))


@triton.jit
def _code(x, r2, r1, rh):
    """Bits of ``C + RNE_e2m1(|x| * rcp)`` (C = 1.5 * 2**23, code 0..9 before saturation).

    min(2y, y + 2, y/2 + 4) maps the E2M1 grid {0,.5,1,1.5,2,3,4,6} onto 0..7; each line is
    one FMA (the product |x| * rcp * 2**k is exact inside it) rounded to an integer by adding C,
    and rounding commutes with min (it is monotonic; ties go to even codes)."""
    a = tl.abs(x)
    u = tl.minimum(tl.fma(a, r2, 12582912.0),
                   tl.minimum(tl.fma(a, r1, 12582914.0), tl.fma(a, rh, 12582916.0)))
    return u.to(tl.int32, bitcast=True)


@triton.jit
def _pack8(x0, x1, x2, x3, x4, x5, x6, x7, neg, rcp):
    """Eight elements -> int32 of eight nibbles (element j at bit 4j), sign bit 3 on nonzero."""
    r2 = rcp * 2.0
    rh = rcp * 0.5
    # sum of C-biased codes << 4j minus the biases summed the same way (mod 2**32): nibbles
    # cannot carry into each other
    cw = (_code(x0, r2, rcp, rh) + (_code(x1, r2, rcp, rh) << 4)
          + (_code(x2, r2, rcp, rh) << 8) + (_code(x3, r2, rcp, rh) << 12)
          + (_code(x4, r2, rcp, rh) << 16) + (_code(x5, r2, rcp, rh) << 20)
          + (_code(x6, r2, rcp, rh) << 24) + (_code(x7, r2, rcp, rh) << 28)) - 0x3F400000
    # saturate codes 8, 9 (y >= 6.5, only under an E4M3-subnormal step) to 7
    b3 = cw & -0x77777778  # 0x88888888
    cw = (cw | (b3 - ((cw >> 3) & 0x11111111))) & ~b3
    nz = cw + 0x77777777  # bit 3 of each nibble: code != 0
    return cw | (neg & nz)  # the sign only on nonzero codes: zero is always 0x0


@triton.jit
def _encode_store(a0, a1, a2, a3, a4, a5, a6, a7, na, b0, b1, b2, b3, b4, b5, b6, b7, nb,
                  bmax, k, gi, rtab_ptr, out_ptr, outw_ptr, m, s, rr, bb, out_stride,
                  out_stride_w, S: tl.constexpr, R, D: tl.constexpr, WORDS: tl.constexpr,
                  ASM: tl.constexpr, EVEN: tl.constexpr):
    NB: tl.constexpr = D // 16
    bcode, rcp = _block_scale(bmax, k, gi, rtab_ptr, ASM)
    w_lo = _pack8(a0, a1, a2, a3, a4, a5, a6, a7, na, rcp)
    w_hi = _pack8(b0, b1, b2, b3, b4, b5, b6, b7, nb, rcp)
    if EVEN:
        smask = None
    else:
        smask = (rr < R)[:, None] & (bb < NB)[None, :]
    row = rr[:, None].to(tl.int64)
    # one block per thread and store: saying so keeps the stores in the compute layout (a
    # wider per-thread store would first move the values through shared memory)
    blk = tl.max_contiguous(row * NB + bb[None, :], [1, 1])
    if WORDS:  # the block's 16 nibbles as one 8-byte word (payload rows are 8-byte aligned)
        w = (w_hi.to(tl.int64) << 32) | (w_lo.to(tl.int64) & 0xFFFFFFFF)
        wbase = outw_ptr + m * out_stride_w + S // 2 + s * R * (D // 16)
        tl.store(wbase + blk, w, mask=smask)
    else:
        cbase = (out_ptr + m * out_stride + 4 * S + s * R * (D // 2) + row * (D // 2)
                 + bb[None, :] * 8)
        for j in tl.static_range(4):
            tl.store(cbase + j, ((w_lo >> (8 * j)) & 0xFF).to(tl.uint8), mask=smask)
            tl.store(cbase + 4 + j, ((w_hi >> (8 * j)) & 0xFF).to(tl.uint8), mask=smask)
    sbase = out_ptr + m * out_stride + 4 * S + S * R * (D // 2) + s * R * NB
    tl.store(sbase + blk, bcode.to(tl.uint8), mask=smask)


@triton.jit
def _nvfp4_encode_kernel(x_ptr, ids_ptr, out_ptr, outw_ptr, bad_ptr, rtab_ptr, page_stride,
                         out_stride, out_stride_w, n_slabs, S: tl.constexpr, R, D: tl.constexpr,
                         BLOCK_R: tl.constexpr, NBP: tl.constexpr, ONE_PASS: tl.constexpr,
                         HAS_IDS: tl.constexpr, KIND: tl.constexpr, WORDS: tl.constexpr,
                         ASM: tl.constexpr, EVEN: tl.constexpr, PERSIST: tl.constexpr,
                         STAGES: tl.constexpr):
    # One program per slab, or (PERSIST) a grid-stride loop over the n_slabs slabs,
    # software-pipelined over STAGES stages (a register prefetch lost: docs/benchmarks.md).
    if PERSIST:
        for pid in tl.range(tl.program_id(0), n_slabs, tl.num_programs(0), num_stages=STAGES):
            _encode_slab(pid, x_ptr, ids_ptr, out_ptr, outw_ptr, bad_ptr, rtab_ptr, page_stride,
                         out_stride, out_stride_w, S, R, D, BLOCK_R, NBP, ONE_PASS, HAS_IDS,
                         KIND, WORDS, ASM, EVEN)
    else:
        _encode_slab(tl.program_id(0), x_ptr, ids_ptr, out_ptr, outw_ptr, bad_ptr, rtab_ptr,
                     page_stride, out_stride, out_stride_w, S, R, D, BLOCK_R, NBP, ONE_PASS,
                     HAS_IDS, KIND, WORDS, ASM, EVEN)


@triton.jit
def _slab_page(ms, ids_ptr, S: tl.constexpr, HAS_IDS: tl.constexpr):
    """Program / slab index ``ms`` -> (payload row m, slab s, page of the pages tensor)."""
    ms = tl.cast(ms, tl.int64)
    m = ms // S
    if HAS_IDS:
        return m, ms % S, tl.load(ids_ptr + m).to(tl.int64)
    else:
        return m, ms % S, m


@triton.jit
def _slab_scale(amax, m, s, out_ptr, bad_ptr, out_stride, S: tl.constexpr):
    """Store the slab's flag and scale ``g``; returns ``(k, gi)`` for ``_block_scale``."""
    g = tl.div_rn(amax, 2688.0)
    g = tl.where(g >= 2.407412430484045e-35, g, 0.0)  # MIN_GLOBAL_SCALE = 2**-115; NaN -> 0
    gi = tl.where(g > 0.0, tl.div_rn(1.0, tl.where(g > 0.0, g, 1.0)), 0.0)
    k = gi * 0.1666666716337204  # RN(1/6): bmax * k ~ bmax / (6 g)
    bad = (amax != amax) | (amax >= 1.7014118346046923e38)
    tl.store(bad_ptr + m * S + s, bad.to(tl.int32))
    gbits = g.to(tl.int32, bitcast=True)
    for j in tl.static_range(4):
        tl.store(out_ptr + m * out_stride + s * 4 + j, ((gbits >> (8 * j)) & 0xFF).to(tl.uint8))
    return k, gi


@triton.jit
def _encode_loaded(t, m, s, rows, bb, out_ptr, outw_ptr, bad_ptr, rtab_ptr, out_stride,
                   out_stride_w, S: tl.constexpr, R, D: tl.constexpr, WORDS: tl.constexpr,
                   ASM: tl.constexpr, EVEN: tl.constexpr):
    """Encode a whole slab held in registers (``t``: ``_load_tile``'s results)."""
    (a0, a1, a2, a3, a4, a5, a6, a7, na, b0, b1, b2, b3, b4, b5, b6, b7, nb, bmax) = t
    k, gi = _slab_scale(tl.reduce(tl.reduce(bmax, 1, _max_nan), 0, _max_nan), m, s, out_ptr,
                        bad_ptr, out_stride, S)
    _encode_store(a0, a1, a2, a3, a4, a5, a6, a7, na, b0, b1, b2, b3, b4, b5, b6, b7, nb,
                  bmax, k, gi, rtab_ptr, out_ptr, outw_ptr, m, s, rows, bb, out_stride,
                  out_stride_w, S, R, D, WORDS, ASM, EVEN)


@triton.jit
def _encode_slab(pid, x_ptr, ids_ptr, out_ptr, outw_ptr, bad_ptr, rtab_ptr, page_stride,
                 out_stride, out_stride_w, S: tl.constexpr, R, D: tl.constexpr,
                 BLOCK_R: tl.constexpr, NBP: tl.constexpr, ONE_PASS: tl.constexpr,
                 HAS_IDS: tl.constexpr, KIND: tl.constexpr, WORDS: tl.constexpr,
                 ASM: tl.constexpr, EVEN: tl.constexpr):
    # One slab; see the module doc for the layout and the one-pass scheme.
    m, s, page = _slab_page(pid, ids_ptr, S, HAS_IDS)
    # x_ptr is an int32 view of the pages; page_stride counts elements
    EPW: tl.constexpr = 1 if KIND == 3 else 2  # elements per int32 word
    slab = x_ptr + (page * page_stride + s * R * D) // EPW
    rows = tl.arange(0, BLOCK_R)
    bb = tl.arange(0, NBP)
    if ONE_PASS:
        _encode_loaded(_load_tile(slab, rows, bb, R, D, KIND, ASM, EVEN), m, s, rows, bb,
                       out_ptr, outw_ptr, bad_ptr, rtab_ptr, out_stride, out_stride_w, S, R, D,
                       WORDS, ASM, EVEN)
    else:
        acc = tl.zeros((BLOCK_R, NBP), dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            t = _load_tile(slab, (r0 + rows).to(tl.int64), bb, R, D, KIND, ASM, EVEN)
            acc = _max_nan(acc, t[18])
        k, gi = _slab_scale(tl.reduce(tl.reduce(acc, 1, _max_nan), 0, _max_nan), m, s,
                            out_ptr, bad_ptr, out_stride, S)
        for r0 in range(0, R, BLOCK_R):
            rr = (r0 + rows).to(tl.int64)
            (a0, a1, a2, a3, a4, a5, a6, a7, na, b0, b1, b2, b3, b4, b5, b6, b7, nb,
             bmax) = _load_tile(slab, rr, bb, R, D, KIND, ASM, EVEN)
            _encode_store(a0, a1, a2, a3, a4, a5, a6, a7, na, b0, b1, b2, b3, b4, b5, b6, b7, nb,
                          bmax, k, gi, rtab_ptr, out_ptr, outw_ptr, m, s, rr, bb, out_stride,
                          out_stride_w, S, R, D, WORDS, ASM, EVEN)


@triton.jit
def _nvfp4_encode_lanes_kernel(x_ptr, ids_ptr, out_ptr, outw_ptr, bad_ptr, rtab_ptr,
                               page_stride, out_stride, out_stride_w, S: tl.constexpr, R,
                               D: tl.constexpr, NBLK: tl.constexpr, HAS_IDS: tl.constexpr,
                               KIND: tl.constexpr, WORDS: tl.constexpr, ASM: tl.constexpr,
                               EVEN: tl.constexpr):
    # ``lanes`` encode (16-bit pages, a slab held whole in registers; see the module doc of
    # kernels/nvfp4.py): a program per slab, a thread per *half* block, the two halves of a
    # block in neighbouring lanes (coalesced loads and stores, a one-shuffle block maximum).
    m, s, page = _slab_page(tl.program_id(0), ids_ptr, S, HAS_IDS)
    NB: tl.constexpr = D // 16
    slab = x_ptr + (page * page_stride + s * R * D) // 2
    # q: half-block index (4 words each; blocks r * NB + b are contiguous in a slab). A 1-D
    # index keeps consecutive halves in consecutive lanes; [NBLK, 2] views pair them per block.
    q = tl.arange(0, 2 * NBLK)
    p = slab + q[:, None] * 4 + tl.arange(0, 4)[None, :]
    if EVEN:
        w = tl.load(p)
        qmask = None
    else:
        qmask = q < 2 * R * NB
        w = tl.load(p, mask=qmask[:, None], other=0)
    x0, x1, x2, x3, x4, x5, x6, x7, neg, hm = _half16(tl.reshape(w, (2 * NBLK, 1, 4)), KIND,
                                                      ASM)
    if KIND == 1:  # the half's packed 16-bit maxima -> fp32 max |x| (NaN bits order above Inf)
        hm = tl.maximum(hm << 16, hm & -0x10000).to(tl.float32, bitcast=True)
    bmax = tl.reduce(tl.reshape(hm, (NBLK, 2)), 1, _max_nan)  # the block's two lanes
    k, gi = _slab_scale(tl.reduce(bmax, 0, _max_nan), m, s, out_ptr, bad_ptr, out_stride, S)
    # both lanes of a block compute its scale: cheaper than moving it between layouts
    bmax = tl.reshape(tl.broadcast_to(bmax[:, None], (NBLK, 2)), (2 * NBLK,))
    bcode, rcp = _block_scale(bmax, k, gi, rtab_ptr, ASM)
    cw = tl.reshape(_pack8(x0, x1, x2, x3, x4, x5, x6, x7, neg, rcp[:, None]),
                    (2 * NBLK,))
    # one word per lane in the stores: a wider per-thread store (the 8 bytes of a block) would
    # first move the codes between lanes through shared memory
    qs = tl.max_contiguous(q, [1])
    if WORDS:  # int32 view: the codes start after the S fp32 slab scales
        tl.store(outw_ptr + m * out_stride_w + S + s * R * (D // 8) + qs, cw, mask=qmask)
    else:
        cbase = out_ptr + m * out_stride + 4 * S + s * R * (D // 2) + qs * 4
        for j in tl.static_range(4):
            tl.store(cbase + j, ((cw >> (8 * j)) & 0xFF).to(tl.uint8), mask=qmask)
    # the block's E4M3 code, from its even lane
    smask = (q % 2) == 0
    if not EVEN:
        smask = smask & qmask
    tl.store(out_ptr + m * out_stride + 4 * S + S * R * (D // 2) + s * R * NB + qs // 2,
             bcode.to(tl.uint8), mask=smask)


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


def _ids(page_ids: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if page_ids is None:
        return torch.zeros(1, dtype=torch.int64, device=like.device)
    if (page_ids.dtype == torch.int64 and page_ids.device == like.device
            and page_ids.is_contiguous()):
        return page_ids   # the common case, without two dispatcher round trips
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


@functools.lru_cache(maxsize=None)
def _rcp_table(device: torch.device) -> torch.Tensor:
    """The encoder's reciprocal table on ``device`` (a cache: one small read-only tensor per
    device for the process's life; the kernels only read it)."""
    return rcp_table().to(device)


@functools.lru_cache(maxsize=None)
def _asm_ok(device: torch.device) -> bool:
    """Inline PTX (prmt, e4m3 conversions: sm_89+) can run: a CUDA device, not the interpreter."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.version.hip is None and torch.cuda.get_device_capability(device) >= (8, 9)


@functools.lru_cache(maxsize=256)   # pure; cached because the tiers launch it per chunk
def _encode_config(dtype: torch.dtype, s: int, r: int, d: int, block_r: int | None, *,
                   has_ids: bool, words: bool, asm: bool, persistent: int = 0,
                   stages: int = 1) -> dict:
    """The encode kernel's constexprs (also used by ``benchmarks/nvfp4_sass.py``)."""
    nbp = triton.next_power_of_2(d // 16)
    full = triton.next_power_of_2(r)
    if block_r is None:
        block_r = max(1, min(full, ONE_PASS_ELEMS // (16 * nbp)))
    one_pass = block_r >= r
    br = full if one_pass else block_r
    return dict(S=s, D=d, BLOCK_R=br, NBP=nbp, ONE_PASS=one_pass, HAS_IDS=has_ids,
                KIND=_KIND[dtype], WORDS=words, ASM=asm, EVEN=r % br == 0 and nbp == d // 16,
                PERSIST=persistent > 0, STAGES=stages)


@functools.lru_cache(maxsize=256)
def _encode_lanes_config(dtype: torch.dtype, s: int, r: int, d: int, *, has_ids: bool,
                         words: bool, asm: bool) -> dict:
    """The ``lanes`` encode kernel's constexprs (also used by ``benchmarks/nvfp4_sass.py``)."""
    nblk = triton.next_power_of_2(r * (d // 16))
    return dict(S=s, D=d, NBLK=nblk, HAS_IDS=has_ids, KIND=_KIND[dtype], WORDS=words, ASM=asm,
                EVEN=nblk == r * (d // 16))


@functools.lru_cache(maxsize=256)
def _decode_config(s: int, r: int, d: int, block_r: int, words_per_thread: int, flat: bool, *,
                   has_ids: bool, out_kind: int, words: bool) -> tuple[dict, int]:
    """The decode kernel's constexprs and its number of tiles per slab."""
    nwp = triton.next_power_of_2(d // 8)
    wpt = min(triton.next_power_of_2(max(1, words_per_thread)), nwp)
    tiles = triton.cdiv(r * (d // 8), block_r * nwp) if flat else triton.cdiv(r, block_r)
    return dict(S=s, D=d, BLOCK_R=block_r, NWP=nwp, WPT=wpt, FLAT=flat, HAS_IDS=has_ids,
                OUT_KIND=out_kind, WORDS=words), tiles


@functools.lru_cache(maxsize=256)
def _decode_lanes_config(s: int, r: int, d: int, block_r: int, *, has_ids: bool, out_kind: int,
                         words: bool, persistent: int, stages: int) -> tuple[dict, int]:
    """The ``lanes`` decode kernel's constexprs and its number of tiles per slab."""
    block_w = block_r * triton.next_power_of_2(d // 8)
    return dict(S=s, D=d, BLOCK_W=block_w, HAS_IDS=has_ids, OUT_KIND=out_kind, WORDS=words,
                EVEN=r * (d // 8) % block_w == 0, PERSIST=persistent > 0,
                STAGES=stages), triton.cdiv(r * (d // 8), block_w)


def nvfp4_encode(pages: torch.Tensor, page_ids: torch.Tensor | None = None, *,
                 out: torch.Tensor | None = None, block_r: int | None = None,
                 num_warps: int = 4, asm: bool | None = None, persistent: int = 0,
                 stages: int = 1, maxnreg: int | None = None,
                 lanes: bool | None = None, raw_flags: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode pages to NVFP4 in one launch (Triton); same contract as :func:`nvfp4_encode_ref`.

    pages: ``[N, num_layers, 2, num_kv_heads, page_size, head_dim]`` bf16/fp16/fp32.
    page_ids: optional ``[M]`` int; encodes ``pages[page_ids]`` without gathering them first.
    block_r: rows (tokens x heads) per tile, a power of two; ``None`` (default) keeps the whole
    slab in registers when it has at most ``ONE_PASS_ELEMS`` elements, else tiles of that size.
    A ``block_r`` >= the slab's rows also means one pass. out: optional ``[M, nbytes]`` uint8
    on ``pages.device`` to encode into; its rows may be strided (e.g. columns of a staging buffer
    laid out like host slots). asm: use inline PTX (byte permutes, hardware E4M3 conversion);
    ``None`` = when the device allows it (CUDA sm_89+, not the interpreter); the bytes are the
    same either way. persistent: launch ``persistent`` programs per SM, each looping over slabs
    (software-pipelined over ``stages`` stages when > 1); 0 (default) = one program per slab. maxnreg: cap the registers per
    thread (more programs per SM; ptxas spills past what the kernel needs). lanes: a thread
    per half block (see ``_nvfp4_encode_lanes_kernel``); ``None`` (default) = for bf16/fp16
    slabs of at most ``ONE_PASS_ELEMS`` elements when neither ``block_r`` nor ``persistent``
    asks for another variant.
    Returns ``(payload [M, nbytes] uint8, ok [M] bool)`` on ``pages.device``;
    nothing here waits for the device (``ok`` is a device tensor). raw_flags: return the kernel's
    per-slab flags ``[M, 2 * num_layers]`` int32 (nonzero = not encodable) instead of ``ok``,
    which saves the reduction's launches (the tiers reduce them on the host).
    """
    s, r, d, m = _check_pages(pages, page_ids)
    total = nvfp4_layout(s, r, d)[3]
    if out is None:
        out = torch.empty(m, total, dtype=torch.uint8, device=pages.device)
    else:
        _check_rows(out, m, total, pages.device, "out")
    # every slab's program writes its flag (no rows: nothing to flag)
    bad = (torch.empty if r else torch.zeros)(m, s, dtype=torch.int32, device=pages.device)
    if lanes is None:
        lanes = block_r is None and not persistent
    lanes = lanes and pages.dtype != torch.float32 and r * d <= ONE_PASS_ELEMS
    if m and r and lanes:
        words = _words(out, 4)
        _nvfp4_encode_lanes_kernel[(m * s,)](
            pages.view(torch.int32), _ids(page_ids, pages), out, out if words is None else words,
            bad, _rcp_table(pages.device), pages.stride(0), out.stride(0), out.stride(0) // 4,
            **_encode_lanes_config(pages.dtype, s, r, d, has_ids=page_ids is not None,
                                   words=words is not None,
                                   asm=_asm_ok(pages.device) if asm is None else asm),
            R=r, num_warps=num_warps, **({} if maxnreg is None else dict(maxnreg=maxnreg)))
    elif m and r:
        words = _words(out, 8)
        cfg = _encode_config(pages.dtype, s, r, d, block_r, has_ids=page_ids is not None,
                             words=words is not None,
                             asm=_asm_ok(pages.device) if asm is None else asm,
                             persistent=persistent, stages=stages)
        grid = min(m * s, persistent * num_sms(pages.device, 2)) if persistent else m * s
        _nvfp4_encode_kernel[(grid,)](
            pages.view(torch.int32), _ids(page_ids, pages), out, out if words is None else words,
            bad, _rcp_table(pages.device), pages.stride(0), out.stride(0), out.stride(0) // 8,
            m * s, R=r, num_warps=num_warps, **cfg,
            **({} if maxnreg is None else dict(maxnreg=maxnreg)))
    if raw_flags or not m:
        return out, bad if raw_flags else torch.ones(0, dtype=torch.bool, device=pages.device)
    return out, bad.amax(dim=1) == 0


def nvfp4_decode(payload: torch.Tensor, out: torch.Tensor, page_ids: torch.Tensor | None = None,
                 *, block_r: int = 16, num_warps: int = 2, words_per_thread: int = 1,
                 flat: bool = False, lanes: bool = True, persistent: int = 0,
                 stages: int = 2) -> torch.Tensor:
    """Decode NVFP4 pages into ``out`` in one launch (Triton); contract of :func:`nvfp4_decode_ref`.

    payload: ``[M, nbytes]`` uint8 on ``out.device``; its rows may be strided (e.g. columns of
    a staging buffer). out: ``[N, num_layers, 2, num_kv_heads, page_size, head_dim]``
    bf16/fp16/fp32 (a pool works: pass ``page_ids [M]``). block_r: rows per program, a power of
    two. words_per_thread: 32-bit words of codes (8 elements each) per thread, a power of two
    (one load of 4x that many bytes; capped at the row's words). flat: a program takes
    ``block_r`` rows' worth of consecutive words of a slab instead of whole rows (no padding
    when ``head_dim / 8`` is not a power of two). lanes (default): a program takes ``block_r``
    rows' worth of consecutive code words (as ``flat``) and each thread decodes whole words it
    loaded itself (32-bit loads, 16-byte bf16 stores, no shared memory or barriers);
    ``words_per_thread`` and ``flat`` are then ignored. persistent (with ``lanes``): launch
    ``persistent`` programs per SM, each looping over tiles, software-pipelined over ``stages``
    stages; 0 = one program per tile. Returns ``out``.
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
        args = (payload, payload if words is None else words, _ids(page_ids, out),
                out.view(torch.int16) if kind == 1 else out, payload.stride(0),
                payload.stride(0) // 4, out.stride(0))
        if lanes:
            cfg, tiles = _decode_lanes_config(s, r, d, block_r, has_ids=page_ids is not None,
                                              out_kind=kind, words=words is not None,
                                              persistent=persistent, stages=stages)
            n_tiles = m * s * tiles
            grid = min(n_tiles, persistent * num_sms(out.device, 2)) if persistent else n_tiles
            _nvfp4_decode_lanes_kernel[(grid,)](*args, tiles, n_tiles, R=r,
                                                 num_warps=num_warps, **cfg)
        else:
            cfg, tiles = _decode_config(s, r, d, block_r, words_per_thread, flat,
                                        has_ids=page_ids is not None, out_kind=kind,
                                        words=words is not None)
            _nvfp4_decode_kernel[(m * s, tiles)](*args, R=r, num_warps=num_warps, **cfg)
    return out
