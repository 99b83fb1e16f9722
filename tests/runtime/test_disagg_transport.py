"""Page handoff between two processes over Gloo: bit-exact pages of both groups, prefix negotiation,
namespace refusal, and a sender killed midway leaving the receiver consistent."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback

import pytest
import torch

from kvstrata.testing.redis import free_port

P = 4
TOKENS = [int(x) for x in torch.randint(0, 1000, (23,), generator=torch.Generator().manual_seed(1))]


def _groups():
    from kvstrata.pagepool import KVGroupSpec
    return [KVGroupSpec("target", 2, 2, 16, torch.bfloat16, "nvfp4"),
            KVGroupSpec("draft", 1, 2, 16, torch.bfloat16, "lossless")]


def _make(drafter="d1", pages=16):
    from kvstrata.pagepool import KVCacheManager, Namespace, PagePool
    g = _groups()
    pool = PagePool(g, pages, P)
    return pool, KVCacheManager(pool, Namespace("t1", g, P, drafter=drafter))


def _fill(mgr, sid, tokens, seed):
    """Admit + write random (never zero) K/V for every group + commit.

    A page's content is a function of the tokens up to its end (as real K/V is), so two workers that
    computed the same prefix hold the same bytes."""
    seq = mgr.admit(sid, tokens, max_cached_tokens=len(tokens))
    mgr.reserve(sid, len(tokens))
    for i, p in enumerate(mgr.seqs[sid].page_ids):
        if mgr.pool.info(p) is not None:   # a prefix hit: already holds this content
            continue
        key = hash((seed, tuple(tokens[:(i + 1) * P]))) & 0x7FFFFFFF
        gen = torch.Generator().manual_seed(key)
        for t in mgr.pool.kv.values():
            t[p] = torch.randn(t.shape[1:], generator=gen).to(t.dtype) + 3
    mgr.commit(sid, tokens[seq.num_tokens:])


def _page_bytes(mgr, sid, n_tokens):
    n_pages = -(-n_tokens // P)
    pages = mgr.seqs[sid].page_ids[:n_pages]
    out = {}
    for name, t in mgr.pool.kv.items():
        x = t[pages].clone()
        x[-1, :, :, :, (n_tokens - 1) % P + 1:, :] = 0   # slots past the length carry no data
        out[name] = x.view(torch.int16).numpy().copy()   # plain arrays: they outlive the process
    return out


def _links(mgr):
    """Both workers' raw links in chunks of 2 pages, 2 in flight (6 pages = 3 chunks)."""
    from kvstrata.pagepool import PoolView
    from kvstrata.tiers.peer import PeerLink
    return {False: PeerLink(PoolView.of(mgr.pool), mgr.namespace, chunk_pages=2, depth=2)}


class _DyingChannel:
    """A channel whose process dies at its ``after + 1``-th tensor sent without waiting."""

    def __init__(self, ch, after):
        self.ch, self.left = ch, after

    def isend(self, t):
        if not self.left:
            os._exit(9)
        self.left -= 1
        return self.ch.isend(t)

    def __getattr__(self, name):
        return getattr(self.ch, name)


def _run(rank, port, scenario, q):
    import torch.distributed as dist

    from kvstrata.pagepool import page_hashes
    from kvstrata.runtime.disagg import (NamespaceMismatchError, PageChannel, TransferError,
                                         handshake, recv_sequence, send_sequence)
    from kvstrata.runtime.disagg.transport import peer_link
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2)
        ch = PageChannel(1 - rank)
        if rank == 0:  # context worker
            pool, mgr = _make(drafter="none" if scenario == "mismatch" else "d1")
            try:
                handshake(ch, mgr.namespace, "context")
            except NamespaceMismatchError as e:
                q.put(("ctx-refused", str(e)))
                return
            _fill(mgr, "r", TOKENS, seed=7)
            sent = _page_bytes(mgr, "r", len(TOKENS))
            if scenario == "cut":          # die after chunk 0 and chunk 1's heads are out
                ch = _DyingChannel(ch, after=3)
                send_sequence(ch, mgr, "r", links=_links(mgr))
            if scenario == "kill":
                ch.send_obj({"seq_id": "r", "chunk_pages": peer_link(mgr, False).chunk,
                             "token_ids": TOKENS, "cache_salt": None,
                             "num_pages": 6, "hashes": mgr.seqs["r"].hashes, "extra": {}})
                ch.recv_obj()
                ch.send_obj({"checksums": {}})
                os._exit(9)    # die in the middle of the payload
            stats = send_sequence(ch, mgr, "r", extra={"first_token": 42},
                                  links=_links(mgr) if scenario == "chunked" else None)
            q.put(("ctx", sent, stats.pages_sent, stats.pages_skipped))
        else:  # generation worker
            pool, mgr = _make()
            if scenario == "prefix":
                _fill(mgr, "mine", TOKENS[:9], seed=7)   # holds 2 full pages of the same prefix
                mgr.free("mine")
            free_before = pool.num_free + pool.num_cached
            try:
                handshake(ch, mgr.namespace, "generation")
            except NamespaceMismatchError as e:
                q.put(("gen-refused", str(e)))
                return
            try:
                seq, extra, stats = recv_sequence(ch, mgr, links=_links(mgr) if scenario in
                                                  ("cut", "chunked") else None)
            except TransferError as e:
                pool.check_invariants()
                hashes = page_hashes(mgr.namespace, TOKENS)
                q.put(("gen-failed", str(e), pool.num_free + pool.num_cached == free_before,
                       pool.num_in_use, len(mgr.seqs),
                       sum(pool.lookup(h) is not None for h in hashes)))
                return
            pool.check_invariants()
            got = _page_bytes(mgr, seq.seq_id, len(TOKENS))
            findable = all(pool.lookup(h) is not None for h in seq.hashes)
            q.put(("gen", got, extra, seq.token_ids == TOKENS, findable, stats.pages_skipped))
    except Exception:  # noqa: BLE001
        q.put(("error", rank, traceback.format_exc()))
    finally:
        if scenario not in ("kill", "cut") or rank == 1:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def _scenario(name):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_run, args=(r, port, name, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = {}
    for _ in range(2 if name not in ("kill", "cut") else 1):
        item = q.get(timeout=120)
        if item[0] == "error":
            for p in procs:
                p.kill()
            pytest.fail(f"rank {item[1]} failed:\n{item[2]}")
        results[item[0]] = item
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    return results


@pytest.mark.parametrize("scenario", ["plain", "chunked"])
def test_handoff_is_bit_exact_for_both_groups(scenario):
    """One chunk, or 3 chunks of 2 pages with 2 in flight (receives posted ahead over Gloo)."""
    r = _scenario(scenario)
    _, sent, n_sent, n_skipped = r["ctx"]
    _, got, extra, tokens_ok, findable, _ = r["gen"]
    assert (n_sent, n_skipped) == (6, 0) and tokens_ok and findable
    assert extra == {"first_token": 42}
    for name in ("target", "draft"):
        assert got[name].shape == sent[name].shape and (got[name] == sent[name]).all(), name


def test_prefix_pages_the_receiver_holds_are_not_sent():
    r = _scenario("prefix")
    assert r["ctx"][2:] == (4, 2)         # 6 pages: 2 already there, 4 sent
    _, sent, _, _ = r["ctx"]
    _, got, _, tokens_ok, findable, skipped = r["gen"]
    assert skipped == 2 and tokens_ok and findable
    for name in ("target", "draft"):
        assert got[name].shape == sent[name].shape and (got[name] == sent[name]).all(), name


def test_namespace_mismatch_is_refused_naming_the_drafter():
    r = _scenario("mismatch")
    for key in ("ctx-refused", "gen-refused"):
        assert "drafter" in r[key][1] and "no drafter" in r[key][1]


def test_killed_sender_leaves_receiver_consistent():
    r = _scenario("kill")
    _, msg, restored, in_use, n_seqs, findable = r["gen-failed"]
    assert restored and in_use == 0 and n_seqs == 0 and findable == 0, msg


def test_sender_killed_mid_payload_leaves_nothing_visible():
    """The sender dies after chunk 0 (2 of 6 pages) reached the receiver's pool pages: the
    receiver fails, frees the sequence, and none of its pages is findable."""
    r = _scenario("cut")
    _, msg, restored, in_use, n_seqs, findable = r["gen-failed"]
    assert restored and in_use == 0 and n_seqs == 0 and findable == 0, msg
