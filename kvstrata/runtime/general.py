"""The runner's general path: any step the decode path does not take (prefill chunks, mixed
steps, shortened last blocks, sampling, the arena baseline), packed into one eager forward.

Per step: draft the decode blocks longer than one token (paged drafter or arena), one target
forward over every packed row (attention planned on the host for this batch), acceptance
(greedy match or rejection sampling; a prompt's last row sampled), then the draft context K/V
of the rows to commit.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from ..drafter import PagedDraftAttention
from ..kernels.attention_plan import plan_attention
from .sampling import greedy_accept, rejection_accept, sample_from, sampling_probs
from .step import StepItem, StepTiming


class GeneralPath:
    """Packed eager steps over the page pool (see the module doc).

    Args:
        target, drafter, pool, mgr: as for :class:`~.runner.ModelRunner`.
        arena: the arena baseline's :class:`~kvstrata.drafter.DraftArena`, or ``None`` (paged
            drafter).
        generator: RNG for requests without their own seed.
        timing: where to add the draft and target seconds (``None``: not timed).
    """

    def __init__(self, target, drafter, pool, mgr, *, arena=None,
                 generator: torch.Generator | None = None, attn_impl: str = "auto",
                 timing: StepTiming | None = None):
        self.target, self.drafter, self.pool, self.mgr = target, drafter, pool, mgr
        self.arena, self.generator, self.attn_impl = arena, generator, attn_impl
        self.timing = timing
        self.device = pool.device
        self.P = pool.page_size
        self.paged = drafter is not None and arena is None
        self.taps = list(drafter.cfg.target_layer_ids) if drafter is not None else []

    def run(self, items: list[StepItem]) -> list[list[int]]:
        """One step of any items: per item the produced tokens (as ``ModelRunner.execute``)."""
        t0 = time.perf_counter() if self.timing is not None else 0.0
        drafts = self._draft(items) if self.drafter is not None else {}
        if self.timing is not None:
            torch.cuda.synchronize(self.device)
            t1 = time.perf_counter()
            self.timing.draft_s += t1 - t0
        inputs = [it.tokens + drafts.get(i, ([], None))[0] if it.decode else it.tokens
                  for i, it in enumerate(items)]
        hidden, taps, pos_t, slots_t = self._target_forward(items, inputs)
        out, rows = self._accept(items, inputs, drafts, hidden)
        self._write_context(items, rows, taps, pos_t, slots_t)
        if self.timing is not None:
            torch.cuda.synchronize(self.device)
            self.timing.target_s += time.perf_counter() - t1
        return out

    def _draft(self, items: list[StepItem]) -> dict:
        """Draft tokens (and their sampling distributions) for decode blocks longer than one."""
        sel = [i for i, it in enumerate(items) if it.decode and it.n > 1]
        if not sel:
            return {}
        d, cfg, dev = self.drafter, self.drafter.cfg, self.device
        ids, pos, rows = [], [], []
        for i in sel:
            it = items[i]
            rows += range(len(ids) + 1, len(ids) + it.n)
            ids += [it.tokens[-1]] + [cfg.mask_token_id] * (it.n - 1)
            pos += range(it.start, it.start + it.n)
        ids_t = torch.tensor(ids, dtype=torch.int64, device=dev)
        pos_t = torch.tensor(pos, dtype=torch.int64, device=dev)
        noise = self.target.embed(ids_t)
        if cfg.input_embedding_scale != 1.0:
            noise = noise * cfg.input_embedding_scale
        keys = [items[i].seq_id for i in sel]
        starts = [items[i].start for i in sel]
        qlens = [items[i].n for i in sel]
        if self.paged:
            bt, _ = self.mgr.block_tables(keys)
            slots = [s for i in sel for s in self.mgr.slots(items[i].seq_id, items[i].start,
                                                            items[i].start + items[i].n)]
            attn = PagedDraftAttention(d, self.pool.kv["draft"], bt, starts, qlens,
                                       torch.tensor(slots, dtype=torch.int64, device=dev),
                                       self.P, impl=self.attn_impl)
        else:
            attn = self.arena.attention(keys, starts, qlens)
        hidden = d(noise, pos_t, attn)
        h = hidden[torch.tensor(rows, dtype=torch.int64, device=dev)].to(self.target.dtype)
        logits = d.postprocess_logits(self.target.compute_logits(h))
        greedy = logits.argmax(-1).tolist()
        out, at = {}, 0
        for i in sel:
            it, k = items[i], items[i].n - 1
            sp = it.params
            if sp.greedy:
                out[i] = (greedy[at:at + k], None)
            else:
                probs = sampling_probs(logits[at:at + k], sp.temperature, sp.top_p, sp.top_k)
                toks = sample_from(probs, it.generator or self.generator)
                out[i] = (toks.tolist(), probs)
            at += k
        return out

    def _target_forward(self, items, inputs) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        """Hidden states, concatenated taps, positions and slots of the packed step's rows."""
        dev = self.device
        ids, pos, slots, qlens, slens = [], [], [], [], []
        for it, toks in zip(items, inputs):
            s, n = it.start, it.n
            ids += toks
            pos += range(s, s + n)
            slots += self.mgr.slots(it.seq_id, s, s + n)
            qlens.append(n)
            slens.append(s + n)
        bt, sl = self.mgr.block_tables([it.seq_id for it in items], seq_lens=slens)
        meta = plan_attention(bt, sl, qlens, page_size=self.P, causal=True,
                              seq_lens_host=slens,
                              num_kv_heads=self.target.config.num_key_value_heads)
        pos_t = torch.tensor(pos, dtype=torch.int64, device=dev)
        slots_t = torch.tensor(slots, dtype=torch.int64, device=dev)
        hidden, cap = self.target(
            torch.tensor(ids, dtype=torch.int64, device=dev), pos_t, meta, slots_t,
            self.pool.kv["target"], capture_layers=self.taps, attn_impl=self.attn_impl)
        return hidden, (torch.cat(cap, dim=-1) if cap else None), pos_t, slots_t

    def _accept(self, items, inputs, drafts, hidden: Tensor) -> tuple[list[list[int]], list]:
        """Per item the produced tokens, and ``(first row, rows to commit)`` per item."""
        dev = self.device
        need, at, mask = [], 0, []  # rows whose logits we need: verify rows, a prompt's last
        for it in items:
            if it.banned_rows:
                mask.append((len(need), it.banned_rows, sorted(it.banned)))
            if it.decode:
                need += range(at, at + it.n)
            elif it.sample:
                need.append(at + it.n - 1)
            at += it.n
        logits = self.target.compute_logits(
            hidden[torch.tensor(need, dtype=torch.int64, device=dev)])
        for row, k, ids in mask:
            logits[row:row + k, torch.tensor(ids, dtype=torch.int64, device=dev)] = float("-inf")
        greedy = logits.argmax(-1).tolist() if need else []
        out, rows, li, at = [], [], 0, 0
        for i, it in enumerate(items):
            sp, gen = it.params, it.generator or self.generator
            if it.decode:
                n = it.n
                dr, dprobs = drafts.get(i, ([], None))
                if sp.greedy:
                    acc, bonus = greedy_accept(dr, greedy[li:li + n])
                else:
                    tp = sampling_probs(logits[li:li + n], sp.temperature, sp.top_p, sp.top_k)
                    d_t = torch.tensor(dr, dtype=torch.int64, device=dev)
                    acc, bonus = rejection_accept(d_t, tp, tp[:0] if dprobs is None else dprobs,
                                                  gen)
                li += n
                out.append(dr[:acc] + [bonus])
                rows.append((at, acc + 1))
            else:
                first = []
                if it.sample:
                    if sp.greedy:
                        first = [greedy[li]]
                    else:
                        probs = sampling_probs(logits[li], sp.temperature, sp.top_p, sp.top_k)
                        first = [int(sample_from(probs, gen))]
                    li += 1
                out.append(first)
                rows.append((at, it.n))
            at += it.n
        return out, rows

    def _write_context(self, items, rows, taps: Tensor | None, pos_t: Tensor,
                       slots_t: Tensor) -> None:
        """Draft context K/V of the rows to commit (both groups are written before commit)."""
        if self.drafter is None:
            return
        dev = self.device
        idx = []
        for it, (at, m) in zip(items, rows):
            if self.paged:
                idx += range(at, at + m)
            elif m:
                self.arena.append(it.seq_id, taps[at:at + m],
                                  torch.arange(it.start, it.start + m, device=dev))
        if self.paged and idx:
            i = torch.tensor(idx, dtype=torch.int64, device=dev)
            self.drafter.write_context(taps[i], pos_t[i], slots_t[i], self.pool.kv["draft"],
                                       impl=self.attn_impl)


__all__ = ["GeneralPath"]
