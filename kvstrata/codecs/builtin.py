"""Imports every built-in codec module so each registers itself with the registry."""

from . import base  # noqa: F401  (identity)
from . import lossless  # noqa: F401
from . import nvfp4  # noqa: F401
