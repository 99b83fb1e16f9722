"""``kvstrata demo``: an agent-style multi-turn workload on the shipped model pair, run twice.

Several agent conversations over held-out Python stdlib modules grow turn by turn: the first turn
pastes a long piece of the module (``--context-bytes``), every later turn resends the conversation
so far plus the next few lines (``--user-bytes``) and gets a short answer (``--max-tokens``), so
the shared context grows past 2k tokens and the reused prefix dominates every turn after the
first. The device pool holds only half of the conversations at once, so cached prefixes move to a
small host tier and from there to an LMDB disk tier (in a temporary directory; ``--keep`` keeps
it), NVFP4-encoded for the target's pages and losslessly for the drafter's. The same prompts run with the ``paged`` drafter backend (the draft
context is cached and reused with the prefix) and with the ``arena`` baseline (the draft context
starts empty after a prefix hit); the table compares their acceptance length (AL) per turn.

Exits 1 if a tier reports a checksum failure or mismatch, a page on disk does not verify, or two
answers over K/V that never went through NVFP4 differ anywhere but at a near-tie of the target
(both tokens within a dtype-dependent tolerance of a float32 reference's maximum; see
``kvstrata/demo/check.py``: bf16 verify batches of other shapes may break such ties either way).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

HELP = "multi-turn workload over the tiers: paged vs arena drafter, table + plot"

#: option -> value of the default run and of ``--long``
DEFAULT = {"conversations": 8, "turns": 6, "max_tokens": 24, "context_bytes": 2048,
           "user_bytes": 32}
LONG = {"conversations": 8, "turns": 10, "max_tokens": 24, "context_bytes": 2560,
        "user_bytes": 32}


def _preset_help(preset: dict) -> str:
    return ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in preset.items())


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto",
                   help="auto (CUDA when available, else CPU), cpu, cuda, cuda:1, ...")
    p.add_argument("--long", action="store_true",
                   help=f"the long preset: {_preset_help(LONG)} (explicit options override it)")
    # preset options: SUPPRESS keeps an option that was not given out of ``args`` (and out of
    # the "(default: ...)" help suffix), so --long can fill it
    for opt, what in (("conversations", "conversations"), ("turns", "turns per conversation"),
                      ("max_tokens", "answer length per turn"),
                      ("context_bytes", "the first turn's paste of the module, bytes"),
                      ("user_bytes", "new user text per later turn, bytes of held-out source "
                                     "cut at a line end")):
        p.add_argument(f"--{opt.replace('_', '-')}", type=int, default=argparse.SUPPRESS,
                       help=f"{what} (default {DEFAULT[opt]}; --long: {LONG[opt]})")
    p.add_argument("--model", default="kvstrata-tiny-py",
                   help="shipped pair name or a directory with target/ and drafter/")
    p.add_argument("--seed", type=int, default=0, help="which held-out modules and lines")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (1 avoids OpenMP spin-waits on busy machines)")
    p.add_argument("--keep", action="store_true", help="keep the disk tiers (path printed)")
    p.add_argument("--plot", metavar="PATH", default="kvstrata-demo.png", help="PNG to write")
    p.add_argument("--json", metavar="FILE", help="also write machine-readable results here")


def _device(name: str):
    """The device (``ValueError`` if this machine has none of that name) and its dtype."""
    import torch

    from kvstrata.devices import resolve_device
    dev = resolve_device(name)
    return dev, (torch.bfloat16 if dev.type == "cuda" else torch.float32)


def _verify_disk(path: str) -> tuple[int, list[str]]:
    """Check and decode every record of a disk tier (what ``kvstrata inspect --verify`` does)."""
    from kvstrata.tiers import DiskTier

    from .inspect import _scan, _verify
    with DiskTier(path, readonly=True) as disk:
        rows, bad = _scan(disk)
        failures = _verify(rows, bad)
    return len(rows) + len(bad), [f"{path}: page {f['hash'][:16]}: {f['error']}" for f in failures]


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from kvstrata.demo import DemoConfig, report, run_demo

    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 110))   # logs and CI: do not squeeze tables
    try:
        device, dtype = _device(args.device)
    except ValueError as e:
        print(f"kvstrata demo: --device: {e}", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="kvstrata-demo-"))
    threads = torch.get_num_threads()
    if device.type == "cpu" and args.threads > 0:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    try:
        try:
            preset = LONG if args.long else DEFAULT
            opt = {k: getattr(args, k, v) for k, v in preset.items()}
            cfg = DemoConfig(workdir=workdir, conversations=opt["conversations"],
                             turns=opt["turns"], max_tokens=opt["max_tokens"],
                             snippet_bytes=opt["user_bytes"], context_bytes=opt["context_bytes"],
                             seed=args.seed, device=str(device), dtype=dtype, model=args.model)
        except ValueError as e:
            print(f"kvstrata demo: {e}", file=sys.stderr)
            return 2
        console.print(f"kvstrata demo{' --long' if args.long else ''}: {cfg.model} on {device} "
                      f"({str(dtype).split('.')[-1]}), {cfg.conversations} conversations x "
                      f"{cfg.turns} turns: {cfg.context_bytes} bytes of context, then "
                      f"{cfg.snippet_bytes} bytes per turn and {cfg.max_tokens}-token answers; "
                      f"device pool for {cfg.max_batch_size} conversations")
        with Progress(TextColumn("{task.description}"), BarColumn(),
                      TextColumn("turn {task.completed}/{task.total}"), TimeElapsedColumn(),
                      console=console, transient=True) as bar:
            tasks = {b: bar.add_task(f"{b} drafter", total=cfg.turns) for b in ("paged", "arena")}
            res = run_demo(cfg, progress=lambda b, done, _: bar.update(tasks[b], completed=done))
        checked = 0
        for r in res.runs.values():
            n, bad = _verify_disk(r.disk_path)
            checked += n
            res.problems += bad
        elapsed = time.perf_counter() - t0
        plot = report.plot(res, args.plot)
        console.print(report.turn_table(res))
        console.print(report.codec_table(res))
        console.print(report.tier_table(res))
        console.print(f"plot: {plot.resolve()}")
        if args.json:
            doc = report.to_json(res, {"plot": str(plot.resolve()), "elapsed_s": elapsed,
                                       "disk_pages_verified": checked,
                                       "workdir": str(workdir) if args.keep else None})
            Path(args.json).write_text(json.dumps(doc, indent=1))
            console.print(f"json: {Path(args.json).resolve()}")
        if args.keep:
            console.print(f"disk tiers kept in {workdir} (inspect with `kvstrata inspect "
                          f"{workdir}/disk-paged`)")
        if res.problems:
            console.print("[red]FAILED:[/red]")
            for p in res.problems:
                console.print(f"  - {p}")
            return 1
        console.print(report.summary_line(res))
        console.print(f"OK: {report.token_check_line(res)}; {checked} disk pages verify; no "
                      f"checksum failures; {elapsed:.1f} s")
        return 0
    finally:
        torch.set_num_threads(threads)
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
