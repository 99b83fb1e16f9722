"""dtypes kvstrata stores and computes in (a leaf module: it imports nothing from kvstrata)."""

from __future__ import annotations

import torch

#: dtypes the attention kernels and codecs take.
SUPPORTED_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                  "float": "float32"}


def canonical_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Return the torch dtype for ``dtype`` (a torch dtype or a name such as ``"bf16"``).

    Raises ``ValueError`` naming the supported dtypes for anything else.
    """
    if isinstance(dtype, torch.dtype):
        if dtype in SUPPORTED_DTYPES.values():
            return dtype
        name = str(dtype).removeprefix("torch.")
    else:
        name = _DTYPE_ALIASES.get(str(dtype), str(dtype)).removeprefix("torch.")
        if name in SUPPORTED_DTYPES:
            return SUPPORTED_DTYPES[name]
    raise ValueError(
        f"dtype {name!r} is not supported by the kvstrata kernels; "
        f"use one of {sorted(SUPPORTED_DTYPES)}")


def dtype_name(dtype: torch.dtype) -> str:
    """Stable name of a supported dtype (``"bfloat16"``, ``"float16"``, ``"float32"``)."""
    return str(canonical_dtype(dtype)).removeprefix("torch.")


