"""Measuring a codec on real or synthetic KV: ratio, speed and error in one call.

``compression_report(pages, "lossless")`` takes pages exactly as the pool stores them
(``[N, num_layers, 2, num_kv_heads, page_size, head_dim]``, or one page without ``N``), encodes and
decodes every page with the named codec and reports the size ratio, the host throughput and the
reconstruction error. ``synthetic_kv`` makes stand-in data for tests and benchmarks.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from ..dtypes import canonical_dtype, dtype_name
from .base import get_codec


@dataclass(frozen=True)
class CompressionReport:
    """What one codec did to a set of pages. Throughputs are raw (decoded) bytes per second, best
    of ``repeats``: ``*_gbps`` per second of wall time, ``*_cpu_gbps`` per second of the calling
    thread's CPU time (per-core speed that holds up on a busy machine)."""

    codec: str
    options: str
    dtype: str
    num_pages: int
    page_shape: tuple[int, ...]
    raw_bytes: int
    encoded_bytes: int
    encode_gbps: float
    decode_gbps: float
    encode_cpu_gbps: float
    decode_cpu_gbps: float
    bit_exact: bool
    rel_rmse: float
    max_abs_err: float

    @property
    def ratio(self) -> float:
        return self.raw_bytes / max(self.encoded_bytes, 1)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio}

    def markdown_row(self) -> str:
        """One row under :attr:`MARKDOWN_HEADER`."""
        return (f"| {self.codec} | {self.options or '-'} | {self.dtype} | {self.num_pages} | "
                f"{self.ratio:.3f} | {self.encode_gbps:.2f} | {self.decode_gbps:.2f} | "
                f"{self.encode_cpu_gbps:.2f} | {self.decode_cpu_gbps:.2f} | "
                f"{'yes' if self.bit_exact else 'no'} | {self.rel_rmse:.4f} |")

    MARKDOWN_HEADER = ("| codec | options | dtype | pages | ratio | encode GB/s (wall) | "
                       "decode GB/s (wall) | encode GB/s (CPU time) | decode GB/s (CPU time) | "
                       "bit-exact | rel RMSE |\n|---|---|---|---|---|---|---|---|---|---|---|")


def compression_report(pages: torch.Tensor, codec: str = "lossless", *, repeats: int = 3,
                       **options: Any) -> CompressionReport:
    """Encode and decode every page of ``pages`` with codec ``codec`` and report the result.

    pages: ``[N, num_layers, 2, num_kv_heads, page_size, head_dim]`` or one page
    ``[num_layers, 2, num_kv_heads, page_size, head_dim]``, bf16/fp16/fp32, any device (the codec
    runs where the pages are). options go to ``get_codec``. Raises ``ValueError`` for other shapes.
    """
    if pages.dim() == 5:
        pages = pages.unsqueeze(0)
    if pages.dim() != 6 or pages.shape[2] != 2 or pages.shape[0] == 0:
        raise ValueError(f"pages must be [N>0, num_layers, 2, num_kv_heads, page_size, head_dim] "
                         f"or one page without N, got shape {tuple(pages.shape)}")
    canonical_dtype(pages.dtype)
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    c = get_codec(codec, **options)
    pages = pages.contiguous()
    sync = (torch.cuda.synchronize if pages.device.type == "cuda" else (lambda: None))

    def timed(fn):
        best, best_cpu, result = math.inf, math.inf, None
        for _ in range(repeats):
            sync()
            t0, c0 = time.perf_counter(), time.thread_time()
            result = fn()
            sync()
            best = min(best, time.perf_counter() - t0)
            best_cpu = min(best_cpu, max(time.thread_time() - c0, 1e-9))
        return best, best_cpu, result

    t_enc, c_enc, encs = timed(lambda: [c.encode(p) for p in pages])
    encs = [e.to_host() for e in encs]
    t_dec, c_dec, decs = timed(lambda: [c.decode(e, device=pages.device) for e in encs])
    out = torch.stack(decs)
    raw = pages.numel() * pages.element_size()
    x, y = pages.float(), out.float()
    err = (y - x)
    norm = x.norm().item()
    return CompressionReport(
        codec=codec, options=",".join(f"{k}={v}" for k, v in sorted(options.items())),
        dtype=dtype_name(pages.dtype), num_pages=pages.shape[0],
        page_shape=tuple(pages.shape[1:]), raw_bytes=raw,
        encoded_bytes=sum(e.nbytes for e in encs),
        encode_gbps=raw / t_enc / 1e9, decode_gbps=raw / t_dec / 1e9,
        encode_cpu_gbps=raw / c_enc / 1e9, decode_cpu_gbps=raw / c_dec / 1e9,
        bit_exact=torch.equal(pages.reshape(-1).view(torch.uint8),
                              out.reshape(-1).view(torch.uint8)),
        rel_rmse=(err.norm().item() / norm) if norm > 0 else float(err.norm().item()),
        max_abs_err=float(err.abs().max().item()))


def synthetic_kv(kind: Literal["gaussian", "key"], num_pages: int, num_layers: int,
                 num_kv_heads: int, page_size: int, head_dim: int,
                 dtype: torch.dtype | str = torch.bfloat16, seed: int = 0,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """Stand-in KV pages ``[num_pages, num_layers, 2, num_kv_heads, page_size, head_dim]``.

    ``"gaussian"``: i.i.d. N(0, 1). ``"key"``: what RoPE'd keys look like in practice. K has a
    log-normal scale and an offset per (layer, head, channel), with ~3% outlier channels 10-30x
    larger; V is Gaussian with a milder per-channel scale.
    """
    if kind not in ("gaussian", "key"):
        raise ValueError(f"kind must be 'gaussian' or 'key', got {kind!r}")
    dt = canonical_dtype(dtype)
    g = torch.Generator().manual_seed(seed)
    shape = (num_pages, num_layers, 2, num_kv_heads, page_size, head_dim)
    x = torch.randn(shape, generator=g)
    if kind == "key":
        ch = (num_layers, 1, num_kv_heads, 1, head_dim)
        k_scale = torch.exp(0.7 * torch.randn(ch, generator=g))
        outlier = torch.rand(ch, generator=g) < 0.03
        k_scale = torch.where(outlier, k_scale * (10 + 20 * torch.rand(ch, generator=g)), k_scale)
        k_bias = 0.5 * k_scale * torch.randn(ch, generator=g)
        v_scale = torch.exp(0.3 * torch.randn(ch, generator=g))
        x[:, :, 0:1] = x[:, :, 0:1] * k_scale + k_bias
        x[:, :, 1:2] = x[:, :, 1:2] * v_scale
    return x.to(dt).to(device)
