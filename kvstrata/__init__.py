"""kvstrata: a tiered KV-cache store (GPU -> host -> disk) with a DFlash speculative runtime."""

__version__ = "0.1.0"
