"""Lossless codec: exponent / sign+mantissa byte planes, each compressed with zstd.

KV values cluster in a few binades, so their exponent bits are low-entropy while sign and mantissa
bits are close to uniform. Splitting a page into byte planes puts the compressible bits together
where zstd's entropy stage finds them. Planes per element, most significant first:

=========  ============================================  =================================
dtype      exponent plane                                sign+mantissa planes
=========  ============================================  =================================
bfloat16   8-bit exponent                                ``sign<<7 | mantissa[6:0]``
float16    5-bit exponent (zero-extended to a byte)      ``sign<<2 | mantissa[9:8]``, ``mantissa[7:0]``
float32    8-bit exponent                                ``sign<<7 | mantissa[22:16]``, ``[15:8]``, ``[7:0]``
=========  ============================================  =================================

Each plane is stored zstd-compressed or raw, whichever is smaller (``meta["planes"]`` records the
stored length and the choice); if the planes together would exceed the raw page, the raw page
is stored instead (``meta["planes"] == []``), so a payload never exceeds the page.
``compress`` picks which planes zstd even tries: ``"auto"`` (the default) offers the exponent plane
and a sign+mantissa plane with unused high bits (fp16's 3-bit top plane), but not the full
mantissa bytes, which are close to random in real KV and cost compress time for ~1% of the page;
``"all"`` offers every plane. Decoding reproduces the input bit for bit, including NaN payloads,
subnormals and signed zeros.
"""

from __future__ import annotations

import threading
from typing import Any, Literal

import numpy as np
import torch
import zstandard

from ..dtypes import canonical_dtype, dtype_name
from .base import Codec, CorruptPageError, EncodedPage, crc32, register_codec

#: ``level=None`` (the default) uses these zstd parameters instead of a level: a tiny match finder
#: (hash_log 6, min_match 7) makes zstd close to a pure Huffman coder, which is what exponent bytes
#: need. On bf16 KV pages it compresses ~3x faster than level 1 *and* ~15% smaller, because the
#: short matches level 1 finds in exponent noise cost more than they save (measurements in
#: docs/benchmarks.md (Codecs), from benchmarks/codecs_bench.py).
ENTROPY_PARAMS = dict(strategy=zstandard.STRATEGY_FAST, window_log=17, hash_log=6, chain_log=6,
                      search_log=1, min_match=7, target_length=0)

# dtype -> (uint view, total bits, mantissa bits)
_LAYOUT = {
    torch.bfloat16: (np.uint16, 16, 7),
    torch.float16: (np.uint16, 16, 10),
    torch.float32: (np.uint32, 32, 23),
}


def split_planes(bits: np.ndarray, width: int, man_bits: int) -> list[np.ndarray]:
    """Split raw float bits (1-D ``uint16``/``uint32``) into uint8 planes (exponent first)."""
    exp = ((bits >> man_bits) & ((1 << (width - 1 - man_bits)) - 1)).astype(np.uint8)
    sm = ((bits >> (width - 1)) << man_bits) | (bits & ((1 << man_bits) - 1))
    n_sm = (man_bits + 1 + 7) // 8
    return [exp] + [((sm >> (8 * k)) & 0xFF).astype(np.uint8) for k in reversed(range(n_sm))]


def join_planes(planes: list[np.ndarray], dtype: np.dtype, width: int, man_bits: int
                ) -> np.ndarray:
    """Inverse of :func:`split_planes`."""
    sm = planes[1].astype(dtype)
    for p in planes[2:]:
        sm <<= 8
        sm |= p
    out = sm & dtype.type((1 << man_bits) - 1)
    sm >>= man_bits
    sm <<= width - 1
    out |= sm
    exp = planes[0].astype(dtype)
    exp <<= man_bits
    out |= exp
    return out


class LosslessCodec(Codec):
    """Bit-exact codec. ``level``: ``None`` (default: entropy-coder parameters, see
    ``ENTROPY_PARAMS``) or a zstd level in [-50, 22]; ``compress``: which planes are offered to
    zstd, ``"auto"`` (default) or ``"all"`` (see the module doc)."""

    name = "lossless"
    version = 1
    lossless = True

    def __init__(self, level: int | None = None,
                 compress: Literal["auto", "all"] = "auto") -> None:
        if level is not None and (not isinstance(level, int) or isinstance(level, bool)
                                  or not -50 <= level <= 22):
            raise ValueError(f"zstd level must be None or an int in [-50, 22], got {level!r}")
        if compress not in ("auto", "all"):
            raise ValueError(f"compress must be 'auto' or 'all', got {compress!r}")
        self.level = level
        self.compress = compress
        # zstd contexts are not thread-safe; tiers may encode from a thread pool.
        self._local = threading.local()

    def _ctx(self) -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
        ctx = getattr(self._local, "ctx", None)
        if ctx is None:
            cctx = (zstandard.ZstdCompressor(level=self.level) if self.level is not None else
                    zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters(
                        **ENTROPY_PARAMS)))
            ctx = (cctx, zstandard.ZstdDecompressor())
            self._local.ctx = ctx
        return ctx

    def encode(self, page: torch.Tensor) -> EncodedPage:
        """Encode a page ``[num_layers, 2, num_kv_heads, page_size, head_dim]`` (any device; the
        payload is built on the host). Any bit pattern is accepted."""
        dt = canonical_dtype(page.dtype)
        npdt, width, man = _LAYOUT[dt]
        host = page.detach().to("cpu").contiguous()
        bits = host.reshape(-1).view(torch.int16 if width == 16 else torch.int32).numpy()
        planes = split_planes(bits.view(npdt), width, man)
        cctx = self._ctx()[0]
        chunks: list[bytes | np.ndarray] = []
        info: list[list[int]] = []
        for k, plane in enumerate(planes):
            stored: bytes | np.ndarray = plane
            if k == 0 or self.compress == "all" or (k == 1 and (man + 1) % 8):
                z = cctx.compress(plane.data)
                if len(z) < plane.nbytes:
                    stored = z
            info.append([len(stored) if isinstance(stored, bytes) else stored.nbytes,
                         int(isinstance(stored, bytes))])
            chunks.append(stored)
        if sum(i[0] for i in info) >= host.numel() * host.element_size():
            info, chunks = [], [bits.view(np.uint8)]
        payload = np.empty(sum(c.nbytes if isinstance(c, np.ndarray) else len(c) for c in chunks),
                           dtype=np.uint8)
        off = 0
        for c in chunks:
            c = np.frombuffer(c, dtype=np.uint8) if isinstance(c, bytes) else c
            payload[off:off + c.size] = c
            off += c.size
        t = torch.from_numpy(payload)
        return EncodedPage(codec=self.name, version=self.version, shape=tuple(page.shape),
                           dtype=dtype_name(dt), payload=t, checksum=crc32(t),
                           meta={"planes": info})

    def decode(self, encoded: EncodedPage, device: torch.device | str | None = None
               ) -> torch.Tensor:
        """Decode to the original shape and dtype on ``device`` (default CPU), bit for bit.
        Raises CodecVersionError / ChecksumError / CorruptPageError."""
        self.check(encoded)
        dt = canonical_dtype(encoded.dtype)
        npdt, width, man = _LAYOUT[dt]
        n = encoded.raw_nbytes // (width // 8)
        info = encoded.meta.get("planes")
        n_planes = 1 + (man + 1 + 7) // 8
        if info == [] and encoded.nbytes == encoded.raw_nbytes:  # stored raw
            raw = encoded.payload.to("cpu").contiguous().clone()
            return _to(raw.view(dt).reshape(encoded.shape), device)
        if not isinstance(info, list) or len(info) != n_planes:
            raise CorruptPageError(f"lossless page meta has planes={info!r}; {encoded.dtype} "
                                   f"needs {n_planes}")
        if sum(int(i[0]) for i in info) != encoded.nbytes:
            raise CorruptPageError(f"lossless plane sizes {info} do not add up to the payload "
                                   f"({encoded.nbytes} bytes)")
        buf = encoded.payload.to("cpu").contiguous().numpy()
        dctx = self._ctx()[1]
        planes, off = [], 0
        for size, compressed in info:
            chunk = buf[off:off + size]
            off += size
            if compressed:
                try:
                    raw = dctx.decompress(chunk.data, max_output_size=n)
                except zstandard.ZstdError as e:
                    raise CorruptPageError(f"lossless plane does not decompress: {e}") from None
                plane = np.frombuffer(raw, dtype=np.uint8)
            else:
                plane = chunk
            if plane.size != n:
                raise CorruptPageError(f"lossless plane has {plane.size} bytes, expected {n}")
            planes.append(plane)
        bits = join_planes(planes, np.dtype(npdt), width, man)
        signed = np.int16 if width == 16 else np.int32
        return _to(torch.from_numpy(bits.view(signed)).view(dt).reshape(encoded.shape), device)

    def encoded_nbytes(self, spec: Any, page_size: int) -> None:
        return None


def _to(t: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    return t if device is None or torch.device(device).type == "cpu" else t.to(device)


register_codec("lossless", LosslessCodec)
