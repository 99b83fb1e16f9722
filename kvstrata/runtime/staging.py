"""Pinned host staging of the runner's decode steps: the step's inputs in, its tokens out.

A decode step's host side writes, per row, the staged inputs (the row of the previous step it
continues or -1, then the pending token, committed length, block length and length limit) and
the block-table row into one of two pinned slots, then queues two asynchronous copies into the
runner's persistent device buffers; the step's output rows come back through the same slot.
Two slots, so that a submitted step's copies may still be queued while the host stages the
next one (overlapped steps, :meth:`~.runner.ModelRunner.submit_next`).

A live sequence's page list only grows (``KVCacheManager.reserve`` extends it), so a
block-table row that keeps its sequence from the last step staged in that slot gets only its
new pages written (an 8k context is 512 pages of 16 tokens).
"""

from __future__ import annotations

import torch
from torch import Tensor


class StepStaging:
    """Two pinned staging slots over the runner's persistent buffers.

    Args:
        mgr: the :class:`KVCacheManager` (``seqs[seq_id].page_ids``).
        inputs: the device buffer of staged inputs (``5 * max_batch`` int64: five blocks of
            ``max_batch`` rows, read by ``kernels.step_inputs``).
        block_tables: the device block tables ``[max_batch, max_pages]`` (int32).
        out: the device output rows ``[max_batch, B + 2]`` (int32): target tokens, count,
            positions verified.
        block: the draft block size ``B`` (a padding row's block length).
    """

    def __init__(self, mgr, inputs: Tensor, block_tables: Tensor, out: Tensor, block: int):
        self.mgr, self.block = mgr, block
        self.inputs, self.block_tables, self.out = inputs, block_tables, out
        mb, pages = block_tables.shape
        self.max_batch = mb
        pin = inputs.device.type == "cuda"
        self.h_in = torch.zeros((2, inputs.numel()), dtype=torch.int64, pin_memory=pin)
        self.h_bt = torch.zeros((2, mb, pages), dtype=torch.int32, pin_memory=pin)
        self.h_out = torch.zeros((2, *out.shape), dtype=torch.int32, pin_memory=pin)
        self.ins, self.bts, self.outs = self.h_in.numpy(), self.h_bt.numpy(), self.h_out.numpy()
        self.last_tables = self.bts[0]          # the last staged slot's block tables
        self.views: dict[tuple[int, int], tuple] = {}
        # which sequence's pages each staged block-table row holds, and how many (per slot)
        self._row_seq: list[list] = [[None] * mb, [None] * mb]
        self._row_pages = [[0] * mb, [0] * mb]

    def stage(self, slot: int, items, b: int) -> None:
        """A step staged whole from the host (``items``: :class:`~.step.StepItem`), padded to
        ``b`` rows, then copied in."""
        mb, hin = self.max_batch, self.ins[slot]
        n = len(items)
        self.tables(slot, [it.seq_id for it in items])
        hin[:n] = -1
        hin[mb:mb + n] = [it.tokens[-1] for it in items]
        hin[2 * mb:2 * mb + n] = [it.start for it in items]
        hin[3 * mb:3 * mb + n] = [it.n for it in items]
        self.padding(slot, n, b)
        self.copy_in(slot, b)

    def stage_continued(self, slot: int, rows: list[int], seq_ids: list, max_lens: list[int],
                        b: int) -> None:
        """A step that continues the previous one's ``rows`` on the device (their tokens and
        lengths come from its output there): only the rows, length limits and block tables
        are staged, padded to ``b`` rows, then copied in."""
        mb, hin = self.max_batch, self.ins[slot]
        n = len(rows)
        self.tables(slot, seq_ids)
        hin[:n] = rows
        hin[4 * mb:4 * mb + n] = max_lens
        self.padding(slot, n, b)
        self.copy_in(slot, b)

    def padding(self, slot: int, n: int, b: int) -> None:
        """Rows ``n..b`` of the slot's staged inputs: padding (slot -1, length 0)."""
        if n >= b:
            return
        mb, hin = self.max_batch, self.ins[slot]
        hin[n:b] = -1
        hin[mb + n:mb + b] = 0
        hin[2 * mb + n:2 * mb + b] = -1
        hin[3 * mb + n:3 * mb + b] = self.block

    def tables(self, slot: int, seq_ids: list) -> None:
        """The block-table rows of ``seq_ids``, in order: only a row's new pages when it held
        the same sequence's list the last time this slot was staged, else the whole row."""
        seqs, hbt = self.mgr.seqs, self.bts[slot]
        row_seq, row_pages = self._row_seq[slot], self._row_pages[slot]
        for i, sid in enumerate(seq_ids):
            seq = seqs[sid]
            pages = seq.page_ids
            n = len(pages)
            k = row_pages[i] if row_seq[i] is seq else 0
            if k > n or (k and hbt[i, k - 1] != pages[k - 1]):
                k = 0       # not the list this row staged: the whole row again
            if n > k:
                hbt[i, k:n] = pages[k:]
            row_seq[i], row_pages[i] = seq, n
        self.last_tables = hbt

    def copies(self, slot: int, b: int) -> tuple:
        """A step's copies as (destination, source) views, made once per (slot, padded
        batch): the staged inputs and block tables in, the output rows out."""
        v = self.views.get((slot, b))
        if v is None:
            v = self.views[(slot, b)] = (
                ((self.inputs, self.h_in[slot]), (self.block_tables[:b], self.h_bt[slot, :b])),
                (self.h_out[slot, :b], self.out[:b]))
        return v

    def copy_in(self, slot: int, b: int) -> None:
        for dst, src in self.copies(slot, b)[0]:
            dst.copy_(src, non_blocking=True)

    def copy_out(self, slot: int, b: int) -> None:
        """Queue the step's one device-to-host copy: its output rows into the slot."""
        dst, src = self.copies(slot, b)[1]
        dst.copy_(src, non_blocking=True)

    def rows(self, slot: int, n: int):
        """The slot's first ``n`` output rows (a numpy view; read once the copy is done)."""
        return self.outs[slot, :n]


__all__ = ["StepStaging"]
