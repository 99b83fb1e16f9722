"""A decode step's per-row inputs, assembled on the device (the model runner's first kernel).

The runner keeps a step's inputs in one int64 buffer ``small = [tok | start | qlen | split
lengths (3)]`` (``max_batch`` entries each, then three) that its CUDA graphs read. The host
stages ``inp = [src | tok | start | qlen | max_len]`` per row; this kernel writes ``small``:

- a row with ``src < 0`` takes the host's values (a step the host staged whole);
- a row with ``src >= 0`` continues row ``src`` of the previous step, still on the device, from
  that step's output ``out [max_batch, B + 1]`` (tokens, then the count produced): the pending
  token is the last produced one, the committed length grows by the count, and the block
  length is ``min(B, max_len - start)``; a row that reached ``max_len`` becomes padding (start
  ``-1``: no slot is written, nothing is attended). This is what lets the engine submit step
  N + 1 before it has read step N's tokens (``EngineCore``'s overlapped steps).

Then the three attention plans' split lengths from the longest committed length ``top`` (the
host's rule, :meth:`~kvstrata.runtime.runner.ModelRunner._split_len`): ``step * ceil(ceil(
max(top + add_j, 1) / splits_j) / step)`` with ``add = (B, 0, B)`` (verify, draft block, draft
causal). ``assemble_step_inputs_ref`` is the torch reference, and the CPU path.

Two more kernels of the same kind run inside each captured stage, one launch each where the
torch ops took a dozen small ones (a few microseconds each, on the step's critical path at
batch 1):

- :func:`step_positions`: from the assembled rows, a stage's ``W`` positions per row, their
  pool slots (``-1`` on padding rows and past a row's block length), the block lengths capped
  at ``W`` and, as asked, the attention plans' sequence lengths and the draft block's input ids;
- :func:`greedy_accept`: from the target's greedy tokens and the drafts, the drafts accepted per
  row, the slots whose draft context is written, and the step's output rows.

Each has a ``*_ref`` torch reference (the CPU path), which the kernels equal exactly.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._device import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None


def assemble_step_inputs_ref(inp: Tensor, small: Tensor, qlen32: Tensor, out: Tensor, rows: int,
                             block: int, splits: tuple[int, int, int], step: int) -> None:
    """Torch reference of :func:`assemble_step_inputs` (same arguments)."""
    mb = qlen32.shape[0]
    src, htok, hstart, hqlen, maxlen = (inp[k * mb:k * mb + rows] for k in range(5))
    has = src >= 0
    s = src.clamp_min(0)
    cnt = out[s, block].to(torch.int64)
    ptok = out[s, (cnt - 1).clamp_min(0)].to(torch.int64)
    nstart = small[mb + s] + cnt
    live = nstart < maxlen
    tok = torch.where(has, torch.where(live, ptok, 0), htok)
    start = torch.where(has, torch.where(live, nstart, -1), hstart)
    qlen = torch.where(has, torch.where(live, (maxlen - nstart).clamp_max(block), block), hqlen)
    small[:rows] = tok
    small[mb:mb + rows] = start
    small[2 * mb:2 * mb + rows] = qlen
    qlen32[:rows] = qlen.to(torch.int32)
    top = start.clamp_min(0).max() if rows else small.new_zeros(())
    for j, add in enumerate((block, 0, block)):
        per = ((top + add).clamp_min(1) + splits[j] - 1) // splits[j]
        small[3 * mb + j] = (per + step - 1) // step * step


if triton is not None:
    @triton.jit
    def _assemble_kernel(inp_ptr, small_ptr, qlen32_ptr, out_ptr, s_out, rows, mb, block,
                         s_v, s_b, s_c, step, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        m = i < rows
        src = tl.load(inp_ptr + i, mask=m, other=-1)
        htok = tl.load(inp_ptr + mb + i, mask=m, other=0)
        hstart = tl.load(inp_ptr + 2 * mb + i, mask=m, other=-1)
        hqlen = tl.load(inp_ptr + 3 * mb + i, mask=m, other=0)
        maxlen = tl.load(inp_ptr + 4 * mb + i, mask=m, other=0)
        has = m & (src >= 0)
        s = tl.where(has, src, 0)
        cnt = tl.load(out_ptr + s * s_out + block, mask=has, other=1).to(tl.int64)
        ptok = tl.load(out_ptr + s * s_out + tl.maximum(cnt - 1, 0), mask=has,
                       other=0).to(tl.int64)
        nstart = tl.load(small_ptr + mb + s, mask=has, other=0) + cnt
        live = nstart < maxlen
        tok = tl.where(has, tl.where(live, ptok, 0), htok)
        start = tl.where(has, tl.where(live, nstart, -1), hstart)
        qlen = tl.where(has, tl.where(live, tl.minimum(maxlen - nstart, block), block), hqlen)
        # Every thread has read the previous step's lengths before any is overwritten (a row
        # may continue another row's sequence).
        tl.debug_barrier()
        tl.store(small_ptr + i, tok, mask=m)
        tl.store(small_ptr + mb + i, start, mask=m)
        tl.store(small_ptr + 2 * mb + i, qlen, mask=m)
        tl.store(qlen32_ptr + i, qlen.to(tl.int32), mask=m)
        top = tl.max(tl.where(m, tl.maximum(start, 0), 0), 0)
        for j in tl.static_range(3):
            if j == 0:
                sp = s_v
                add = block
            elif j == 1:
                sp = s_b
                add = 0
            else:
                sp = s_c
                add = block
            longest = tl.maximum(top + add, 1)
            per = (longest + sp - 1) // sp
            tl.store(small_ptr + 3 * mb + j, (per + step - 1) // step * step)

    @triton.jit
    def _positions_kernel(start_ptr, qlen_ptr, bt_ptr, s_bt, max_pages, P, rows, width, cap,
                          pos_ptr, slots_ptr, qlenc_ptr, qlenv_ptr, sl_ptr, s_sl, tok_ptr,
                          ids_ptr, dr_ptr, s_dr, full_row, start_row, mask_id,
                          QLENV: tl.constexpr, FULL: tl.constexpr, START: tl.constexpr,
                          IDS: tl.constexpr,
                          BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr):
        i = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
        j = tl.arange(0, BLOCK_W).to(tl.int64)
        mi = i < rows
        m2 = mi[:, None] & (j < width)[None, :]
        start = tl.load(start_ptr + i, mask=mi, other=-1)
        qlen = tl.load(qlen_ptr + i, mask=mi, other=0)
        valid = start >= 0
        s0 = tl.maximum(start, 0)
        pos = s0[:, None] + j[None, :]
        page_of = tl.minimum(pos // P, max_pages - 1)
        page = tl.load(bt_ptr + i[:, None].to(tl.int64) * s_bt + page_of, mask=m2,
                       other=0).to(tl.int64)
        used = valid[:, None] & (j[None, :] < qlen[:, None])
        slots = tl.where(used, page * P + pos % P, -1)
        at = i[:, None].to(tl.int64) * width + j[None, :]
        tl.store(pos_ptr + at, pos, mask=m2)
        tl.store(slots_ptr + at, slots, mask=m2)
        qlenc = tl.minimum(qlen, cap)
        tl.store(qlenc_ptr + i, qlenc, mask=mi)
        if QLENV:
            tl.store(qlenv_ptr + i, qlenc.to(tl.int32), mask=mi)
        if FULL:
            tl.store(sl_ptr + full_row * s_sl + i, tl.where(valid, s0 + qlenc, 0).to(tl.int32),
                     mask=mi)
        if START:
            tl.store(sl_ptr + start_row * s_sl + i, s0.to(tl.int32), mask=mi)
        if IDS > 0:     # 1: tok, then mask_id; 2: tok, then the drafts
            tok = tl.load(tok_ptr + i, mask=mi, other=0)
            if IDS == 2:
                rest = tl.load(dr_ptr + i[:, None].to(tl.int64) * s_dr + j[None, :] - 1,
                               mask=m2 & (j > 0)[None, :], other=0)
            else:
                rest = mask_id + 0 * pos
            tl.store(ids_ptr + at, tl.where(j[None, :] == 0, tok[:, None], rest), mask=m2)

    @triton.jit
    def _accept_kernel(tgt_ptr, s_tgt, drafts_ptr, s_dr, qlenc_ptr, start_ptr, slots_ptr,
                       ctx_ptr, out_ptr, s_out, rows, width, block, DRAFTS: tl.constexpr,
                       BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr):
        i = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
        j = tl.arange(0, BLOCK_W)
        mi = i < rows
        mj = j < width
        m2 = mi[:, None] & mj[None, :]
        i64 = i[:, None].to(tl.int64)
        tgt = tl.load(tgt_ptr + i64 * s_tgt + j[None, :], mask=m2, other=0)
        qlenc = tl.load(qlenc_ptr + i, mask=mi, other=0)
        start = tl.load(start_ptr + i, mask=mi, other=-1)
        if DRAFTS:
            md = m2 & (j < width - 1)[None, :]
            d = tl.load(drafts_ptr + i64 * s_dr + j[None, :], mask=md, other=-1)
            # the first mismatch (position width - 1 has no draft: a mismatch)
            acc = tl.min(tl.where(md & (d == tgt), BLOCK_W, j[None, :]), 1).to(tl.int64)
            acc = tl.minimum(acc, tl.maximum(qlenc - 1, 0))
            slots = tl.load(slots_ptr + i64 * width + j[None, :], mask=m2, other=-1)
            tl.store(ctx_ptr + i64 * width + j[None, :],
                     tl.where(j[None, :] <= acc[:, None], slots, -1), mask=m2)
            cnt = acc + 1
        else:
            cnt = qlenc * 0 + 1
        o = out_ptr + i.to(tl.int64) * s_out
        tl.store(o + block, cnt.to(tl.int32), mask=mi)
        tl.store(o + block + 1, tl.where(start >= 0, qlenc, 0).to(tl.int32), mask=mi)
        tl.store(out_ptr + i64 * s_out + j[None, :], tgt.to(tl.int32), mask=m2)


def step_positions_ref(start: Tensor, qlen: Tensor, block_tables: Tensor, page_size: int,
                       width: int, cap: int, *, seq_lens: Tensor | None = None,
                       full_row: int = -1, start_row: int = -1, qlenv32: Tensor | None = None,
                       tok: Tensor | None = None, mask_id: int | None = None,
                       drafts: Tensor | None = None
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Torch reference of :func:`step_positions` (same arguments and results)."""
    b = start.shape[0]
    offs = torch.arange(width, dtype=torch.int64, device=start.device)
    valid = start >= 0
    s0 = start.clamp_min(0)
    pos = s0[:, None] + offs[None, :]
    # Rows past a shortened block may lie past the block table: clamp (their slot is -1).
    page_of = (pos // page_size).clamp_max(block_tables.shape[1] - 1)
    page = torch.gather(block_tables[:b], 1, page_of).to(torch.int64)
    used = valid[:, None] & (offs[None, :] < qlen[:, None])
    slots = torch.where(used, page * page_size + pos % page_size, -1)
    qlenc = qlen.clamp_max(cap)
    if qlenv32 is not None:
        qlenv32[:b].copy_(qlenc)
    if full_row >= 0:
        seq_lens[full_row, :b].copy_(torch.where(valid, s0 + qlenc, 0))
    if start_row >= 0:
        seq_lens[start_row, :b].copy_(s0)
    ids = None
    if drafts is not None:
        ids = torch.cat([tok[:b, None], drafts[:b, :width - 1]], 1)
    elif mask_id is not None:
        ids = torch.full((b, width), mask_id, dtype=torch.int64, device=start.device)
        ids[:, 0] = tok[:b]
    return pos.reshape(-1), slots, qlenc, ids


def step_positions(start: Tensor, qlen: Tensor, block_tables: Tensor, page_size: int,
                   width: int, cap: int, *, seq_lens: Tensor | None = None, full_row: int = -1,
                   start_row: int = -1, qlenv32: Tensor | None = None,
                   tok: Tensor | None = None, mask_id: int | None = None,
                   drafts: Tensor | None = None, impl: str = "auto"
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """A stage's per-position inputs for ``b = len(start)`` assembled rows (committed lengths
    ``start``, ``-1`` on padding rows; block lengths ``qlen``; both int64) and ``width``
    positions per row. Returns:

    - ``pos [b * width]`` int64: ``max(start, 0) + j``;
    - ``slots [b, width]`` int64: the pool slot of position ``j`` through ``block_tables [>= b,
      max_pages]`` (page index clamped to the table), ``-1`` on padding rows and for ``j >=
      qlen``;
    - ``qlenc [b]`` int64: ``min(qlen, cap)``;
    - ``ids [b, width]`` int64, the stage's input tokens: ``tok`` in column 0, then
      ``drafts[:, :width - 1]`` when ``drafts`` is given (a verify stage), or ``mask_id`` (the
      draft block); ``None`` when neither is.

    And writes, where asked: ``qlenv32[:b] = qlenc`` (int32); ``seq_lens[full_row, :b] =
    start + qlenc`` (0 on padding rows) and ``seq_lens[start_row, :b] = max(start, 0)``. One
    launch on CUDA (``impl="auto"``; ``"triton"``: wherever Triton runs, the CPU interpreter
    included), the torch reference elsewhere (or ``impl="torch"``)."""
    b = start.shape[0]
    if (full_row >= 0 or start_row >= 0) and seq_lens is None:
        raise ValueError("step_positions: full_row / start_row need seq_lens")
    want_ids = drafts is not None or mask_id is not None
    if want_ids and tok is None:
        raise ValueError("step_positions: the stage's ids (drafts or mask_id) need tok")
    if not use_triton(start, impl) or b == 0:
        return step_positions_ref(start, qlen, block_tables, page_size, width, cap,
                                  seq_lens=seq_lens, full_row=full_row, start_row=start_row,
                                  qlenv32=qlenv32, tok=tok, mask_id=mask_id, drafts=drafts)
    pos, slots, qlenc, ids, args = _positions_outputs(start, width, seq_lens, qlenv32, tok,
                                                      want_ids, drafts)
    block_b = min(64, max(16, triton.next_power_of_2(b)))
    _positions_kernel[(triton.cdiv(b, block_b),)](
        start, qlen, block_tables, block_tables.stride(0), block_tables.shape[1], page_size, b,
        width, cap, pos, slots, qlenc, *args, full_row, start_row,
        mask_id if mask_id is not None else 0, QLENV=qlenv32 is not None, FULL=full_row >= 0,
        START=start_row >= 0, IDS=0 if ids is None else (2 if drafts is not None else 1),
        BLOCK_B=block_b, BLOCK_W=max(2, triton.next_power_of_2(width)), num_warps=4)
    return pos, slots, qlenc, ids


def _positions_outputs(start: Tensor, width: int, seq_lens, qlenv32, tok, want_ids: bool,
                       drafts):
    """step_positions' result tensors, and the kernel's pointer arguments (an unused one
    points at ``qlenc``)."""
    b, dev = start.shape[0], start.device
    pos = torch.empty(b * width, dtype=torch.int64, device=dev)
    slots = torch.empty((b, width), dtype=torch.int64, device=dev)
    qlenc = torch.empty(b, dtype=torch.int64, device=dev)
    ids = torch.empty((b, width), dtype=torch.int64, device=dev) if want_ids else None
    sl = seq_lens if seq_lens is not None else qlenc
    dr = drafts if drafts is not None else qlenc
    args = (qlenv32 if qlenv32 is not None else qlenc, sl,
            sl.stride(0) if seq_lens is not None else 0,
            tok if tok is not None else qlenc, ids if ids is not None else qlenc, dr,
            dr.stride(0) if drafts is not None else 0)
    return pos, slots, qlenc, ids, args


def greedy_accept_ref(tgt: Tensor, drafts: Tensor | None, qlenc: Tensor, start: Tensor,
                      slots: Tensor | None, out: Tensor, block: int) -> Tensor | None:
    """Torch reference of :func:`greedy_accept` (same arguments and result)."""
    b, w = tgt.shape
    ctx = None
    if drafts is not None:
        # Drafts equal the target's tokens up to the first mismatch, so the produced tokens
        # are the target's first acc + 1; their inputs (rows 0..acc) are committed. A
        # shortened block of n rows accepts at most n - 1 drafts.
        acc = (drafts[:b, :w - 1] == tgt[:, :-1]).to(torch.int32).cumprod(1).sum(1)
        acc = torch.minimum(acc, (qlenc - 1).clamp_min(0).to(torch.int32))
        offs = torch.arange(w, dtype=torch.int64, device=tgt.device)
        ctx = torch.where(offs[None, :] <= acc[:, None], slots, -1)
        out[:b, block].copy_(acc + 1)
    else:
        out[:b, block].fill_(1)
    out[:b, block + 1].copy_(torch.where(start >= 0, qlenc, 0))
    out[:b, :w].copy_(tgt)
    return ctx


def greedy_accept(tgt: Tensor, drafts: Tensor | None, qlenc: Tensor, start: Tensor,
                  slots: Tensor | None, out: Tensor, block: int, impl: str = "auto"
                  ) -> Tensor | None:
    """Greedy acceptance of a verify stage: ``tgt [b, w]`` the target's token at each verified
    position (int64), ``drafts [>= b, >= w - 1]`` the drafts verified (``None``: no drafts,
    one token per row), ``qlenc [b]`` the block lengths capped at ``w``, ``start [b]`` the
    committed lengths (``-1``: padding row), ``slots [b, w]`` the verified positions' slots.

    A row accepts its leading drafts equal to the target's tokens, at most ``qlenc - 1``:
    ``acc`` of them. Writes ``out[:b, :w] = tgt``, ``out[:b, block] = acc + 1`` (the tokens
    produced) and ``out[:b, block + 1] = qlenc`` (0 on padding rows); returns the slots of
    positions ``0 .. acc`` (the committed rows, whose draft context is written), ``-1``
    elsewhere, or ``None`` without drafts. One launch on CUDA, the torch reference elsewhere
    (``impl`` as for :func:`step_positions`)."""
    b, w = tgt.shape
    if not use_triton(tgt, impl) or b == 0:
        return greedy_accept_ref(tgt, drafts, qlenc, start, slots, out, block)
    ctx = torch.empty((b, w), dtype=torch.int64, device=tgt.device) if drafts is not None \
        else None
    block_b = min(64, max(16, triton.next_power_of_2(b)))
    d = drafts if drafts is not None else tgt
    _accept_kernel[(triton.cdiv(b, block_b),)](
        tgt, tgt.stride(0), d, d.stride(0), qlenc, start,
        slots if slots is not None else tgt, ctx if ctx is not None else tgt, out,
        out.stride(0), b, w, block, DRAFTS=drafts is not None, BLOCK_B=block_b,
        BLOCK_W=max(2, triton.next_power_of_2(w)), num_warps=4)
    return ctx


def assemble_step_inputs(inp: Tensor, small: Tensor, qlen32: Tensor, out: Tensor, rows: int,
                         block: int, splits: tuple[int, int, int], step: int) -> None:
    """Write the first ``rows`` rows of ``small`` (and ``qlen32``) and its three split lengths
    from the staged ``inp`` and, for continued rows, the previous step's ``out`` (see the
    module docstring). One launch of one program on CUDA (it is captured in the runner's
    graphs); the torch reference elsewhere."""
    if small.device.type != "cuda" or triton is None:
        assemble_step_inputs_ref(inp, small, qlen32, out, rows, block, splits, step)
        return
    mb = qlen32.shape[0]
    _assemble_kernel[(1,)](inp, small, qlen32, out, out.stride(0), rows, mb, block,
                           splits[0], splits[1], splits[2], step,
                           BLOCK=max(16, triton.next_power_of_2(max(rows, 1))), num_warps=4)


__all__ = ["assemble_step_inputs", "assemble_step_inputs_ref", "greedy_accept",
           "greedy_accept_ref", "step_positions", "step_positions_ref"]
