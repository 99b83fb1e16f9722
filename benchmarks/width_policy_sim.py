"""What the verify-width policy's exploration costs, simulated with measured step times.

The policy (``kvstrata.runtime.verify_width.WidthPolicy``) runs every width it did not choose
now and then. This replays its choices over many steps of one batch size, with each width's
step time fixed (``--ms``, e.g. the pinned overlapped times of ``runner_bench.py``) and every
draft accepted with probability ``--p``. It prints the throughput lost to exploration: one
minus the simulated tokens per millisecond over the chosen width's. ``--old-rule`` uses the
period rule before the twelfth runner session (``cost = 1 - rate(V) / rate(V*)``).

    python benchmarks/width_policy_sim.py --ms 16=35.17 8=20.12 4=12.57 2=9.91 1=7.68 --p 0
"""

from __future__ import annotations

import argparse

import numpy as np

from kvstrata.runtime.verify_width import WidthPolicy


def simulate(ms: dict[int, float], p: float, steps: int, block: int = 16, b: int = 64,
             old_rule: bool = False, seed: int = 0) -> dict:
    widths = tuple(sorted(ms, reverse=True))
    pol = WidthPolicy(block, widths)
    pol.capture_ms.update({(b, w): t for w, t in ms.items()})
    if old_rule:
        def period(bb, width, chosen):
            lo = pol.explore_every
            q = pol.acceptance()
            r, rc = pol.rate(bb, width, q), pol.rate(bb, chosen, q)
            return int(min(max((1.0 - r / rc) / pol.explore_cost, lo), 32 * lo))
        pol.explore_period = period
    rng = np.random.default_rng(seed)
    tokens = time = 0.0
    runs = {w: 0 for w in widths}
    for _ in range(steps):
        w = pol.choose(b)
        runs[w] += 1
        # each row: drafts accepted in order with probability p, the bonus token always
        acc = np.minimum(rng.geometric(1 - p, size=b) - 1 if p > 0 else np.zeros(b, int),
                         w - 1)
        pol.observe(acc + 1, np.full(b, w))
        tokens += float((acc + 1).sum())
        time += ms[w]
    best = max(b * pol.expected_tokens(w, np.full(block - 1, p)) / ms[w] for w in widths)
    return {"chosen": pol.chosen.get(b), "runs": runs, "lost": 1 - (tokens / time) / best}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", nargs="+", required=True, help="width=ms ...")
    ap.add_argument("--p", type=float, default=0.0, help="acceptance of each draft")
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--old-rule", action="store_true")
    args = ap.parse_args()
    ms = {int(k): float(v) for k, v in (x.split("=") for x in args.ms)}
    r = simulate(ms, args.p, args.steps, old_rule=args.old_rule)
    print(f"chosen {r['chosen']}, steps per width {r['runs']}, throughput lost to exploration "
          f"{100 * r['lost']:.2f}%")


if __name__ == "__main__":
    main()
