"""Disaggregated serving: a context worker hands its pages, draft KV included, to a generation
worker through ``torch.distributed`` (Gloo on the CPU, NCCL between GPUs)."""

from .transport import (NamespaceMismatchError, PageChannel, TransferError, TransferStats,
                        handshake, recv_sequence, send_sequence)
from .workers import ContextWorker, GenerationWorker, LoopbackChannel, loopback_pair

__all__ = ["ContextWorker", "GenerationWorker", "LoopbackChannel", "NamespaceMismatchError",
           "PageChannel", "TransferError", "TransferStats", "handshake", "loopback_pair",
           "recv_sequence", "send_sequence"]
