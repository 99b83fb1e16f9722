"""Where the verify segment's attention differs from a float32 reference, by query head, token
and 8-dim group: o_proj is the identity, the residual zero, so ``h`` is the attention output
(bf16). For checking a variant's fragment and descriptor layouts on the GPU (e.g. the warpgroup
products, ``--variant 8:0:1``); prints the worst (head, token, dims) cells."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvstrata.kernels import verify_segment as vs  # noqa: E402
from kvstrata.kernels._cuda import variant  # noqa: E402
from kvstrata.kernels.attention import paged_attention  # noqa: E402
from kvstrata.kernels.attention_plan import plan_attention  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", default="8:0:1")
    ap.add_argument("--contexts", type=int, nargs="+", default=[16, 40, 1000])
    ap.add_argument("--queries", type=int, default=16)
    args = ap.parse_args()
    v = variant(args.variant, vs.VARIANT, "--variant")
    dev = torch.device("cuda")
    hq, hkv, t = 32, 8, args.queries
    g = torch.Generator().manual_seed(0)
    for ctx in args.contexts:
        pages = -(-ctx // 16) + 1
        kv = torch.randn(pages, 1, 2, hkv, 16, 128, generator=g).to(torch.bfloat16).to(dev)
        bt = torch.randperm(pages, generator=g)[None].to(torch.int32).to(dev)
        meta = plan_attention(bt, [ctx], [t], page_size=16, num_kv_heads=hkv)
        q = torch.randn(t, hq, 128, generator=g).to(torch.bfloat16).to(dev)
        w = torch.eye(hq * 128, dtype=torch.bfloat16, device=dev)
        res = torch.zeros(t, hq * 128, dtype=torch.bfloat16, device=dev)
        gam = torch.ones(hq * 128, dtype=torch.bfloat16, device=dev)
        _, h, _ = vs.verify_segment(q, kv, 0, meta, sm_scale=128 ** -0.5, weight=w,
                                    residual=res, norm_weight=gam, eps=1e-6, _variant=v)
        ref = paged_attention(q.float(), kv.float(), 0, meta, sm_scale=128 ** -0.5,
                              impl="torch").reshape(t, hq, 128)
        err = (h.float().view(t, hq, 128) - ref).abs()
        cell = err.view(t, hq, 16, 8).amax(-1)              # [token, head, dim group]
        print(f"ctx {ctx} variant {v}: max err {err.max().item():.3e} (bf16 step of |ref| max "
              f"{ref.abs().max().item():.2f}); bad cells (> 0.05) {(cell > 0.05).sum().item()} "
              f"of {cell.numel()}")
        print("  by token:", [round(x, 3) for x in cell.amax((1, 2)).tolist()])
        print("  by head:", [round(x, 3) for x in cell.amax((0, 2)).tolist()])
        print("  by dim group:", [round(x, 3) for x in cell.amax((0, 1)).tolist()])


if __name__ == "__main__":
    main()
