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


def page_prefix(text: str) -> str | None:
    """``--page``'s hex hash (or prefix of one) in lower case; ``None``, after the error line,
    when it is not hex."""
    prefix = text.lower()
    if not prefix or prefix.strip("0123456789abcdef"):
        error(f"--page takes a hex page hash (or a prefix of one), got {text!r}")
        return None
    return prefix


def one_page(matches: list, text: str, where: str) -> bool:
    """Whether exactly one page of ``where`` matched ``--page text``; the error line if not."""
    if len(matches) != 1:
        error(f"{len(matches)} pages match {text!r}; give more hex digits" if matches
              else f"no page {text!r} in {where}")
    return len(matches) == 1


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
