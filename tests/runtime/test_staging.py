"""The runner's pinned staging on its own (CPU): exact staged rows, padding, block-table rows
written in part or whole, continued steps, and copies made once per (slot, padded batch)."""

from __future__ import annotations

import torch

from kvstrata.pagepool import KVCacheManager, KVGroupSpec, Namespace, PagePool
from kvstrata.runtime.sampling import SamplingParams
from kvstrata.runtime.staging import StepStaging
from kvstrata.runtime.step import StepItem

P, MB, PAGES, B = 4, 4, 6, 3
GROUPS = [KVGroupSpec("target", 1, 1, 16, torch.float32)]


def _setup():
    pool = PagePool(GROUPS, 16, P)
    mgr = KVCacheManager(pool, Namespace("s", GROUPS, P))
    inputs = torch.zeros(5 * MB, dtype=torch.int64)
    tables = torch.zeros((MB, PAGES), dtype=torch.int32)
    out = torch.zeros((MB, B + 2), dtype=torch.int32)
    return mgr, StepStaging(mgr, inputs, tables, out, B)


def _item(mgr, sid, start, n, token):
    return StepItem(sid, start, n, [token], True, SamplingParams())


def test_a_staged_step_its_padding_and_copies():
    mgr, st = _setup()
    for sid, length in (("a", 6), ("b", 2)):
        mgr.admit(sid, list(range(length)))
        mgr.reserve(sid, length + B)
    st.stage(0, [_item(mgr, "a", 6, 3, 17), _item(mgr, "b", 2, 2, 23)], 4)
    ins = st.inputs.view(5, MB).tolist()
    assert ins[0] == [-1, -1, -1, -1]          # no row continues a previous step
    assert ins[1] == [17, 23, 0, 0]            # pending tokens; padding: token 0
    assert ins[2] == [6, 2, -1, -1]            # committed lengths; padding: -1
    assert ins[3] == [3, 2, B, B]              # block lengths; padding: a whole block
    pa, pb = mgr.seqs["a"].page_ids, mgr.seqs["b"].page_ids
    assert len(pa) == 3 and len(pb) == 2
    assert st.block_tables[0, :3].tolist() == pa and st.block_tables[1, :2].tolist() == pb
    assert st.last_tables.ctypes.data == st.bts[0].ctypes.data
    # the copies' views are made once per (slot, padded batch) over the same buffers
    assert st.copies(0, 4) is st.copies(0, 4) and sorted(st.views) == [(0, 4)]
    st.out.copy_(torch.arange(MB * (B + 2), dtype=torch.int32).view(MB, B + 2))
    st.copy_out(0, 4)
    assert st.rows(0, 2).tolist() == st.out[:2].tolist()
    assert st.outs[1].sum() == 0               # the other slot is untouched


def test_block_table_rows_written_in_part_when_a_row_keeps_its_sequence():
    mgr, st = _setup()
    for sid in ("a", "b"):
        mgr.admit(sid, [1, 2, 3, 4, 5])
        mgr.reserve(sid, 8)
    st.stage(1, [_item(mgr, "a", 5, 3, 1), _item(mgr, "b", 5, 3, 2)], 2)
    hbt = st.bts[1]
    hbt[0, 0] = hbt[1, 0] = 99                 # marks: a rewrite of the whole row clears them
    mgr.reserve("a", 12)                       # "a" grows by one page; "b" does not
    st.stage(1, [_item(mgr, "a", 8, 3, 1), _item(mgr, "b", 8, 3, 2)], 2)
    pa = mgr.seqs["a"].page_ids
    assert len(pa) == 3 and hbt[0, 0] == 99 and hbt[0, 1:3].tolist() == pa[1:]
    assert hbt[1, 0] == 99                     # nothing new for "b": nothing written
    # the other order: each row now holds another sequence's list, written whole
    st.stage(1, [_item(mgr, "b", 8, 3, 2), _item(mgr, "a", 8, 3, 1)], 2)
    assert hbt[0, :2].tolist() == mgr.seqs["b"].page_ids and hbt[1, :3].tolist() == pa
    # a slot keeps its own record: slot 0 has staged nothing, so its rows are written whole
    st.stage(0, [_item(mgr, "a", 8, 3, 1)], 1)
    assert st.bts[0][0, :3].tolist() == pa and st.last_tables.ctypes.data == st.bts[0].ctypes.data


def test_a_continued_step_stages_only_rows_limits_and_tables():
    mgr, st = _setup()
    for sid in ("a", "b", "c"):
        mgr.admit(sid, [7, 8])
        mgr.reserve(sid, 2 + 2 * B)
    st.stage(0, [_item(mgr, s, 2, 3, 5) for s in ("a", "b", "c")], 3)
    # rows 2 and 0 of the previous step continue, in that order; padded to 3 rows
    st.stage_continued(1, [2, 0], ["c", "a"], [40, 50], 3)
    ins = st.inputs.view(5, MB)
    assert ins[0, :3].tolist() == [2, 0, -1]
    assert ins[4, :2].tolist() == [40, 50]
    assert ins[1:4, 2].tolist() == [0, -1, B]  # row 2 pads: token 0, length -1, a whole block
    assert st.block_tables[0].tolist()[:2] == mgr.seqs["c"].page_ids[:2]
    assert st.block_tables[1].tolist()[:2] == mgr.seqs["a"].page_ids[:2]
