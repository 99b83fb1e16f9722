"""PoolView: what the tiers see of an engine's device pages (the seam outside engines plug into).

A tier never touches a :class:`~kvstrata.pagepool.PagePool`'s internals: it reads and writes
device pages through a :class:`PoolView`, which any engine can build from its own KV tensors.

- **groups**: one :class:`GroupView` per layer group, in record order. Each holds the group's
  :class:`~kvstrata.pagepool.KVGroupSpec` (layers, heads, head_dim, dtype, codec) and its device
  tensors in one of two layouts:

  ``PAGE_MAJOR`` (kvstrata's own pool)
      one tensor ``[num_pages, num_layers, 2, num_kv_heads, page_size, head_dim]``: a page of a
      group is one contiguous span of memory (K then V, heads-major inside a layer).
  ``LAYER_KV_FIRST`` (e.g. vLLM's flash-attention cache)
      ``num_layers`` tensors ``[2, num_pages, page_size, num_kv_heads, head_dim]``, one per layer
      (K then V along dim 0, tokens before heads).

- **page ids**: ``0 <= page_id < num_pages`` index every group at once (a page holds
  ``page_size`` consecutive tokens of every group).

Whatever the layout, a page crosses the tier boundary in the *canonical* page shape
``[num_layers, 2, num_kv_heads, page_size, head_dim]`` (:meth:`PoolView.read` /
:meth:`PoolView.write`), so stored records are the same bytes for every engine. For
``PAGE_MAJOR`` groups :meth:`PoolView.page_major` hands the tensor itself to batch codecs, which
then gather straight from the pool without an intermediate copy.

``lookup`` (optional): ``hash -> page id | None``, where the engine's prefix index says a page
hash lives now. Write-through uses it to skip a queued page that the engine has replaced since it
was hashed; an engine without such an index leaves it ``None``.

``hashed_pages`` (optional): ``() -> list[PageInfo]``, every device page whose content is final
and findable by its hash (in use or cached). ``TierManager.write_back()`` writes them down; an
engine without it passes the pages to ``write_back`` itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .spec import KVGroupSpec, check_page_size

PAGE_MAJOR = "page_major"
LAYER_KV_FIRST = "layer_kv_first"
LAYOUTS = (PAGE_MAJOR, LAYER_KV_FIRST)


@dataclass(frozen=True)
class GroupView:
    """One layer group's device tensors (see the module doc for the two layouts)."""

    spec: KVGroupSpec
    layout: str
    tensors: tuple[torch.Tensor, ...]

    def expected_shapes(self, num_pages: int, page_size: int) -> list[tuple[int, ...]]:
        s = self.spec
        if self.layout == PAGE_MAJOR:
            return [(num_pages, *s.page_shape(page_size))]
        return [(2, num_pages, page_size, s.num_kv_heads, s.head_dim)] * s.num_layers


@dataclass(frozen=True)
class PoolView:
    """Device pages of every group, as the tiers see them.

    Args:
        groups: the groups in record order.
        num_pages: pages per group.
        page_size: tokens per page (a power of two).
        lookup: optional ``hash -> page id | None`` (see the module doc).
        hashed_pages: optional ``() -> list[PageInfo]`` (see the module doc).

    Raises ValueError when a tensor's shape, dtype or device disagrees with its spec.
    """

    groups: tuple[GroupView, ...]
    num_pages: int
    page_size: int
    lookup: Callable[[bytes], int | None] | None = None
    hashed_pages: Callable[[], list] | None = None

    def __post_init__(self) -> None:
        check_page_size(self.page_size)
        if not isinstance(self.num_pages, int) or self.num_pages <= 0:
            raise ValueError(f"PoolView: num_pages must be a positive integer, got "
                             f"{self.num_pages!r}")
        if not self.groups:
            raise ValueError("PoolView needs at least one group")
        object.__setattr__(self, "groups", tuple(self.groups))
        names = [g.spec.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"PoolView: group names must be unique, got {names}")
        devices = set()
        for g in self.groups:
            if g.layout not in LAYOUTS:
                raise ValueError(f"group {g.spec.name!r}: layout {g.layout!r} is not one of "
                                 f"{LAYOUTS}")
            want = g.expected_shapes(self.num_pages, self.page_size)
            got = [tuple(t.shape) for t in g.tensors]
            if got != want:
                raise ValueError(f"group {g.spec.name!r} ({g.layout}): tensors of shapes {got}, "
                                 f"expected {want}")
            for t in g.tensors:
                if t.dtype != g.spec.dtype:
                    raise ValueError(f"group {g.spec.name!r}: tensor dtype {t.dtype}, its spec "
                                     f"says {g.spec.dtype}")
                devices.add(t.device)
        if len(devices) != 1:
            raise ValueError(f"PoolView: every tensor must be on one device, got {devices}")

    @classmethod
    def of(cls, pool) -> "PoolView":
        """The view of a kvstrata :class:`~kvstrata.pagepool.PagePool` (``PAGE_MAJOR``)."""
        return cls(tuple(GroupView(g, PAGE_MAJOR, (pool.kv[g.name],)) for g in pool.groups),
                   pool.num_pages, pool.page_size, lookup=pool.lookup,
                   hashed_pages=pool.hashed_pages)

    @classmethod
    def page_major_groups(cls, specs: Sequence[KVGroupSpec], kv: dict[str, torch.Tensor],
                          page_size: int, lookup: Callable[[bytes], int | None] | None = None
                          ) -> "PoolView":
        """A view over ``kv[name]: [num_pages, L, 2, H, P, D]`` tensors of the given groups."""
        specs = list(specs)
        if not specs:
            raise ValueError("PoolView needs at least one group")
        return cls(tuple(GroupView(s, PAGE_MAJOR, (kv[s.name],)) for s in specs),
                   int(kv[specs[0].name].shape[0]), page_size, lookup)

    @property
    def specs(self) -> list[KVGroupSpec]:
        return [g.spec for g in self.groups]

    @property
    def device(self) -> torch.device:
        return self.groups[0].tensors[0].device

    def page_major(self, group: int) -> torch.Tensor | None:
        """Group index ``group``'s ``[num_pages, L, 2, H, P, D]`` tensor, or ``None`` when the
        group is stored in another layout (then use :meth:`read` / :meth:`write`)."""
        g = self.groups[group]
        return g.tensors[0] if g.layout == PAGE_MAJOR else None

    def read(self, group: int, page_ids: torch.Tensor) -> torch.Tensor:
        """Pages ``page_ids`` (int64 on the view's device) of group index ``group`` as a new
        ``[n, L, 2, H, P, D]`` tensor."""
        g = self.groups[group]
        if g.layout == PAGE_MAJOR:
            return g.tensors[0].index_select(0, page_ids)
        # [2, n, P, H, D] per layer -> [n, 2, H, P, D], stacked along a new layer dim
        return torch.stack([t.index_select(1, page_ids).permute(1, 0, 3, 2, 4)
                            for t in g.tensors], dim=1)

    def write(self, group: int, page_ids: torch.Tensor, pages: torch.Tensor) -> None:
        """Write ``pages`` ``[n, L, 2, H, P, D]`` into pages ``page_ids`` of group ``group``."""
        g = self.groups[group]
        pages = pages.to(device=self.device, dtype=g.spec.dtype)
        if g.layout == PAGE_MAJOR:
            g.tensors[0].index_copy_(0, page_ids, pages)
            return
        for layer, t in enumerate(g.tensors):
            t.index_copy_(1, page_ids, pages[:, layer].permute(1, 0, 3, 2, 4))
