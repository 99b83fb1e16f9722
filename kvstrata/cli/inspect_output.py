"""How the inspect commands report, disk and remote tiers alike: exit codes, one-line errors
on stderr, tables."""

from __future__ import annotations

import sys

#: exit codes: success; a page or the index is damaged (or, remote, a record); a usage error
#: (no such tier, a bad argument, the tier busy with a writer, a server out of reach)
OK, DAMAGED, USAGE = 0, 1, 2


def error(msg: str) -> None:
    """A usage error or damage, one line on stderr (``kvstrata inspect: ...``)."""
    print(f"kvstrata inspect: {msg}", file=sys.stderr)


def bad_pages_table(failures: list[dict], total: int):
    """A rich table of ``failures`` (each ``{"hash", "error", ...}``) out of ``total`` pages."""
    from rich.table import Table
    t = Table(title=f"{len(failures)} bad pages of {total}")
    t.add_column("hash")
    t.add_column("problem")
    for f in failures:
        t.add_row(f["hash"], f["error"])
    return t


def groups_table(groups: dict[str, dict]):
    """A rich table of per-group storage, ``{name: {"codecs", "raw_bytes", "stored_bytes",
    "ratio"}}`` (the summaries of both inspect commands)."""
    from rich.table import Table

    from kvstrata.pagepool import format_bytes
    g = Table(title="groups")
    for c in ("group", "codec", "raw", "stored", "ratio"):
        g.add_column(c, justify="left" if c in ("group", "codec") else "right")
    for name, s in groups.items():
        g.add_row(name, ", ".join(s["codecs"]), format_bytes(s["raw_bytes"]),
                  format_bytes(s["stored_bytes"]), f"{s['ratio']:.2f}x" if s["ratio"] else "-")
    return g
