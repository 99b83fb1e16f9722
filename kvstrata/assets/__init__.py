"""Shipped model weights: name -> directory resolution.

The small trained pair lives in ``kvstrata/assets/kvstrata-tiny-py/{target,drafter}/`` (package
data: ``config.json`` + ``model.safetensors`` each). Names::

    resolve_model("kvstrata-tiny-py/target")   # the Qwen3 target directory
    resolve_model("kvstrata-tiny-py/drafter")  # its DFlash drafter directory
    resolve_model("kvstrata-tiny-py")          # the directory holding both

An existing directory path is returned unchanged, so callers can accept either a name or a path.
The weights are produced by ``scripts/train_tiny_pair.sh`` (see ``docs/training.md``).
:mod:`kvstrata.assets.corpus` defines the data they were trained on and the fixed held-out split
that benchmarks, the demo and the disaggregation launcher draw prompts from (it lives here, low in
the layering, so those upper layers need not import the trainers).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..tokenizer import ByteTokenizer

ASSETS_DIR = Path(__file__).resolve().parent
#: shipped model name -> its parts (each a subdirectory with config.json + model.safetensors)
MODELS: dict[str, tuple[str, ...]] = {"kvstrata-tiny-py": ("target", "drafter")}
_WEIGHT_FILES = ("config.json", "model.safetensors")


def list_models() -> list[str]:
    """Every resolvable name (``model`` and ``model/part``), shipped or not."""
    return sorted([m for m in MODELS] + [f"{m}/{p}" for m, parts in MODELS.items() for p in parts])


def _missing(d: Path, parts: tuple[str, ...]) -> list[str]:
    dirs = [d / p for p in parts] if parts else [d]
    return [str(x / f) for x in dirs for f in _WEIGHT_FILES if not (x / f).is_file()]


def resolve_model(name: str | os.PathLike, part: str | None = None) -> Path:
    """A shipped model name (or an existing directory) -> its directory.

    A directory that holds ``target/`` and ``drafter/`` (a trained pair) resolves like a shipped
    name: with ``part``, to that part's directory.

    With ``part`` (``"target"`` / ``"drafter"``), a bare model name means that part of it:
    ``resolve_model("kvstrata-tiny-py", part="drafter")`` is the drafter's directory.

    Raises ``ValueError`` for an unknown name, or for a known one whose weights are not present
    (they are trained by ``scripts/train_tiny_pair.sh`` and committed after the GPU run).
    """
    p = Path(name)
    if p.is_dir():
        # a pair directory (``OUT`` of scripts/train_tiny_pair.sh) holds target/ and drafter/
        if part is not None and (p / part / "config.json").is_file():
            return p / part
        return p
    s = str(name).strip("/")
    if part is not None and "/" not in s and s in MODELS:
        s = f"{s}/{part}"
    model, _, part = s.partition("/")
    if model not in MODELS or (part and part not in MODELS[model]):
        raise ValueError(f"unknown model {str(name)!r}: not a directory and not a shipped model "
                         f"name; known names: {list_models()}")
    d = ASSETS_DIR / model
    missing = _missing(d / part if part else d, () if part else MODELS[model])
    if missing:
        raise ValueError(f"model {s!r} is not installed: {missing[0]} is missing. Train it with "
                         f"`scripts/train_tiny_pair.sh OUT --device cuda` and copy OUT/target and "
                         f"OUT/drafter to {d}/ (see docs/training.md), or pass a directory")
    return d / part if part else d


def load_tokenizer(name: str | os.PathLike = "kvstrata-tiny-py") -> ByteTokenizer:
    """The tokenizer of a shipped model or model directory.

    Every kvstrata-trained model uses the byte tokenizer of :mod:`kvstrata.tokenizer`; a directory
    whose ``tokenizer_config.json`` names another tokenizer raises ``ValueError``.
    """
    import json

    p = Path(name)
    if not p.is_dir():
        model = str(name).strip("/").partition("/")[0]
        if model not in MODELS:
            raise ValueError(f"unknown model {str(name)!r}; known names: {list_models()}")
        return ByteTokenizer()
    cfg = p / "tokenizer_config.json"
    if cfg.is_file():
        cls = json.loads(cfg.read_text()).get("tokenizer_class", "")
        if cls != "kvstrata.tokenizer.ByteTokenizer":
            raise ValueError(f"{cfg} names tokenizer {cls!r}; only kvstrata's byte tokenizer "
                             "is built in (use the model's own tokenizer library)")
    return ByteTokenizer()


__all__ = ["ASSETS_DIR", "MODELS", "list_models", "load_tokenizer", "resolve_model"]
