"""Imports every built-in codec module so each registers itself with the registry."""

from . import base  # noqa: F401  (identity)
