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
