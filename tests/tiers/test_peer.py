"""The peer path on its own: a page a codec refuses fails both sides cleanly; another layout
(per-layer tensors) receives bit-exactly."""

from __future__ import annotations

import threading

import pytest
import torch

from kvstrata.pagepool import LAYER_KV_FIRST, GroupView, KVGroupSpec, Namespace, PagePool, PoolView
from kvstrata.runtime.disagg.workers import loopback_pair
from kvstrata.testing.tiers import chain
from kvstrata.tiers.peer import PeerError, PeerLink

P = 4
GROUPS = [KVGroupSpec("target", 2, 2, 16, torch.bfloat16, "nvfp4"),
          KVGroupSpec("draft", 1, 2, 16, torch.bfloat16, "lossless")]
NS = Namespace("peer", GROUPS, P)


def _infos(n):
    return chain(NS, n, P)


def _exchange(src_view, dst_view, infos, ids, encode):
    a, b = loopback_pair(timeout_s=30)
    err = []

    def send():
        try:
            PeerLink(src_view, NS, encode=encode).send(a, infos)
        except PeerError as e:
            err.append(e)
    t = threading.Thread(target=send)
    t.start()
    try:
        return PeerLink(dst_view, NS, encode=encode).recv(b, infos, ids), err
    finally:
        t.join(timeout=30)


def test_raw_pages_reach_another_layout_bit_exactly():
    src = PagePool(GROUPS, 6, P)
    for t in src.kv.values():
        t.normal_()
    layers = {g.name: tuple(torch.zeros(2, 6, P, g.num_kv_heads, g.head_dim, dtype=g.dtype)
                            for _ in range(g.num_layers)) for g in GROUPS}
    dst = PoolView(tuple(GroupView(g, LAYER_KV_FIRST, layers[g.name]) for g in GROUPS), 6, P)
    infos = _infos(3)
    got, err = _exchange(PoolView.of(src), dst, infos, [5, 0, 2], encode=False)
    assert not err and got > 0
    for gi, g in enumerate(GROUPS):
        assert torch.equal(dst.read(gi, torch.tensor([5, 0, 2])).view(torch.int16),
                           src.kv[g.name][:3].view(torch.int16))


def test_a_page_the_codec_refuses_fails_both_sides():
    src, dst = PagePool(GROUPS, 4, P), PagePool(GROUPS, 4, P)
    for t in src.kv.values():
        t.normal_()
    src.kv["target"][1, 0, 0, 0, 0, 0] = float("nan")          # NVFP4 cannot hold it
    before = dst.kv["target"].clone()
    with pytest.raises(PeerError, match="could not send"):
        _exchange(PoolView.of(src), PoolView.of(dst), _infos(2), [0, 1], encode=True)
    assert torch.equal(dst.kv["target"].view(torch.int16), before.view(torch.int16))


# -- the pipelined path: chunks, depth, groups, a partial last page, cuts -------------------------
class _Flaky:
    """A loopback end that damages the ``damage``-th tensor it sends (one byte) or, at the
    ``cut``-th, closes the link instead (the sender died mid-handoff)."""

    def __init__(self, end, damage=None, cut=None):
        self.end, self.damage, self.cut, self.n = end, damage, cut, 0
        self.device = end.device

    def isend(self, t):
        self.n += 1
        if self.n == self.cut:
            self.end.close()
            raise ConnectionError("cut")
        if self.n == self.damage:
            t = t.clone()
            t.view(-1)[t.numel() // 2] ^= 0x5A
        return self.end.isend(t)

    def __getattr__(self, name):
        return getattr(self.end, name)


def _partial_chain(n, tail):
    """``n`` pages whose last one holds ``tail`` tokens (its key is H(parent || its tokens))."""
    from kvstrata.pagepool import PageInfo, hash_page
    infos = _infos(n)
    last = infos[-1]
    toks = last.token_ids[:tail]
    return infos[:-1] + [PageInfo(last.page_id, hash_page(last.parent_hash, toks),
                                  last.parent_hash, toks)]


def _pools(n, seed=0):
    src, dst = PagePool(GROUPS, n + 2, P), PagePool(GROUPS, n + 2, P)
    g = torch.Generator().manual_seed(seed)
    for t in src.kv.values():
        t.copy_(torch.randn(t.shape, generator=g))
    for t in dst.kv.values():
        t.fill_(7)
    return src, dst


def _move(src, dst, infos, ids, encode, chunk, depth, wrap=None, link=None, device_link=None,
          sent=None):
    """Run one transfer (sender on a thread); returns (bytes received or the receiver's
    exception, the sender's exception or None, the receiving link)."""
    a, b = loopback_pair(timeout_s=30)
    sender = wrap(a) if wrap else a
    out = {}

    def send():
        try:
            PeerLink(PoolView.of(src), NS, encode=encode, chunk_pages=chunk, depth=depth,
                     device_link=device_link).send(sender, sent or infos)
        except (PeerError, ConnectionError) as e:
            out["send"] = e
    t = threading.Thread(target=send)
    t.start()
    link = link or PeerLink(PoolView.of(dst), NS, encode=encode, chunk_pages=chunk, depth=depth,
                            device_link=device_link)
    try:
        got = link.recv(b, infos, ids)
    except (PeerError, ConnectionError, TimeoutError) as e:
        got = e
    t.join(timeout=30)
    assert not t.is_alive()
    return got, out.get("send"), link


@pytest.mark.parametrize("encode", [False, True])
@pytest.mark.parametrize("chunk,depth", [(1, 1), (3, 2), (3, 3), (4, 1), (7, 3), (64, 3)])
def test_pipelined_chunks_equal_the_serial_transfer(encode, chunk, depth):
    """7 pages (the last one holding 3 of 4 tokens) over every chunk/depth: each chunk boundary,
    a short last chunk, one chunk for all; both groups land where they should, and equal the
    one-page-at-a-time transfer (raw: the source bytes)."""
    infos = _partial_chain(7, 3)
    ids = [8, 0, 3, 1, 6, 2, 4]
    src, dst = _pools(7)
    got, err, link = _move(src, dst, infos, ids, encode, chunk, depth)
    assert err is None and isinstance(got, int) and got > 0
    assert len(link.host._free) == link.host.num_slots         # every slot given back
    _, ref = _pools(7)
    _move(src, ref, infos, ids, encode, 1, 1)
    for name in ("target", "draft"):
        moved = dst.kv[name][ids].view(torch.int16)
        assert torch.equal(moved, ref.kv[name][ids].view(torch.int16)), name
        if not encode or name == "draft":           # raw, or lossless: bit-exact
            assert torch.equal(moved, src.kv[name][:7].view(torch.int16)), name
    untouched = [i for i in range(9) if i not in ids]
    assert (dst.kv["target"][untouched] == 7).all()


@pytest.mark.parametrize("encode", [False, True])
def test_a_damaged_chunk_fails_the_receiver_and_keeps_both_in_step(encode):
    """The 2nd chunk's data is damaged: the receiver raises naming a page of that chunk and
    writes none of it, the sender finishes, and the next transfer on the same link is exact."""
    infos = _partial_chain(7, 2)
    ids = list(range(7))
    src, dst = _pools(7)
    before = {k: v.clone() for k, v in dst.kv.items()}
    got, err, link = _move(src, dst, infos, ids, encode, 3, 2,
                           wrap=lambda a: _Flaky(a, damage=4))       # heads0 data0 heads1 DATA1
    assert err is None and isinstance(got, PeerError)
    assert "received page 3" in str(got) or "received page 4" in str(got) \
        or "received page 5" in str(got), got
    for name in ("target", "draft"):       # chunk 0 written (the caller frees), chunk 1 not
        assert torch.equal(dst.kv[name][3:6], before[name][3:6]), name
    assert len(link.host._free) == link.host.num_slots
    got, err, _ = _move(src, dst, infos, ids, encode, 3, 2, link=link)
    assert err is None and isinstance(got, int)
    assert torch.equal(dst.kv["draft"][:7].view(torch.int16), src.kv["draft"][:7].view(torch.int16))


def test_a_cut_mid_transfer_fails_the_receiver_and_frees_its_slots():
    infos = _infos(9)
    ids = list(range(9))
    src, dst = _pools(9)
    got, err, link = _move(src, dst, infos, ids, False, 2, 3, wrap=lambda a: _Flaky(a, cut=5))
    assert isinstance(err, ConnectionError)
    assert isinstance(got, ConnectionError), got
    assert len(link.host._free) == link.host.num_slots
    got, err, _ = _move(src, dst, infos, ids, False, 2, 3, link=link)      # the link still works
    assert err is None and isinstance(got, int)
    assert torch.equal(dst.kv["target"][:9].view(torch.int16),
                       src.kv["target"][:9].view(torch.int16))


def test_a_refused_page_mid_transfer_fails_both_and_drains():
    """NVFP4 refuses a page of the 3rd chunk: the sender flags that chunk and the rest, the
    receiver drains them, both raise, and the same receiving link serves the next transfer."""
    infos = _infos(8)
    src, dst = _pools(8)
    src.kv["target"][6, 0, 0, 0, 0, 0] = float("nan")
    got, err, link = _move(src, dst, infos, list(range(8)), True, 2, 2)
    assert isinstance(err, PeerError) and isinstance(got, PeerError)
    assert "could not send" in str(got)
    src.kv["target"][6].zero_()
    got, err, _ = _move(src, dst, infos, list(range(8)), True, 2, 2, link=link)
    assert err is None and isinstance(got, int)


def test_link_arguments_are_checked():
    pool = PagePool(GROUPS, 2, P)
    for kw in ({"chunk_pages": 0}, {"depth": 0}, {"chunk_pages": 1.5}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            PeerLink(PoolView.of(pool), NS, **kw)
    with pytest.raises(ValueError, match="device_link"):
        PeerLink(PoolView.of(pool), NS, encode=True, device_link=True)     # lossless: CPU codec


@pytest.mark.parametrize("chunk,depth", [(1, 1), (3, 2), (4, 3)])
def test_the_device_buffer_path_moves_pages_bit_exactly(chunk, depth):
    """The NCCL path's code (gather into buffers on the pool's device, heads without payload
    CRCs, receive into buffers, decode from them), run on CPU buffers."""
    infos = _partial_chain(7, 1)
    ids = [6, 5, 4, 3, 2, 1, 0]
    src, dst = _pools(7)
    got, err, link = _move(src, dst, infos, ids, False, chunk, depth, device_link=True)
    assert err is None and isinstance(got, int) and got > 0
    for name in ("target", "draft"):
        assert torch.equal(dst.kv[name][ids].view(torch.int16), src.kv[name][:7].view(torch.int16))
    # the sender swaps pages 3 and 4: refused (identity is checked on this path too)
    bad = infos[:3] + [infos[4], infos[3]] + infos[5:]
    got, err, _ = _move(src, dst, infos, ids, False, chunk, depth, device_link=True, sent=bad)
    assert isinstance(got, PeerError) and "received page 3" in str(got), got


@pytest.mark.parametrize("encode", [False, True])
def test_a_damaged_head_fails_its_page_not_the_framing(encode):
    """A byte of a page's record head flips (chunk 1's heads tensor): the receiver names that
    page, drains the handoff by the control row's sizes, and the same link serves the next one."""
    infos = _partial_chain(7, 2)
    ids = list(range(7))
    src, dst = _pools(7)
    hb = PeerLink(PoolView.of(src), NS, encode=encode, chunk_pages=3).head_bytes

    class _Head(_Flaky):
        def isend(self, t):
            self.n += 1
            if self.n == 3:                              # heads of chunk 1 (pages 3, 4, 5)
                t = t.clone()
                t.view(-1)[2 * hb + 4 + 20] ^= 0x01     # row of page 4, inside its header
            return self.end.isend(t)
    got, err, link = _move(src, dst, infos, ids, encode, 3, 2, wrap=lambda a: _Head(a))
    assert err is None and isinstance(got, PeerError) and "received page 4" in str(got), got
    got, err, _ = _move(src, dst, infos, ids, encode, 3, 2, link=link)
    assert err is None and isinstance(got, int)
    assert torch.equal(dst.kv["draft"][:7].view(torch.int16), src.kv["draft"][:7].view(torch.int16))


@pytest.mark.parametrize("encode", [False, True])
def test_a_damaged_control_row_is_caught(encode):
    """Chunk 1's control row (status, data bytes) flips a bit: caught by its CRC. Raw chunks
    have known sizes, so the handoff is drained (in step); encoded ones cannot be framed any
    more, and the receiver says the link is out of step."""
    infos = _infos(7)
    src, dst = _pools(7)

    class _Ctl(_Flaky):
        def isend(self, t):
            self.n += 1
            if self.n == 3:
                t = t.clone()
                t.view(-1)[5] ^= 0x01
            return self.end.isend(t)
    got, err, link = _move(src, dst, infos, list(range(7)), encode, 3, 2, wrap=lambda a: _Ctl(a))
    assert isinstance(got, PeerError) and "control row is damaged" in str(got), got
    assert ("out of step" in str(got)) == encode
    assert len(link.host._free) == link.host.num_slots
