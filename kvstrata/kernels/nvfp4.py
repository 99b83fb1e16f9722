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
single rounding) and is then rounded to the output dtype. Encoding, with ``gi = RN(1 / g)`` and
``k = RN(gi * RN(1/6))`` per slab: block scale ``e4m3 = RN_e4m3(min(RN(blockmax * k), 448))``,
reciprocal step ``rcp = RN(RN(1 / e4m3) * gi)`` (``RN(1 / e4m3)`` from a 128-entry table, see
:func:`rcp_table`), element ``RNE_e2m1(|x| * rcp)`` of the exact product (it is not rounded to
fp32 first: one rounding, onto the E2M1 grid), saturating at 6; a zero scale encodes its block as
zeros. NVFP4 quantizers scale by reciprocals in the same way (multiplies instead of divides per
block and element). Every other rounding is an fp32 IEEE round-to-nearest-even.
(Before the instruction-count work of issue 3 the scale was ``RN(blockmax / RN(6 g))`` and the
element ``RNE_e2m1(RN(|x| * RN(1 / RN(e4m3 * g))))``; codes differ from those in rare ties.)

Bit-exactness between the kernels and the reference (and between GPU and interpreter) rests on:
every float operation is one IEEE-rounded multiply, add, explicit ``fma`` or ``div_rn`` divide
whose operands make an FMA contraction harmless (products by powers of two are exact); the
reference computes ``|x| * rcp`` in float64, where the product of two 24-bit significands is
exact, and the kernels round it with FMAs (below); E4M3 rounding is integer arithmetic (or the
sm_89+ ``cvt.rn.satfinite.e4m3x2.f32``, also nearest-even); bf16 inputs are widened by hand. The
reference divides tensor by tensor, never by a
Python scalar: on CUDA, torch turns ``t / scalar`` into ``t * (1 / scalar)``, which is not the
correctly rounded quotient (that made the reference differ between CPU and GPU). Triton runs with
flush-to-zero on GPUs, so no subnormal may matter: a slab with ``g < 2**-115`` is stored as zeros
(amax below ~1.1e-31), which makes every nonzero ``rcp <= 2**124``; an fp32-subnormal ``|x|``
then has ``|x| * rcp < 0.25`` and encodes as 0 whether or not it is flushed, and every decoded
magnitude is 0 or at least ``2**-125`` (normal). Slabs with NaN, Inf or ``amax >= 2**127`` (whose
decode could overflow fp32) are flagged as not encodable.

Kernels (GPU path: ``nvfp4_encode`` / ``nvfp4_decode`` in :mod:`kvstrata.kernels.nvfp4_triton`,
with the signatures of the references here). Encode: one program per slab (page, layer, K/V); when the slab fits
(``rows * head_dim <= ONE_PASS_ELEMS``) it is loaded once into registers, its amax reduced and
then quantized from registers, so HBM sees each input byte once. bf16/fp16 slabs (the default
``lanes`` encoder) give each thread *half* a block: 8 elements, one 16-byte load, consecutive
halves in consecutive lanes, so a warp's load reads 512 contiguous bytes and its store writes 128;
a block's maximum is one shuffle between its two lanes, and both lanes compute its scale. (With a
thread per whole block, each warp-wide load read every 32-byte sector with two instructions,
which doubled the L1/L2 requests: the H200 profile showed L2 at 93% of its throughput and DRAM at
60%.) fp32 slabs and row tiles give each thread whole 16-element
blocks, held as 16 separate tensors, so block maxima, scales and nibble packing need no shuffles.
In both, every step is a short fixed instruction sequence per element: bf16 block maxima are packed
16-bit integer maxima of the raw words (``|bf16|`` orders as its bits); the E2M1 code is
``min(RN(2y + C), RN(y + 2 + C), RN(y/2 + 4 + C)) - C`` with ``C = 1.5 * 2**23``, each line one
FMA on ``|x|`` (three FMAs and two mins per element instead of seven compares); the biased codes
are summed into nibbles with shift-adds, saturated on the packed word, and the signs come from
byte permutes (``prmt``) of the raw words; the 16 nibbles of a block leave as one 8-byte store.
``asm`` selects the inline PTX (``prmt``, ``max.u16x2``, the E4M3 conversion); the interpreter
runs pure-Triton twins with the same results. Decode: a program per ``block_r`` rows of a slab
(or, ``flat``, per ``block_r * D / 8`` consecutive code words); each thread turns
``words_per_thread`` neighbouring 32-bit words of codes (one load) into 16-byte stores (bf16).
``benchmarks/nvfp4_sass.py`` reports the SASS of every variant (instructions per element,
registers, load / store widths) without a GPU.
"""

from __future__ import annotations

import torch

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
    inner, step = [], 1
    for n in reversed(pages.shape[1:]):   # the strides of one contiguous page
        inner.append(step)
        step *= n
    if pages.numel() and tuple(pages.stride()[1:]) != tuple(reversed(inner)):
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


def rcp_table() -> torch.Tensor:
    """fp32 ``RN(1 / e4m3)`` for every E4M3 code 0..127 (0 for code 0; 127 is NaN, unused)."""
    q = e4m3_value(torch.arange(128, dtype=torch.int32))
    return torch.where(q > 0, torch.ones_like(q) / torch.where(q > 0, q, 1.0), 0.0)


def nvfp4_encode_ref(pages: torch.Tensor, page_ids: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode pages to NVFP4 (reference).

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
    gi = torch.where(g > 0, torch.ones_like(g) / torch.where(g > 0, g, 1.0), 0.0)
    k = gi * (torch.ones_like(g) / torch.full_like(g, E2M1_MAX))  # RN(gi * RN(1/6))
    bmax = a.reshape(m, s, r, d // 16, 16).amax(dim=4)
    bs = bmax * k[..., None, None]
    bs = torch.where(torch.isnan(bs), 0.0, torch.clamp(bs, max=E4M3_MAX))  # NaN: pages not ok
    bq, bcode = e4m3_round(bs)
    rcp = rcp_table().to(bq.device)[bcode] * gi[..., None, None]
    # |x| * rcp exactly (24 x 24 significand bits fit a double), rounded once, onto the grid
    y = a.reshape(m, s, r, d // 16, 16).double() * rcp[..., None].double()
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
                     page_ids: torch.Tensor | None = None) -> torch.Tensor:
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

