"""Training corpus: the Python standard library source of the running interpreter.

Read at training time from ``sysconfig.get_paths()["stdlib"]`` (nothing of it is committed). Files
are ``*.py`` outside ``site-packages``, minus generated tables (``encodings/``, ``pydoc_data/``)
and anything over :data:`MAX_FILE_BYTES`. Each file becomes ``[BOS] + utf-8 bytes + [EOS]``.

:data:`HELDOUT` lists ~20 plain modules present in CPython 3.10, 3.11, 3.12 and 3.13 (none is
affected by the PEP 594 removals or the 3.12/3.13 package reshuffles); they are never trained on
and feed the held-out loss, :func:`heldout_prompts`, benchmarks and the demo. The split is by
path, so it is the same on every interpreter version; the *training* files differ slightly
between versions (the stdlib changes), so bit-exact weights need the same Python minor version.
"""

from __future__ import annotations

import os
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import tokenizer as tok

#: Held-out modules (relative to the stdlib root); never trained on.
HELDOUT: tuple[str, ...] = (
    "bisect.py", "calendar.py", "colorsys.py", "difflib.py", "filecmp.py", "fnmatch.py",
    "fractions.py", "graphlib.py", "heapq.py", "html/parser.py", "json/decoder.py",
    "json/encoder.py", "netrc.py", "pprint.py", "queue.py", "quopri.py", "reprlib.py",
    "sched.py", "shlex.py", "textwrap.py",
)
SKIP_DIRS = ("site-packages", "encodings", "pydoc_data", "__pycache__")
MAX_FILE_BYTES = 400_000


def stdlib_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(split: str = "train", root: str | os.PathLike | None = None) -> list[Path]:
    """Sorted ``*.py`` files of ``split`` (``"train"`` or ``"heldout"``) under the stdlib root."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    base = Path(root) if root is not None else stdlib_root()
    if not base.is_dir():
        raise ValueError(f"stdlib root {base} is not a directory")
    if split == "heldout":
        files = [base / h for h in HELDOUT]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"held-out modules missing from {base}: {missing}")
        return files
    held = {base / h for h in HELDOUT}
    out = []
    for p in sorted(base.rglob("*.py")):
        rel = p.relative_to(base)
        if any(part in SKIP_DIRS for part in rel.parts[:-1]) or p in held:
            continue
        if p.stat().st_size > MAX_FILE_BYTES:
            continue
        out.append(p)
    if not out:
        raise ValueError(f"no training files found under {base}")
    return out


def load_tokens(split: str = "train", root: str | os.PathLike | None = None) -> torch.Tensor:
    """All files of ``split`` as one ``[N] int16`` stream of ``[BOS] bytes [EOS]`` documents."""
    parts = []
    for f in corpus_files(split, root):
        data = f.read_bytes()
        parts.append(torch.tensor([tok.BOS], dtype=torch.int16))
        if data:
            parts.append(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int16))
        parts.append(torch.tensor([tok.EOS], dtype=torch.int16))
    return torch.cat(parts)


@dataclass
class TokenStream:
    """A token stream that samples fixed-length windows (``[batch, length] int64``)."""

    tokens: torch.Tensor  # [N] int16 (any device)

    def __post_init__(self) -> None:
        if self.tokens.dim() != 1 or self.tokens.numel() < 2:
            raise ValueError("TokenStream needs a 1-D stream of at least 2 tokens")

    def to(self, device: str | torch.device) -> "TokenStream":
        return TokenStream(self.tokens.to(device))

    def sample(self, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
        """``batch`` random windows of ``length`` tokens (starts drawn on the CPU from ``gen``)."""
        n = self.tokens.numel()
        if length > n:
            raise ValueError(f"window length {length} exceeds the stream ({n} tokens)")
        starts = torch.randint(0, n - length + 1, (batch,), generator=gen)
        idx = starts.to(self.tokens.device)[:, None] + torch.arange(length,
                                                                    device=self.tokens.device)
        return self.tokens[idx].long()

    def windows(self, count: int, length: int) -> torch.Tensor:
        """``count`` evenly spaced, non-random windows (for a deterministic evaluation)."""
        n = self.tokens.numel()
        if length > n:
            raise ValueError(f"window length {length} exceeds the stream ({n} tokens)")
        step = max(1, (n - length) // max(1, count))
        starts = torch.arange(count) * step
        starts = starts[starts + length <= n]
        idx = starts.to(self.tokens.device)[:, None] + torch.arange(length,
                                                                    device=self.tokens.device)
        return self.tokens[idx].long()


def line_prompts(files: list[Path], n: int, prompt_len: int, seed: int) -> list[list[int]]:
    """``n`` prompts of exactly ``prompt_len`` byte tokens, each starting at a line start of a
    file (file and line drawn with ``random.Random(seed)``); files too short are skipped."""
    if n < 0 or prompt_len < 1:
        raise ValueError(f"need n >= 0 and prompt_len >= 1, got n={n}, prompt_len={prompt_len}")
    rng = random.Random(seed)
    datas = [d for d in (f.read_bytes() for f in files) if len(d) > prompt_len]
    if not datas:
        raise ValueError(f"no file is longer than prompt_len={prompt_len} bytes")
    # line starts that leave a full prompt before the end of the file
    starts = [[0] + [m.end() for m in re.finditer(b"\n", d[:len(d) - prompt_len - 1])]
              for d in datas]
    out = []
    while len(out) < n:
        k = rng.randrange(len(datas))
        s = starts[k][rng.randrange(len(starts[k]))]
        out.append(list(datas[k][s:s + prompt_len]))
    return out


def heldout_prompts(n: int, prompt_len: int, seed: int = 0,
                    root: str | os.PathLike | None = None) -> list[list[int]]:
    """Fixed prompts (byte token lists) cut from the held-out modules at line starts."""
    return line_prompts(corpus_files("heldout", root), n, prompt_len, seed)


__all__ = ["HELDOUT", "MAX_FILE_BYTES", "SKIP_DIRS", "TokenStream", "corpus_files",
           "heldout_prompts", "line_prompts", "load_tokens", "stdlib_root"]
