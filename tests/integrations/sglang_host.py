"""A host KV pool with SGLang's MHA host-pool page interface, for the storage-backend tests.

SGLang's own ``MHATokenToKVPoolHost`` cannot be imported here: its package imports SGLang's
multimodal configs, which need ``torchvision``, and ``torchvision`` must not sit beside vLLM's CPU
build. This class holds the same buffer (``kv_buffer`` in each layout's dimension order) and
answers the calls a storage backend makes (``layout``, ``page_size``, ``layer_num``,
``head_num``, ``head_dim``, ``dtype``, ``get_data_page``, ``set_from_flat_data_page``), with the
layouts' documented dimension orders:

=====================  ======================================================
``layer_first``        ``[2, L, tokens, H, D]``
``page_first``         ``[2, tokens, L, H, D]``
``page_first_direct``  ``[2, pages, L, P, H, D]``
``page_head``          ``[2, pages, H, P, L, D]``
=====================  ======================================================
"""

from __future__ import annotations

import torch


class HostPool:
    def __init__(self, layout: str, num_pages: int, page_size: int = 16, layer_num: int = 3,
                 head_num: int = 2, head_dim: int = 32, dtype: torch.dtype = torch.bfloat16):
        self.layout, self.page_size, self.layer_num = layout, page_size, layer_num
        self.head_num, self.head_dim, self.dtype = head_num, head_dim, dtype
        self.v_head_dim = head_dim
        L, P, H, D, n = layer_num, page_size, head_num, head_dim, num_pages
        dims = {"layer_first": (2, L, n * P, H, D), "page_first": (2, n * P, L, H, D),
                "page_first_direct": (2, n, L, P, H, D), "page_head": (2, n, H, P, L, D)}
        self.kv_buffer = torch.zeros(dims[layout], dtype=dtype)

    def _page(self, index: int) -> torch.Tensor:
        P = self.page_size
        if self.layout == "layer_first":
            return self.kv_buffer[:, :, index:index + P]
        if self.layout == "page_first":
            return self.kv_buffer[:, index:index + P]
        return self.kv_buffer[:, index // P:index // P + 1]

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self._page(index)
        return page.flatten() if flat else page

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        dst = self._page(index)
        dst.copy_(data_page.reshape(dst.shape))

    def page_kv(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the page at token ``index`` as ``[L, P, H, D]`` each (layout-free), for
        comparisons."""
        page = self._page(index)
        if self.layout == "layer_first":
            kv = page                                           # [2, L, P, H, D]
        elif self.layout == "page_first":
            kv = page.permute(0, 2, 1, 3, 4)                    # [2, P, L, H, D] -> [2, L, P, H, D]
        elif self.layout == "page_first_direct":
            kv = page[:, 0]                                     # [2, L, P, H, D]
        else:
            kv = page[:, 0].permute(0, 3, 2, 1, 4)              # [2, H, P, L, D] -> [2, L, P, H, D]
        return kv[0], kv[1]
