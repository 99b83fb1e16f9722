"""The runner's per-stage input and acceptance kernels (``kernels.step_inputs``) against their
torch references: random rows (padding rows, block lengths below the width, drafts accepted in
part), every output and every optional write, bit for bit, through the CPU interpreter and on
CUDA."""

from __future__ import annotations

import os

import pytest
import torch

from kvstrata.kernels.step_inputs import (greedy_accept, greedy_accept_ref, step_positions,
                                          step_positions_ref)

DEVICES = ["interpreter", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


def _device(which: str) -> str:
    pytest.importorskip("triton")
    if which == "interpreter" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels run on the CPU through the interpreter only")
    return "cuda" if which == "cuda" else "cpu"


def _rows(g, b: int, block: int, page: int, max_pages: int):
    """Committed lengths (-1 on about a quarter of the rows: padding), block lengths 1..block,
    block tables of distinct random page ids."""
    start = torch.randint(0, max((max_pages - 1) * page - block, 2), (b,), generator=g)
    start[torch.rand(b, generator=g) < 0.25] = -1
    qlen = torch.randint(1, block + 1, (b,), generator=g)
    tables = torch.randperm(4 * b * max_pages, generator=g)[:b * max_pages].view(b, max_pages)
    return start, qlen, tables.to(torch.int32)


CASES = [(1, 16, 16, 16), (1, 16, 2, 16), (5, 16, 16, 16), (16, 4, 4, 16), (64, 16, 8, 16),
         (70, 8, 1, 32), (3, 16, 16, 1)]


@pytest.mark.parametrize("which", DEVICES)
def test_step_positions_equal_reference(which):
    """Positions, slots, capped lengths, the seq_lens rows and qlenv32 written, and each form
    of the stage's ids (the draft block's mask, the verify stage's drafts, none)."""
    dev = _device(which)
    g = torch.Generator().manual_seed(0)
    for b, block, width, page in CASES:
        max_pages = 12
        start, qlen, tables = _rows(g, b, block, page, max_pages)
        tok = torch.randint(0, 1000, (b + 3,), generator=g)
        drafts = torch.randint(0, 1000, (b + 3, max(block - 1, 1)), generator=g)
        for cap, ids_kind, rows in ((width, "drafts", (0, -1)), (width, "mask", (2, 1)),
                                    (block, None, (-1, -1)), (1, "mask", (-1, 1))):
            outs = []
            for fn, d in ((step_positions_ref, "cpu"), (step_positions, dev)):
                seq_lens = torch.full((3, b + 2), 7, dtype=torch.int32, device=d)
                qlenv = torch.full((b + 2,), 9, dtype=torch.int32, device=d)
                kw = dict(seq_lens=seq_lens, full_row=rows[0], start_row=rows[1],
                          qlenv32=qlenv if cap < block else None, tok=tok.to(d))
                if ids_kind == "drafts":
                    kw["drafts"] = drafts.to(d)
                elif ids_kind == "mask":
                    kw["mask_id"] = 151_000
                if fn is step_positions:
                    kw["impl"] = "triton"
                res = fn(start.to(d), qlen.to(d), tables.to(d), page, width, cap, **kw)
                outs.append([None if t is None else t.cpu() for t in (*res, seq_lens, qlenv)])
            for got, want, name in zip(outs[1], outs[0],
                                       ("pos", "slots", "qlenc", "ids", "seq_lens", "qlenv32")):
                assert (got is None) == (want is None), name
                if want is not None:
                    assert got.dtype == want.dtype and torch.equal(got, want), (
                        name, b, block, width, cap, ids_kind)
            pos, slots, qlenc, ids = outs[0][:4]
            # what the reference means, spelled out for one row
            i = int(torch.argmax((start >= 0).int())) if (start >= 0).any() else None
            if i is not None:
                s0, j = int(start[i]), min(int(qlen[i]), width) - 1
                p = s0 + j
                assert int(pos[i * width + j]) == p
                assert int(slots[i, j]) == int(tables[i, p // page]) * page + p % page
            assert (slots[start < 0] == -1).all()
            assert torch.equal(qlenc, qlen.clamp_max(cap))
            if ids_kind == "drafts":
                assert torch.equal(ids[:, 1:], drafts[:b, :width - 1])


@pytest.mark.parametrize("which", DEVICES)
def test_greedy_accept_equals_reference(which):
    """Accepted counts (capped by the block length), committed slots and the output rows, with
    drafts that match the target's tokens for a random prefix, and without drafts."""
    dev = _device(which)
    g = torch.Generator().manual_seed(1)
    for b, block, width, _ in CASES:
        tgt = torch.randint(0, 50, (b, width), generator=g)
        drafts = torch.randint(0, 50, (b + 2, max(block - 1, 1)), generator=g)
        agree = torch.randint(0, width, (b,), generator=g)
        for i in range(b):      # row i's drafts equal the target's first agree[i] tokens
            n = min(int(agree[i]), width - 1)
            drafts[i, :n] = tgt[i, :n]
            if n < width - 1:
                drafts[i, n] = tgt[i, n] + 1        # and not the next one
        start = torch.randint(-1, 100, (b,), generator=g)
        qlenc = torch.randint(1, width + 1, (b,), generator=g)
        slots = torch.randint(-1, 5000, (b, width), generator=g)
        for with_drafts in (True, False):
            res = []
            for fn, d in ((greedy_accept_ref, "cpu"), (greedy_accept, dev)):
                out = torch.full((b + 2, block + 2), -5, dtype=torch.int32, device=d)
                kw = {"impl": "triton"} if fn is greedy_accept else {}
                ctx = fn(tgt.to(d), drafts.to(d) if with_drafts else None, qlenc.to(d),
                         start.to(d), slots.to(d), out, block, **kw)
                res.append((None if ctx is None else ctx.cpu(), out.cpu()))
            (ctx_w, out_w), (ctx_g, out_g) = res
            assert torch.equal(out_g, out_w), (b, width, with_drafts)
            assert (ctx_g is None) == (ctx_w is None)
            if with_drafts:
                assert torch.equal(ctx_g, ctx_w), (b, width)
                acc = out_w[:b, block].long() - 1
                assert torch.equal(acc, torch.minimum(agree.clamp_max(width - 1),
                                                      (qlenc - 1).clamp_min(0)))
            else:
                assert (out_w[:b, block] == 1).all()
            assert torch.equal(out_w[:b, block + 1].long(), torch.where(start >= 0, qlenc, 0))
            assert (out_w[b:] == -5).all()      # rows past b untouched


def test_step_inputs_refuse_what_they_cannot_do():
    z = torch.zeros(2, dtype=torch.int64)
    bt = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="seq_lens"):
        step_positions(z, z, bt, 16, 4, 4, full_row=0)
    with pytest.raises(ValueError, match="need tok"):
        step_positions(z, z, bt, 16, 4, 4, mask_id=3)
    with pytest.raises(ValueError, match="impl"):
        step_positions(z, z, bt, 16, 4, 4, impl="cuda")
