"""NVFP4 codec (lossy): E2M1 elements, an E4M3 scale per 16 elements, an FP32 scale per slab.

4.5 bits per element plus 4 bytes per (layer, K/V): 3.56x smaller than bf16. The byte format and
the rounding rules are fixed in :mod:`kvstrata.kernels.nvfp4`. CUDA pages are encoded and decoded
by the Triton kernels on the GPU (so only the small payload crosses PCIe); CPU pages by the torch
reference, which produces the same bytes.

Error bound (what the tests assert): with ``d = e4m3 * g`` the block's step and ``y = |x| / d``,
``|x̂ - x| <= d * h(y)`` where ``h`` is half the E2M1 grid gap around ``y`` (0.25 below 2, 0.5 in
[2, 4), 1 in [4, 6]) and ``|x| - 6d`` for ``y > 6`` (the block scale rounded down), plus the final
rounding to the page dtype. Blocks and slabs that are all zero decode to exact zeros.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from ..dtypes import canonical_dtype, dtype_name
from ..kernels.nvfp4 import nvfp4_decode_ref, nvfp4_encode_ref, nvfp4_layout
from ..kernels.nvfp4_triton import nvfp4_decode, nvfp4_encode
from .base import (Codec, CorruptPageError, EncodedPage, UnencodablePageError, crc32,
                   register_codec)

Backend = Literal["auto", "triton", "torch"]


class NVFP4Codec(Codec):
    """Lossy NVFP4 codec. ``backend``: ``"auto"`` (Triton on CUDA, torch on CPU), ``"triton"``
    (also on CPU under ``TRITON_INTERPRET=1``) or ``"torch"``."""

    name = "nvfp4"
    version = 1
    lossless = False

    def __init__(self, backend: Backend = "auto") -> None:
        if backend not in ("auto", "triton", "torch"):
            raise ValueError(f"nvfp4 backend must be 'auto', 'triton' or 'torch', got {backend!r}")
        self.backend = backend

    def _use_triton(self, device: torch.device) -> bool:
        return self.backend == "triton" or (self.backend == "auto" and device.type == "cuda")

    # -- encode ------------------------------------------------------------------------------

    def encode(self, page: torch.Tensor) -> EncodedPage:
        """Encode one page ``[num_layers, 2, num_kv_heads, page_size, head_dim]`` (any device).

        The payload stays on the page's device (``checksum`` is ``None`` until ``to_host()``).
        Raises :class:`UnencodablePageError` for NaN/Inf.
        """
        if page.dim() != 5:
            raise ValueError(f"a page is [num_layers, 2, num_kv_heads, page_size, head_dim], got "
                             f"shape {tuple(page.shape)}")
        return self.encode_batch(page.contiguous().unsqueeze(0))[0]  # type: ignore[return-value]

    def encode_batch(self, pages: torch.Tensor, page_ids: torch.Tensor | None = None, *,
                     to_host: bool = False, errors: Literal["raise", "skip"] = "raise"
                     ) -> list[EncodedPage | None]:
        """Encode many pages in one launch.

        pages: ``[N, num_layers, 2, num_kv_heads, page_size, head_dim]`` bf16/fp16/fp32 (a pool's
        storage works as is). page_ids: optional ``[M]`` int; encodes ``pages[page_ids]`` without
        gathering them. to_host: copy all payloads to the host in one transfer and checksum them.
        errors: ``"raise"`` raises :class:`UnencodablePageError` (``.page_indices`` lists the bad
        rows) if any page holds NaN/Inf; ``"skip"`` returns ``None`` for those rows instead.
        """
        if errors not in ("raise", "skip"):
            raise ValueError(f"errors must be 'raise' or 'skip', got {errors!r}")
        dt = canonical_dtype(pages.dtype)
        fn = nvfp4_encode if self._use_triton(pages.device) else nvfp4_encode_ref
        payload, finite = fn(pages, page_ids)
        bad = (~finite).nonzero().flatten().tolist()  # one sync: the caller must know now
        if bad and errors == "raise":
            err = UnencodablePageError(
                f"{len(bad)} of {payload.shape[0]} pages hold NaN, Inf or |x| >= 2**127 (rows "
                f"{bad[:8]}); NVFP4 "
                f"cannot represent them, nothing was stored. Use the 'lossless' or 'identity' "
                f"codec for this group, or find where the non-finite KV came from")
            err.page_indices = bad  # type: ignore[attr-defined]
            raise err
        if to_host and payload.device.type != "cpu":
            host = torch.empty(payload.shape, dtype=torch.uint8, pin_memory=True)
            host.copy_(payload, non_blocking=True)
            torch.cuda.current_stream(payload.device).synchronize()
            payload = host
        shape = tuple(pages.shape[1:])
        out: list[EncodedPage | None] = []
        bad_set = set(bad)
        for i in range(payload.shape[0]):
            if i in bad_set:
                out.append(None)
                continue
            row = payload[i]
            out.append(EncodedPage(codec=self.name, version=self.version, shape=shape,
                                   dtype=dtype_name(dt), payload=row,
                                   checksum=crc32(row) if row.device.type == "cpu" else None))
        return out

    rows_path = True

    def encode_rows(self, pool: torch.Tensor, page_ids: torch.Tensor, rows: torch.Tensor
                    ) -> torch.Tensor:
        """Encode ``pool[page_ids]`` into ``rows`` (strided rows welcome) without a device sync;
        returns the refusals (nonzero: NaN/Inf or too large, row meaningless)."""
        if self._use_triton(pool.device):
            return nvfp4_encode(pool, page_ids, out=rows, raw_flags=True)[1]
        payload, ok = nvfp4_encode_ref(pool, page_ids)
        rows.copy_(payload)
        return ~ok

    def decode_rows(self, rows: torch.Tensor, pool: torch.Tensor, page_ids: torch.Tensor) -> None:
        self._decode_rows(rows, pool, page_ids)

    # -- decode ------------------------------------------------------------------------------

    def _validate(self, enc: EncodedPage) -> None:
        self.check(enc)
        if len(enc.shape) != 5 or enc.shape[1] != 2 or enc.shape[4] % 16:
            raise CorruptPageError(f"nvfp4 page has shape {enc.shape}; expected "
                                   f"[num_layers, 2, num_kv_heads, page_size, 16*k]")
        l, _, h, p, d = enc.shape
        need = nvfp4_layout(2 * l, h * p, d)[3]
        if enc.nbytes != need:
            raise CorruptPageError(f"nvfp4 payload has {enc.nbytes} bytes; shape {enc.shape} "
                                   f"needs {need}")

    def decode(self, encoded: EncodedPage, device: torch.device | str | None = None
               ) -> torch.Tensor:
        """Decode to ``[num_layers, 2, num_kv_heads, page_size, head_dim]`` of the page's dtype
        on ``device`` (default CPU). Raises CodecVersionError / ChecksumError / CorruptPageError."""
        self._validate(encoded)
        dev = torch.device(device if device is not None else "cpu")
        out = torch.empty(encoded.shape, dtype=canonical_dtype(encoded.dtype), device=dev)
        return self.decode_into(encoded, out)

    def decode_into(self, encoded: EncodedPage, out: torch.Tensor) -> torch.Tensor:
        """Decode straight into ``out`` (e.g. a pool page view
        ``[num_layers, 2, num_kv_heads, page_size, head_dim]``, contiguous). Returns ``out``."""
        self._validate(encoded)
        if tuple(out.shape) != encoded.shape or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous tensor of shape {encoded.shape}, got "
                             f"{tuple(out.shape)}")
        self._decode_rows(encoded.payload.reshape(1, -1), out.unsqueeze(0), None)
        return out

    def _decode_rows(self, rows: torch.Tensor, out: torch.Tensor, ids: torch.Tensor | None
                     ) -> None:
        rows = rows.to(out.device, non_blocking=True)
        if self._use_triton(out.device):
            nvfp4_decode(rows, out, ids)
        else:
            nvfp4_decode_ref(rows, out, ids)

    def encoded_nbytes(self, spec: Any, page_size: int) -> int:
        return nvfp4_layout(2 * spec.num_layers, spec.num_kv_heads * page_size, spec.head_dim)[3]


register_codec("nvfp4", NVFP4Codec)
