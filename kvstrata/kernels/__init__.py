"""kvstrata.kernels: Triton kernels next to plain-torch references with the same signatures."""

from .attention import paged_attention, paged_attention_ref
from .attention_plan import AttentionMetadata, plan_attention
from .kv_write import write_kv, write_kv_ref

__all__ = ["AttentionMetadata", "paged_attention", "paged_attention_ref", "plan_attention",
           "write_kv", "write_kv_ref"]
