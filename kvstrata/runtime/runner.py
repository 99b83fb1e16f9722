"""The model runner: the device side of one engine step (draft, verify, accept, context write).

The engine (:mod:`.engine`) schedules and turns tokens into outputs; it hands the runner one
step's items (:class:`StepItem`) and gets back, per item, the tokens the step produced as host
lists, after ONE small device-to-host copy into pinned memory.

Two paths:

- **decode** (every item generates with a block of ``1..B`` positions, greedy, paged drafter or
  none): the step reads persistent device buffers (pending token, committed length, block
  length and block table row per sequence, split lengths of the attention plans), computes
  positions and slots on the device, drafts ``V - 1`` tokens from a block of ``V`` positions
  (``V <= B``: the step's verify width, chosen per batch size by :mod:`.verify_width`'s
  policy; ``RunnerConfig.draft_block="full"`` drafts the whole block of ``B`` instead),
  verifies the first ``V`` positions, accepts greedily, writes the draft context K/V of the
  committed rows (slots of rejected rows are masked to -1) and leaves ``[tokens..., count,
  positions verified]`` per row in a device buffer. Rows sit at a fixed stride: the draft
  block's in the draft, ``V`` in the verify. A shortened
  block (a sequence's last, or one at the length limit) uses its first ``n`` rows (the plans
  carry per-row query lengths), the rest are masked: slot -1, never attended to, never
  accepted. With CUDA graphs on, the batch is padded to the next size of a ladder and two
  graphs per size and width are replayed (draft, verify; at width 1 the verify graph alone);
  padding rows carry slot -1 and length 0, which every kernel ignores. Eagerly (CPU, graphs
  off, or the ``KVSTRATA_CUDA_GRAPHS=0`` switch) the same function runs on the exact batch.
- **general** (prefill chunks, mixed steps, sampling, the arena baseline): packed eager
  forward (:class:`~.general.GeneralPath`, in its own module).

A decode step is :meth:`ModelRunner.submit` (stage, replay, queue the copy) then
:meth:`ModelRunner.collect` (wait, read). :meth:`ModelRunner.submit_next` submits the step
that continues the last one before it is collected: the step's first kernel
(``kernels.step_inputs``, captured in the graphs) takes each row's pending token and lengths
from the previous step's output on the device, so the engine's host work on step N overlaps
the device's step N + 1 (pinned staging, :mod:`.staging`, has two slots for that).

Graph replay runs the same kernels with the same launch parameters on the same buffers as the
eager decode path, so both give bit-identical tokens and K/V (``tests/runtime/test_runner_cuda``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from ..drafter import PagedDraftAttention
from ..kernels._device import num_sms as device_num_sms
from ..kernels.attention_plan import (DEFAULT_SPLIT_POLICY, AttentionMetadata,
                                      choose_num_splits)
from ..kernels.gemv import gemv_argmax
from ..kernels.step_inputs import assemble_step_inputs, greedy_accept, step_positions
from .config import (SPLIT_ALIGN, RunnerConfig, default_ladder, draft_block_mode,
                     graph_batch_size, graphs_enabled, overlap_enabled)
from .general import GeneralPath
from .staging import StepStaging
from .step import StepItem, StepTiming
from .verify_width import WIDTHS_ENV, WidthPolicy, default_widths, parse_widths

#: A step's split length is a multiple of this (of ``SPLIT_ALIGN`` with sliding-window
#: layers): the longest context spreads over every split program of the graph's grid. H200,
#: batch 1 at 1k in the runner's grid (split sweep, docs/benchmarks.md): 32-token splits took
#: decode attention from 15.9 to 10.1 us per layer and verify-16 from 21.9 to 14.3 against
#: 256-token splits.
_SPLIT_STEP = 32


def _inference(fn):
    """``fn`` in ``torch.inference_mode``, entered once: called from inside it (``execute`` ->
    ``decode`` -> ``submit``, or an engine already in it), ``fn`` runs as it is (each entry
    costs ~2 us of host time, and a synchronous step's host time leaves the device idle)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)
    return run


@dataclass(slots=True, eq=False)
class InFlight:
    """A decode step submitted to the device (:meth:`ModelRunner.submit`), in flight until
    collected: its padded batch ``b``, its ``n`` rows, its pinned staging slot, its verify
    ``width`` and whether its device time was recorded for the width policy (``timed``)."""
    b: int
    n: int
    slot: int
    width: int = 1
    timed: bool = False


@dataclass(slots=True)
class _Plans:
    verify: dict[int, AttentionMetadata]      # by verify width
    block: dict[int, AttentionMetadata]       # the draft block's, by its rows per sequence
    causal: dict[int, AttentionMetadata]      # the causal draft layers' (same keys), if any
    splits: tuple[int, int, int]


class ModelRunner:
    """Device side of the speculative (or plain) step over the page pool.

    Args:
        target, drafter: the models (``drafter`` ``None``: plain decoding, ``B = 1``).
        pool: the :class:`PagePool` (``target`` and, for the paged drafter, ``draft`` groups).
        mgr: the :class:`KVCacheManager` (page tables of the admitted sequences).
        block_size: draft block size ``B``.
        max_batch_size, max_seq_len: sizes of the persistent buffers.
        arena: the arena baseline's :class:`DraftArena` (general path only), or ``None``.
        generator: RNG for requests without their own seed.
    """

    def __init__(self, target, drafter, pool, mgr, *, block_size: int, max_batch_size: int,
                 max_seq_len: int, arena=None, generator: torch.Generator | None = None,
                 attn_impl: str = "auto", config: RunnerConfig | None = None):
        self.cfg = config = config if config is not None else RunnerConfig()
        if not isinstance(config, RunnerConfig):
            raise ValueError(f"runner config must be a RunnerConfig, got {type(config).__name__}")
        self.target, self.drafter, self.pool, self.mgr = target, drafter, pool, mgr
        self.arena, self.generator, self.attn_impl = arena, generator, attn_impl
        # One product for q/k/v and one for gate/up per layer (idempotent: loading merges).
        target.merge_weights()
        if drafter is not None:
            drafter.merge_weights()
        self.device = dev = pool.device
        self.B = B = block_size if drafter is not None else 1
        self.P = P = pool.page_size
        self.paged = drafter is not None and arena is None
        self.taps = list(drafter.cfg.target_layer_ids) if drafter is not None else []
        self.max_batch = max_batch_size
        self.max_seq_len = max_seq_len
        self.max_pages = math.ceil(max_seq_len / P)
        # The arena baseline's private buffers live outside the pool: always the general path.
        self.use_graphs = graphs_enabled(config, dev) and (drafter is None or self.paged)
        #: the engine may submit a decode step before collecting the previous one
        #: (:meth:`submit_next`); the arena baseline has no decode path
        self.overlap = overlap_enabled(config, dev) and (drafter is None or self.paged)
        self.ladder = config.batch_sizes or default_ladder(max_batch_size)
        if self.ladder[-1] < max_batch_size and self.use_graphs:
            self.ladder = tuple(sorted(set(self.ladder) | {max_batch_size}))
        #: verify widths (widest first) and the policy choosing one per step
        self.widths = self._widths(config)
        self.width_policy = WidthPolicy(B, self.widths)
        #: rows per sequence of the draft block at each verify width (see ``draft_block``)
        narrow = draft_block_mode(config) == "width"
        self.draft_rows = {w: w if narrow else B for w in self.widths if w > 1}
        # Persistent device buffers (graphs read these addresses on every replay). ``small``
        # holds, per row, the pending token, the committed length (-1: padding row) and the
        # block length, then the three plans' split lengths; the step's first kernel
        # (``kernels.step_inputs``) writes it from ``inp`` (per row: the row of the previous
        # step it continues, or -1, then the host's token, length, block length and length
        # limit), which travels in one host->device copy per step. The plans read the block
        # lengths as int32 (``qlen32``).
        mb = max_batch_size
        self._small = torch.zeros(3 * mb + 3, dtype=torch.int64, device=dev)
        self.tok, self.start = self._small[:mb], self._small[mb:2 * mb]
        self.qlen = self._small[2 * mb:3 * mb]
        self.qlen32 = torch.zeros(mb, dtype=torch.int32, device=dev)
        # the verify plan's query lengths: min(block length, verify width)
        self.qlenv32 = torch.zeros(mb, dtype=torch.int32, device=dev)
        self.split_tokens = self._small[3 * mb:]
        self._in = torch.zeros(5 * mb, dtype=torch.int64, device=dev)
        self.min_split_tokens = config.min_split_tokens
        windowed = bool(target.config.sliding_windows and any(
            w is not None for w in target.config.sliding_windows)) or (
            drafter is not None and any(w is not None for w in drafter.cfg.layer_window))
        self._split_step = SPLIT_ALIGN if windowed else _SPLIT_STEP
        self.block_tables = torch.zeros((mb, self.max_pages), dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros((3, mb), dtype=torch.int32, device=dev)
        self.drafts = torch.zeros((mb, max(B - 1, 1)), dtype=torch.int64, device=dev)
        # per row: the target's tokens, the count produced, the positions verified
        self.out = torch.zeros((mb, B + 2), dtype=torch.int32, device=dev)
        # query start offsets at a fixed stride: B (the draft block) and each verify width
        self._qsls = {w: torch.arange(mb + 1, dtype=torch.int32, device=dev) * w
                      for w in {B, *self.widths}}
        # pinned staging, two slots (overlapped steps: see .staging)
        self.staging = StepStaging(mgr, self._in, self.block_tables, self.out, B)
        self._slot = 1
        self._last: InFlight | None = None               # the last submitted decode step
        self._uncollected: list[InFlight | None] = [None, None]
        self._done = ([torch.cuda.Event(), torch.cuda.Event()] if dev.type == "cuda"
                      else None)
        self._events = ([[torch.cuda.Event(enable_timing=True) for _ in range(3)]
                         for _ in range(2)] if config.timing and dev.type == "cuda" else None)
        # the adaptive width's step timer (start, end per slot), with graphs only
        self._width_ev = ([[torch.cuda.Event(enable_timing=True) for _ in range(2)]
                           for _ in range(2)]
                          if self.width_policy.adaptive and self.use_graphs else None)
        self._plans: dict[int, _Plans] = {}
        #: (stage, padded batch, verify width) -> graph
        self.graphs: dict[tuple[str, int, int], torch.cuda.CUDAGraph] = {}
        self.graph_pool_bytes = 0
        self.timing = StepTiming()
        self.general = GeneralPath(target, drafter, pool, mgr, arena=arena, generator=generator,
                                   attn_impl=attn_impl,
                                   timing=self.timing if self._events is not None else None)
        self._stats = {"decode_steps": 0, "graph_steps": 0, "general_steps": 0}

    def stats(self) -> dict:
        """Steps so far: ``decode_steps`` (of which ``graph_steps`` replayed graphs) and
        ``general_steps``; the verify widths, the width last chosen per batch size and the
        drafts' estimated acceptance by position (:class:`~.verify_width.WidthPolicy`), and
        the draft block's rows at each verify width (``draft_rows``)."""
        out: dict = dict(self._stats)
        if self.drafter is not None:
            out.update(self.width_policy.stats())
            out["draft_rows"] = {int(w): int(r) for w, r in self.draft_rows.items()}
        return out

    def _widths(self, config: RunnerConfig) -> tuple[int, ...]:
        if self.drafter is None:
            return (1,)
        env = os.environ.get(WIDTHS_ENV, "").strip()
        if env:
            return parse_widths(env, self.B, WIDTHS_ENV)
        if config.verify_widths is not None:
            return parse_widths(config.verify_widths, self.B, "RunnerConfig.verify_widths")
        return default_widths(self.B) if self.use_graphs else (self.B,)

    @staticmethod
    def workspace_bytes(target, drafter, max_batch: int, block_size: int,
                        max_tokens: int) -> int:
        """Device memory a step's activations may take beside the pool (an upper estimate:
        the largest step's rows through a decoder layer, its logits and the taps)."""
        c = target.config
        rows = max(max_batch * block_size, max_tokens)
        item = torch.finfo(target.dtype).bits // 8
        per_row = (item * (4 * c.hidden_size + 3 * c.intermediate_size
                           + 2 * c.num_attention_heads * c.head_dim)
                   + 6 * c.vocab_size)   # bf16 head output + float32 logits of verify rows
        if drafter is not None:
            per_row += item * len(drafter.cfg.target_layer_ids) * c.hidden_size
        return rows * per_row + (256 << 20)

    # -- plans ----------------------------------------------------------------------------------
    def _splits(self, b: int, q: int, num_kv_heads: int) -> int:
        m = self.min_split_tokens
        # The runner's grids were measured in its graphs (36 layers, warm): its batch-1
        # decode keeps the 4-wave grid (34 programs per KV head at 8k + 512, fifth runner
        # session) with the merge in the same launch.
        pol = dataclasses.replace(DEFAULT_SPLIT_POLICY, min_tokens=m,
                                  fused_waves=DEFAULT_SPLIT_POLICY.waves)
        s = choose_num_splits(b, self.max_seq_len, num_kv_heads=num_kv_heads,
                              num_q_blocks=max(1, math.ceil(q / 16)),
                              num_sms=device_num_sms(self.device, 132), policy=pol,
                              max_query_len=q)
        # No more programs than splits of min_split_tokens can use.
        return max(1, min(s, math.ceil(self.max_seq_len / m)))

    def _split_len(self, longest: int, splits: int) -> int:
        """Tokens per split: ``longest`` spread evenly over ``splits`` programs, rounded up to
        a multiple of ``_SPLIT_STEP`` (``SPLIT_ALIGN`` with sliding-window layers)."""
        step = self._split_step
        return math.ceil(math.ceil(max(longest, 1) / splits) / step) * step

    def _meta(self, b: int, which: int, causal: bool, splits: int, width: int | None = None
              ) -> AttentionMetadata:
        """A decode-path plan over the persistent buffers: the draft block's (``width``
        ``None``: ``B`` query rows per sequence) or the verify step's at ``width``."""
        w = self.B if width is None else width
        return AttentionMetadata(
            block_tables=self.block_tables[:b], seq_lens=self.seq_lens[which, :b],
            query_start_loc=self._qsls[w][:b + 1], max_query_len=w,
            max_seq_len=self.max_seq_len, causal=causal, page_size=self.P, num_splits=splits,
            tokens_per_split=self._split_len(self.max_seq_len, splits),
            query_lens_host=[w] * b, split_tokens=self.split_tokens[which:which + 1],
            query_lens=self.qlenv32[:b] if width is not None else self.qlen32[:b])

    def plans(self, b: int) -> _Plans:
        """The decode path's attention plans for ``b`` rows over the persistent buffers."""
        p = self._plans.get(b)
        if p is None:
            hkv = self.target.config.num_key_value_heads
            sv = self._splits(b, self.B, hkv)
            sb = sc = 1
            block, causal = {}, {}
            if self.paged:
                dh = self.drafter.cfg.num_key_value_heads
                sb = sc = self._splits(b, self.B, dh)
                for r in {self.B, *self.draft_rows.values()}:
                    width = None if r == self.B else r
                    block[r] = self._meta(b, 1, False, sb, width=width)
                    if any(self.drafter.cfg.layer_causal):
                        causal[r] = self._meta(b, 2, True, sc, width=width)
            verify = {w: self._meta(b, 0, True, sv, width=w) for w in self.widths}
            p = self._plans[b] = _Plans(verify, block, causal, (sv, sb, sc))
        return p

    # -- entry ------------------------------------------------------------------------------------
    def decode_ok(self, items: list[StepItem]) -> bool:
        """Whether ``items`` take the decode path (graph or its eager twin)."""
        if not items or len(items) > self.max_batch or (self.drafter is not None
                                                        and not self.paged):
            return False
        return all(it.decode and 1 <= it.n <= self.B and it.params.greedy
                   and not it.banned_rows for it in items)

    @_inference
    def execute(self, items: list[StepItem]) -> list[list[int]]:
        """Run one step; per item the produced tokens (decode: accepted drafts + the bonus
        token; prefill: ``[first token]`` when ``sample`` else ``[]``).

        The draft context K/V of every accepted row is written; the engine commits (a request
        that stops early commits fewer rows: the extra rows are hidden by its length).
        """
        if self.decode_ok(items):
            return self.decode(items)
        self._stats["general_steps"] += 1
        self._last = None          # nothing continues a general step on the device
        return self._general(items)

    # -- decode path ------------------------------------------------------------------------------
    @_inference
    def decode(self, items: list[StepItem], pad_to: int | None = None) -> list[list[int]]:
        """The decode path: stage inputs, replay (or run) draft + verify, one D2H copy.

        ``pad_to`` forces the padded batch size (tests); by default graphs pad to the ladder
        and the eager path runs the exact batch.
        """
        return self.collect(self.submit(items, pad_to))

    def _batch(self, n: int, pad_to: int | None = None) -> int:
        b = pad_to or (graph_batch_size(self.ladder, n) if self.use_graphs else n)
        if b is None or b < n or b > self.max_batch:
            raise ValueError(f"a batch of {n} sequences does not fit {b} rows (at most "
                             f"{self.max_batch})")
        return b

    @_inference
    def submit(self, items: list[StepItem], pad_to: int | None = None) -> InFlight:
        """Start a decode step staged from the host (``items`` must pass :meth:`decode_ok`);
        :meth:`collect` waits for its tokens. Nothing waits for the device here."""
        b = self._batch(len(items), pad_to)
        slot = self._claim_slot()
        self.staging.stage(slot, items, b)
        return self._run(b, len(items), slot)

    @_inference
    def submit_next(self, prev: InFlight, rows: list[int], seq_ids: list,
                    max_lens: list[int]) -> InFlight:
        """Start the decode step that continues ``prev`` (the last submitted step, collected or
        not) for its rows ``rows``, in that order, before the host has read ``prev``'s tokens:
        each row's pending token, committed length and block length come from ``prev``'s
        output on the device (``kernels.step_inputs``). ``seq_ids`` name the rows' sequences,
        whose pages must already be reserved for two blocks past the host's committed length;
        ``max_lens`` are their length limits (a row that reaches its limit in ``prev`` runs as
        padding)."""
        if prev is not self._last:
            raise RuntimeError("submit_next continues the last submitted decode step only")
        b = self._batch(len(rows))
        slot = self._claim_slot()
        self.staging.stage_continued(slot, rows, seq_ids, max_lens, b)
        return self._run(b, len(rows), slot)

    def collect(self, h: InFlight) -> list[list[int]]:
        """Wait for a submitted step and return, per row, the tokens it produced (accepted drafts
        + the bonus token). Each submitted step is collected once, before the step submitted two
        after it."""
        if self._uncollected[h.slot] is not h:
            raise RuntimeError("this decode step was already collected (or never submitted)")
        if self._done is not None:
            self._done[h.slot].synchronize()
            if self._events is not None:
                e = self._events[h.slot]
                self.timing.draft_s += e[0].elapsed_time(e[1]) / 1e3
                self.timing.target_s += e[1].elapsed_time(e[2]) / 1e3
            if h.timed:
                e = self._width_ev[h.slot]
                self.width_policy.observe_time(h.b, h.width, e[0].elapsed_time(e[1]))
        self._uncollected[h.slot] = None
        B = self.B
        rows = self.staging.rows(h.slot, h.n)
        if self.drafter is not None:
            self.width_policy.observe(rows[:, B], rows[:, B + 1])
        return [r[:r[B]] for r in rows.tolist()]

    def drop(self, h: InFlight) -> None:
        """Wait for a submitted step without reading its tokens (nothing once collected)."""
        if self._uncollected[h.slot] is h:
            self.collect(h)

    def _claim_slot(self) -> int:
        slot = self._slot = self._slot ^ 1
        if self._uncollected[slot] is not None:
            raise RuntimeError("collect a submitted decode step before submitting two more")
        return slot

    def _run(self, b: int, n: int, slot: int) -> InFlight:
        """Replay (or run) the step's draft and verify at the width the policy picks for
        ``b``, then queue its one D2H copy."""
        ev = self._events[slot] if self._events is not None else None
        w = self.width_policy.choose(b)
        use = self.use_graphs and ("verify", b, w) in self.graphs
        wev = self._width_ev[slot] if self._width_ev is not None and use else None
        if wev is not None:
            wev[0].record()
        if ev is not None:
            ev[0].record()
        if self.drafter is not None and w > 1:     # width 1: nothing to draft
            self.graphs[("draft", b, w)].replay() if use else self._draft_fn(b, w)
        if ev is not None:
            ev[1].record()
        self.graphs[("verify", b, w)].replay() if use else self._verify_fn(b, w)
        if ev is not None:
            ev[2].record()
        if wev is not None:
            wev[1].record()
        self._stats["decode_steps"] += 1
        self._stats["graph_steps"] += int(use)
        self.staging.copy_out(slot, b)
        if self._done is not None:
            self._done[slot].record()
        h = self._last = self._uncollected[slot] = InFlight(b, n, slot, w, wev is not None)
        return h

    def _assemble(self, b: int) -> None:
        """The step's first kernel: ``small`` (tokens, lengths, block lengths, split lengths)
        from the staged rows and, for continued rows, the previous step's output."""
        assemble_step_inputs(self._in, self._small, self.qlen32, self.out, b, self.B,
                             self.plans(b).splits, self._split_step)

    def _draft_fn(self, b: int, width: int | None = None) -> None:
        """Draft greedy tokens per row into ``self.drafts`` (captured as a graph): a block of
        ``R = draft_rows[width]`` positions runs through the drafter (``R = width`` below the
        full width unless ``draft_block="full"``); below the full width, its last layer's
        output projection and MLP, and the LM head, run only over the ``width - 1`` drafts the
        verify step of that width reads (not over row 0, the pending token)."""
        d, cfg, B = self.drafter, self.drafter.cfg, self.B
        w = B if width is None else width
        R = self.draft_rows.get(w, B)
        self._assemble(b)
        plans = self.plans(b)
        # positions, slots, the plans' lengths (the block plan's query lengths min(block
        # length, R) below the full width) and the block's ids, in one launch
        pos, slots, _, ids = step_positions(
            self.start[:b], self.qlen[:b], self.block_tables, self.P, R, R,
            seq_lens=self.seq_lens, full_row=2 if plans.causal else -1, start_row=1,
            qlenv32=self.qlenv32 if R < B else None, tok=self.tok,
            mask_id=cfg.mask_token_id)
        noise = self.target.embed(ids.reshape(-1))
        if cfg.input_embedding_scale != 1.0:
            noise = noise * cfg.input_embedding_scale
        attn = PagedDraftAttention.from_plans(d, self.pool.kv["draft"], plans.block[R],
                                              plans.causal.get(R), slots.reshape(-1),
                                              impl=self.attn_impl)
        if w < B:   # a narrow width: row 0 (the pending token) and rows past w are not read
            h = d(noise, pos, attn, rows=(R, 1, w))
        else:   # the whole block's rows as the reference runs them (same products' shapes)
            h = d(noise, pos, attn).view(b, R, -1)[:, 1:].reshape(b * (R - 1), -1)
        self.drafts[:b, :w - 1].copy_(
            self._greedy(h.to(self.target.dtype), drafter=True).view(b, w - 1))

    def _verify_fn(self, b: int, width: int | None = None) -> None:
        """Verify ``width`` positions per row (default ``B``): the pending token and the first
        ``width - 1`` drafts; accept greedily, write the draft context of the committed rows;
        leaves ``[target tokens, count, positions verified]`` in ``self.out`` (captured)."""
        B = self.B
        W = B if width is None else width
        if self.drafter is None or W == 1:      # no draft step ran this step's first kernel
            self._assemble(b)
        plans = self.plans(b)
        pos, slots, qlen, ids = step_positions(
            self.start[:b], self.qlen[:b], self.block_tables, self.P, W, W,
            seq_lens=self.seq_lens, full_row=0, qlenv32=self.qlenv32, tok=self.tok,
            drafts=self.drafts if self.drafter is not None else None)
        if ids is None:
            ids = self.tok[:b, None]
        hidden, cap = self.target(ids.reshape(-1), pos, plans.verify[W], slots.reshape(-1),
                                  self.pool.kv["target"], capture_layers=self.taps,
                                  attn_impl=self.attn_impl)
        tgt = self._greedy(hidden).view(b, W)
        # the accepted drafts, the step's output rows and the committed rows' slots
        ctx = greedy_accept(tgt, self.drafts if self.drafter is not None else None, qlen,
                            self.start[:b], slots, self.out, B)
        if self.drafter is not None:
            self.drafter.write_context(torch.cat(cap, -1), pos, ctx.reshape(-1),
                                       self.pool.kv["draft"], impl=self.attn_impl)

    def _greedy(self, hidden: Tensor, drafter: bool = False) -> Tensor:
        """Argmax token of each row's logits (``[T, hidden]`` -> ``[T]`` int64).

        The argmax of the bf16/fp16 head output equals the argmax of its float32 upcast
        (``compute_logits``), so the float32 logits are only built when the drafter
        rescales them.
        """
        t = self.target
        if drafter:
            c = self.drafter.cfg
            if c.output_multiplier != 1.0 or c.final_logit_softcapping:
                return self.drafter.postprocess_logits(t.compute_logits(hidden)).argmax(-1)
        w = t.embed_tokens.weight if t.lm_head is None else t.lm_head.weight
        # the head's product and argmax in the product's epilogue (F.linear + argmax for
        # more rows than gemv takes, or off CUDA)
        return gemv_argmax(hidden, w, impl=self.attn_impl)

    # -- CUDA graphs --------------------------------------------------------------------------------
    def capture(self) -> None:
        """Capture draft and verify graphs for every ladder size and verify width, largest
        first, into one memory pool (``graph_pool_bytes`` says how much it took); with more
        than one width, time each size's graphs per width (:meth:`_time_widths`)."""
        if not self.use_graphs or self.graphs:
            return
        mb = self.max_batch
        self.staging.padding(0, 0, mb)      # every row padding: nothing is written
        self._in.copy_(self.staging.h_in[0])
        torch.cuda.synchronize(self.device)
        # Capture releases the allocator's free blocks (torch.cuda.graph empties the cache),
        # e.g. the separate weights merge_weights replaced: release them first, so the
        # difference below is the graphs' pool alone.
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(self.device)
        pool = None
        stream = torch.cuda.Stream(self.device)
        with torch.inference_mode():
            for b in sorted(self.ladder, reverse=True):
                for w in self.widths:
                    stages = [("verify", self._verify_fn)]
                    if self.drafter is not None and w > 1:
                        stages.insert(0, ("draft", self._draft_fn))
                    for name, fn in stages:
                        # Warm-up outside capture: Triton compiles, the split counters exist.
                        stream.wait_stream(torch.cuda.current_stream(self.device))
                        with torch.cuda.stream(stream):
                            fn(b, w)
                        torch.cuda.current_stream(self.device).wait_stream(stream)
                        g = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(g, pool=pool, stream=stream):
                            fn(b, w)
                        pool = g.pool() if pool is None else pool
                        self.graphs[(name, b, w)] = g
        torch.cuda.synchronize(self.device)
        self.graph_pool_bytes = torch.cuda.memory_reserved(self.device) - before
        if self.width_policy.adaptive:
            self._time_widths()

    def _time_widths(self, reps: int = 5) -> None:
        """Each ladder size's draft + verify replay time per width (median of ``reps`` after
        one, CUDA events; every row padding, so no context is read): the policy's ``T(b,
        V)`` before steps at real contexts correct it."""
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        for b in self.ladder:
            for w in self.widths:
                times = []
                for _ in range(reps + 1):
                    ev[0].record()
                    if self.drafter is not None and w > 1:
                        self.graphs[("draft", b, w)].replay()
                    self.graphs[("verify", b, w)].replay()
                    ev[1].record()
                    ev[1].synchronize()
                    times.append(ev[0].elapsed_time(ev[1]))
                self.width_policy.capture_ms[(b, w)] = sorted(times[1:])[reps // 2]

    def _general(self, items: list[StepItem]) -> list[list[int]]:
        """The general path (:class:`~.general.GeneralPath`)."""
        return self.general.run(items)

__all__ = ["InFlight", "ModelRunner", "StepItem"]
