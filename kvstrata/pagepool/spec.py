"""Layer-group specs and KV budget accounting.

A model's KV cache is one or more *layer groups* (``target``, ``draft``) that share page ids. This
module describes a group and answers the budget questions that must be settled at config time:
bytes per token and per page, how many pages a byte budget buys, and what a sliding-window group
really needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from ..dtypes import canonical_dtype, dtype_name

#: Version of the page layout ``[num_pages, num_layers, 2, num_kv_heads, page_size, head_dim]``.
#: It is bound into every prefix-hash namespace and every stored page header: bump it whenever the
#: byte layout of a page changes, so old pages become misses instead of wrong data.
LAYOUT_VERSION = 1

def _check_positive(what: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")


def check_page_size(page_size: int) -> None:
    """Page sizes are positive powers of two (kernels split pages into power-of-two tiles)."""
    _check_positive("page_size", page_size)
    if page_size & (page_size - 1):
        lo = 1 << (page_size.bit_length() - 1)
        raise ValueError(
            f"page_size={page_size} is not a power of two; the nearest that fit are {lo} and {lo * 2}")


@dataclass(frozen=True)
class KVGroupSpec:
    """One layer group of the KV cache.

    Storage for the group is ``[num_pages, num_layers, 2, num_kv_heads, page_size, head_dim]``
    (K then V). ``codec`` names the cold-page codec used when a page of this group leaves the
    device (``"nvfp4"`` for target pages, ``"lossless"`` for draft pages, ``"identity"``).
    ``sliding_window`` (tokens) marks a group whose attention only looks back that far.
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype | str = torch.bfloat16
    codec: str = "identity"
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or not self.name.isidentifier():
            raise ValueError(f"group name must be a non-empty identifier, got {self.name!r}")
        _check_positive(f"group {self.name!r}: num_layers", self.num_layers)
        _check_positive(f"group {self.name!r}: num_kv_heads", self.num_kv_heads)
        _check_positive(f"group {self.name!r}: head_dim", self.head_dim)
        if self.head_dim % 16:
            lo = self.head_dim // 16 * 16
            hint = f"{lo} or {lo + 16}" if lo else "16"
            raise ValueError(
                f"group {self.name!r}: head_dim={self.head_dim} is not a multiple of 16 "
                f"(NVFP4 scales cover 16 elements and kernels tile by 16); nearest that fit: {hint}")
        try:
            dt = canonical_dtype(self.dtype)
        except ValueError as e:
            raise ValueError(f"group {self.name!r}: {e}") from None
        object.__setattr__(self, "dtype", dt)
        if not isinstance(self.codec, str) or not self.codec:
            raise ValueError(f"group {self.name!r}: codec must be a codec name, got {self.codec!r}")
        if self.sliding_window is not None:
            _check_positive(f"group {self.name!r}: sliding_window", self.sliding_window)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def page_shape_tail(self) -> tuple[int, int, int]:
        """``(num_layers, 2, num_kv_heads)``; a page is this plus ``(page_size, head_dim)``."""
        return (self.num_layers, 2, self.num_kv_heads)

    def page_shape(self, page_size: int) -> tuple[int, int, int, int, int]:
        """Shape of one page of this group: ``[num_layers, 2, num_kv_heads, page_size, head_dim]``."""
        return (self.num_layers, 2, self.num_kv_heads, page_size, self.head_dim)

    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.itemsize

    def bytes_per_page(self, page_size: int) -> int:
        return self.bytes_per_token() * page_size

    def pages_needed(self, num_tokens: int, page_size: int) -> int:
        """Pages this group really needs to attend for a sequence of ``num_tokens`` tokens.

        A sliding-window group only reads the last ``sliding_window`` tokens (plus the partial page
        the window starts in). Pages are shared across groups, so the pool still allocates full
        pages for every group; this number is what a window-aware pool could keep resident.
        """
        full = math.ceil(num_tokens / page_size)
        if self.sliding_window is None:
            return full
        return min(full, math.ceil(self.sliding_window / page_size) + 1)

    def fingerprint_fields(self) -> tuple:
        """Fields that change the bytes of this group's KV (bound into the hash namespace)."""
        return (self.name, self.num_layers, self.num_kv_heads, self.head_dim, dtype_name(self.dtype))


def check_groups(groups: Sequence[KVGroupSpec]) -> tuple[KVGroupSpec, ...]:
    groups = tuple(groups)
    if not groups:
        raise ValueError("a page pool needs at least one KVGroupSpec")
    for g in groups:
        if not isinstance(g, KVGroupSpec):
            raise ValueError(f"expected KVGroupSpec, got {type(g).__name__}")
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        raise ValueError(f"group names must be unique, got {names}")
    return groups


def bytes_per_token(groups: Iterable[KVGroupSpec]) -> int:
    """Σ over groups of ``num_layers * 2 * num_kv_heads * head_dim * itemsize``."""
    return sum(g.bytes_per_token() for g in groups)


def bytes_per_page(groups: Iterable[KVGroupSpec], page_size: int) -> int:
    check_page_size(page_size)
    return bytes_per_token(groups) * page_size


def pages_for_budget(groups: Sequence[KVGroupSpec], page_size: int, budget_bytes: int) -> int:
    """Number of whole pages a byte budget buys for these groups.

    Raises ``ValueError`` if the budget does not buy a single page, naming the smallest budget that
    does.
    """
    groups = check_groups(groups)
    per_page = bytes_per_page(groups, page_size)
    if not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise ValueError(f"KV budget must be a positive number of bytes, got {budget_bytes!r}")
    n = budget_bytes // per_page
    if n < 1:
        raise ValueError(
            f"a KV budget of {format_bytes(budget_bytes)} does not hold one page: one page of "
            f"{page_size} tokens over groups {[g.name for g in groups]} takes "
            f"{format_bytes(per_page)} ({per_page} bytes)")
    return n


def max_tokens_for_pages(num_pages: int, page_size: int) -> int:
    return num_pages * page_size


def format_bytes(n: float) -> str:
    """Human-readable binary size: ``format_bytes(3 << 30) == '3.00 GiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
