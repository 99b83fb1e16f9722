"""Handing a sequence (its tokens and pages, both layer groups) from one worker to another.

The context worker (sender) and the generation worker (receiver) each own a page pool. A handoff:

1. header (sender -> receiver): request id, token ids whose K/V is in the pages, the chain hashes of
   the full pages, an opaque ``extra`` dict (first generated token, sampling state, ...);
2. negotiation (receiver -> sender): the receiver admits the sequence in its own manager, which
   reuses the longest prefix it already holds (device pool, or its tiers), and answers how many
   leading pages it has: those are not sent again;
3. pages (sender -> receiver): the missing pages move through the tiers' peer path
   (:class:`~kvstrata.tiers.peer.PeerLink`): the same Mover and records (header, payloads, CRCs)
   as every tier, raw or, with ``encode=True`` (a slow link), in each group's codec (``nvfp4``
   target pages are lossy, ``lossless`` draft pages bit-exact), pipelined by chunk (gather,
   send and decode overlap; both links' ``chunk_pages`` travel in the header and must agree);
   the receiver verifies every record of a chunk before it decodes it into pages it reserved
   for the sequence;
4. the receiver only then commits the tokens (which hashes the full pages and makes them
   findable).

Pages reserved for a handoff are owned by the new sequence and unhashed until step 4, so a transfer
that fails or is cut midway (the sender dies, a record fails its check) is undone with ``free``:
nothing partial is ever visible to other requests.

Gloo carries CPU tensors; NCCL carries CUDA tensors. Messages are msgpack bytes in uint8 tensors.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ...pagepool import (KVCacheManager, Namespace, PageInfo, PoolView, SequenceState,
                         hash_page, namespace_differences, page_hashes)
from ...tiers.peer import PageChannel, PeerError, PeerLink

__all__ = ["NamespaceMismatchError", "PageChannel", "TransferError", "TransferStats",
           "handshake", "peer_link", "recv_sequence", "send_sequence"]

PROTOCOL_VERSION = 1


class TransferError(RuntimeError):
    """A handoff failed (peer gone, payload damaged); the receiver's pool is unchanged."""


class NamespaceMismatchError(ValueError):
    """The two workers do not agree on models, drafter, group specs, page size or layout."""


@dataclass(slots=True)
class TransferStats:
    pages_total: int = 0
    pages_sent: int = 0          # full or partial pages whose bytes crossed the link
    pages_skipped: int = 0       # prefix pages the receiver already held
    bytes: int = 0
    seconds: float = 0.0

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


def handshake(channel: PageChannel, namespace: Namespace, role: str) -> None:
    """Exchange namespaces; raise :class:`NamespaceMismatchError` naming every differing field.

    Both sides send first-then-receive in a fixed order (context first) so Gloo cannot deadlock.
    """
    mine = {"protocol": PROTOCOL_VERSION, **namespace.shared_fields()}
    if role == "context":
        channel.send_obj(mine)
        theirs = channel.recv_obj()
    elif role == "generation":
        theirs = channel.recv_obj()
        channel.send_obj(mine)
    else:
        raise ValueError(f"role must be 'context' or 'generation', got {role!r}")
    diffs = []
    if theirs.get("protocol") != PROTOCOL_VERSION:
        diffs.append(f"protocol: {PROTOCOL_VERSION!r} at this worker vs "
                     f"{theirs.get('protocol')!r} at the peer")
    diffs += namespace_differences(mine, theirs, "this worker", "the peer")
    if diffs:
        raise NamespaceMismatchError(f"{role} worker refuses the peer: " + "; ".join(diffs))


def peer_link(mgr: KVCacheManager, encode: bool,
              links: dict[bool, PeerLink] | None = None) -> PeerLink:
    """The :class:`PeerLink` over ``mgr``'s pool for a mode, kept in ``links`` (a worker's: a
    link owns staging buffers) when given."""
    link = links.get(encode) if links is not None else None
    if link is None:
        link = PeerLink(PoolView.of(mgr.pool), mgr.namespace, encode=encode)
        if links is not None:
            links[encode] = link
    return link


def _page_infos(page_ids, token_ids, hashes, root: bytes, first: int, n_pages: int,
                page_size: int) -> list[PageInfo]:
    """PageInfo of pages ``first .. n_pages-1`` of a sequence: full pages carry their chain
    hash; a partial last page the key ``H(parent || its tokens)``, which no full page can have."""
    out = []
    for i in range(first, n_pages):
        parent = hashes[i - 1] if i else root
        tokens = tuple(token_ids[i * page_size:(i + 1) * page_size])
        h = hashes[i] if i < len(hashes) else hash_page(parent, tokens)
        out.append(PageInfo(page_ids[i], h, parent, tokens))
    return out


def send_sequence(channel, mgr: KVCacheManager, seq_id: object,
                  extra: dict[str, Any] | None = None, encode: bool = False,
                  links: dict[bool, PeerLink] | None = None) -> TransferStats:
    """Hand sequence ``seq_id`` (its committed tokens and pages) to the peer.

    ``encode``: send every page encoded with its group's codec (fewer bytes on a slow link; a
    lossy target codec makes the receiver's target K/V approximate, draft pages stay bit-exact).
    ``links``: the worker's :class:`PeerLink` per mode (:func:`peer_link`; made per call when
    ``None``).
    """
    t0 = time.perf_counter()
    seq = mgr.seqs[seq_id]
    P = mgr.page_size
    n_pages = -(-seq.num_tokens // P)
    link = peer_link(mgr, encode, links)
    channel.send_obj({"seq_id": str(seq_id), "chunk_pages": link.chunk,
                      "token_ids": seq.token_ids, "cache_salt": seq.namespace.cache_salt,
                      "num_pages": n_pages,
                      "hashes": [h for h in seq.hashes], "encoded": bool(encode),
                      "extra": extra or {}})
    reply = channel.recv_obj()
    if not reply.get("ok", False):
        raise TransferError(f"receiver refused {seq_id!r}: {reply.get('error')}")
    have = int(reply["have_pages"])
    stats = TransferStats(pages_total=n_pages, pages_sent=n_pages - have, pages_skipped=have)
    if have < n_pages:
        infos = _page_infos(seq.page_ids, seq.token_ids, seq.hashes, seq.namespace.digest, have,
                            n_pages, P)
        tail = seq.num_tokens - (n_pages - 1) * P
        if encode and tail < P:
            # Slots past the length may hold garbage (NaN) a lossy codec refuses; they carry no
            # data (attention stops at the length), so the partial page is zeroed there first.
            _zero_tail(link.view, infos[-1].page_id, tail)
        try:
            stats.bytes = link.send(channel, infos)
        except PeerError as e:
            raise TransferError(f"cannot send {seq_id!r}: {e}") from e
    done = channel.recv_obj()
    if not done.get("ok", False):
        raise TransferError(f"receiver failed to store {seq_id!r}: {done.get('error')}")
    stats.seconds = time.perf_counter() - t0
    return stats


def _zero_tail(view: PoolView, page_id: int, tail: int) -> None:
    import torch
    ids = torch.tensor([page_id], device=view.device)
    for gi in range(len(view.groups)):
        page = view.read(gi, ids)
        page[..., tail:, :] = 0
        view.write(gi, ids, page)


def recv_sequence(channel, mgr: KVCacheManager, seq_id: object | None = None,
                  links: dict[bool, PeerLink] | None = None
                  ) -> tuple[SequenceState, dict[str, Any], TransferStats]:
    """Receive one handed-over sequence into ``mgr``'s pool.

    Returns the admitted :class:`SequenceState` (all tokens committed, full pages hashed), the
    sender's ``extra`` dict and transfer stats. On any failure the sequence is freed (no partial page
    becomes visible) and :class:`TransferError` is raised.
    """
    t0 = time.perf_counter()
    try:
        header = channel.recv_obj()
    except Exception as e:  # noqa: BLE001 - the peer died before anything was admitted
        raise TransferError(f"peer closed before sending a header: {e}") from e
    sid = header["seq_id"] if seq_id is None else seq_id
    tokens = [int(t) for t in header["token_ids"]]
    P = mgr.page_size
    n_pages = int(header["num_pages"])
    admitted = False
    try:
        link = peer_link(mgr, bool(header.get("encoded", False)), links)
        if header.get("chunk_pages") != link.chunk:
            # The receiver posts each chunk's receive before it arrives: sizes must agree.
            raise ValueError(f"the sender moves pages in chunks of {header.get('chunk_pages')}"
                             f", this worker in chunks of {link.chunk}; give both PeerLinks "
                             f"the same chunk_pages")
        if len(tokens) > mgr.max_tokens:
            raise ValueError(f"{len(tokens)} tokens do not fit this worker's pool "
                             f"({mgr.max_tokens} tokens at most)")
        # Both sides hash the same tokens under their own namespace: a difference means the
        # namespaces drifted after the handshake, and nothing may be stored.
        ns = mgr.namespace_for(header.get("cache_salt"))
        hashes = page_hashes(ns, tokens)
        if hashes != [bytes(h) for h in header["hashes"]]:
            raise ValueError("page hashes differ between the workers (namespace drift)")
        # Reuse every full page we already hold (max_cached_tokens = all full pages).
        seq = mgr.admit(sid, tokens, cache_salt=header.get("cache_salt"),
                        max_cached_tokens=len(tokens))
        admitted = True
        have = len(seq.page_ids)
        mgr.reserve(sid, len(tokens))
    except Exception as e:  # noqa: BLE001 - refuse this one request, keep serving
        if admitted:
            mgr.free(sid)
        channel.send_obj({"ok": False, "error": f"{type(e).__name__}: {e}"})
        raise TransferError(f"cannot admit handed-over request {sid!r}: {e}") from e
    stats = TransferStats(pages_total=n_pages, pages_skipped=have, pages_sent=n_pages - have)
    try:
        channel.send_obj({"ok": True, "have_pages": have})
        if have < n_pages:
            infos = _page_infos(seq.page_ids, tokens, hashes, ns.digest, have, n_pages, P)
            stats.bytes = link.recv(channel, infos, seq.page_ids[have:n_pages])
        # Only now, with every byte in place, do the pages get hashed and become findable.
        mgr.commit(sid, tokens[seq.num_tokens:])
        channel.send_obj({"ok": True})
    except Exception as e:  # noqa: BLE001
        mgr.free(sid)   # reserved pages were never hashed: they go back to the free list
        try:
            channel.send_obj({"ok": False, "error": str(e)})
        except Exception:  # noqa: BLE001 - the peer may be gone; nothing more to tell it
            pass
        if isinstance(e, TransferError):
            raise
        raise TransferError(f"transfer of {sid!r} cut midway: {e}") from e
    stats.seconds = time.perf_counter() - t0
    return mgr.seqs[sid], header.get("extra", {}), stats
