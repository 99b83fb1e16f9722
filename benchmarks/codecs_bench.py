"""Codec benchmark: NVFP4 encode/decode bandwidth on the GPU, lossless ratio and speed per CPU core.

    python benchmarks/codecs_bench.py --device cuda --out /tmp/out.md   # H200, ~2 min
    python benchmarks/codecs_bench.py --device cpu --out /tmp/codecs_cpu.md          # smoke + CPU
    python benchmarks/codecs_bench.py --device cuda --nvfp4-sweep     # every kernel knob, ~2 min
    TRITON_INTERPRET=1 python benchmarks/codecs_bench.py --device cpu --nvfp4-sweep --tiny  # smoke

GPU part: ~1 GiB of bf16 pages shaped like Qwen3-8B's target group (36 layers, 8 KV heads,
head_dim 128, page 16). Every NVFP4 kernel config of a small sweep is timed with CUDA events
(median of ``--repeat`` runs; the 1 GiB working set is ~20x the L2, so every run reads HBM) and
reported as GB/s of bytes read + written and as a fraction of a device-to-device copy of the same
pages measured in the same run. The Triton output is checked bit for bit against the torch
reference on a slice of the pages. On ``--device cpu`` the same code runs at tiny sizes with the
torch reference (and the Triton kernels too when ``TRITON_INTERPRET=1``): a smoke test only.

CPU part (both devices): the lossless codec on one thread (``torch.set_num_threads(1)``) over bf16
pages, Gaussian and key-like (per-channel scales, outlier channels), per zstd setting: ratio,
compress and decompress GB/s of raw page bytes (checksums included), best of 5, per second
of wall time and per second of the thread's CPU time (robust on a shared machine).
"""

from __future__ import annotations

import argparse
import os
import platform

import torch
import triton

from kvstrata.codecs import CompressionReport, compression_report, synthetic_kv
from kvstrata.kernels.nvfp4 import nvfp4_decode_ref, nvfp4_encode_ref, nvfp4_layout
# the variants' launchers: the library always launches the default (benchmarked here against the
# others)
from kvstrata.kernels.nvfp4_triton import (DecodeLaunch, EncodeLaunch, _launch_decode,
                                           _launch_encode, nvfp4_decode, nvfp4_encode)

from _timing import median_ms  # benchmarks/ is on sys.path when a script here runs
from _report import emit

GIB = 1 << 30


def nvfp4_section(device: torch.device, target_bytes: int, repeat: int) -> list[str]:
    cuda = device.type == "cuda"
    if cuda:
        L, H, P, D = 36, 8, 16, 128
    else:
        L, H, P, D = 2, 2, 16, 64
    page_bytes = L * 2 * H * P * D * 2
    n = max(2, target_bytes // page_bytes)
    # Content does not change the kernels' memory traffic: Gaussian pages made on the device.
    gen = torch.Generator(device=device).manual_seed(0)
    pages = torch.randn(n, L, 2, H, P, D, device=device, generator=gen).to(torch.bfloat16)
    enc_bytes = nvfp4_layout(2 * L, H * P, D)[3]
    raw, packed = n * page_bytes, n * enc_bytes
    use_triton = cuda or os.environ.get("TRITON_INTERPRET") == "1"

    dst = torch.empty_like(pages)
    copy_ms = median_ms(lambda: dst.copy_(pages), device, repeat, device_only=cuda)
    ceiling = 2 * raw / copy_ms / 1e6  # GB/s, read + write

    rows = []

    def row(op, impl, cfg, ms, nbytes):
        gbps = nbytes / ms / 1e6
        rows.append(f"| {op} | {impl} | {cfg} | {ms:.3f} | {gbps:.3g} | {100 * gbps / ceiling:.3g}% |")

    row("d2d copy (ceiling)", "torch", "-", copy_ms, 2 * raw)
    best = {}
    if use_triton:
        # (label, kwargs): the defaults first; `lanes` = a thread per half block (encode) or
        # per code word (decode), `block/thread` = the encoder with a thread per whole block
        enc_sweep = ([("default: lanes, 4 warps", {}), ("lanes, 8 warps", dict(num_warps=8)),
                      ("lanes, 2 warps", dict(num_warps=2)),
                      ("block/thread, slab, 4 warps", dict(lanes=False)),
                      ("block/thread, slab, 8 warps", dict(lanes=False, num_warps=8)),
                      ("block/thread, block_r=32, 4 warps", dict(block_r=32))] if cuda
                     else [("default", {})])
        dec_sweep = ([("default: lanes, block_r=16, 2 warps", {})]
                     + [(f"lanes, block_r={br}, {nw} warps", dict(block_r=br, num_warps=nw))
                        for br, nw in ((8, 1), (8, 2), (32, 4), (64, 4), (64, 8))] if cuda
                     else [("default", {})])
        out = torch.empty_like(pages)
        payload, _ = nvfp4_encode(pages)
        for op, sweep in (("encode", enc_sweep), ("decode", dec_sweep)):
            for cfg, kw in sweep:
                ms = median_ms(_variant(op, kw, pages, payload, out), device, repeat,
                               device_only=cuda)
                row(op, "triton", cfg, ms, raw + packed)
                if op not in best or ms < best[op][1]:
                    best[op] = (cfg, ms)
        # the same defaults timed with the launch work (an idle GPU waits for the host)
        ms = median_ms(lambda: nvfp4_encode(pages), device, repeat)
        row("encode incl. launch", "triton", "default", ms, raw + packed)
        ms = median_ms(lambda: nvfp4_decode(payload, out), device, repeat)
        row("decode incl. launch", "triton", "default", ms, raw + packed)
        # the tiers' path: encode half the pages of a pool in place (page_ids, no gather)
        ids = torch.randperm(n, device=device)[: n // 2]
        ms = median_ms(lambda: nvfp4_encode(pages, ids), device, repeat, device_only=cuda)
        row("encode pool[page_ids] (n/2)", "triton", "default", ms,
            (raw + packed) // n * ids.numel())
        # the oracle is the reference run on CPU copies (torch's CUDA kernels are not the spec)
        k = min(n, 8)
        host = pages[:k].cpu()
        ref_payload, _ = nvfp4_encode_ref(host)
        same_enc = torch.equal(payload[:k].cpu(), ref_payload)
        o1 = nvfp4_decode_ref(ref_payload, torch.empty_like(host))
        o2 = nvfp4_decode(ref_payload.to(device), torch.empty_like(pages[:k])).cpu()
        exact = same_enc and torch.equal(o1.view(torch.int16), o2.view(torch.int16))
    else:
        exact = None
    ref_n = min(n, 64)
    ms = median_ms(lambda: nvfp4_encode_ref(pages[:ref_n]), device, max(3, repeat // 4))
    row(f"encode ({ref_n} pages)", "torch reference", "-", ms,
        (raw + packed) // n * ref_n)
    pl_ref, _ = nvfp4_encode_ref(pages[:ref_n])
    ms = median_ms(lambda: nvfp4_decode_ref(pl_ref, dst[:ref_n]), device, max(3, repeat // 4))
    row(f"decode ({ref_n} pages)", "torch reference", "-", ms, (raw + packed) // n * ref_n)

    dev_name = torch.cuda.get_device_name(device) if cuda else platform.processor() or "CPU"
    lines = [
        "### NVFP4 encode / decode bandwidth",
        "",
        f"Conditions: {dev_name}; torch {torch.__version__}; bf16 pages of shape "
        f"[{L}, 2, {H}, {P}, {D}] (layers, K/V, KV heads, page size, head_dim); {n} pages = "
        f"{raw / GIB:.3f} GiB raw, {packed / GIB:.3f} GiB encoded (ratio {raw / packed:.3f}); one "
        f"launch for all pages; median of {repeat} runs "
        f"({'CUDA events, device time: a GPU-side sleep queued before each run hides the host launch work' if cuda else 'perf_counter'}); GB/s counts bytes read + written once; "
        f"ceiling = device-to-device copy of the same pages in the same run "
        f"({ceiling:.0f} GB/s).",
        f"Triton vs torch reference (run on CPU copies), first {min(n, 8)} pages, encoded bytes "
        f"and decoded values: "
        f"{'bit-exact' if exact else ('DIFFER' if exact is False else 'not run (no Triton)')}.",
        *[f"Best {op}: {cfg}, {raw_plus / ms / 1e6:.0f} GB/s = "
          f"{100 * raw_plus / ms / 1e6 / ceiling:.1f}% of the copy ceiling."
          for op, (cfg, ms) in best.items() for raw_plus in [raw + packed]],
        "",
        "| op | implementation | config | ms | GB/s | % of copy |",
        "|---|---|---|---|---|---|",
        *rows,
    ]
    return lines


def _variant(op: str, kw: dict, pages: torch.Tensor, payload: torch.Tensor, out: torch.Tensor):
    """One encode / decode launch variant (``kw``: its :class:`EncodeLaunch` /
    :class:`DecodeLaunch` fields) as a callable; the library always launches the defaults."""
    if op == "encode":
        enc = EncodeLaunch(**kw)
        return lambda: _launch_encode(pages, None, enc)
    dec = DecodeLaunch(**kw)
    return lambda: _launch_decode(payload, out, None, dec)


def _sweep_grids(cuda: bool) -> tuple[list[dict], list[dict]]:
    """Encode / decode knob combinations of ``--nvfp4-sweep`` (the first of each: the defaults)."""
    if not cuda:  # interpreter smoke test: a few small tiles
        return ([{}, dict(block_r=16, num_warps=2, asm=False),
                 dict(block_r=None, num_warps=2, persistent=1, stages=2)],
                [{}, dict(block_r=16, num_warps=1, words_per_thread=1, lanes=False),
                 dict(block_r=8, num_warps=1, words_per_thread=2, flat=True, lanes=False),
                 dict(block_r=8, num_warps=1, persistent=1, stages=2)])
    # dropped after the first H200 run: row tiles 64 / 4 warps, words_per_thread 4 and most
    # 4-8 warp / words_per_thread 2 tilings of the old decode (28-54% of the copy ceiling); one
    # representative of each stays
    enc = [{}, dict(num_warps=8), dict(num_warps=2), dict(asm=False), dict(maxnreg=96)]
    enc += [dict(lanes=False, block_r=br, num_warps=nw, asm=asm) for asm in (True, False)
            for br, nw in ((None, 8), (None, 4), (32, 4))]
    enc += [dict(block_r=None, num_warps=nw, persistent=p, stages=st)
            for nw, p, st in ((4, 2, 1), (4, 4, 2), (8, 2, 2))]
    dec = [{}] + [dict(block_r=br, num_warps=nw, lanes=False) for br, nw in ((16, 2), (32, 4))]
    dec += [dict(block_r=br, num_warps=nw) for br, nw in ((8, 1), (8, 2), (32, 4), (64, 8))]
    dec += [dict(block_r=br, num_warps=nw, persistent=p, stages=st)
            for br, nw, p, st in ((16, 2, 8, 2), (32, 4, 4, 2))]
    return enc, dec


def nvfp4_sweep(device: torch.device, target_bytes: int, repeat: int) -> list[str]:
    """Every encode / decode knob combination on the same pages in one run; each variant's output
    must equal the default's bit for bit (the default is checked against the reference)."""
    cuda = device.type == "cuda"
    L, H, P, D = (36, 8, 16, 128) if cuda else (2, 2, 16, 64)
    page_bytes = L * 2 * H * P * D * 2
    n = max(2, target_bytes // page_bytes)
    gen = torch.Generator(device=device).manual_seed(0)
    pages = torch.randn(n, L, 2, H, P, D, device=device, generator=gen).to(torch.bfloat16)
    raw = n * page_bytes
    moved = raw + n * nvfp4_layout(2 * L, H * P, D)[3]  # bytes read + written once
    dst = torch.empty_like(pages)
    copy_ms = median_ms(lambda: dst.copy_(pages), device, repeat, device_only=cuda)
    ceiling = 2 * raw / copy_ms / 1e6
    enc_grid, dec_grid = _sweep_grids(cuda)
    payload, ok = nvfp4_encode(pages)
    # Warm-up, untimed: the first variant timed in a run read ~25% slow on the H200 (clocks and
    # caches settling after the copy), so every variant starts from the same state.
    median_ms(lambda: nvfp4_encode(pages), device, min(repeat, 10), device_only=cuda)
    k = min(n, 4)
    ref, _ = nvfp4_encode_ref(pages[:k].cpu())
    out_ref = nvfp4_decode(payload, torch.empty_like(pages))
    o_cpu = nvfp4_decode_ref(ref, torch.empty_like(pages[:k].cpu()))
    default_exact = (torch.equal(payload[:k].cpu(), ref)
                     and torch.equal(out_ref[:k].cpu().view(torch.int16), o_cpu.view(torch.int16)))
    rows = []
    out = torch.empty_like(pages)
    for op, grid in (("encode", enc_grid), ("decode", dec_grid)):
        for kw in grid:
            label = ", ".join(f"{a}={b}" for a, b in kw.items()) or "default"
            try:
                fn = _variant(op, kw, pages, payload, out)
                if op == "encode":
                    got, got_ok = fn()
                    same = torch.equal(got, payload) and torch.equal(got_ok, ok)
                else:
                    same = torch.equal(fn().view(torch.int16), out_ref.view(torch.int16))
                ms = median_ms(fn, device, repeat, device_only=cuda)
            except Exception as e:  # a variant that fails is reported, the sweep goes on
                rows.append((op, float("inf"), f"| {op} | {label} | failed: "
                             f"{type(e).__name__}: {str(e).splitlines()[0][:100]} | | | |"))
                continue
            gbps = moved / ms / 1e6
            rows.append((op, ms, f"| {op} | {label} | {ms:.3f} | {gbps:.0f} | "
                         f"{100 * gbps / ceiling:.1f}% | {'yes' if same else 'NO'} |"))
    rows.sort(key=lambda t: (t[0], t[1]))
    dev_name = torch.cuda.get_device_name(device) if cuda else platform.processor() or "CPU"
    return ["### NVFP4 kernel sweep", "",
            f"{dev_name}; triton {triton.__version__}; {n} bf16 pages [{L}, 2, {H}, {P}, {D}] = "
            f"{raw / GIB:.3f} GiB; median of {repeat} runs; GB/s = bytes read + written once; "
            f"copy ceiling {ceiling:.0f} GB/s (same run). Default encode/decode vs the torch "
            f"reference on CPU copies of {k} pages: "
            f"{'bit-exact' if default_exact else 'DIFFER'}. same = output equals the default's "
            f"bit for bit.", "",
            "| op | knobs | ms | GB/s | % of copy | same |", "|---|---|---|---|---|---|",
            *[r for _, _, r in rows]]


def lossless_section(mib: int, repeat: int) -> list[str]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    L, H, P, D = 5, 8, 16, 128  # DFlash-b16 drafter of Qwen3-8B: the draft group
    page_bytes = L * 2 * H * P * D * 2
    n = max(2, (mib << 20) // page_bytes)
    lines = ["### Lossless codec, one CPU core",
             "",
             f"Conditions: {platform.processor() or platform.machine()}, 1 thread; bf16 pages "
             f"[{L}, 2, {H}, {P}, {D}] (the draft group), {n} pages = {n * page_bytes / 2**20:.1f} "
             f"MiB per data set; GB/s = raw page bytes / wall time, best of {repeat}, CRC32 "
             f"included; level None = the codec's entropy-coder parameters (the default).",
             "", "| data | " + CompressionReport.MARKDOWN_HEADER.split("\n")[0][2:],
             "|---|" + CompressionReport.MARKDOWN_HEADER.split("\n")[1][1:]]
    settings = [dict(level=None), dict(level=None, compress="all"), dict(level=-5),
                dict(level=1), dict(level=3)]
    for kind in ("gaussian", "key"):
        pages = synthetic_kv(kind, n, L, H, P, D, seed=1)
        for opts in settings:
            r = compression_report(pages, "lossless", repeats=repeat, **opts)
            lines.append(f"| {kind} " + r.markdown_row())
    torch.set_num_threads(threads)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--gib", type=float, default=1.0, help="NVFP4 data size on a GPU")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--cpu-mib", type=int, default=32, help="lossless data size per set")
    ap.add_argument("--skip-lossless", action="store_true")
    ap.add_argument("--out", help="also write the markdown here")
    ap.add_argument("--nvfp4-sweep", action="store_true",
                    help="only time every NVFP4 encode/decode knob combination (GPU: ~2 min)")
    ap.add_argument("--tiny", action="store_true", help="smallest data (a smoke test)")
    args = ap.parse_args()
    device = torch.device(args.device)
    # CPU: a smoke test; the Triton interpreter takes seconds per page, so keep it to a few
    target = (int(args.gib * GIB) if device.type == "cuda" and not args.tiny else
              (4 << 14 if os.environ.get("TRITON_INTERPRET") == "1" or args.tiny else 1 << 20))
    repeat = args.repeat if device.type == "cuda" else min(args.repeat, 5)
    if args.nvfp4_sweep:
        lines = nvfp4_sweep(device, 1 if device.type == "cpu" else target,
                            min(repeat, 20 if device.type == "cuda" else 2))
    else:
        lines = ["## Codecs", ""] + nvfp4_section(device, target, repeat) + [""]
    if not args.skip_lossless and not args.nvfp4_sweep:
        lines += lossless_section(args.cpu_mib, 5) + [""]
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
