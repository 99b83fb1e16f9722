"""The benchmarks' shared output: the markdown a run measured, printed and optionally kept."""

from __future__ import annotations

from pathlib import Path


def emit(text: str, out: str | Path | None) -> None:
    """Print a benchmark's markdown and, when ``out`` is given (``--out``), write it there too
    (parent folders created, one trailing newline)."""
    text = text.rstrip("\n")
    print(text)
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
