"""NVFP4 page encode: the Triton kernels (a tile kernel, optionally persistent, and the
``lanes`` kernel, a thread per half block) and their jit helpers. Launched by
:func:`kvstrata.kernels.nvfp4_triton.nvfp4_encode`; the format is in :mod:`kvstrata.kernels.nvfp4`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# ---------------------------------------------------------------------------------------------
# Encode kernels (GPU path; the tests also run them through the interpreter)
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
