"""Acceptance-length benchmark (issue 7): cold vs warm AL per backend, tier and codec.

A thin wrapper over ``kvstrata bench acceptance`` (same options); see
``kvstrata/bench/acceptance.py`` and ``docs/benchmarks.md``.

    python benchmarks/acceptance_bench.py --device cpu --threads 2 --out /tmp/acceptance.md
"""

from __future__ import annotations

import argparse
import sys

from kvstrata.cli.bench import add_acceptance_arguments, run_acceptance


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_acceptance_arguments(p)
    return run_acceptance(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
