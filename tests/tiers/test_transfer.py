"""Pipelined page moves: every chunking gives the same bytes, and the event order is right."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from kvstrata.pagepool import PageInfo, page_hashes
from kvstrata.tiers import TierManager, transfer

from tierutil import PAGE, Stack


def _host_bytes(s: Stack, hashes) -> list[bytes]:
    out = []
    for h in hashes:
        e = s.tiers.host.entry(h)
        out.append(b"".join(s.tiers.host.payload(e, gi).numpy().tobytes()
                            for gi in range(len(s.groups))))
    return out


@pytest.mark.parametrize("codecs", [("identity", "identity"), ("nvfp4", "lossless")])
def test_every_chunking_moves_the_same_bytes(tmp_path, codecs):
    tokens = list(range(7 * PAGE + 1))
    ref = None
    for chunk in (1, 2, 3, 7, 64):
        s = Stack(tmp_path / str(chunk), num_pages=16, host_pages=8, disk=False, codecs=codecs)
        s.tiers = TierManager(s.pool, s.ns, host_bytes=8 * TierManager.slot_bytes_for(s.pool),
                              batch_pages=7, chunk_pages=chunk)
        s.mgr.tiers = s.tiers
        assert s.tiers.mover.chunk_pages == min(chunk, 7)
        assert len(s.tiers.mover._demotes.bufs) == (2 if chunk < 7 else 1)
        s.run(tokens)
        s.pool.evict(s.pool.num_cached)
        hashes = page_hashes(s.ns, tokens)
        got = _host_bytes(s, hashes)
        assert ref is None or got == ref, f"chunk_pages={chunk} staged other bytes"
        ref = got
        seq = s.run(tokens)                  # promotes all 7 pages (checks every value)
        assert seq.cached_from["lower"] == 7


def test_bad_chunk_pages_is_a_value_error(tmp_path):
    s = Stack(tmp_path, disk=False)
    with pytest.raises(ValueError, match="chunk_pages"):
        TierManager(s.pool, s.ns, chunk_pages=0)


class _Trace:
    """Stands in for CUDA streams and events: ops per stream, events as (stream, position)."""

    def __init__(self):
        self.ops: dict[str, list] = {"work": [], "copy": []}
        self.stack: list[str] = []

    @contextmanager
    def on(self, stream):
        self.stack.append(stream)
        yield
        self.stack.pop()

    def mark(self, stream):
        return (stream, len(self.ops[stream]))             # after every op so far

    def after(self, stream, ev):
        if stream is not None and ev is not None:
            self.ops[stream].append(("wait", ev))

    def op(self, what, chunk):
        self.ops[self.stack[-1]].append((what, chunk))

    def done_before(self, ev, stream, pos) -> set:
        """Ops that surely completed before position ``pos`` of ``stream`` (waits followed)."""
        seen, todo = set(), [(stream, pos)]
        while todo:
            st, p = todo.pop()
            for i in range(p):
                kind, arg = self.ops[st][i]
                if kind == "wait" and arg not in seen:
                    seen.add(arg)
                    todo.append(arg)
                elif kind != "wait":
                    seen.add((st, i))
        return seen


@pytest.mark.parametrize("direction", ["down", "up"])
def test_pipeline_event_order(tmp_path, monkeypatch, direction):
    """The CUDA ordering, checked on the CPU: a copy starts after its chunk is staged, a staging
    buffer is refilled only after its previous copy (or decode) finished, and the batch's event
    follows every op."""
    s = Stack(tmp_path, num_pages=16, host_pages=12, disk=False)
    tokens = list(range(9 * PAGE + 1))
    s.run(tokens)
    s.pool.evict(s.pool.num_cached)
    hashes = page_hashes(s.ns, tokens)
    entries = [s.tiers.host.entry(h) for h in hashes]
    mover = transfer.Mover(s.tiers.view, s.tiers.host, s.tiers.codecs, batch_pages=9, chunk_pages=2)
    t = _Trace()
    monkeypatch.setattr(transfer, "_on", t.on)
    monkeypatch.setattr(transfer, "_mark", t.mark)
    monkeypatch.setattr(transfer, "_after", t.after)
    for p in (mover._demotes, mover._promotes):
        p.work, p.copy = "work", "copy"
    stage_ids = {}

    def record(what, fn):
        def wrapped(stage, *a):
            chunk = len([o for o in t.ops[t.stack[-1]] if o[0] == what])
            stage_ids[(what, chunk)] = stage.data_ptr()
            t.op(what, chunk)
            return fn(stage, *a)
        return wrapped
    if direction == "down":
        monkeypatch.setattr(mover, "_gather", record("fill", mover._gather))
        monkeypatch.setattr(mover, "_rows_to_slots", record("drain", mover._rows_to_slots))
        infos = [PageInfo(j, e.info.hash, e.info.parent_hash, e.info.token_ids)
                 for j, e in enumerate(entries)]      # host entries keep no device page id
        _, ev, _ = mover.demote(s.ns.digest, infos, [e.slot for e in entries])
        fill, drain = "work", "copy"
    else:
        real_runs = transfer._runs
        monkeypatch.setattr(mover, "_decode", record("drain", mover._decode))

        def runs(slots):                      # the H2D copies of one chunk happen here
            t.op("fill", len([o for o in t.ops["copy"] if o[0] == "fill"]))
            return real_runs(slots)
        monkeypatch.setattr(transfer, "_runs", runs)
        ev = mover.promote(entries, list(range(9)))
        fill, drain = "copy", "work"
    pos = {(kind, c): (st, i) for st, ops in t.ops.items() for i, (kind, c) in enumerate(ops)
           if kind != "wait"}
    chunks = 5                               # 9 pages in chunks of 2
    assert sorted(c for k, c in pos if k == "fill") == list(range(chunks))
    assert sorted(c for k, c in pos if k == "drain") == list(range(chunks))
    for c in range(chunks):
        st, i = pos[("drain", c)]
        assert st == drain and pos[("fill", c)] in t.done_before(None, st, i), \
            f"chunk {c} is drained before it is staged"
        if c >= 2:
            st, i = pos[("fill", c)]
            assert st == fill and pos[("drain", c - 2)] in t.done_before(None, st, i), \
                f"chunk {c} overwrites a staging buffer chunk {c - 2} still uses"
    # The batch event follows everything; two buffers alternate.
    assert ev is not None and all(p in t.done_before(None, *ev) for p in pos.values())
    if direction == "down":
        assert len({stage_ids[("fill", c)] for c in range(chunks)}) == 2


def test_default_chunk_is_about_16_mib_of_slots():
    from kvstrata.tiers.transfer import default_chunk_pages
    assert default_chunk_pages(2_359_296, 64) == 8        # Qwen3-8B bf16 page (identity)
    assert default_chunk_pages(663_808, 64) == 26         # the same page under NVFP4
    assert default_chunk_pages(663_808, 16) == 16         # never more than the batch
    assert default_chunk_pages(64 << 20, 64) == 4         # at least 4 pages


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_refused_page_flags_line_up_across_chunks(tmp_path, chunk):
    s = Stack(tmp_path, num_pages=8, host_pages=8, disk=False, codecs=("nvfp4", "identity"))
    mover = transfer.Mover(s.tiers.view, s.tiers.host, s.tiers.codecs, batch_pages=5, chunk_pages=chunk)
    infos = [PageInfo(i, bytes([i]) * 16, b"\0" * 16, (i,) * PAGE) for i in range(5)]
    s.pool.kv["target"][:5].normal_()
    s.pool.kv["target"][3, 1, 1, 0, 2, 5] = float("inf")
    _, ev, refused = mover.demote(s.ns.digest, infos, [0, 1, 2, 3, 4])
    assert ev is None and refused.reshape(5, -1).ne(0).any(dim=1).tolist() == [False] * 3 + [True, False]


def test_lossless_group_moves_raw_like_identity(tmp_path, monkeypatch):
    # A CPU-only lossless codec never runs between device and host: down is a gather into the
    # staging rows (identity header, raw bytes), up an index_copy_ from them.
    from kvstrata.codecs import LosslessCodec

    def refuse(*a, **k):
        raise AssertionError("the lossless codec ran between device and host")
    monkeypatch.setattr(LosslessCodec, "encode", refuse)
    monkeypatch.setattr(LosslessCodec, "decode", refuse)
    s = Stack(tmp_path, num_pages=8, host_pages=8, disk=False, codecs=("nvfp4", "lossless"))
    assert [c.name for c in s.tiers.mover.host_codecs] == ["nvfp4", "identity"]
    assert s.tiers.host.max_sizes[1] == s.groups[1].bytes_per_page(PAGE)
    tokens = list(range(5 * PAGE + 1))
    s.run(tokens)
    s.pool.evict(s.pool.num_cached)
    hashes = page_hashes(s.ns, tokens)
    for h in hashes:
        hdr = s.tiers.host.entry(h).headers[1]
        assert (hdr.codec, hdr.version, hdr.shape, hdr.dtype) == (
            "identity", 1, s.groups[1].page_shape(PAGE), "float32")
    seq = s.run(tokens, check=False)
    assert seq.cached_from["lower"] == 5
    for i, pid in enumerate(seq.page_ids[:5]):
        assert torch.equal(s.pool.kv["draft"][pid], s.expected(hashes[i], s.groups[1]))
