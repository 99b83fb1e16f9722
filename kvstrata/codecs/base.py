"""Codec interface, encoded pages, the registry and the identity codec.

A codec turns one group's page ``[num_layers, 2, num_kv_heads, page_size, head_dim]`` into an
:class:`EncodedPage` and back. Encoded pages are self-describing: they carry the codec name and
version, the original shape and dtype, codec-specific metadata and a CRC32 of the payload. A reader
that finds a version it does not speak or a payload whose checksum fails gets a
:class:`CorruptPageError` subclass, which tiers count and turn into a miss.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from ..dtypes import canonical_dtype, dtype_name

try:
    # ISA-L computes the same CRC-32 as zlib, ~4x faster: stored pages stay readable either way.
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - optional accelerator
    from zlib import crc32 as _crc32


class CodecError(Exception):
    """Base class for codec errors."""


class UnencodablePageError(CodecError, ValueError):
    """The page cannot be encoded (e.g. NaN/Inf for a lossy codec). Nothing was stored."""


class CorruptPageError(CodecError):
    """An encoded page cannot be trusted; tiers treat it as a miss and delete it."""


class ChecksumError(CorruptPageError):
    """The payload's CRC32 does not match the one recorded at encode time."""


class CodecVersionError(CorruptPageError):
    """The page was written by a codec name/version this process cannot decode."""


def crc32(payload: torch.Tensor | bytes | memoryview) -> int:
    """CRC-32 (zlib's polynomial) of a host payload: bytes-like, or a CPU tensor of any dtype
    (its bytes). The one checksum of the package: codecs, records and page transfers use it."""
    if isinstance(payload, torch.Tensor):
        if payload.device.type != "cpu":
            raise ValueError("crc32 needs a host payload; call EncodedPage.to_host() first")
        payload = payload.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data
    return _crc32(payload) & 0xFFFFFFFF


@dataclass(slots=True)
class EncodedPage:
    """One encoded page of one group.

    ``payload`` is a contiguous 1-D ``uint8`` tensor; it may live on the GPU right after a GPU encode
    (then ``checksum`` is ``None`` until :meth:`to_host`). ``meta`` holds small codec-specific fields
    (msgpack-serialisable: ints, floats, strings, bytes, lists).
    """

    codec: str
    version: int
    shape: tuple[int, ...]
    dtype: str
    payload: torch.Tensor
    checksum: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Stored size of the payload in bytes."""
        return int(self.payload.numel())

    @property
    def raw_nbytes(self) -> int:
        """Size of the decoded page in bytes."""
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=canonical_dtype(self.dtype)).element_size()

    def to_host(self, non_blocking: bool = False) -> "EncodedPage":
        """Payload on the CPU with its checksum computed (a no-op copy for CPU payloads)."""
        payload = self.payload
        if payload.device.type != "cpu":
            payload = payload.to("cpu", non_blocking=non_blocking)
            if non_blocking:
                torch.cuda.current_stream(self.payload.device).synchronize()
        checksum = crc32(payload) if self.checksum is None else self.checksum
        return replace(self, payload=payload, checksum=checksum)

    def header(self) -> dict[str, Any]:
        """Everything but the payload, as plain msgpack-able values."""
        return {"codec": self.codec, "version": self.version, "shape": list(self.shape),
                "dtype": self.dtype, "nbytes": self.nbytes, "checksum": self.checksum,
                "meta": self.meta}

    @classmethod
    def from_header(cls, header: dict[str, Any], payload: torch.Tensor | bytes | memoryview
                    ) -> "EncodedPage":
        """The page a stored header (``header()``'s fields; a record's group entry) describes,
        around ``payload`` (bytes-like payloads are copied into a new uint8 tensor: the source
        may be read-only or short-lived). The one constructor of stored pages in the package."""
        if not isinstance(payload, torch.Tensor):
            payload = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if len(payload)
                       else torch.empty(0, dtype=torch.uint8))
        return cls(codec=header["codec"], version=int(header["version"]),
                   shape=tuple(int(s) for s in header["shape"]), dtype=header["dtype"],
                   payload=payload, checksum=header.get("checksum"),
                   meta=dict(header.get("meta") or {}))


class Codec(ABC):
    """A cold-page codec. Subclasses set ``name``, ``version`` and ``lossless``."""

    name: str = ""
    version: int = 1
    lossless: bool = True

    @abstractmethod
    def encode(self, page: torch.Tensor) -> EncodedPage:
        """Encode one page ``[num_layers, 2, num_kv_heads, page_size, head_dim]`` (any device)."""

    @abstractmethod
    def decode(self, encoded: EncodedPage, device: torch.device | str | None = None) -> torch.Tensor:
        """Decode to a tensor of the original shape and dtype on ``device`` (default: CPU)."""

    @abstractmethod
    def encoded_nbytes(self, spec: Any, page_size: int) -> int | None:
        """Payload size this codec produces for one page of ``spec`` (a ``KVGroupSpec``), or
        ``None`` when it depends on the data (entropy coders); then the raw size is the bound."""

    #: The codec has a fixed-size batch path on the pool's device (:meth:`encode_rows` /
    #: :meth:`decode_rows`): tiers encode straight into staging rows and decode from them.
    rows_path: bool = False

    def encode_rows(self, pool: torch.Tensor, page_ids: torch.Tensor, rows: torch.Tensor
                    ) -> torch.Tensor | None:
        """Encode ``pool[page_ids]`` into ``rows`` without waiting for the device.

        pool: ``[num_pages, num_layers, 2, num_kv_heads, page_size, head_dim]``; page_ids: ``[M]``
        int64 on ``pool.device``; rows: ``[M, encoded_nbytes]`` uint8 on ``pool.device``, rows
        contiguous but possibly strided (columns of a staging buffer). Returns the refusals: a
        device tensor ``[M, ...]`` whose nonzero entries mark a page that cannot be encoded (its
        row is meaningless), or ``None`` when every page can be. Only codecs with ``rows_path``."""
        raise NotImplementedError(f"codec {self.name!r} has no fixed-size device batch path")

    def decode_rows(self, rows: torch.Tensor, pool: torch.Tensor, page_ids: torch.Tensor) -> None:
        """Decode ``rows`` (as written by :meth:`encode_rows`, already verified) into
        ``pool[page_ids]``. Only codecs with ``rows_path``."""
        raise NotImplementedError(f"codec {self.name!r} has no fixed-size device batch path")

    def check(self, encoded: EncodedPage) -> None:
        """Raise :class:`CodecVersionError` / :class:`ChecksumError` if ``encoded`` is not ours or
        its payload is damaged. Device payloads without a checksum are trusted (never left a GPU)."""
        if encoded.codec != self.name or encoded.version != self.version:
            raise CodecVersionError(
                f"page was encoded by {encoded.codec!r} v{encoded.version}; this is "
                f"{self.name!r} v{self.version}")
        if encoded.checksum is not None and encoded.payload.device.type == "cpu":
            got = crc32(encoded.payload)
            if got != encoded.checksum:
                raise ChecksumError(
                    f"{self.name} payload checksum mismatch: stored {encoded.checksum:#010x}, "
                    f"computed {got:#010x}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, version={self.version})"


class IdentityCodec(Codec):
    """The raw bytes of the page."""

    name = "identity"
    version = 1
    lossless = True

    def encode(self, page: torch.Tensor) -> EncodedPage:
        canonical_dtype(page.dtype)
        payload = page.detach().contiguous().view(torch.uint8).reshape(-1)
        if payload.data_ptr() == page.data_ptr():
            payload = payload.clone()  # never alias the pool: the page may be reused next step
        enc = EncodedPage(codec=self.name, version=self.version, shape=tuple(page.shape),
                          dtype=dtype_name(page.dtype), payload=payload)
        if payload.device.type == "cpu":
            enc.checksum = crc32(payload)
        return enc

    def decode(self, encoded: EncodedPage, device: torch.device | str | None = None) -> torch.Tensor:
        self.check(encoded)
        dt = canonical_dtype(encoded.dtype)
        if encoded.nbytes != encoded.raw_nbytes:
            raise CorruptPageError(
                f"identity payload has {encoded.nbytes} bytes, shape {encoded.shape} of "
                f"{encoded.dtype} needs {encoded.raw_nbytes}")
        out = encoded.payload.view(dt).reshape(encoded.shape)
        return out.to(device if device is not None else "cpu", copy=out.device.type != "cpu")

    def encoded_nbytes(self, spec: Any, page_size: int) -> int:
        return spec.bytes_per_page(page_size)

    rows_path = True

    def encode_rows(self, pool: torch.Tensor, page_ids: torch.Tensor, rows: torch.Tensor
                    ) -> None:
        torch.index_select(pool, 0, page_ids, out=_as_pages(rows, pool))
        return None

    def decode_rows(self, rows: torch.Tensor, pool: torch.Tensor, page_ids: torch.Tensor) -> None:
        pool.index_copy_(0, page_ids, _as_pages(rows, pool))


def _as_pages(rows: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    """``rows [M, page bytes]`` uint8 viewed as ``M`` pages of ``pool`` (no copy; rows may be
    strided by a multiple of the element size)."""
    page = tuple(pool.shape[1:])
    nb = pool[0].numel() * pool.element_size() if pool.shape[0] else 0
    if rows.dim() != 2 or rows.dtype != torch.uint8 or rows.shape[1] != nb:
        raise ValueError(f"rows must be [M, {nb}] uint8 for pages {page} of {pool.dtype}, got "
                         f"{tuple(rows.shape)} {rows.dtype}")
    return rows.view(pool.dtype).view(rows.shape[0], *page)


#: The process-wide codec registry: name -> factory. Each codec module registers its codec when
#: it is imported, and ``kvstrata.codecs`` imports every built-in codec module, so by the time
#: any code can reach ``get_codec`` (importing a submodule runs the package first) the built-ins
#: are registered. Written only by ``register_codec`` (at import time, or by a plug-in).
_REGISTRY: dict[str, Callable[[], Codec]] = {}


def register_codec(name: str, factory: Callable[[], Codec]) -> None:
    """Register a codec factory under ``name`` (used by ``get_codec``)."""
    _REGISTRY[name] = factory


def available_codecs() -> list[str]:
    return sorted(_REGISTRY)


def get_codec(name: str, **options: Any) -> Codec:
    """Instantiate the codec registered as ``name`` (options go to its constructor)."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; available: {sorted(_REGISTRY)}") from None
    return factory(**options)


register_codec("identity", IdentityCodec)
