"""Tables the inspect commands share (disk and remote tiers print damage the same way)."""

from __future__ import annotations


def bad_pages_table(failures: list[dict], total: int):
    """A rich table of ``failures`` (each ``{"hash", "error", ...}``) out of ``total`` pages."""
    from rich.table import Table
    t = Table(title=f"{len(failures)} bad pages of {total}")
    t.add_column("hash")
    t.add_column("problem")
    for f in failures:
        t.add_row(f["hash"], f["error"])
    return t
