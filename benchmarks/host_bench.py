"""Host time of a decode step, the device's work left out (issue 13).

A synchronous step leaves the device idle while the host collects step N's tokens and stages
step N + 1 (an overlapped step hides it). This measures that host part alone: the runner's
draft and verify functions do nothing, over an output written once (every row's tokens, its
count, the positions verified), so what is timed is everything else the step does:

- ``runner``: a step as ``runner_bench.Bench`` runs it (reserve, ``ModelRunner.execute``: stage,
  copies, width choice, collect; commit), per step;
- ``engine``: decode steps through ``LLM.generate`` (schedule, items, runner, acceptance, stops,
  text, commit), per step: a long run's time minus a short run's, over the steps between them,
  so prefill and request setup drop out; synchronous steps, and overlapped ones (step N + 1
  submitted from step N's output before step N's tokens are read: the host work per step an
  overlapped engine must keep below the device's step time).

Tiny preset models, graphs off (the host work of a replayed step is the same but for the replay
call). Median of ``--reps`` rounds.

    python benchmarks/host_bench.py --device cpu
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from engine_bench import PRESETS, build_models
from runner_bench import Bench

from kvstrata.runtime import LLM, CacheConfig, RunnerConfig, SamplingParams


def make_llm(mode: str, batch: int, device: str, ctx: int, overlap: bool = False) -> LLM:
    target, drafter = build_models(PRESETS["tiny"], device, torch.float32)
    cache = CacheConfig(page_size=16, max_seq_len=ctx + 8192, max_batch_size=batch,
                        max_num_batched_tokens=max(2048, 4 * batch), target_codec="identity",
                        draft_codec="identity")
    llm = LLM(target, drafter if mode == "spec" else None, cache, device=device,
              runner=RunnerConfig(cuda_graphs=False, overlap=overlap, batch_sizes=(batch,)))
    run, B = llm.runner, llm.runner.B
    produced = 1 if mode == "plain" else max(1, B - 1)

    run.out[:, :B] = 7          # written once: nothing else writes the output rows
    run.out[:, B] = produced
    run.out[:, B + 1] = B
    run._verify_fn = run._draft_fn = lambda b, width=None: None
    return llm


def runner_us(llm: LLM, batch: int, ctx: int, steps: int, reps: int) -> float:
    bench = Bench(llm, batch, ctx, "host")
    for _ in range(20):
        bench.step()
    per = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(steps):
            bench.step()
        per.append((time.perf_counter() - t) / steps * 1e6)
    bench.close()
    return statistics.median(per)


def engine_us(llm: LLM, batch: int, steps: int, reps: int) -> float:
    prompts = [[3 + i] * 100 for i in range(batch)]
    stats = llm.runner.stats

    def run(tokens: int, salt: str) -> tuple[float, int]:
        sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
        s0 = stats()["decode_steps"]
        t = time.perf_counter()
        llm.generate(prompts, sp, cache_salt=salt)
        return time.perf_counter() - t, stats()["decode_steps"] - s0

    per_token = max(1, llm.runner.B - 1) if llm.drafter is not None else 1
    long, short = steps * per_token, max(8, steps // 10) * per_token
    run(short, "warm")
    per = []
    for r in range(reps):
        (ta, na), (tb, nb) = run(long, f"a{r}"), run(short, f"b{r}")
        per.append((ta - tb) / (na - nb) * 1e6)
    return statistics.median(per)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--modes", nargs="+", default=["plain", "spec"])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("| mode | batch | runner us/step | engine us/step | engine overlapped us/step |")
    print("|---|---|---|---|---|")
    for mode in args.modes:
        for b in args.batches:
            llm = make_llm(mode, b, args.device, args.context)
            r = runner_us(llm, b, args.context, args.steps, args.reps)
            e = engine_us(llm, b, args.steps, args.reps)
            llm.close()
            llm = make_llm(mode, b, args.device, args.context, overlap=True)
            o = engine_us(llm, b, args.steps, args.reps)
            llm.close()
            print(f"| {mode} | {b} | {r:.1f} | {e:.1f} | {o:.1f} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
