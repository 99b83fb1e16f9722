"""Shared helpers of the engine-integration tests."""

from __future__ import annotations

import importlib
import os

import pytest


def require(module: str) -> None:
    """Import ``module`` or skip the calling test module; in CI (``CI`` set), where
    ``scripts/setup.sh`` installs the engines, a missing engine is an error, not a skip."""
    if os.environ.get("CI"):
        importlib.import_module(module)
    else:
        pytest.importorskip(module)
