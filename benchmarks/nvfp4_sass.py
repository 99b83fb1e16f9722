"""Static SASS analysis of the NVFP4 Triton kernels for sm_90, compiled without a GPU.

    python benchmarks/nvfp4_sass.py                       # every encode / decode variant
    python benchmarks/nvfp4_sass.py --only encode --dump /tmp/sass   # also write the SASS
    python benchmarks/nvfp4_sass.py --module /tmp/old_nvfp4.py       # another version's kernels

Compiles each kernel variant for the Qwen3-8B-shaped pages of the GPU benchmark (36 layers, 8 KV
heads, page 16, head_dim 128: slabs of 128 x 128) with ``triton.compile`` for
``GPUTarget("cuda", 90, 32)``, disassembles the cubin with the ``cuobjdump`` bundled with Triton
and prints a markdown table: SASS instructions of the kernel (excluding out-of-line subroutines
such as the slow path of ``div.rn``), of its main loop when it has one (the bodies between a
backward branch and its target), per element (the program's instructions, or with loops the
loop bodies, over the elements each thread owns per program or per loop iteration), registers,
local-memory (spill) bytes and the global loads / stores by kind. Counts are static, and the local
Triton may differ from the GPU machine's: directional only.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the GPU's default; silences a warning

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
TARGET = GPUTarget("cuda", 90, 32)
L, H, P, D = 36, 8, 16, 128  # Qwen3-8B: layers, KV heads, page size, head_dim
S, R = 2 * L, H * P
_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def load_module(path: str | None):
    if path is None:
        from kvstrata.kernels import nvfp4_triton
        return nvfp4_triton
    # a module of the kvstrata.kernels package, so that its relative imports resolve
    import kvstrata.kernels.nvfp4  # noqa: F401
    spec = importlib.util.spec_from_file_location("kvstrata.kernels._nvfp4_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def compile_kernel(fn, ptr_types: dict[str, str], constexprs: dict, num_warps: int):
    """Compile ``fn`` for sm_90: pointers typed by ``ptr_types``, other runtime args i32, every
    runtime arg specialised as 16-divisible (as the launcher does for aligned tensors / sizes)."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        else:
            sig[name] = ptr_types.get(name, "i32")
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": num_warps})


def sass_of(cubin: bytes) -> tuple[str, str]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([str(CUOBJDUMP), "-sass", f.name], check=True,
                              capture_output=True, text=True).stdout
        res = subprocess.run([str(CUOBJDUMP), "-res-usage", f.name], check=True,
                             capture_output=True, text=True).stdout
    return sass, res


def analyse(sass: str, res: str, elems_per_program: int, threads: int) -> dict:
    insns = [(int(a, 16), op, args) for a, _, op, args in _INSN.findall(sass)]
    insns = [t for t in insns if t[1] != "NOP"]
    # out-of-line subroutines (CALL targets) follow the kernel's last EXIT
    calls = [int(m, 16) for _, op, args in insns if op.startswith("CALL")
             for m in re.findall(r"0x([0-9a-f]+)", args)[:1]]
    exits = [a for a, op, _ in insns if op == "EXIT"]
    end = min([c for c in calls if c > max(exits, default=0)], default=None)
    body = [t for t in insns if end is None or t[0] < end]
    while body and body[-1][1] == "BRA":  # the trailing self-loop after EXIT
        body.pop()
    loops = []  # instructions of each loop body (a backward branch back to its head)
    for addr, op, args in body:
        m = re.search(r"0x([0-9a-f]+)", args) if op.startswith("BRA") else None
        if m and int(m.group(1), 16) < addr:
            loops.append(sum(1 for a, _, _ in body if int(m.group(1), 16) <= a <= addr))
    mem = collections.Counter(op for _, op, _ in body if op.startswith(("LDG", "STG", "LDL",
                                                                        "STL", "LDS", "STS")))
    regs = re.search(r"REG:(\d+)", res)
    local = re.search(r"LOCAL:(\d+)", res)
    per_thread = elems_per_program / threads
    # with loops, every element passes through each loop body once per tile of a program
    return dict(total=len(body), loop="+".join(map(str, loops)),
                per_elem=(sum(loops) if loops else len(body)) / per_thread,
                regs=int(regs.group(1)) if regs else -1,
                local=int(local.group(1)) if local else -1, mem=dict(sorted(mem.items())),
                bar=sum(1 for _, op, _ in body if op.startswith("BAR")),
                hist=collections.Counter(op for _, op, _ in body))


def launch_knobs(mod, launch_class: str, launcher) -> set[str]:
    """The launch knobs a version of the module has: the fields of its launch dataclass, or
    (versions before those) the launcher's keyword arguments."""
    cls = getattr(mod, launch_class, None)
    if cls is not None:
        return {f.name for f in dataclasses.fields(cls)}
    return set(getattr(launcher, "__kwdefaults__", None) or {})


def encode_variants(mod) -> list[tuple[str, dict, int, int]]:
    """(label, constexprs, num_warps, elements per program) of each encode variant."""
    out = []
    knobs = launch_knobs(mod, "EncodeLaunch", mod.nvfp4_encode)
    has_asm = "asm" in knobs
    for asm in ((True, False) if has_asm else (None,)):
        for block_r, nw in ((None, 8), (None, 4), (None, 16), (32, 4), (32, 8)):
            if has_asm:
                cfg = mod._encode_config(torch.bfloat16, S, R, D, block_r, has_ids=False,
                                         words=True, asm=asm)
            else:  # the version before the variants (kernel signature of that commit)
                full = triton.next_power_of_2(R)
                br = full if block_r is None else block_r
                cfg = dict(S=S, D=D, BLOCK_R=br, NBP=D // 16, ONE_PASS=br >= R, HAS_IDS=False,
                           IS_BF16=True, WORDS=True)
            elems = (R if cfg["ONE_PASS"] else cfg["BLOCK_R"]) * D
            label = f"encode block_r={block_r or 'slab'} warps={nw}" + (
                "" if asm is None else f" asm={int(asm)}")
            out.append((label, cfg, nw, elems))
    if hasattr(mod, "_encode_lanes_config"):  # a thread per half block
        for nw in (2, 4, 8):
            cfg = mod._encode_lanes_config(torch.bfloat16, S, R, D, has_ids=False, words=True,
                                           asm=True)
            out.append((f"encode lanes warps={nw} asm=1", cfg, nw, R * D))
    if has_asm and "persistent" in knobs:  # grid-stride slab loop
        for nw, st in ((4, 1), (8, 1), (4, 2), (8, 2)):
            cfg = mod._encode_config(torch.bfloat16, S, R, D, None, has_ids=False, words=True,
                                     asm=True, persistent=4, stages=st)
            out.append((f"encode block_r=slab warps={nw} asm=1 persistent stages={st}", cfg, nw,
                        R * D))
    return out


def decode_variants(mod) -> list[tuple[str, dict, int, int]]:
    out = []
    has_wpt = "words_per_thread" in launch_knobs(mod, "DecodeLaunch", mod.nvfp4_decode)
    grid = ([(br, nw, wpt, flat) for flat in (False, True) for wpt in (1, 2, 4)
             for br, nw in ((8, 2), (16, 2), (32, 4), (64, 4), (32, 8))] if has_wpt
            else [(br, nw, 1, False) for br, nw in ((8, 2), (16, 2), (32, 4), (64, 4))])
    for br, nw, wpt, flat in grid:
        if has_wpt:
            cfg, _ = mod._decode_config(S, R, D, br, wpt, flat, has_ids=False, out_kind=0,
                                        words=True)
        else:
            cfg = dict(S=S, D=D, BLOCK_R=br, NWP=D // 8, HAS_IDS=False, OUT_KIND=0, WORDS=True)
        label = f"decode block_r={br} warps={nw}" + (f" wpt={wpt} flat={int(flat)}"
                                                     if has_wpt else "")
        out.append((label, cfg, nw, br * D))
    if hasattr(mod, "_decode_lanes_config"):  # lanes: a thread decodes the words it loaded
        for br, nw, pers, st in ((8, 1, 0, 2), (16, 2, 0, 2), (32, 4, 0, 2), (64, 8, 0, 2),
                                 (16, 2, 4, 1), (16, 2, 4, 2), (32, 4, 4, 3)):
            cfg, _ = mod._decode_lanes_config(S, R, D, br, has_ids=False, out_kind=0,
                                              words=True, persistent=pers, stages=st)
            label = f"decode lanes block_r={br} warps={nw}" + (
                f" persistent={pers} stages={st}" if pers else "")
            out.append((label, cfg, nw, br * D))
    return out


ENC_PTRS = dict(x_ptr="*i32", ids_ptr="*i64", out_ptr="*u8", outw_ptr="*i64", bad_ptr="*i32",
                rtab_ptr="*fp32")
DEC_PTRS = dict(in_ptr="*u8", inw_ptr="*i32", ids_ptr="*i64", out_ptr="*bf16")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--module", help="another kvstrata/kernels/nvfp4_triton.py (or, before the "
                    "split, nvfp4.py) to analyse")
    ap.add_argument("--only", choices=("encode", "decode"))
    ap.add_argument("--dump", help="write each variant's SASS into this folder")
    ap.add_argument("--hist", type=int, default=0, help="print the N most frequent opcodes")
    args = ap.parse_args()
    mod = load_module(args.module)
    jobs = []
    if args.only != "decode":
        jobs += [(lbl, mod._nvfp4_encode_lanes_kernel, dict(ENC_PTRS, outw_ptr="*i32"), cfg,
                  nw, el) if "lanes" in lbl else (lbl, mod._nvfp4_encode_kernel, ENC_PTRS, cfg,
                                                  nw, el)
                 for lbl, cfg, nw, el in encode_variants(mod)]
    if args.only != "encode":
        jobs += [(lbl, mod._nvfp4_decode_lanes_kernel if "lanes" in lbl
                  else mod._nvfp4_decode_kernel, DEC_PTRS, cfg, nw, el)
                 for lbl, cfg, nw, el in decode_variants(mod)]
    print(f"Triton {triton.__version__}, sm_90, bf16 pages [{L}, 2, {H}, {P}, {D}]\n")
    print("| variant | SASS | loop | SASS/elem | regs | spill B | smem B | BAR | global loads / stores |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, fn, ptrs, cfg, nw, elems in jobs:
        try:
            k = compile_kernel(fn, ptrs, cfg, nw)
        except Exception as e:  # a variant that does not compile is reported, not fatal
            print(f"| {label} | compile error: {str(e).splitlines()[0][:80]} |||||")
            continue
        sass, res = sass_of(k.asm["cubin"])
        a = analyse(sass, res, elems, 32 * nw)
        mem = ", ".join(f"{n}x{op}" for op, n in a["mem"].items() if op[:3] in ("LDG", "STG"))
        spill = a["local"] + sum(n for op, n in a["mem"].items() if op[:3] in ("LDL", "STL"))
        print(f"| {label} | {a['total']} | {a['loop'] or '-'} | {a['per_elem']:.1f} | "
              f"{a['regs']} | {spill} | {k.metadata.shared} | {a['bar']} | {mem} |")
        if args.hist:
            print("|  | " + ", ".join(f"{op} {n}" for op, n in a["hist"].most_common(args.hist))
                  + " ||||||")
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            name = re.sub(r"[^a-z0-9]+", "_", label.lower()).strip("_")
            Path(args.dump, name + ".sass").write_text(sass)
            Path(args.dump, name + ".ptx").write_text(k.asm["ptx"])


if __name__ == "__main__":
    main()
