"""``/metrics``: Prometheus text exposition through ``prometheus_client`` (one registry per server).

Two kinds of series:

* observed per request by the engine thread as deltas arrive (counters and histograms): requests
  by finish reason, prompt and generated tokens, acceptance length per verify step, time to first
  token (from the request's arrival at the server, so queueing counts), prompt tokens reused from
  the prefix cache per tier;
* read from ``LLM.stats()`` at scrape time (a custom collector): pool pages by state, tier
  occupancy, engine steps and preemptions, and the runner's verify width per batch size with
  its inputs (estimated step time per width, draft acceptance by position). The snapshot is
  taken by the engine thread, the only thread that touches the engine.
"""

from __future__ import annotations

from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics", "TIERS"]

TIERS = ("device", "host", "disk", "remote")
#: lower tier -> the ``TierManager.stats()`` counter of pages demoted into it / promoted out of it
DEMOTIONS = {"host": "d2h_pages", "disk": "host_to_disk_pages", "remote": "host_to_remote_pages"}
PROMOTIONS = {"host": "h2d_pages", "disk": "disk_to_host_pages", "remote": "remote_to_host_pages"}
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _StatsCollector:
    """Series derived from the last ``LLM.stats()`` snapshot handed to ``render``."""

    def __init__(self) -> None:
        self.snapshot: dict = {}

    def describe(self) -> list:
        return []     # unchecked collector: series appear once a snapshot exists

    def collect(self) -> Iterable:
        s = self.snapshot
        if not s:
            return
        pool = s.get("pool", {})
        pages = GaugeMetricFamily("kvstrata_pool_pages", "Device page pool pages by state",
                                  labels=["state"])
        for state in ("free", "in_use", "cached"):
            if state in pool:
                pages.add_metric([state], pool[state])
        yield pages
        if "num_pages" in pool:
            yield GaugeMetricFamily("kvstrata_pool_capacity_pages", "Device page pool size",
                                    value=pool["num_pages"])
        if "evictions" in pool:
            yield CounterMetricFamily("kvstrata_pool_evictions", "Cached pages evicted from "
                                      "the device pool", value=pool["evictions"])
        eng = s.get("engine", {})
        for key, help in (("preemptions", "Running requests preempted under pool pressure"),
                          ("steps", "Engine steps")):
            if key in eng:
                yield CounterMetricFamily(f"kvstrata_engine_{key}", help, value=eng[key])
        run = s.get("runner", {})
        if run.get("verify_width_by_batch"):
            vw = GaugeMetricFamily("kvstrata_verify_width", "Positions a speculative step "
                                   "verifies per sequence (1: no drafts), last chosen per "
                                   "padded batch size",
                                   labels=["batch"])
            for b, w in run["verify_width_by_batch"].items():
                vw.add_metric([str(b)], w)
            yield vw
        if run.get("verify_step_ms"):
            vt = GaugeMetricFamily("kvstrata_verify_step_ms", "Estimated device time of a "
                                   "speculative step per padded batch size and verify width "
                                   "(milliseconds; the width policy's step time)",
                                   labels=["batch", "width"])
            for b, per in run["verify_step_ms"].items():
                for w, ms in per.items():
                    vt.add_metric([str(b), str(w)], ms)
            yield vt
        if run.get("draft_acceptance"):
            da = GaugeMetricFamily("kvstrata_draft_acceptance", "Estimated probability that "
                                   "the draft at a block position is accepted when every "
                                   "earlier one was", labels=["position"])
            for j, p in enumerate(run["draft_acceptance"], 1):
                da.add_metric([str(j)], p)
            yield da
        tiers = s.get("tiers")
        if tiers:
            tp = GaugeMetricFamily("kvstrata_tier_pages", "Pages held per lower tier",
                                   labels=["tier"])
            tb = GaugeMetricFamily("kvstrata_tier_bytes", "Bytes held per lower tier",
                                   labels=["tier"])
            tc = GaugeMetricFamily("kvstrata_tier_capacity_bytes", "Capacity per lower tier",
                                   labels=["tier"])
            for tier in TIERS[1:]:
                if f"{tier}_pages" in tiers:
                    tp.add_metric([tier], tiers[f"{tier}_pages"])
                if f"{tier}_bytes" in tiers:
                    tb.add_metric([tier], tiers[f"{tier}_bytes"])
                if f"{tier}_capacity_bytes" in tiers:
                    tc.add_metric([tier], tiers[f"{tier}_capacity_bytes"])
            yield from (tp, tb, tc)
            down = CounterMetricFamily("kvstrata_tier_demoted_pages", "Pages demoted into a "
                                       "lower tier", labels=["tier"])
            up = CounterMetricFamily("kvstrata_tier_promoted_pages", "Pages promoted out of a "
                                     "lower tier (host: into the device pool; disk: to the host)",
                                     labels=["tier"])
            for fam, moves in ((down, DEMOTIONS), (up, PROMOTIONS)):
                for tier, key in moves.items():
                    if key in tiers:
                        fam.add_metric([tier], tiers[key])
            yield from (down, up)


class ServerMetrics:
    """Every series the server exposes, in a private registry (no process-global state)."""

    def __init__(self, model: str, block_size: int):
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter("kvstrata_requests", "Finished requests by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("kvstrata_prompt_tokens", "Prompt tokens of admitted "
                                     "requests", registry=r)
        self.generation_tokens = Counter("kvstrata_generation_tokens", "Generated tokens",
                                         registry=r)
        self.cached_tokens = Counter("kvstrata_prefix_cached_tokens", "Prompt tokens reused "
                                     "from the prefix cache, by the tier they came from",
                                     ["tier"], registry=r)
        # A verify step commits 1..block_size tokens.
        self.acceptance_length = Histogram(
            "kvstrata_acceptance_length", "Tokens committed per verify step",
            buckets=tuple(range(1, max(block_size, 1) + 1)), registry=r)
        self.ttft = Histogram("kvstrata_time_to_first_token_seconds", "From arrival at the "
                              "server to the first generated token", buckets=TTFT_BUCKETS,
                              registry=r)
        self.running = Gauge("kvstrata_requests_in_flight", "Requests submitted and not "
                             "finished", registry=r)
        self.rejected = Counter("kvstrata_rejected_requests", "Requests answered with a 4xx "
                                "error", ["status"], registry=r)
        info = Gauge("kvstrata_model_info", "The served model", ["model"], registry=r)
        info.labels(model).set(1)
        for t in TIERS:      # every tier series exists from the start, at zero
            self.cached_tokens.labels(t)
        self._stats = _StatsCollector()
        r.register(self._stats)

    def observe_admitted(self, delta) -> None:
        """The request's first delta: its prompt and what the prefix cache gave it, per tier."""
        self.prompt_tokens.inc(delta.num_prompt_tokens)
        for tier, n in (delta.cached_by_tier or {}).items():
            if n:
                self.cached_tokens.labels(tier).inc(n)

    def observe(self, delta) -> None:
        """Every delta: generated tokens, the step's acceptance length, a finish."""
        if delta.new_token_ids:
            self.generation_tokens.inc(len(delta.new_token_ids))
        if delta.acceptance_length:
            self.acceptance_length.observe(delta.acceptance_length)
        if delta.finished:
            self.requests.labels(delta.finish_reason or "unknown").inc()

    def render(self, stats: dict) -> bytes:
        """The exposition text with ``stats`` (an ``LLM.stats()`` snapshot) folded in."""
        self._stats.snapshot = stats
        return generate_latest(self.registry)
