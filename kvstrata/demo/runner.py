"""Run the demo workload on one drafter backend, then on the other, and compare them turn by turn.

Both runs use the same shipped target + drafter, the same prompts and the same memory shape: a
device pool that holds only ``max_batch_size`` sequences (the working set of all conversations
does not fit, so cached prefixes are evicted to a small host tier and from there to an LMDB disk
tier), NVFP4 target pages and lossless draft pages below the device.

Per-turn reuse per tier comes from the tier counters around each ``generate`` call: pages promoted
into the device (``h2d_pages``) were prefix hits below it, and of those, ``disk_to_host_pages``
were read from disk; the rest of the reused prefix was still in the device pool.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .. import tokenizer as tok
from .check import TIE_TOLERANCE, Divergence, ReferenceTarget, first_divergence, judge
from .workload import Conversation, build_conversations, max_prompt_tokens

BACKENDS = ("paged", "arena")

#: steps per request counted by the "first steps" AL: where an empty arena context hurts most
EARLY_STEPS = 4


@dataclass(frozen=True)
class DemoConfig:
    """What the demo runs. ``workdir`` receives one disk tier per backend."""

    workdir: Path
    conversations: int = 8
    turns: int = 6
    max_tokens: int = 24
    snippet_bytes: int = 32
    context_bytes: int = 2048          # the first turn's paste (0: snippet_bytes)
    seed: int = 0
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    model: str = "kvstrata-tiny-py"
    page_size: int = 16
    batch_size: int | None = None      # default: half the conversations (the pool holds these)
    host_pages: int | None = None      # default: a quarter of the final working set

    def __post_init__(self) -> None:
        if not isinstance(self.snippet_bytes, int) or self.snippet_bytes < 16:
            raise ValueError(f"snippet_bytes (--user-bytes) must be an integer >= 16, got "
                             f"{self.snippet_bytes!r}")
        if not isinstance(self.context_bytes, int) or self.context_bytes < 0:
            raise ValueError(f"context_bytes (--context-bytes) must be an integer >= 0, got "
                             f"{self.context_bytes!r}")
        for name in ("conversations", "turns", "max_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")

    @property
    def max_batch_size(self) -> int:
        return self.batch_size or max(1, self.conversations // 2)


@dataclass(slots=True)
class TurnStats:
    """One turn of one backend, summed over its conversations."""

    turn: int
    prompt_tokens: int = 0
    reused_device: int = 0
    reused_host: int = 0
    reused_disk: int = 0
    generated_tokens: int = 0
    steps: int = 0
    committed_in_steps: int = 0
    early_steps: int = 0               # each request's first EARLY_STEPS steps
    early_committed: int = 0
    ttft_s: float = 0.0                # mean over the turn's requests
    wall_s: float = 0.0

    @property
    def reused(self) -> int:
        return self.reused_device + self.reused_host + self.reused_disk

    @property
    def acceptance_length(self) -> float:
        return self.committed_in_steps / self.steps if self.steps else 0.0

    @property
    def early_acceptance_length(self) -> float:
        return self.early_committed / self.early_steps if self.early_steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "reused": self.reused, "acceptance_length": self.acceptance_length,
                "early_acceptance_length": self.early_acceptance_length,
                "tokens_per_s": self.tokens_per_s}


@dataclass(slots=True)
class BackendRun:
    """Everything one backend's run produced."""

    backend: str
    turns: list[TurnStats]
    outputs: list[list[list[int]]]     # [turn][conversation] generated token ids
    lossy_reuse: list[list[bool]]      # [turn][conversation]: reused K/V that went through NVFP4
    tiers: dict
    pool: dict
    compression: dict
    disk_path: str
    wall_s: float

    def as_dict(self) -> dict:
        return {"backend": self.backend, "turns": [t.as_dict() for t in self.turns],
                "tiers": self.tiers, "pool": self.pool, "compression": self.compression,
                "disk_path": self.disk_path, "wall_s": self.wall_s}


@dataclass(slots=True)
class DemoResult:
    config: DemoConfig
    conversations: list[str]
    runs: dict[str, BackendRun]
    problems: list[str] = field(default_factory=list)
    checked_requests: int = 0          # answers over exact K/V on both backends
    divergences: list[Divergence] = field(default_factory=list)   # of those, the differing ones

    @property
    def ok(self) -> bool:
        return not self.problems


Progress = Callable[[str, int, int], None]     # (backend, turns done, turns total)


def _tiers_factory(cfg: DemoConfig, backend: str, host_pages: int, promoted: set[bytes]):
    from ..tiers import DiskTier, TierManager
    path = Path(cfg.workdir) / f"disk-{backend}"

    class RecordingTiers(TierManager):
        """Remembers every page promoted into the device: its target K/V went through NVFP4."""

        def load_prefix(self, namespace, pages, page_ids):
            n = super().load_prefix(namespace, pages, page_ids)
            promoted.update(p.hash for p in pages[:n])
            return n

    def make(pool, namespace):
        return RecordingTiers(pool, namespace,
                              host_bytes=host_pages * TierManager.slot_bytes_for(pool),
                              disk=DiskTier(path, map_size=1 << 30))
    return make


def _compression(llm) -> dict:
    """Each group's codec on up to 64 of the pool's cached pages (real K/V of this run)."""
    from ..codecs.measure import compression_report
    pages = llm.pool.cached_pages()[:64]
    out = {}
    if not pages:
        return out
    idx = torch.tensor(pages, dtype=torch.int64, device=llm.pool.device)
    for g in llm.pool.groups:
        r = compression_report(llm.pool.kv[g.name].index_select(0, idx), g.codec, repeats=1)
        out[g.name] = {"codec": g.codec, "dtype": r.dtype, "pages": r.num_pages,
                       "raw_bytes": r.raw_bytes, "encoded_bytes": r.encoded_bytes,
                       "ratio": r.ratio, "bit_exact": r.bit_exact, "rel_rmse": r.rel_rmse}
    return out


def run_backend(cfg: DemoConfig, backend: str, convs: list[Conversation], max_seq_len: int,
                replay: list[list[list[int]]] | None = None,
                progress: Progress | None = None) -> tuple[BackendRun, list[list[list[int]]]]:
    """Run every turn of ``convs`` on ``backend``. Without ``replay`` the conversations advance
    with this run's answers; with it, its prompts (``[turn][conversation]``) are sent as-is.
    Returns the run and the prompts it sent."""
    from ..pagepool.hashing import page_hashes
    from ..runtime import LLM, CacheConfig, SamplingParams
    t_start = time.perf_counter()
    P = cfg.page_size
    # The pool holds max_batch_size sequences of max_seq_len; the host a quarter of what all
    # conversations hold at the end, so both tiers below the device see traffic.
    host_pages = cfg.host_pages or max(8, cfg.conversations * (max_seq_len // P) // 4)
    # Hashes of pages whose target K/V is not what a cold run computes: promoted from host/disk
    # (NVFP4 round trip), or computed by a request that attended over such pages.
    lossy: set[bytes] = set()
    cache = CacheConfig(page_size=P, max_seq_len=max_seq_len, max_batch_size=cfg.max_batch_size,
                        max_num_batched_tokens=1024, target_codec="nvfp4",
                        draft_codec="lossless", drafter_backend=backend,
                        tiers=_tiers_factory(cfg, backend, host_pages, lossy))
    llm = LLM(cfg.model, cfg.model, cache, device=cfg.device, dtype=cfg.dtype, seed=cfg.seed)
    ns = llm.mgr.namespace_for(None)
    params = SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0,
                            stop_token_ids=[tok.EOS])
    turns, outputs, lower, sent = [], [], [], []
    try:
        for t in range(cfg.turns):
            prompts = replay[t] if replay is not None else [c.prompt() for c in convs]
            before = llm.tiers.stats()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            wall = time.perf_counter() - t0
            after = llm.tiers.stats()
            llm.pool.check_invariants()
            bad = [o for o in outs if o.finish_reason == "rejected"]
            if bad:
                raise RuntimeError(f"{backend}: turn {t + 1}: request rejected: {bad[0].error}")
            lower_pages = after["h2d_pages"] - before["h2d_pages"]
            disk_pages = min(after["disk_to_host_pages"] - before["disk_to_host_pages"],
                             lower_pages)
            cached = sum(o.num_cached_tokens for o in outs)
            turns.append(TurnStats(
                t + 1, prompt_tokens=sum(len(p) for p in prompts),
                reused_device=cached - lower_pages * P, reused_host=(lower_pages - disk_pages) * P,
                reused_disk=disk_pages * P, generated_tokens=sum(len(o.token_ids) for o in outs),
                steps=sum(len(o.acceptance_lengths) for o in outs),
                committed_in_steps=sum(sum(o.acceptance_lengths) for o in outs),
                early_steps=sum(len(o.acceptance_lengths[:EARLY_STEPS]) for o in outs),
                early_committed=sum(sum(o.acceptance_lengths[:EARLY_STEPS]) for o in outs),
                ttft_s=sum(o.metrics["ttft_s"] for o in outs) / len(outs), wall_s=wall))
            tainted = []
            for p, o in zip(prompts, outs):
                hashes = page_hashes(ns, list(p) + o.token_ids)
                tainted.append(any(h in lossy for h in hashes[:o.num_cached_tokens // P]))
            for p, o, bad_kv in zip(prompts, outs, tainted):
                if bad_kv:
                    lossy.update(page_hashes(ns, list(p) + o.token_ids))
            outputs.append([o.token_ids for o in outs])
            lower.append(tainted)
            sent.append([list(p) for p in prompts])
            if replay is None:
                for c, p, o in zip(convs, prompts, outs):
                    c.answer(p, o.token_ids)
            if progress is not None:
                progress(backend, t + 1, cfg.turns)
        compression = _compression(llm)
        pool = llm.stats()["pool"]
        llm.tiers.drain_host()     # write-back: what the host still holds goes to disk
        llm.tiers.flush()
        tier_stats = llm.tiers.stats()
    finally:
        llm.tiers.close()
    run = BackendRun(backend, turns, outputs, lower, tier_stats, pool, compression,
                     str(llm.tiers.disk.path), time.perf_counter() - t_start)
    return run, sent


def run_demo(cfg: DemoConfig, progress: Progress | None = None) -> DemoResult:
    """The workload on the paged backend (which writes the transcript), then replayed on the
    arena backend; checks that nothing went wrong."""
    convs = build_conversations(cfg.conversations, cfg.turns, cfg.snippet_bytes, cfg.seed,
                                context_bytes=cfg.context_bytes)
    names = [c.name for c in convs]
    Path(cfg.workdir).mkdir(parents=True, exist_ok=True)
    P = cfg.page_size
    longest = max_prompt_tokens(convs, cfg.max_tokens) + cfg.max_tokens + 16
    max_seq_len = math.ceil(longest / P) * P
    paged, prompts = run_backend(cfg, "paged", convs, max_seq_len, progress=progress)
    arena, _ = run_backend(cfg, "arena", convs, max_seq_len, replay=prompts, progress=progress)
    res = DemoResult(cfg, names, {"paged": paged, "arena": arena})
    for r in res.runs.values():
        for key in ("checksum_failures", "mismatches", "disk_write_errors"):
            if r.tiers.get(key, 0):
                res.problems.append(f"{r.backend}: tier counter {key} = {r.tiers[key]}")
    _check_tokens(res, prompts)
    return res


def _check_tokens(res: DemoResult, prompts: list[list[list[int]]]) -> None:
    """Where neither run reused lossy (NVFP4, from host/disk) pages, both answers are greedy
    decodes of the target over exact K/V: equal, or first different at a near-tie of the target
    (both tokens within ``TIE_TOLERANCE`` of the float32 reference maximum; see ``check.py``)."""
    p, a = res.runs["paged"], res.runs["arena"]
    tol = TIE_TOLERANCE.get(res.config.dtype, TIE_TOLERANCE[torch.bfloat16])
    ref = None
    for t in range(len(p.outputs)):
        for c in range(len(p.outputs[t])):
            if p.lossy_reuse[t][c] or a.lossy_reuse[t][c]:
                continue
            res.checked_requests += 1
            x, y = p.outputs[t][c], a.outputs[t][c]
            k = first_divergence(x, y)
            if k is None:
                continue
            ref = ref or ReferenceTarget(res.config.model)
            d = judge(ref, prompts[t][c], x, y, k, tol, t + 1, c + 1)
            where = f"turn {t + 1}, conversation {c + 1} ({res.conversations[c]})"
            if d is None:
                res.problems.append(f"{where}: one backend's answer is a strict prefix of the "
                                    f"other's ({len(x)} vs {len(y)} tokens)")
                continue
            res.divergences.append(d)
            if not d.near_tie:
                res.problems.append(
                    f"{where}: paged and arena answers differ at token {k} although neither reused "
                    f"lossy pages, and it is no near-tie of the target: the float32 reference "
                    f"puts the tokens {d.gaps[0]:.3f} / {d.gaps[1]:.3f} nats below its maximum "
                    f"(tolerance {tol:g} for {str(res.config.dtype).split('.')[-1]})")
