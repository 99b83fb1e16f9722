"""A prototype batch-1 decode attention over the page pool through Hopper bulk tensor copies
(TMA), for ``decode_attn_study.py``. The library's page-copy kernel
(``kvstrata.kernels.attention_triton._paged_attention_tma_kernel``) grew out of it; this one
stays to reproduce the thirteenth runner session's figures (docs/benchmarks.md), which it
measured.

One program per (KV head, split), as the shipped kernel's runner grid. Each step loads one page
of K and one of V (``[16, d]`` boxes of a 2-D tensor descriptor over the whole pool) into a
ring of ``STAGES`` shared-memory stages, then runs the online-softmax update on a ``[16, 16]``
score tile. It leaves out what the library kernel must have: masks for a partial last page,
sliding windows, query rows beyond the GQA group (rows 4..15 repeat heads 0..3), the fused
split merge (``merge`` below does it in torch), PDL. So its times bound what such a kernel
could gain, they are not one.

    TRITON_INTERPRET=1 python benchmarks/_tma_decode_proto.py   # checks it against torch
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

_LOG2E = 1.4426950408889634


@triton.jit
def _tma_decode_kernel(desc, bt_ptr, tps_ptr, q_ptr, po_ptr, pl_ptr, layer, seq_len, qk_scale,
                       L: tl.constexpr, H: tl.constexpr, STAGES: tl.constexpr,
                       UPCAST: tl.constexpr, QT: tl.constexpr, ROWS: tl.constexpr):
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    tps = tl.load(tps_ptr)
    lo = split * tps
    hi = tl.minimum(lo + tps, seq_len)
    rows = tl.arange(0, ROWS)
    d = tl.arange(0, 128)
    tok = (rows // 4) % QT     # row r: query token r // 4, head 4 kvh + r % 4 (padding repeats)
    q = tl.load(q_ptr + (tok * 4 * H + kvh * 4 + rows % 4)[:, None] * 128 + d[None, :])
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, 128], tl.float32)
    for start in tl.range(lo, hi, 16, num_stages=STAGES):
        page = tl.load(bt_ptr + start // 16)
        base = (((page * L + layer) * 2) * H + kvh) * 16   # pool row of (page, layer, K, head)
        k = desc.load([base, 0])
        v = desc.load([base + H * 16, 0])
        if UPCAST:   # the CPU interpreter multiplies bf16 tiles wrongly
            s = tl.dot(q.to(tl.float32), tl.trans(k).to(tl.float32)) * qk_scale
        else:
            s = tl.dot(q, tl.trans(k)) * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if UPCAST:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32))
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    o = acc / l_i[:, None]
    pid = kvh * tl.num_programs(2) + split
    ok = rows < 4 * QT
    tl.store(po_ptr + (pid * 4 * QT + rows)[:, None] * 128 + d[None, :], o, mask=ok[:, None])
    tl.store(pl_ptr + pid * 4 * QT + rows, m_i + tl.log2(l_i), mask=ok)


def tma_decode(kv: torch.Tensor, bt: torch.Tensor, tps_dev: torch.Tensor, q: torch.Tensor,
               layer: int, seq_len: int, splits: int, stages: int = 8,
               sm_scale: float = 0.088) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-split partial outputs ``[H * splits, 4 QT, d]`` and log2-sum-exps ``[H * splits,
    4 QT]`` (row ``4 t + g``: query token ``t``, head ``4 kvh + g``) of one sequence's ``QT``
    query tokens (``q`` ``[QT, 4 H, 128]``, GQA 4; every one sees every key: no causal mask)
    over ``kv`` ``[pages, L, 2, H, 16, 128]`` (``bt``: its page ids; ``tps_dev``: the split
    length on the device)."""
    P, L, _, H, PS, D = kv.shape
    QT = q.shape[0]
    assert PS == 16 and D == 128 and q.shape[1] == 4 * H and QT in (1, 16)
    desc = TensorDescriptor(kv.view(-1, D), [P * L * 2 * H * PS, D], [D, 1], [16, D])
    po = torch.empty((H * splits, 4 * QT, D), dtype=torch.float32, device=kv.device)
    pl = torch.empty((H * splits, 4 * QT), dtype=torch.float32, device=kv.device)
    _tma_decode_kernel[(1, H, splits)](desc, bt, tps_dev, q, po, pl, layer, seq_len,
                                       sm_scale * _LOG2E, L=L, H=H, STAGES=stages,
                                       UPCAST=kv.device.type != "cuda", QT=QT,
                                       ROWS=max(16, 4 * QT), num_warps=4)
    return po, pl


def merge(po: torch.Tensor, pl: torch.Tensor, H: int, splits: int) -> torch.Tensor:
    """The splits' partials merged (torch): ``[H, 4 QT, d]``."""
    po = po.view(H, splits, po.shape[1], -1)
    pl = pl.view(H, splits, pl.shape[1])
    w = torch.exp2(pl - pl.max(1, keepdim=True).values)
    return (po * w[..., None]).sum(1) / w.sum(1)[..., None]


def _self_check(qt: int) -> float:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ctx, L, H, splits = 512, 3, 8, 4
    g = torch.Generator().manual_seed(0)
    kv = torch.randn((ctx // 16, L, 2, H, 16, 128), generator=g).to(dev, torch.bfloat16)
    bt = torch.randperm(ctx // 16, generator=g).to(dev, torch.int32)
    q = torch.randn((qt, 4 * H, 128), generator=g).to(dev, torch.bfloat16)
    po, pl = tma_decode(kv, bt, torch.tensor([ctx // splits], device=dev), q, 1, ctx, splits)
    out = merge(po, pl, H, splits)                               # [H, 4 qt, d]
    k = kv[bt.long(), 1, 0].permute(1, 0, 2, 3).reshape(H, ctx, 128).float()
    v = kv[bt.long(), 1, 1].permute(1, 0, 2, 3).reshape(H, ctx, 128).float()
    qh = q.float().view(qt, H, 4, 128).permute(1, 0, 2, 3).reshape(H, 4 * qt, 128)
    ref = torch.softmax(qh @ k.transpose(1, 2) * 0.088, -1) @ v
    return (out - ref).abs().max().item()


if __name__ == "__main__":
    for qt in (1, 16):
        print(f"{qt} query tokens: max abs diff against torch: {_self_check(qt):.1e}")
