"""kvstrata.drafter: the DFlash drafter (context K/V writer + block drafter) over pool views."""

from .arena import DraftArena
from .config import DFlashConfig, default_target_layer_ids
from .model import DFlashDrafter, DraftAttentionFn, PagedDraftAttention

__all__ = ["DFlashConfig", "DFlashDrafter", "DraftArena", "DraftAttentionFn", "PagedDraftAttention",
           "default_target_layer_ids"]
