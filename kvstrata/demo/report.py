"""The demo's outputs: rich tables, the PNG plot and the JSON document, all from a DemoResult."""

from __future__ import annotations

from pathlib import Path

from ..pagepool import format_bytes
from .runner import DemoResult

TIER_COUNTERS = (
    ("host hits / misses (pages / lookups)", ("host_hits", "host_misses")),
    ("disk hits / misses (pages / lookups)", ("disk_hits", "disk_misses")),
    ("device -> host pages", ("d2h_pages",)),
    ("host -> device pages", ("h2d_pages",)),
    ("host -> disk pages", ("host_to_disk_pages",)),
    ("disk -> host pages", ("disk_to_host_pages",)),
    ("evictions device / host / disk", ("pool_evictions", "host_evictions", "disk_evictions")),
    ("pages dropped", ("dropped_pages",)),
    ("checksum failures / mismatches", ("checksum_failures", "mismatches")),
)


def to_json(res: DemoResult, extra: dict | None = None) -> dict:
    """Machine-readable results: config, per-turn rows (both backends), tier and codec figures."""
    cfg = res.config
    paged, arena = res.runs["paged"], res.runs["arena"]
    rows = []
    for p, a in zip(paged.turns, arena.turns):
        rows.append({"turn": p.turn, "prompt_tokens": p.prompt_tokens,
                     "reused_device": p.reused_device, "reused_host": p.reused_host,
                     "reused_disk": p.reused_disk, "al_paged": p.acceptance_length,
                     "al_arena": a.acceptance_length,
                     "al_first_steps_paged": p.early_acceptance_length,
                     "al_first_steps_arena": a.early_acceptance_length, "ttft_s_paged": p.ttft_s,
                     "ttft_s_arena": a.ttft_s, "tokens_per_s_paged": p.tokens_per_s,
                     "tokens_per_s_arena": a.tokens_per_s})
    doc = {
        "config": {"conversations": cfg.conversations, "turns": cfg.turns,
                   "max_tokens": cfg.max_tokens, "snippet_bytes": cfg.snippet_bytes,
                   "context_bytes": cfg.context_bytes,
                   "seed": cfg.seed, "device": cfg.device, "dtype": str(cfg.dtype).split(".")[-1],
                   "model": cfg.model, "page_size": cfg.page_size,
                   "max_batch_size": cfg.max_batch_size},
        "conversations": res.conversations,
        "turns": rows,
        "al": {b: _overall_al(r) for b, r in res.runs.items()},
        "al_first_steps": {b: _overall_al(r, early=True) for b, r in res.runs.items()},
        "al_gain": _gain(res), "al_first_steps_gain": _gain(res, early=True),
        "divergences": [d.as_dict() for d in res.divergences],
        "al_texts": _texts(res),
        "runs": {b: r.as_dict() for b, r in res.runs.items()},
        "checked_requests": res.checked_requests,
        "problems": list(res.problems),
        "ok": res.ok,
    }
    doc.update(extra or {})
    return doc


def _overall_al(run, early: bool = False) -> float:
    """Tokens per step over all turns (``early``: each request's first EARLY_STEPS steps)."""
    steps = sum(t.early_steps if early else t.steps for t in run.turns)
    done = sum(t.early_committed if early else t.committed_in_steps for t in run.turns)
    return done / steps if steps else 0.0


def _gain(res: DemoResult, early: bool = False) -> float:
    """Paged over arena AL, as a fraction (0.15 = +15%)."""
    a = _overall_al(res.runs["arena"], early)
    return _overall_al(res.runs["paged"], early) / a - 1 if a else 0.0


def _texts(res: DemoResult) -> str:
    """What the AL comparison compares: identical answers, or answers that part at near-ties."""
    if not res.divergences:
        return (f"identical texts: all {res.checked_requests} answers over exact K/V are equal "
                f"across backends")
    return (f"near-identical texts: {len(res.divergences)} of {res.checked_requests} answers over "
            f"exact K/V part at a near-tie of the target (both tokens within "
            f"{res.divergences[0].tolerance:g} nats of the float32 reference maximum), so AL is "
            f"compared on texts that differ after that token")


def summary_line(res: DemoResult) -> str:
    """The headline: paged over arena AL overall and over each request's first steps."""
    from .runner import EARLY_STEPS
    p, a = res.runs["paged"], res.runs["arena"]
    return (f"AL paged {_overall_al(p):.2f} vs arena {_overall_al(a):.2f} "
            f"({_gain(res) * 100:+.1f}%); first {EARLY_STEPS} steps of each answer "
            f"{_overall_al(p, True):.2f} vs {_overall_al(a, True):.2f} "
            f"({_gain(res, True) * 100:+.1f}%)")


def token_check_line(res: DemoResult) -> str:
    return _texts(res)


def turn_table(res: DemoResult):
    from rich.table import Table
    paged, arena = res.runs["paged"], res.runs["arena"]
    t = Table(title=f"{res.config.conversations} conversations x {res.config.turns} turns; "
                    f"prefix tokens reused per tier (paged run); p = paged, a = arena")
    for col in ("turn", "prompt", "device", "host", "disk", "AL p", "AL a", "AL gain",
                "first 4 p/a", "TTFT p/a ms", "tok/s p/a"):
        t.add_column(col, justify="right", no_wrap=True)
    for p, a in zip(paged.turns, arena.turns):
        gain = (p.acceptance_length / a.acceptance_length - 1) * 100 if a.acceptance_length else 0
        t.add_row(str(p.turn), str(p.prompt_tokens), str(p.reused_device), str(p.reused_host),
                  str(p.reused_disk), f"{p.acceptance_length:.2f}", f"{a.acceptance_length:.2f}",
                  f"{gain:+.1f}%",
                  f"{p.early_acceptance_length:.2f} / {a.early_acceptance_length:.2f}",
                  f"{p.ttft_s * 1e3:.0f} / {a.ttft_s * 1e3:.0f}",
                  f"{p.tokens_per_s:.0f} / {a.tokens_per_s:.0f}")
    ap, aa = _overall_al(paged), _overall_al(arena)
    t.add_row("all", str(sum(x.prompt_tokens for x in paged.turns)),
              *(str(sum(getattr(x, k) for x in paged.turns))
                for k in ("reused_device", "reused_host", "reused_disk")),
              f"{ap:.2f}", f"{aa:.2f}", f"{(ap / aa - 1) * 100 if aa else 0:+.1f}%",
              f"{_overall_al(paged, True):.2f} / {_overall_al(arena, True):.2f}", "", "",
              style="bold")
    return t


def codec_table(res: DemoResult):
    from rich.table import Table
    t = Table(title="compression: each group's codec on real pages of the paged run, and all "
                    "bytes the tiers moved device -> host")
    for col in ("group", "codec", "dtype", "pages", "raw", "encoded", "ratio", "exact",
                "rel RMSE"):
        t.add_column(col, justify="left" if col in ("group", "codec", "dtype") else "right",
                     no_wrap=True)
    for name, c in res.runs["paged"].compression.items():
        t.add_row(name, c["codec"], c["dtype"], str(c["pages"]), format_bytes(c["raw_bytes"]),
                  format_bytes(c["encoded_bytes"]), f"{c['ratio']:.2f}x",
                  "yes" if c["bit_exact"] else "no", f"{c['rel_rmse']:.4f}")
    for b, r in res.runs.items():
        s, per_page = r.tiers, r.pool["bytes"] // max(r.pool["num_pages"], 1)
        if s["d2h_pages"]:
            raw = s["d2h_pages"] * per_page
            t.add_row(f"moved ({b})", "mixed", "", str(s["d2h_pages"]), format_bytes(raw),
                      format_bytes(s["d2h_bytes"]), f"{raw / s['d2h_bytes']:.2f}x", "", "",
                      style="dim")
    return t


def tier_table(res: DemoResult):
    from rich.table import Table
    t = Table(title="tier counters")
    t.add_column("counter")
    for b in res.runs:
        t.add_column(b, justify="right")
    for label, keys in TIER_COUNTERS:
        t.add_row(label, *(" / ".join(str(_counter(r, k)) for k in keys)
                           for r in res.runs.values()))
    return t


def _counter(run, key: str) -> int:
    return run.pool["evictions"] if key == "pool_evictions" else int(run.tiers.get(key, 0))


def plot(res: DemoResult, path: str | Path) -> Path:
    """AL per turn (paged vs arena) and prompt tokens per turn by where they came from."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paged, arena = res.runs["paged"], res.runs["arena"]
    turns = [t.turn for t in paged.turns]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.plot(turns, [t.acceptance_length for t in paged.turns], "o-", lw=2, color="tab:blue",
             label="paged drafter (context reused with the prefix)")
    ax1.plot(turns, [t.acceptance_length for t in arena.turns], "s--", lw=2, color="tab:orange",
             label="arena drafter (context empty after a hit)")
    for run, dy in ((paged, 8), (arena, -14)):
        for t in run.turns:
            ax1.annotate(f"{t.acceptance_length:.2f}", (t.turn, t.acceptance_length), fontsize=8,
                         textcoords="offset points", xytext=(0, dy), ha="center")
    ax1.set_xlabel("turn")
    ax1.set_ylabel("acceptance length (tokens / target step)")
    ax1.set_title("acceptance length per turn")
    ax1.set_xticks(turns)
    top = max([t.acceptance_length for r in (paged, arena) for t in r.turns] + [1.0])
    ax1.set_ylim(0, top * 1.2)            # room for the value labels above the top point
    ax1.grid(alpha=0.3)
    ax1.legend(loc="lower right", fontsize=8)
    parts = [("reused from device", "reused_device", "tab:green"),
             ("reused from host", "reused_host", "tab:cyan"),
             ("reused from disk", "reused_disk", "tab:purple")]
    bottom = [0] * len(turns)
    for label, key, color in parts:
        vals = [getattr(t, key) for t in paged.turns]
        ax2.bar(turns, vals, bottom=bottom, color=color, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    computed = [t.prompt_tokens - t.reused for t in paged.turns]
    ax2.bar(turns, computed, bottom=bottom, color="lightgray", label="computed (prefill)")
    ax2.set_xlabel("turn")
    ax2.set_ylabel("prompt tokens (all conversations)")
    ax2.set_title("prefix reuse per turn (paged run)")
    ax2.set_xticks(turns)
    ax2.legend(loc="upper left", fontsize=8)
    cfg = res.config
    fig.suptitle(f"kvstrata demo: {cfg.model}, {cfg.conversations} conversations x {cfg.turns} "
                 f"turns, {cfg.device}, NVFP4 target / lossless draft pages below the device")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
