"""Moving a sequence's pages, both layer groups, between two workers over ``torch.distributed``.

The context worker (sender) and the generation worker (receiver) each own a page pool. A handoff:

1. header (sender -> receiver): request id, token ids whose K/V is in the pages, the chain hashes of
   the full pages, an opaque ``extra`` dict (first generated token, sampling state, ...);
2. negotiation (receiver -> sender): the receiver admits the sequence in its own manager, which
   reuses the longest prefix it already holds (device pool, or its tiers), and answers how many
   leading pages it has: those are not sent again;
3. payload (sender -> receiver): for every group, the missing pages as one contiguous batch
   ``[n, num_layers, 2, num_kv_heads, page_size, head_dim]`` (raw), plus a CRC32 per group batch on
   the CPU path; or, with ``encode=True`` (a slow link), every page encoded with its group's codec
   (``nvfp4`` target pages are lossy, ``lossless`` draft pages bit-exact) as one uint8 batch per
   group, each page carrying its codec header and CRC32;
4. the receiver copies the batch into pages it reserved for the sequence and only then commits the
   tokens (which hashes the full pages and makes them findable).

Pages reserved for a handoff are owned by the new sequence and unhashed until step 4, so a transfer
that fails or is cut midway (the sender dies, a checksum fails) is undone with ``free``: nothing
partial is ever visible to other requests.

Gloo carries CPU tensors; NCCL carries CUDA tensors. Messages are msgpack bytes in uint8 tensors.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from ...codecs import EncodedPage, get_codec
from ...pagepool import KVCacheManager, Namespace, SequenceState, page_hashes

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


class PageChannel:
    """Point-to-point messages and tensors to one peer rank of the default process group."""

    def __init__(self, peer: int, device: torch.device | str | None = None):
        self.peer = peer
        if device is None:
            device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        self.device = torch.device(device)

    def send_obj(self, obj: Any) -> None:
        data = msgpack.packb(obj, use_bin_type=True)
        n = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        dist.send(n, self.peer)
        if data:
            dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device), self.peer)

    def recv_obj(self) -> Any:
        n = torch.empty(1, dtype=torch.int64, device=self.device)
        dist.recv(n, self.peer)
        buf = torch.empty(int(n.item()), dtype=torch.uint8, device=self.device)
        if buf.numel():
            dist.recv(buf, self.peer)
        return msgpack.unpackb(buf.cpu().numpy().tobytes(), raw=False)

    def send_tensor(self, t: torch.Tensor) -> None:
        dist.send(t.contiguous().to(self.device), self.peer)

    def recv_tensor(self, shape, dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(t, self.peer)
        return t


def namespace_fields(ns: Namespace) -> dict[str, Any]:
    return {"protocol": PROTOCOL_VERSION, "target": ns.target, "drafter": ns.drafter,
            "page_size": ns.page_size, "layout_version": ns.layout_version,
            "groups": [list(g.fingerprint_fields()) for g in ns.groups]}


def handshake(channel: PageChannel, namespace: Namespace, role: str) -> None:
    """Exchange namespaces; raise :class:`NamespaceMismatchError` naming every differing field.

    Both sides send first-then-receive in a fixed order (context first) so Gloo cannot deadlock.
    """
    mine = namespace_fields(namespace)
    if role == "context":
        channel.send_obj(mine)
        theirs = channel.recv_obj()
    elif role == "generation":
        theirs = channel.recv_obj()
        channel.send_obj(mine)
    else:
        raise ValueError(f"role must be 'context' or 'generation', got {role!r}")
    diffs = []
    for key in ("protocol", "layout_version", "page_size", "target", "drafter", "groups"):
        a, b = mine.get(key), theirs.get(key)
        if a != b:
            if key == "drafter" and "none" in (a, b):
                who = "this worker" if a == "none" else "the peer"
                diffs.append(f"drafter: {who} has no drafter ({a!r} here vs {b!r} at the peer); "
                             "the draft KV cannot be handed over")
            else:
                diffs.append(f"{key}: {a!r} here vs {b!r} at the peer")
    if diffs:
        raise NamespaceMismatchError(f"{role} worker refuses the peer: " + "; ".join(diffs))


def _pages_payload(mgr: KVCacheManager, page_ids: list[int]) -> dict[str, torch.Tensor]:
    idx = torch.as_tensor(page_ids, dtype=torch.long, device=mgr.pool.device)
    return {name: t.index_select(0, idx) for name, t in mgr.pool.kv.items()}


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().contiguous().view(torch.uint8).reshape(-1).numpy().data)


def _encode_payload(mgr: KVCacheManager, payload: dict[str, torch.Tensor]
                    ) -> tuple[dict[str, list[dict]], dict[str, torch.Tensor]]:
    """Encode every page of every group with the group's codec: headers and one uint8 batch each."""
    headers, blobs = {}, {}
    for spec in mgr.pool.groups:
        codec = get_codec(spec.codec)
        pages = [codec.encode(p).to_host() for p in payload[spec.name]]
        headers[spec.name] = [e.header() for e in pages]
        blobs[spec.name] = torch.cat([e.payload for e in pages])
    return headers, blobs


def _decode_payload(mgr: KVCacheManager, headers: dict[str, list[dict]],
                    blobs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for spec in mgr.pool.groups:
        codec, flat, at, pages = get_codec(spec.codec), blobs[spec.name].cpu(), 0, []
        for h in headers[spec.name]:
            n = int(h["nbytes"])
            # decode() checks the codec name/version and the page's CRC32: a damaged page raises.
            pages.append(codec.decode(EncodedPage.from_header(h, flat[at:at + n]),
                                      device=mgr.pool.device))
            at += n
        out[spec.name] = torch.stack(pages)
    return out


def send_sequence(channel: PageChannel, mgr: KVCacheManager, seq_id: object,
                  extra: dict[str, Any] | None = None, encode: bool = False) -> TransferStats:
    """Hand sequence ``seq_id`` (its committed tokens and pages) to the peer.

    ``encode``: send every page encoded with its group's codec (fewer bytes on a slow link; a
    lossy target codec makes the receiver's target K/V approximate, draft pages stay bit-exact).
    """
    t0 = time.perf_counter()
    seq = mgr.seqs[seq_id]
    P = mgr.page_size
    n_pages = -(-seq.num_tokens // P)
    channel.send_obj({"seq_id": str(seq_id), "token_ids": seq.token_ids,
                      "cache_salt": seq.namespace.cache_salt, "num_pages": n_pages,
                      "hashes": [h for h in seq.hashes], "extra": extra or {}})
    reply = channel.recv_obj()
    if not reply.get("ok", False):
        raise TransferError(f"receiver refused {seq_id!r}: {reply.get('error')}")
    have = int(reply["have_pages"])
    missing = seq.page_ids[have:n_pages]
    stats = TransferStats(pages_total=n_pages, pages_sent=len(missing), pages_skipped=have)
    if missing:
        payload = _pages_payload(mgr, missing)
        checks, headers = {}, None
        if encode:
            tail = seq.num_tokens - (n_pages - 1) * P
            for t in payload.values():   # a copy: slots past the length may hold NaN garbage
                t[-1, :, :, :, tail:] = 0
            headers, payload = _encode_payload(mgr, payload)
        elif channel.device.type == "cpu":
            checks = {name: _crc(t.cpu()) for name, t in payload.items()}
        channel.send_obj({"checksums": checks, "encoded": headers})
        for name in mgr.pool.kv:
            channel.send_tensor(payload[name])
            stats.bytes += payload[name].numel() * payload[name].element_size()
    done = channel.recv_obj()
    if not done.get("ok", False):
        raise TransferError(f"receiver failed to store {seq_id!r}: {done.get('error')}")
    stats.seconds = time.perf_counter() - t0
    return stats


def recv_sequence(channel: PageChannel, mgr: KVCacheManager, seq_id: object | None = None
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
        if len(tokens) > mgr.max_tokens:
            raise ValueError(f"{len(tokens)} tokens do not fit this worker's pool "
                             f"({mgr.max_tokens} tokens at most)")
        # Both sides hash the same tokens under their own namespace: a difference means the
        # namespaces drifted after the handshake, and nothing may be stored.
        ns = mgr.namespace_for(header.get("cache_salt"))
        if page_hashes(ns, tokens) != [bytes(h) for h in header["hashes"]]:
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
            meta = channel.recv_obj()
            missing = seq.page_ids[have:n_pages]
            idx = torch.as_tensor(missing, dtype=torch.long, device=mgr.pool.device)
            staged, headers = {}, meta.get("encoded")
            for name, t in mgr.pool.kv.items():
                if headers:
                    size = sum(int(h["nbytes"]) for h in headers[name])
                    staged[name] = channel.recv_tensor((size,), torch.uint8)
                else:
                    staged[name] = channel.recv_tensor((len(missing), *t.shape[1:]), t.dtype)
                stats.bytes += staged[name].numel() * staged[name].element_size()
            if headers:
                staged = _decode_payload(mgr, headers, staged)
            for name, want in meta.get("checksums", {}).items():
                got = _crc(staged[name].cpu())
                if got != want:
                    raise TransferError(f"group {name!r}: payload CRC {got:#010x} != {want:#010x}")
            for name, t in mgr.pool.kv.items():
                t.index_copy_(0, idx, staged[name].to(t.device))
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
