"""Building blocks of Qwen3-style decoders, shared by the target model, the DFlash drafter and the
training code.

All modules take packed token-major tensors (``[T, ...]``, no batch dim): a step's tokens of every
sequence are concatenated, as the paged-attention kernels expect. Parameter names follow the
Hugging Face Qwen3 checkpoints (``q_proj``, ``q_norm``, ``gate_proj`` ...), so a state dict loads
with no renaming.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn


#: ``F.linear``'s signature: ``(x, weight, bias) -> x @ weight.T + bias``. The modules below take
#: one as ``product`` (default ``F.linear``) so a model can run its products on a kernel of its
#: choice (the target and drafter pass ``kvstrata.kernels.gemv.gemv``) without this layer
#: importing kernels.
Product = Callable[[Tensor, Tensor, Optional[Tensor]], Tensor]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim, computed in float32 and cast back to ``x.dtype`` before the
    weight multiply (the Hugging Face order, so outputs match bit-for-bit in fp32).

    x: ``[..., dim]``; weight: ``[dim]``. Returns ``x``'s shape, ``weight``'s dtype promotion.
    """
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


class RMSNorm(nn.Module):
    """``y = weight * x / sqrt(mean(x^2) + eps)``; x: ``[..., dim]``."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | str | None = None
                  ) -> Tensor:
    """Default RoPE inverse frequencies ``[head_dim // 2]`` float32 (the Hugging Face formula)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64,
                                         device=device).float() / head_dim))


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype
                 ) -> tuple[Tensor, Tensor]:
    """Default-RoPE cos/sin ``[..., head_dim]`` for positions ``[...]`` (int64), built in float32
    on the positions' device and cast to ``dtype`` (the activation dtype).

    The functional form of :class:`RotaryEmbedding` (no scaling), for callers without a module.
    """
    return rope_cos_sin_rows(positions, rope_inv_freq(head_dim, theta, positions.device), 1.0,
                             dtype)


def rope_cos_sin_rows(positions: Tensor, inv_freq: Tensor, scaling: float = 1.0,
                      dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """RoPE cos/sin ``[..., 2 * len(inv_freq)]`` (rotate-half layout: the frequencies twice)
    of positions ``[...]`` (int64): ``cos(p * inv_freq)`` in float32 (``inv_freq`` upcast),
    times ``scaling`` (not multiplied when 1: the same values), cast to ``dtype``. The one
    formula of :func:`rope_cos_sin` and :meth:`RotaryEmbedding.cos_sin`;
    ``kernels.layer_ops.rope_cos_sin_rows`` is its one-launch CUDA form."""
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
    return cos.to(dtype), sin.to(dtype)


def _inv_freq(head_dim: int, theta: float, scaling: Mapping | None) -> tuple[Tensor, float]:
    """Inverse frequencies ``[head_dim // 2]`` float32 and the cos/sin amplitude factor."""
    inv = rope_inv_freq(head_dim, theta)
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return inv, 1.0
    if kind == "linear":
        return inv / float(scaling["factor"]), 1.0
    raise ValueError(f"rope_scaling type {kind!r} is not supported; kvstrata supports "
                     "'default' and 'linear'")


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half convention of Hugging Face Llama/Qwen).

    ``cos_sin(positions)``: positions ``[T]`` int64 -> ``(cos, sin)``, each ``[T, head_dim]``
    float32. Pass them to :func:`apply_rotary`, once per step for every layer.
    """

    def __init__(self, head_dim: int, theta: float = 1e6, scaling: Mapping | None = None):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        inv, self.attention_scaling = _inv_freq(head_dim, theta, scaling)
        self.register_buffer("inv_freq", inv, persistent=False)

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        return rope_cos_sin_rows(positions, self.inv_freq, self.attention_scaling)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x: [T, heads, head_dim]`` by ``cos, sin: [T, head_dim]``; returns x's dtype."""
    c = cos.to(x.dtype)[:, None, :]
    s = sin.to(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * c + rot * s


class MergedLinear:
    """Linears that read one input, as one matrix product: their weights (and biases) are
    concatenated along the output dim into one tensor, and each linear's parameters are rebound
    as views of its rows, so the weights exist once in memory and the modules' names, state
    dicts and fingerprints stay those of the separate linears.

    ``merged(x)`` is ``torch.cat([l(x) for l in linears], -1)`` in one GEMM while the views hold;
    once a parameter was replaced (``model.to(...)``, ``load_state_dict(assign=True)``,
    training) it falls back to the separate products, concatenated: same values, never stale.
    """

    __slots__ = ("linears", "weight", "bias")

    def __init__(self, linears: Sequence[nn.Linear]):
        self.linears = tuple(linears)
        if not self.linears or len({l.in_features for l in self.linears}) != 1:
            raise ValueError("MergedLinear needs linears of one input width")
        if len({l.bias is None for l in self.linears}) != 1:
            raise ValueError("MergedLinear needs all linears with a bias or none")
        with torch.no_grad():
            self.weight = torch.cat([l.weight.detach() for l in self.linears], 0)
            self.bias = (None if self.linears[0].bias is None else
                         torch.cat([l.bias.detach() for l in self.linears], 0))
        at = 0
        for l in self.linears:
            n = l.out_features
            grad = l.weight.requires_grad
            l.weight = nn.Parameter(self.weight[at:at + n], requires_grad=grad)
            if self.bias is not None:
                l.bias = nn.Parameter(self.bias[at:at + n], requires_grad=grad)
            at += n

    def holds(self) -> bool:
        """Whether every linear's parameters are still views of the merged tensors."""
        w, b = self.weight, self.bias
        row = w.shape[1] * w.element_size()
        at = 0
        for l in self.linears:
            if (l.weight.data_ptr() != w.data_ptr() + at * row or l.weight.dtype != w.dtype
                    or l.weight.device != w.device):
                return False
            if b is not None and l.bias.data_ptr() != b.data_ptr() + at * b.element_size():
                return False
            at += l.out_features
        return True

    def __call__(self, x: Tensor, first: int = 0, product: Product = F.linear) -> Tensor:
        """``cat([l(x) for l in linears[first:]], -1)``; the linears from ``first`` on are
        adjacent rows of the merged weight, so this is one product too."""
        if self.holds():
            at = sum(l.out_features for l in self.linears[:first])
            return product(x, self.weight[at:], None if self.bias is None else self.bias[at:])
        return torch.cat([product(x, l.weight, l.bias) for l in self.linears[first:]], -1)


def merged(linears: Sequence[nn.Linear], current: MergedLinear | None) -> MergedLinear:
    """``current`` while its views hold, else a new :class:`MergedLinear` of ``linears``."""
    return current if current is not None and current.holds() else MergedLinear(linears)


class SwiGLUMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``; x: ``[T, hidden]`` -> ``[T, hidden]``.

    :meth:`merge` (once, after loading) makes gate and up one ``[2 * inter, hidden]`` matrix:
    :meth:`gate_up` is then one product.
    """

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self._gate_up: MergedLinear | None = None

    def merge(self) -> None:
        """Gate and up as one matrix (views; idempotent)."""
        self._gate_up = merged((self.gate_proj, self.up_proj), self._gate_up)

    def gate_up(self, x: Tensor, product: Product = F.linear) -> Tensor:
        """``cat(gate_proj(x), up_proj(x), -1)``: ``[T, 2 * inter]``, one product when merged."""
        if self._gate_up is None:
            return torch.cat([product(x, l.weight, l.bias)
                              for l in (self.gate_proj, self.up_proj)], -1)
        return self._gate_up(x, product=product)

    def gate_up_weight(self) -> tuple[Tensor, Tensor | None]:
        """``(weight [2 * inter, hidden], bias or None)`` of :meth:`gate_up`: the merged
        tensors while merged, else a concatenated copy."""
        if self._gate_up is not None and self._gate_up.holds():
            return self._gate_up.weight, self._gate_up.bias
        return torch.cat([self.gate_proj.weight, self.up_proj.weight]), None   # no biases

    def forward(self, x: Tensor) -> Tensor:
        gu = self.gate_up(x)
        n = self.gate_proj.out_features
        return self.down_proj(F.silu(gu[..., :n]) * gu[..., n:])


class AttentionProjections(nn.Module):
    """Qwen3 attention projections with per-head q/k RMSNorm (no attention math inside).

    - ``project_q(x, cos, sin)``: x ``[T, hidden]`` -> q ``[T, num_heads, head_dim]`` (q_norm, RoPE)
    - ``project_kv(x, cos, sin)``: x ``[T, hidden_kv_in]`` -> k, v ``[T, num_kv_heads, head_dim]``
      (k_norm and RoPE on k only)
    - ``project_out(o)``: o ``[T, num_heads, head_dim]`` -> ``[T, hidden]``

    ``kv_input_size`` lets a drafter project K/V from a different width than the queries.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 eps: float = 1e-6, bias: bool = False, kv_input_size: int | None = None):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of "
                             f"num_key_value_heads={num_kv_heads}")
        kv_in = hidden_size if kv_input_size is None else kv_input_size
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(kv_in, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(kv_in, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)
        self._qkv: MergedLinear | None = None

    def merge(self) -> None:
        """q, k and v projections as one ``[(Hq + 2 Hkv) * D, hidden]`` matrix (views;
        idempotent). Only when all three read one width (no ``kv_input_size``)."""
        if self.q_proj.in_features == self.k_proj.in_features:
            self._qkv = merged((self.q_proj, self.k_proj, self.v_proj), self._qkv)

    def qkv(self, x: Tensor, with_q: bool = True, product: Product = F.linear) -> Tensor:
        """``cat(q_proj(x), k_proj(x), v_proj(x), -1)``: ``[T, (Hq + 2 Hkv) * D]`` (k and v
        only unless ``with_q``), one product when merged (k, v are adjacent rows)."""
        if self._qkv is None:
            lins = ((self.q_proj,) if with_q else ()) + (self.k_proj, self.v_proj)
            return torch.cat([product(x, l.weight, l.bias) for l in lins], -1)
        return self._qkv(x, first=0 if with_q else 1, product=product)

    def project_q(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        q = self.q_norm(self.q_proj(x).view(x.shape[0], self.num_heads, self.head_dim))
        return apply_rotary(q, cos, sin)

    def project_kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        t = x.shape[0]
        k = self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        return apply_rotary(k, cos, sin), v

    def project_out(self, o: Tensor, product: Product = F.linear) -> Tensor:
        return product(o.reshape(o.shape[0], self.num_heads * self.head_dim), self.o_proj.weight,
                       self.o_proj.bias)


def merge_layer_weights(layers: Sequence[nn.Module]) -> None:
    """Per decoder layer (``self_attn`` + ``mlp``), q/k/v as one matrix and gate/up as one: the
    parameters become views of them (one copy in memory; the same names, state dict and
    fingerprint). Idempotent; call it again after replacing parameters (``.to(...)``). Until
    then, or when the views broke, each forward takes separate products of the same values."""
    with torch.no_grad():
        for layer in layers:
            layer.self_attn.merge()
            layer.mlp.merge()


__all__ = ["AttentionProjections", "MergedLinear", "Product", "RMSNorm", "RotaryEmbedding",
           "SwiGLUMLP", "apply_rotary", "merge_layer_weights", "merged", "rms_norm",
           "rope_cos_sin", "rope_cos_sin_rows", "rope_inv_freq"]
