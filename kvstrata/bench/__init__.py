"""kvstrata.bench: benchmark suites that drive the runtime end to end (above ``runtime``/``tiers``).

- :mod:`kvstrata.bench.acceptance`: acceptance length (AL) cold vs warm, per drafter backend, tier
  and codec (issue 7).
"""

from .acceptance import SCENARIOS, render_markdown, run_acceptance_suite

__all__ = ["SCENARIOS", "render_markdown", "run_acceptance_suite"]
