"""Acceptance-length (AL) benchmarks: does a prefix hit cost the drafter anything?

AL = tokens committed per target step, pooled over every step of every prompt of a pass
(``sum(acceptance_lengths) / number of steps``; the first token comes from the prefill and is not a
step). Every scenario runs the same held-out prompts twice under one ``cache_salt`` of its own
(so no two scenarios share a page): *cold* (nothing cached) and *warm* (the same requests again,
the prompt prefix found in the device pool, the host tier or the disk tier). Warm is compared with
the cold pass of the same scenario, run by the same engine in the same process.

Scenarios (:data:`SCENARIOS`):

- ``paged``: default drafter backend, warm from the device pool (goal: warm AL >= 0.98 x cold).
- ``arena``: the private per-request draft buffer; after a prefix hit it starts empty and drafts
  from the un-reused tail only, so its warm AL drops (the baseline the paged backend fixes).
- tiered, warm from the host tier (every cached device page evicted, hence encoded with its
  group's codec and demoted) and from the disk tier (evicted, then ``TierManager.drain_host()``
  writes every host page to LMDB and empties the host), per target / draft codec pair:
  ``tiers-mixed`` (``nvfp4`` / ``lossless``, the default: goal warm AL >= 0.95 x cold),
  ``tiers-lossless`` (``lossless`` / ``lossless``: tokens identical to cold), ``tiers-nvfp4``
  (``nvfp4`` / ``nvfp4``: lossy draft pages too) and ``tiers-draft-nvfp4`` (``lossless`` /
  ``nvfp4``: isolates what lossy draft pages cost; the target side is exact, so greedy tokens
  stay identical and only the AL can move).
- ``sampled``: temperature 1.0 with rejection sampling, fixed per-prompt seeds, paged and arena,
  warm from the device pool.

:func:`run_acceptance_suite` returns a JSON-able dict; :func:`render_markdown` turns it into the
table in ``docs/benchmarks.md``.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Iterable

import torch

SCENARIOS = ("paged", "arena", "tiers-mixed", "tiers-lossless", "tiers-nvfp4", "tiers-draft-nvfp4",
             "sampled")

#: warm AL / cold AL a scenario should reach (None: no goal, the figure is what it measures).
GOALS = {"paged": 0.98, "tiers-mixed": 0.95, "tiers-lossless": 1.0}

#: tiered scenario -> (target codec, draft codec)
TIER_CODECS = {"tiers-mixed": ("nvfp4", "lossless"), "tiers-lossless": ("lossless", "lossless"),
               "tiers-nvfp4": ("nvfp4", "nvfp4"), "tiers-draft-nvfp4": ("lossless", "nvfp4")}

#: steps per prompt counted by ``early_al``: where an empty arena hurts most
EARLY_STEPS = 4


@dataclass(slots=True)
class PassResult:
    """One ``generate`` call over all prompts."""

    scenario: str
    kind: str                       # "cold" or "warm"
    source: str                     # where the warm prefix came from: "-", "device", "host", "disk"
    backend: str
    target_codec: str
    draft_codec: str
    temperature: float
    salt: str
    mean_al: float
    early_al: float                 # pooled AL of each prompt's first EARLY_STEPS steps
    steps: int
    prompt_tokens: int
    generated_tokens: int
    seconds: float
    ttft_s: float                   # mean time to first token (admission -> first token)
    reused: dict[str, int]          # prompt tokens reused per tier (device/host/disk)
    cold_al: float | None = None    # AL of the same scenario's cold pass (None for cold)
    al_ratio: float | None = None   # warm AL / cold AL
    tokens_identical: bool | None = None
    common_prefix: float | None = None  # mean generated tokens equal to cold before the first diff
    goal: float | None = None
    token_ids: list[list[int]] = field(default_factory=list)
    acceptance_lengths: list[list[int]] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def met(self) -> bool | None:
        if self.goal is None or self.al_ratio is None:
            return None
        return self.al_ratio >= self.goal - 1e-9


class _AdmitLog:
    """Records ``SequenceState.cached_from`` of every admission (the engine does not return it).

    Installed as an instance attribute over ``KVCacheManager.admit``; the manager is unchanged.
    """

    def __init__(self, mgr):
        self._admit = mgr.admit
        self.rows: list[dict[str, int]] = []
        mgr.admit = self

    def __call__(self, *args, **kwargs):
        seq = self._admit(*args, **kwargs)
        self.rows.append(dict(seq.cached_from))
        return seq


def _pooled(als) -> float:
    """Tokens committed per step over all steps of all prompts."""
    als = list(als)
    steps = sum(len(a) for a in als)
    return sum(map(sum, als)) / steps if steps else 0.0


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _dtype(dtype) -> torch.dtype | str:
    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    dt = getattr(torch, str(dtype), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r} (use e.g. float32, bfloat16 or auto)")
    return dt


class _Suite:
    """Builds engines and runs passes for one suite invocation (no state outside it)."""

    def __init__(self, prompts, max_seq_len, max_tokens, device, dtype, tmpdir, model, seed):
        self.prompts = prompts
        self.max_seq_len = max_seq_len
        self.max_tokens = max_tokens
        self.device, self.dtype = device, dtype
        self.tmpdir = os.fspath(tmpdir)
        self.model = model
        self.seed = seed
        self.passes: list[PassResult] = []

    # -- engines -------------------------------------------------------------------------------
    def engine(self, backend="paged", target_codec="nvfp4", draft_codec="lossless", disk=None):
        from ..runtime import LLM, CacheConfig

        n = len(self.prompts)
        tiers = None
        if disk is not None:
            tiers = _tier_factory(os.path.join(self.tmpdir, disk))
        # Device-only engines get room for two passes; tiered ones one pass (all of it evicted
        # before the warm pass anyway).
        cache = CacheConfig(page_size=16, max_seq_len=self.max_seq_len,
                            max_batch_size=n if tiers else 2 * n,
                            max_num_batched_tokens=2048, target_codec=target_codec,
                            draft_codec=draft_codec, drafter_backend=backend, tiers=tiers)
        llm = LLM(self.model, self.model, cache, device=self.device, dtype=self.dtype,
                  seed=self.seed)
        return llm, _AdmitLog(llm.mgr)

    def params(self, temperature: float):
        from ..runtime import SamplingParams

        return [SamplingParams(max_tokens=self.max_tokens, temperature=temperature,
                               seed=self.seed * 100_003 + i if temperature > 0 else None)
                for i in range(len(self.prompts))]

    # -- one pass ------------------------------------------------------------------------------
    def run(self, llm, log: _AdmitLog, scenario: str, kind: str, source: str, salt: str,
            temperature: float = 0.0, cold: PassResult | None = None) -> PassResult:
        P = llm.pool.page_size
        before = llm.tiers.stats() if llm.tiers is not None else {}
        start = len(log.rows)
        t0 = time.perf_counter()
        outs = llm.generate(self.prompts, self.params(temperature), cache_salt=salt)
        seconds = time.perf_counter() - t0
        bad = [o.error for o in outs if o.finish_reason == "rejected"]
        if bad:
            raise RuntimeError(f"{scenario} {kind}: requests rejected: {bad[:3]}")
        after = llm.tiers.stats() if llm.tiers is not None else {}
        rows = log.rows[start:]
        dev = sum(r.get("device", 0) for r in rows) * P
        lower = sum(r.get("lower", 0) for r in rows) * P
        disk = min(lower, (after.get("disk_to_host_pages", 0)
                           - before.get("disk_to_host_pages", 0)) * P)
        cached = sum(o.num_cached_tokens for o in outs)
        if cached != dev + lower:
            raise RuntimeError(f"{scenario} {kind}: num_cached_tokens={cached} but the manager "
                               f"reported {dev} device + {lower} lower-tier tokens")
        als = [list(o.acceptance_lengths) for o in outs]
        steps = sum(len(a) for a in als)
        cfg = llm.cache
        r = PassResult(
            scenario=scenario, kind=kind, source=source, backend=cfg.drafter_backend,
            target_codec=cfg.target_codec, draft_codec=cfg.draft_codec, temperature=temperature,
            salt=salt, mean_al=_pooled(als), early_al=_pooled(a[:EARLY_STEPS] for a in als),
            steps=steps,
            prompt_tokens=sum(len(p) for p in self.prompts),
            generated_tokens=sum(len(o.token_ids) for o in outs), seconds=seconds,
            ttft_s=sum(o.metrics["ttft_s"] for o in outs) / len(outs),
            reused={"device": dev, "host": lower - disk, "disk": disk},
            token_ids=[list(o.token_ids) for o in outs], acceptance_lengths=als)
        if cold is not None:
            r.cold_al = cold.mean_al
            r.al_ratio = r.mean_al / cold.mean_al if cold.mean_al else None
            r.tokens_identical = r.token_ids == cold.token_ids
            r.common_prefix = sum(_common_prefix(a, b) for a, b in zip(r.token_ids, cold.token_ids)
                                  ) / len(self.prompts)
            r.goal = GOALS.get(scenario)
        self.passes.append(r)
        return r

    def cold_warm(self, llm, log, scenario: str, salt: str, temperature: float = 0.0) -> None:
        cold = self.run(llm, log, scenario, "cold", "-", salt, temperature)
        self.run(llm, log, scenario, "warm", "device", salt, temperature, cold)

    # -- scenarios -----------------------------------------------------------------------------
    def device_scenarios(self, backend: str, greedy: bool, sampled: bool) -> None:
        llm, log = self.engine(backend=backend)
        if greedy:
            self.cold_warm(llm, log, backend, f"{backend}-greedy")
        if sampled:
            self.cold_warm(llm, log, "sampled", f"{backend}-t1", temperature=1.0)

    def tier_scenario(self, scenario: str) -> None:
        tc, dc = TIER_CODECS[scenario]
        llm, log = self.engine(target_codec=tc, draft_codec=dc, disk=scenario)
        try:
            for source in ("host", "disk"):
                salt = f"{scenario}-{source}"
                cold = self.run(llm, log, scenario, "cold", "-", salt)
                # Demote: evict every cached device page (the path a full pool's allocate takes),
                # so each page is encoded with its group's codec and copied to the host tier.
                llm.pool.evict(llm.pool.num_cached)
                if source == "disk":
                    llm.tiers.drain_host()   # host pages -> LMDB; the host tier is empty after
                self.run(llm, log, scenario, "warm", source, salt, cold=cold)
        finally:
            llm.tiers.disk.close()


def _tier_factory(path: str):
    """``CacheConfig.tiers`` callable: host slots for twice the pool, an LMDB disk tier."""
    from ..tiers import DiskTier, TierManager

    def make(pool, namespace):
        slot = TierManager.slot_bytes_for(pool)
        return TierManager(pool, namespace, host_bytes=2 * pool.num_pages * slot,
                           disk=DiskTier(path, map_size=max(1 << 26, 8 * pool.num_pages * slot)))

    return make


def run_acceptance_suite(n_prompts: int = 16, prompt_len: int = 256, max_tokens: int = 128,
                         device: str = "cpu", dtype="float32",
                         tmpdir: str | os.PathLike | None = None,
                         scenarios: Iterable[str] = SCENARIOS, model: str = "kvstrata-tiny-py",
                         seed: int = 0) -> dict:
    """Run the acceptance scenarios on ``n_prompts`` held-out prompts; returns a JSON-able dict.

    Args:
        n_prompts, prompt_len: held-out prompts (``kvstrata.assets.corpus.heldout_prompts``).
        max_tokens: new tokens per prompt.
        device, dtype: where and in what dtype the models and the page pool live.
        tmpdir: directory for the disk tiers (one LMDB per tiered scenario, created inside);
            ``None``: a temporary directory, removed afterwards.
        scenarios: a subset of :data:`SCENARIOS`.
        model: a shipped pair name or a directory holding ``target/`` and ``drafter/``.
        seed: prompt selection and sampling seeds.

    Returns ``{"conditions": {...}, "passes": [PassResult as dict + tok_s, met]}``.
    """
    from ..assets.corpus import heldout_prompts

    scenarios = tuple(scenarios)
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenarios {unknown}; choose from {SCENARIOS}")
    for name, v in (("n_prompts", n_prompts), ("prompt_len", prompt_len),
                    ("max_tokens", max_tokens)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if prompt_len <= 16:
        raise ValueError(f"prompt_len={prompt_len} leaves no full 16-token page to reuse (the "
                         f"last prompt token is always recomputed); use at least 17")
    if tmpdir is None:
        with tempfile.TemporaryDirectory(prefix="kvstrata-acc-") as tmp:
            return run_acceptance_suite(n_prompts, prompt_len, max_tokens, device, dtype, tmp,
                                        scenarios, model, seed)
    os.makedirs(tmpdir, exist_ok=True)
    prompts = heldout_prompts(n_prompts, prompt_len, seed)
    max_seq_len = -(-(prompt_len + max_tokens) // 16) * 16
    suite = _Suite(prompts, max_seq_len, max_tokens, device, _dtype(dtype), tmpdir, model, seed)
    t0 = time.perf_counter()
    for backend in ("paged", "arena"):
        greedy, sampled = backend in scenarios, "sampled" in scenarios
        if greedy or sampled:
            suite.device_scenarios(backend, greedy, sampled)
    for s in SCENARIOS:
        if s in TIER_CODECS and s in scenarios:
            suite.tier_scenario(s)
    passes = []
    for p in suite.passes:
        d = asdict(p)
        d.update(tok_s=p.tok_s, met=p.met)
        passes.append(d)
    return {
        "conditions": {
            "model": model, "device": str(device), "dtype": str(_dtype(dtype)),
            "n_prompts": n_prompts, "prompt_len": prompt_len, "max_tokens": max_tokens,
            "page_size": 16, "max_seq_len": max_seq_len, "seed": seed,
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "total_s": time.perf_counter() - t0,
        },
        "passes": passes,
    }


#: the prompt-length sweep's default lengths (``kvstrata bench acceptance --prompt-lens``)
SWEEP_LENS = (256, 1024, 2048, 3584)


def run_length_sweep(prompt_lens: Iterable[int] = SWEEP_LENS, n_prompts: int = 16,
                     max_tokens: int = 128, device: str = "cpu", dtype="float32",
                     tmpdir: str | os.PathLike | None = None,
                     scenarios: Iterable[str] = ("paged", "arena", "tiers-mixed"),
                     model: str = "kvstrata-tiny-py", seed: int = 0) -> dict:
    """:func:`run_acceptance_suite` once per prompt length (cold / warm per scenario and tier);
    returns ``{"conditions": {...}, "sweep": [suite result per length]}``."""
    lens = [int(n) for n in prompt_lens]
    if not lens:
        raise ValueError("prompt_lens is empty: give at least one prompt length")
    if len(set(lens)) != len(lens):
        raise ValueError(f"prompt_lens has repeats: {lens}")
    scenarios = tuple(scenarios)
    t0 = time.perf_counter()
    runs = []
    for n in lens:
        sub = None if tmpdir is None else os.path.join(os.fspath(tmpdir), f"len{n}")
        runs.append(run_acceptance_suite(n_prompts, n, max_tokens, device, dtype, sub, scenarios,
                                         model, seed))
    cond = dict(runs[0]["conditions"])
    cond.update(prompt_lens=lens, total_s=time.perf_counter() - t0)
    for k in ("prompt_len", "max_seq_len"):
        cond.pop(k)
    return {"conditions": cond, "sweep": runs}


def render_sweep_markdown(result: dict) -> str:
    """One row per prompt length and scenario: cold AL, then warm AL and ratio per tier."""
    c = result["conditions"]
    lines = [
        f"{_machine(c)}; {c['n_prompts']} held-out prompts per length (seed "
        f"{c['seed']}), {c['max_tokens']} new tokens, page size {c['page_size']}; whole sweep "
        f"{c['total_s']:.1f} s. AL / cold in parentheses; TTFT = mean admission -> first token "
        f"of the pass (cold = the whole prompt recomputed).",
        "",
        "| prompt | scenario | backend | codecs | cold AL | cold AL first 4 | warm from | warm AL "
        "| warm AL first 4 | tokens = cold | TTFT cold ms | TTFT warm ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in result["sweep"]:
        n = run["conditions"]["prompt_len"]
        cold = None
        for p in run["passes"]:
            if p["kind"] == "cold":
                cold = p
                continue
            codecs = _codecs(p, "-")
            lines.append(
                f"| {n} | {p['scenario']} | {p['backend']} | {codecs} | {cold['mean_al']:.3f} | "
                f"{cold['early_al']:.3f} | {p['source']} | {p['mean_al']:.3f} "
                f"({'-' if p['al_ratio'] is None else format(p['al_ratio'], '.3f')}) | "
                f"{p['early_al']:.3f} | {_same(p)} | "
                f"{cold['ttft_s'] * 1e3:.1f} | {p['ttft_s'] * 1e3:.1f} |")
    return "\n".join(lines) + "\n"


def _machine(c: dict) -> str:
    """The head of a result's conditions: model, device, machine, threads, dtype, torch."""
    return (f"Conditions: `{c['model']}` on {c['device']} ({c['machine']}, {c['threads']} "
            f"threads), {c['dtype']}, torch {c['torch']}")


def _codecs(p: dict, device_only: str) -> str:
    """A pass's codecs (target / draft), or ``device_only`` for a scenario whose pages never
    leave the device pool (codecs only act on pages that do)."""
    if p["scenario"] in TIER_CODECS:
        return f"{p['target_codec']} / {p['draft_codec']}"
    return device_only


def _same(p: dict) -> str:
    if p["tokens_identical"] is None:
        return "-"
    if p["tokens_identical"]:
        return "yes"
    return f"no (first {p['common_prefix']:.1f} same)"


def render_markdown(result: dict) -> str:
    """The suite's result as a markdown table (one row per pass) with its conditions."""
    c = result["conditions"]
    lines = [
        f"{_machine(c)}; {c['n_prompts']} held-out prompts x "
        f"{c['prompt_len']} tokens (seed {c['seed']}), {c['max_tokens']} new tokens, page size "
        f"{c['page_size']}, max_seq_len {c['max_seq_len']}; whole suite {c['total_s']:.1f} s.",
        "",
        f"| scenario | pass | from | backend | codecs (target / draft) | T | AL | AL first "
        f"{EARLY_STEPS} steps | AL / cold | goal | tokens = cold | prompt tokens reused "
        f"(device / host / disk) | tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in result["passes"]:
        ratio = "-" if p["al_ratio"] is None else f"{p['al_ratio']:.3f}"
        goal = "-" if p["goal"] is None else (f">= {p['goal']:.2f} "
                                               f"{'met' if p['met'] else '**missed**'}")
        codecs = _codecs(p, "n/a (device)")
        ru = p["reused"]
        lines.append(
            f"| {p['scenario']} | {p['kind']} | {p['source']} | {p['backend']} | {codecs} | "
            f"{p['temperature']:g} | {p['mean_al']:.3f} | {p['early_al']:.3f} | {ratio} | "
            f"{goal} | {_same(p)} | {ru['device']} / {ru['host']} / "
            f"{ru['disk']} of {p['prompt_tokens']} | {p['tok_s']:.0f} |")
    return "\n".join(lines) + "\n"
