"""The ``kvstrata demo`` workload: multi-turn conversations over the tiers, paged vs arena drafter.

``run_demo(DemoConfig(workdir=...))`` runs it and returns a :class:`DemoResult`; :mod:`.report`
turns that into tables, a plot and JSON. The CLI (``kvstrata/cli/demo.py``) adds progress output.
"""

from . import report
from .runner import BACKENDS, BackendRun, DemoConfig, DemoResult, TurnStats, run_backend, run_demo
from .workload import Conversation, build_conversations

__all__ = ["BACKENDS", "BackendRun", "Conversation", "DemoConfig", "DemoResult", "TurnStats",
           "build_conversations", "report", "run_backend", "run_demo"]
