"""Shared tiny checkpoints for the engine tests (built once per session, saved to disk)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("dflash.model")
    import tiny_dflash as td
    root = tmp_path_factory.mktemp("ckpts")
    out = {}
    out["target"] = (root / "target", td.make_target(root / "target"))
    out["agree"] = (root / "agree", td.make_target(root / "agree", agree=8.0))
    out["drafter"] = (root / "drafter", td.make_drafter(root / "drafter"))
    out["sliding"] = (root / "sliding", td.make_drafter(
        root / "sliding", seed=1, layer_types=["sliding_attention", "full_attention"], window=6))
    return {k: (str(p), m) for k, (p, m) in out.items()}
