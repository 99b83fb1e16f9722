"""NVFP4 GPU diagnosis: Triton-on-GPU against the torch reference run on CPU copies.

    python benchmarks/nvfp4_debug.py [--old OLD_MODULE.py]

Prints, per dtype and data kind, whether the encoded bytes (split into slab scales, codes and
block scales) and the decoded values agree, and how the reference itself differs between CUDA and
CPU. ``--old`` loads another version of ``kvstrata/kernels/nvfp4.py`` (e.g. from ``git show``)
and runs the same comparison on it, to say what was wrong before a fix.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import types

import torch

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def pages(shape, dtype, seed, kind):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if kind == "wide":
        x = x * torch.exp2(torch.randint(-20, 12, shape, generator=g).float())
    elif kind == "outlier":
        x[..., 0, :, :] *= 3000.0
    x[0, 0, 1, 1, 2, 16:32] = 0  # a zero block
    x[-1, -1, 0] = 0  # a zero slab
    return x.to(dtype)


def sections(a, b, mod, shape):
    _, _, h, p, d = shape[1:]
    _, oc, os_, _ = mod.nvfp4_layout(2 * shape[1], h * p, d)
    diff = a != b
    return {"gscale": int(diff[:, :oc].sum()), "codes": int(diff[:, oc:os_].sum()),
            "scales": int(diff[:, os_:].sum())}


def compare(mod, label, shape=(8, 4, 2, 8, 16, 128)):
    bad = 0
    for dtype in DTYPES:
        for kind in ("gauss", "wide", "outlier"):
            x = pages(shape, dtype, DTYPES.index(dtype), kind)
            ref, _ = mod.nvfp4_encode_ref(x)
            ref_cuda, _ = mod.nvfp4_encode_ref(x.cuda())
            got, _ = mod.nvfp4_encode(x.cuda())
            o_ref = mod.nvfp4_decode_ref(ref, torch.empty_like(x))
            o_got = mod.nvfp4_decode(ref.cuda(), torch.empty_like(x.cuda())).cpu()
            o_rc = mod.nvfp4_decode_ref(ref.cuda(), torch.empty_like(x.cuda())).cpu()
            dec = int((o_ref.view(torch.uint8) != o_got.view(torch.uint8)).sum())
            dec_rc = int((o_ref.view(torch.uint8) != o_rc.view(torch.uint8)).sum())
            tri = sections(got.cpu(), ref, mod, shape)
            rc = sections(ref_cuda.cpu(), ref, mod, shape)
            bad += sum(tri.values()) + dec
            print(f"{label} {str(dtype)[6:]:9s} {kind:8s} triton-GPU vs ref-CPU: bytes {tri} "
                  f"decoded bytes {dec} | ref-CUDA vs ref-CPU: bytes {rc} decoded {dec_rc}")
    return bad


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", help="an older kvstrata/kernels/nvfp4.py to diagnose as well")
    args = ap.parse_args()
    # torch on CUDA divides by a Python scalar as a multiply by its reciprocal:
    a = torch.rand(1 << 20) * 100
    ac = a.cuda()
    print("t / 2688.0: CUDA vs CPU differ in", int(((ac / 2688.0).cpu() != a / 2688.0).sum()),
          "of", a.numel(), "; t / tensor(2688.0):",
          int(((ac / torch.full_like(ac, 2688.0)).cpu() != a / 2688.0).sum()))
    if args.old:
        compare(load(args.old, "nvfp4_old"), "old")
    from kvstrata.kernels import nvfp4, nvfp4_triton
    bad = compare(types.SimpleNamespace(**{**vars(nvfp4), **vars(nvfp4_triton)}), "new")
    print("new kernels bit-exact vs CPU reference:", bad == 0)


if __name__ == "__main__":
    main()
