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
"""

from __future__ import annotations

import torch
from torch import Tensor

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


__all__ = ["assemble_step_inputs", "assemble_step_inputs_ref"]
