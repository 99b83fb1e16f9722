"""NVFP4 page encode/decode on the GPU: the launchers (:func:`nvfp4_encode`,
:func:`nvfp4_decode`) and their launch configurations; the Triton kernels live in
:mod:`._nvfp4_encode` and :mod:`._nvfp4_decode` (CI runs them through the interpreter). The
format, the rounding rules and the plain-torch reference with the same signatures are in
:mod:`kvstrata.kernels.nvfp4`, whose module doc describes these kernels too.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton

from ._device import num_sms
from ._nvfp4_decode import _nvfp4_decode_kernel, _nvfp4_decode_lanes_kernel
from ._nvfp4_encode import _KIND, _nvfp4_encode_kernel, _nvfp4_encode_lanes_kernel
from .nvfp4 import ONE_PASS_ELEMS, _check_pages, _check_payload, nvfp4_layout, rcp_table


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


@dataclass(frozen=True)
class EncodeLaunch:
    """How :func:`nvfp4_encode` launches: the kernel variant and its tuning. Every launch writes
    the same bytes; the library always uses the default (the variant and tuning measured best,
    ``docs/benchmarks.md``). The kernel tests and ``benchmarks/codecs_bench.py`` try the others
    through :func:`_launch_encode`.

    block_r: rows (tokens x heads) per tile, a power of two; ``None`` keeps the whole slab in
    registers when it has at most ``ONE_PASS_ELEMS`` elements, else tiles of that size (a
    ``block_r`` >= the slab's rows also means one pass). num_warps: warps per program. asm: use
    inline PTX (byte permutes, hardware E4M3 conversion); ``None`` = when the device allows it
    (CUDA sm_89+, not the interpreter). persistent: launch ``persistent`` programs per SM, each
    looping over slabs (software-pipelined over ``stages`` stages when > 1); 0 = one program
    per slab. maxnreg: cap the registers per thread (more programs per SM; ptxas spills past
    what the kernel needs). lanes: a thread per half block (``_nvfp4_encode_lanes_kernel``);
    ``None`` = for bf16/fp16 slabs of at most ``ONE_PASS_ELEMS`` elements when neither
    ``block_r`` nor ``persistent`` asks for another variant.
    """

    block_r: int | None = None
    num_warps: int = 4
    asm: bool | None = None
    persistent: int = 0
    stages: int = 1
    maxnreg: int | None = None
    lanes: bool | None = None

    def __post_init__(self) -> None:
        _check_launch(self, "block_r", self.block_r, power_of_two=True, optional=True)
        _check_launch(self, "num_warps", self.num_warps, power_of_two=True)
        _check_launch(self, "stages", self.stages)
        _check_launch(self, "persistent", self.persistent, minimum=0)
        _check_launch(self, "maxnreg", self.maxnreg, optional=True)


@dataclass(frozen=True)
class DecodeLaunch:
    """How :func:`nvfp4_decode` launches (see :class:`EncodeLaunch`; tried through
    :func:`_launch_decode`).

    block_r: rows per program, a power of two. lanes (default): a program takes ``block_r``
    rows' worth of consecutive code words and each thread decodes whole words it loaded itself
    (32-bit loads, 16-byte bf16 stores, no shared memory or barriers); ``words_per_thread`` and
    ``flat`` then do not apply. Without lanes: words_per_thread: 32-bit words of codes (8
    elements each) per thread, a power of two (one load of 4x that many bytes; capped at the
    row's words); flat: a program takes ``block_r`` rows' worth of consecutive words of a slab
    instead of whole rows (no padding when ``head_dim / 8`` is not a power of two).
    persistent (with ``lanes``): launch ``persistent`` programs per SM, each looping over tiles,
    software-pipelined over ``stages`` stages; 0 = one program per tile.
    """

    block_r: int = 16
    num_warps: int = 2
    words_per_thread: int = 1
    flat: bool = False
    lanes: bool = True
    persistent: int = 0
    stages: int = 2

    def __post_init__(self) -> None:
        _check_launch(self, "block_r", self.block_r, power_of_two=True)
        _check_launch(self, "num_warps", self.num_warps, power_of_two=True)
        _check_launch(self, "words_per_thread", self.words_per_thread, power_of_two=True)
        _check_launch(self, "stages", self.stages)
        _check_launch(self, "persistent", self.persistent, minimum=0)


def _check_launch(cfg, name: str, v, *, power_of_two: bool = False, optional: bool = False,
                  minimum: int = 1) -> None:
    if v is None and optional:
        return
    if (not isinstance(v, int) or isinstance(v, bool) or v < minimum
            or (power_of_two and v & (v - 1))):
        what = "a power of two" if power_of_two else f"an integer >= {minimum}"
        raise ValueError(f"{type(cfg).__name__}.{name} must be {what}"
                         f"{' or None' if optional else ''}, got {v!r}")


_ENCODE = EncodeLaunch()
_DECODE = DecodeLaunch()


def nvfp4_encode(pages: torch.Tensor, page_ids: torch.Tensor | None = None, *,
                 out: torch.Tensor | None = None, raw_flags: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode pages to NVFP4 in one launch (Triton); same contract as :func:`nvfp4_encode_ref`.

    pages: ``[N, num_layers, 2, num_kv_heads, page_size, head_dim]`` bf16/fp16/fp32.
    page_ids: optional ``[M]`` int; encodes ``pages[page_ids]`` without gathering them first.
    out: optional ``[M, nbytes]`` uint8 on ``pages.device`` to encode into; its rows may be
    strided (e.g. columns of a staging buffer laid out like host slots).
    Returns ``(payload [M, nbytes] uint8, ok [M] bool)`` on ``pages.device``;
    nothing here waits for the device (``ok`` is a device tensor). raw_flags: return the kernel's
    per-slab flags ``[M, 2 * num_layers]`` int32 (nonzero = not encodable) instead of ``ok``,
    which saves the reduction's launches (the tiers reduce them on the host).
    """
    return _launch_encode(pages, page_ids, _ENCODE, out=out, raw_flags=raw_flags)


def _launch_encode(pages: torch.Tensor, page_ids: torch.Tensor | None, launch: EncodeLaunch, *,
                   out: torch.Tensor | None = None, raw_flags: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`nvfp4_encode` with another :class:`EncodeLaunch` (kernel tests, benchmarks)."""
    block_r, num_warps, asm = launch.block_r, launch.num_warps, launch.asm
    persistent, stages, maxnreg, lanes = (launch.persistent, launch.stages, launch.maxnreg,
                                          launch.lanes)
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


def nvfp4_decode(payload: torch.Tensor, out: torch.Tensor, page_ids: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """Decode NVFP4 pages into ``out`` in one launch (Triton); contract of :func:`nvfp4_decode_ref`.

    payload: ``[M, nbytes]`` uint8 on ``out.device``; its rows may be strided (e.g. columns of
    a staging buffer). out: ``[N, num_layers, 2, num_kv_heads, page_size, head_dim]``
    bf16/fp16/fp32 (a pool works: pass ``page_ids [M]``). Returns ``out``.
    """
    return _launch_decode(payload, out, page_ids, _DECODE)


def _launch_decode(payload: torch.Tensor, out: torch.Tensor, page_ids: torch.Tensor | None,
                   launch: DecodeLaunch) -> torch.Tensor:
    """:func:`nvfp4_decode` with another :class:`DecodeLaunch` (kernel tests, benchmarks)."""
    block_r, num_warps, persistent, stages = (launch.block_r, launch.num_warps,
                                              launch.persistent, launch.stages)
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
        if launch.lanes:
            cfg, tiles = _decode_lanes_config(s, r, d, block_r, has_ids=page_ids is not None,
                                              out_kind=kind, words=words is not None,
                                              persistent=persistent, stages=stages)
            n_tiles = m * s * tiles
            grid = min(n_tiles, persistent * num_sms(out.device, 2)) if persistent else n_tiles
            _nvfp4_decode_lanes_kernel[(grid,)](*args, tiles, n_tiles, R=r,
                                                 num_warps=num_warps, **cfg)
        else:
            cfg, tiles = _decode_config(s, r, d, block_r, launch.words_per_thread, launch.flat,
                                        has_ids=page_ids is not None, out_kind=kind,
                                        words=words is not None)
            _nvfp4_decode_kernel[(m * s, tiles)](*args, R=r, num_warps=num_warps, **cfg)
    return out
