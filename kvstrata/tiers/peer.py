"""The peer path: a sequence's pages (every group) to or from one peer over ``torch.distributed``.

Disaggregated serving hands a request's pages from a context worker to a generation worker. They
move the way pages move between any two tiers: the :class:`~kvstrata.tiers.transfer.Mover`
gathers (and encodes) device pages into host slots, each page leaves as a self-describing record
(:mod:`~kvstrata.tiers.record`: header, per-group payloads, CRCs), and the receiver verifies every
record against the page it expects (namespace, hash link, tokens, codec, CRCs) before the Mover
decodes it into its own device pages. Nothing here knows requests: the handoff protocol
(negotiation, admission, commit) lives in ``kvstrata.runtime.disagg.transport``.

- ``encode=False`` (a fast link): records in the identity codec, the device bytes as they are
  (bit-exact for every group).
- ``encode=True`` (a slow link): records in each group's configured codec (``nvfp4`` target pages
  are lossy, ``lossless`` draft pages bit-exact), as the disk and remote tiers store them.

A sequence's last page is usually partial: its record carries the tokens it holds and the key
``H(parent || those tokens)``, which no full page can have, so it verifies like any other.

On the wire, per batch of pages, one of two forms:

- *slots* (every group's host format is its record codec: raw links, or device codecs only): a
  message ``{"heads": [record head, ...], "layout": [slot_bytes, offsets]}`` and the batch's host
  slots as one uint8 tensor ``[n, slot_bytes]``, sent from and received into the host slots
  themselves (each record = its head + its payloads at the slot's group offsets; no copy into a
  wire buffer on either side);
- *records* (a group is encoded on the CPU for the link, e.g. ``lossless``): a message
  ``{"sizes": [record bytes, ...]}`` and one uint8 tensor of the records back to back.

Gloo carries CPU tensors, NCCL CUDA tensors.
"""

from __future__ import annotations

from typing import Any, Sequence

import msgpack
import numpy as np
import torch
import torch.distributed as dist

from ..codecs import CorruptPageError, get_codec
from ..pagepool import Namespace, PageInfo, PoolView
from .host import HostTier, host_codec, slot_layout
from .protocol import record_nbytes
from .record import payload_sizes, verify_record
from .transfer import Mover


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
            dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device),
                      self.peer)

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

    def recv_into(self, t: torch.Tensor) -> torch.Tensor:
        """Receive into ``t`` (on the channel's device): no new buffer per message."""
        dist.recv(t, self.peer)
        return t


class PeerError(RuntimeError):
    """Pages could not be sent or received (a codec refused a page, a record failed its CRC or
    identity check, the peer sent something else); nothing was written to the device."""


class PeerLink:
    """Pages of ``view`` to or from a peer as records (see the module doc).

    Args:
        view: the device pages (:class:`PoolView`).
        namespace: both workers' namespace (its unsalted digest goes into every record).
        encode: records in the groups' configured codecs (``True``) or raw (identity).
        batch_pages: pages per batch (host staging slots: ``batch_pages`` pages).
    """

    def __init__(self, view: PoolView, namespace: Namespace, encode: bool = False,
                 batch_pages: int = 64):
        if not isinstance(batch_pages, int) or batch_pages <= 0:
            raise ValueError(f"batch_pages must be a positive integer, got {batch_pages!r}")
        self.view = view
        self.ns_digest = namespace.with_salt(None).digest
        self.specs = view.specs
        self.codecs = [get_codec(g.codec if encode else "identity") for g in self.specs]
        slot = slot_layout(self.specs, self.codecs, view.page_size)[2]
        pin = view.device.type == "cuda" and torch.cuda.is_available()
        self.host = HostTier(self.specs, self.codecs, view.page_size, batch_pages * slot, pin=pin)
        self.batch = batch_pages
        self.mover = Mover(view, self.host, self.codecs, batch_pages)
        #: records are the slots' bytes (no group is encoded on the CPU for the link)
        self.slot_records = all(host_codec(c) is c for c in self.codecs)
        # Wire buffers, kept across batches and handoffs: a fresh buffer of a batch's records
        # (~160 MiB of Qwen3-8B pages) costs more in page faults than the copy into it.
        self._bufs: dict[str, torch.Tensor] = {}

    def _buffer(self, which: str, n: int, device: torch.device | None = None) -> torch.Tensor:
        device = torch.device("cpu") if device is None else device
        b = self._bufs.get(which)
        if b is None or b.numel() < n or b.device != device:
            b = self._bufs[which] = torch.empty(n, dtype=torch.uint8, device=device)
        return b[:n]

    def send(self, channel, pages: Sequence[PageInfo]) -> int:
        """Send the device pages ``pages`` (``page_id``, hash, parent, tokens) as records;
        returns the bytes sent. Raises :class:`PeerError` if a codec refuses a page (NaN/Inf
        under NVFP4), after telling the peer (its :meth:`recv` raises too)."""
        sent = 0
        for k in range(0, len(pages), self.batch):
            chunk = list(pages[k:k + self.batch])
            slots, _ = self.host.take_slots(len(chunk))
            entries, ev, refused = self.mover.down(self.ns_digest, chunk, slots)
            self.host.add(entries, ev, refused)
            self.host.settle()
            held = [self.host.entry(i.hash) for i in chunk]
            try:
                if any(e is None for e in held):
                    err = PeerError("a page could not be encoded for the link (NaN/Inf in the "
                                    "KV under a lossy codec?)")
                    channel.send_obj({"error": str(err)})     # the peer fails this handoff too
                    raise err
                recs = self.host.records(held)
                if self.slot_records:
                    msg = {"heads": [bytes(r[0]) for r in recs],
                           "layout": [self.host.slot_bytes, self.host.offsets]}
                    blob = self._rows(slots)
                else:
                    sizes = [record_nbytes(r) for r in recs]
                    msg = {"sizes": sizes}
                    blob = self._buffer("send", sum(sizes))
                    out, at = blob.numpy(), 0
                    for r in recs:
                        for part in r:
                            n = memoryview(part).nbytes
                            out[at:at + n] = np.frombuffer(part, dtype=np.uint8)
                            at += n
                channel.send_obj(msg)
                channel.send_tensor(blob)
                sent += blob.numel()
            finally:
                self.host.discard(i.hash for i in chunk)
        return sent

    def _rows(self, slots: Sequence[int]) -> torch.Tensor:
        """The host slots ``slots`` as one ``[n, slot_bytes]`` tensor (a view when they are
        consecutive, as they are in this link's otherwise empty host tier)."""
        if list(slots) == list(range(slots[0], slots[0] + len(slots))):
            return self.host.rows(slots[0], len(slots))
        return torch.cat([self.host.rows(s) for s in slots])

    def recv(self, channel, pages: Sequence[PageInfo], page_ids: Sequence[int]) -> int:
        """Receive the records of ``pages`` (what the receiver expects) and decode them into its
        device pages ``page_ids``; returns the bytes received. Every record is verified before
        anything of its batch reaches the device; a bad one raises :class:`PeerError` naming the
        page (earlier batches are written: the caller frees the pages)."""
        if len(pages) != len(page_ids):
            raise ValueError(f"{len(pages)} pages but {len(page_ids)} page ids")
        got, failed = 0, None
        for k in range(0, len(pages), self.batch):
            chunk = list(pages[k:k + self.batch])
            meta = channel.recv_obj()
            if isinstance(meta, dict) and "error" in meta:
                raise PeerError(f"the peer could not send its pages: {meta['error']}")
            if not isinstance(meta, dict) or len(meta.get("heads", meta.get("sizes", ()))) \
                    != len(chunk):
                raise PeerError(f"expected the records of {len(chunk)} pages, the peer sent "
                                f"{meta!r:.80}")
            slots, _ = self.host.take_slots(len(chunk))
            self.mover.fence_host_writes()
            try:
                if "heads" in meta:
                    if meta.get("layout") != [self.host.slot_bytes, self.host.offsets]:
                        raise PeerError(f"the peer's host slots are laid out as "
                                        f"{meta.get('layout')}, this worker's as "
                                        f"{[self.host.slot_bytes, self.host.offsets]}")
                    records, got = self._recv_slots(channel, meta["heads"], slots, got)
                else:
                    records, got = self._recv_records(channel, meta["sizes"], got)
                if failed is not None:
                    continue    # drain the batches still on the link: the peer stays in step
                entries = []
                for j, (info, parts) in enumerate(zip(chunk, records)):
                    try:
                        rec = verify_record(parts, self.ns_digest, info, self.specs,
                                            self.codecs, self.view.page_size)
                        entries.append(self.host.fill(slots[j], info, self.ns_digest, rec))
                    except CorruptPageError as e:
                        failed = PeerError(f"received page {k + j} is damaged (CRC or identity "
                                           f"check failed: {e})")
                        break
                else:
                    self.mover.up(entries, page_ids[k:k + len(chunk)])
            finally:
                self.host.give_back(slots)
        if failed is not None:
            raise failed
        return got

    def _recv_into(self, channel, buf: torch.Tensor) -> torch.Tensor:
        """Receive the next tensor into ``buf`` (a CPU tensor): in place where the channel can
        (Gloo), else through the channel's own buffer."""
        if hasattr(channel, "recv_into") and channel.device.type == "cpu":
            return channel.recv_into(buf)
        return buf.copy_(channel.recv_tensor(tuple(buf.shape), buf.dtype).reshape(buf.shape))

    def _recv_slots(self, channel, heads: list, slots: list[int], got: int):
        """Slot rows straight into this link's host slots; records = head + slot payloads."""
        rows = self._rows(slots)
        self._recv_into(channel, rows)
        if rows.data_ptr() != self.host.rows(slots[0]).data_ptr():     # not consecutive
            for j, s in enumerate(slots):
                self.host.rows(s).copy_(rows[j:j + 1])
        records = []
        for h, s in zip(heads, slots):
            try:
                sizes = payload_sizes(h)
            except CorruptPageError:
                sizes = None
            if sizes is None or len(sizes) != len(self.specs):
                records.append([h])         # fails verification as a record without payloads
                continue
            records.append([h, *(self.host.group_region(s, gi)[:n].numpy().data
                                 for gi, n in enumerate(sizes))])
        return records, got + rows.numel()

    def _recv_records(self, channel, sizes: list, got: int):
        sizes = [int(n) for n in sizes]
        blob = self._recv_into(channel, self._buffer("recv", sum(sizes)))
        mv, at, records = memoryview(blob.numpy()), 0, []
        for n in sizes:
            records.append(mv[at:at + n])
            at += n
        return records, got + blob.numel()
