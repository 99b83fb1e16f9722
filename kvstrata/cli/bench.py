"""Benchmarks through the real runtime.

    kvstrata bench acceptance                       # 16 prompts x 256 tokens, 128 new, CPU fp32
    kvstrata bench acceptance --prompts 4 --max-tokens 32 --out acc.md
    kvstrata bench acceptance --out acc.json        # every pass, with tokens and per-step ALs
    kvstrata bench acceptance --prompt-lens 256,1024,2048,3584 --scenarios paged,arena,tiers-mixed
                                                    # prompt-length sweep: cold / warm per tier

``acceptance`` runs the acceptance-length suite (``kvstrata.bench.acceptance``): AL of a cold pass
and of a warm pass (prefix from the device pool, the host tier or the disk tier) per drafter
backend, codec pair and temperature, on held-out prompts with the shipped trained pair.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HELP = "run benchmark suites (acceptance length cold vs warm)"


def add_acceptance_arguments(p: argparse.ArgumentParser) -> None:
    from kvstrata.bench.acceptance import SCENARIOS

    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    p.add_argument("--dtype", default="float32", help="model and pool dtype (or 'auto')")
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts")
    p.add_argument("--prompt-len", type=int, default=256, help="tokens per prompt")
    p.add_argument("--prompt-lens", default=None, metavar="N,N,...",
                   help="sweep: run the suite once per prompt length (e.g. 256,1024,2048,3584) "
                        "and print one row per length, scenario and tier")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt")
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help=f"comma-separated subset of {','.join(SCENARIOS)}")
    p.add_argument("--model", default="kvstrata-tiny-py",
                   help="shipped pair name or a directory with target/ and drafter/")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt draw and sampling")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--dir", default=None, help="disk tier directory (default: a temporary one)")
    p.add_argument("--out", default=None,
                   help="write the result here: markdown, or JSON when the name ends in .json")


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="suite", required=True, metavar="SUITE")
    from kvstrata.cli.main import HelpFormatter
    acc = sub.add_parser("acceptance", help="acceptance length cold vs warm, per tier and codec",
                         description=__doc__, formatter_class=HelpFormatter)
    add_acceptance_arguments(acc)
    acc.set_defaults(_suite=run_acceptance)


def run_acceptance(args: argparse.Namespace) -> int:
    import torch

    from kvstrata.bench.acceptance import (render_markdown, render_sweep_markdown,
                                           run_acceptance_suite, run_length_sweep)

    if args.out:
        _check_out(args.out)      # before the run (minutes), not after it
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    scenarios = [s for s in args.scenarios.split(",") if s]
    if args.prompt_lens:
        try:
            lens = [int(x) for x in args.prompt_lens.split(",") if x.strip()]
        except ValueError:
            print(f"kvstrata bench acceptance: --prompt-lens must be comma-separated integers, "
                  f"got {args.prompt_lens!r}", file=sys.stderr)
            return 2
        result = run_length_sweep(lens, args.prompts, args.max_tokens, args.device, args.dtype,
                                  args.dir, scenarios=scenarios, model=args.model, seed=args.seed)
        md = render_sweep_markdown(result)
    else:
        result = run_acceptance_suite(args.prompts, args.prompt_len, args.max_tokens, args.device,
                                      args.dtype, args.dir, scenarios=scenarios,
                                      model=args.model, seed=args.seed)
        md = render_markdown(result)
    sys.stdout.write(md)
    if args.out:
        try:
            with open(args.out, "w") as f:
                if args.out.endswith(".json"):
                    json.dump(result, f, indent=1)
                else:
                    f.write(md)
        except OSError as e:
            raise ValueError(f"--out {args.out!r}: cannot write it ({e.strerror or e}); the "
                             f"tables are above") from None
    return 0


def _check_out(path: str) -> None:
    """``--out``'s folder made (``ValueError`` if it cannot be, or the path is a folder or not
    writable)."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {path!r}: cannot create {folder}: {e.strerror or e}") from None
    if os.path.isdir(path) or not os.access(folder, os.W_OK):
        raise ValueError(f"--out {path!r} is a folder or in one this user cannot write")


def run(args: argparse.Namespace) -> int:
    return args._suite(args)
