"""The peer path: a sequence's pages (every group) to or from one peer over ``torch.distributed``.

Disaggregated serving hands a request's pages from a context worker to a generation worker. They
move the way pages move between any two tiers: the :class:`~kvstrata.tiers.transfer.Mover`
gathers (and encodes) device pages into slots laid out like host slots, each page leaves as a
self-describing record (:mod:`~kvstrata.tiers.record`: header, per-group payloads, CRCs), and the
receiver verifies every record against the page it expects (namespace, hash link, tokens, codec,
CRCs) before the Mover decodes it into its own device pages. Nothing here knows requests: the
handoff protocol (negotiation, admission, commit) lives in ``kvstrata.runtime.disagg.transport``.

- ``encode=False`` (a fast link): records in the identity codec, the device bytes as they are
  (bit-exact for every group).
- ``encode=True`` (a slow link): records in each group's configured codec (``nvfp4`` target pages
  are lossy, ``lossless`` draft pages bit-exact), as the disk and remote tiers store them.

A sequence's last page is usually partial: its record carries the tokens it holds and the key
``H(parent || those tokens)``, which no full page can have, so it verifies like any other.

Pipelining. Pages move in *chunks* of ``chunk_pages`` pages (every group of a page in one slot
row), at most ``depth`` chunks in flight: the sender gathers chunk k+1 while chunk k is on the
link, and the receiver verifies and scatters chunk k while chunks k+1 .. k+depth-1 arrive::

    sender:    [gather 0][gather 1][gather 2] ...        (gather k+depth waits for send k)
    link:               [send 0   ][send 1   ][send 2   ] ...
    receiver:                      [verify+scatter 0][verify+scatter 1] ...

Per chunk, two tensors, both posted without waiting (``isend``/``irecv``):

- *heads*: uint8 ``[1 + pages, head_bytes]``: a control row (u32 status, u64 bytes of the
  chunk's data, an error message), then one row per page: u32 length + the record's head (prefix
  + header: identity, codec, payload sizes and CRCs). ``head_bytes`` is fixed by the groups and
  the page size (:func:`head_bytes`), so the receiver posts its receive ahead of the data. A
  status ``0xFFFFFFFF`` says the sender could not encode a page: it then sends every remaining
  chunk flagged so, and the receiver drains them; both sides stay in step and raise
  :class:`PeerError`. A damaged head fails its page's check, never the framing.
- *data*, when every group's host format is its record codec (raw links, or device codecs only):
  the chunk's slot rows ``[pages, slot_bytes]``, sent from and received into the slots themselves
  (record = head + payloads at the slot's group offsets). The receiver posts the heads and data of
  ``depth`` chunks ahead. When a group is encoded on the CPU for the link (``lossless``), data is
  the chunk's payloads back to back, sized by the control row: the receiver posts it once the
  heads came.

Where the bytes live. On the CPU (Gloo) the Mover gathers pages straight into the link's slots and
decodes straight from them: one copy per side, no staging. With CUDA pools over NCCL (a CUDA
channel) a chunk is gathered into a device buffer, sent from it, received into a device buffer
and decoded from it: no host round trip; the NCCL calls are ordered after the gather and before
the decode by the current stream, and a buffer is reused only after its send (or decode) is
complete. That device path carries heads without payload CRCs (``checksum`` 0; NCCL's transports
protect the bytes in flight; a CRC would cost a device pass): identity, codec and sizes are still
verified. CUDA pools over a CPU channel stage through pinned host slots (the Mover's DMAs).
"""

from __future__ import annotations

import struct
import time
from collections import deque
from dataclasses import replace
from typing import Any, Sequence

import msgpack
import numpy as np
import torch
import torch.distributed as dist

from ..codecs import CorruptPageError, crc32, get_codec
from ..pagepool import KVGroupSpec, Namespace, PageInfo, PoolView
from .host import HostEntry, HostTier, host_codec, slot_layout
from .record import (build_record, check_identity, check_record_groups, parse_record,
                     payload_sizes, verify_record)
from .transfer import Mover

#: Bytes per pipelined chunk by default (rounded down to whole pages, at least one): 8 pages of
#: Qwen3-8B + DFlash-b16 (2.56 MiB each). On the CPU over Gloo, 8-page chunks did better than 3
#: or 12 in every side-by-side run (docs/benchmarks.md, "Pipelined handoff"); on GPUs unmeasured.
LINK_CHUNK_BYTES = 21 << 20
_LEN = struct.Struct("<I")
_CONTROL = struct.Struct("<IQ")     # status, data bytes; then a CRC-32 of those 12 bytes
_ERROR = 0xFFFFFFFF


def head_bytes(specs: Sequence[KVGroupSpec], page_size: int) -> int:
    """Wire bytes reserved for one record head: u32 length + prefix + header (format, namespace,
    hash, parent, ``page_size`` token ids of up to 5 msgpack bytes each, time, and per group its
    name, codec, dtype, shape, size, CRC and codec metadata), with room to spare."""
    n = 4 + 12 + 160 + 5 * page_size + sum(160 + len(g.name) for g in specs)
    return -(-2 * n // 64) * 64


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

    def isend(self, t: torch.Tensor):
        """Start sending ``t`` (contiguous, on the channel's device; untouched until the
        returned work's ``wait()``)."""
        return dist.isend(t, self.peer)

    def irecv(self, t: torch.Tensor):
        """Start receiving the next tensor into ``t`` (on the channel's device); it holds the
        bytes after the returned work's ``wait()``. Receives match sends in posting order."""
        return dist.irecv(t, self.peer)


class PeerError(RuntimeError):
    """Pages could not be sent or received (a codec refused a page, a record failed its CRC or
    identity check, the peer sent something else); nothing was written to the device."""


class _Staged:
    """A receive posted through a channel buffer on another device (copied in on ``wait``)."""

    def __init__(self, work, tmp: torch.Tensor, dst: torch.Tensor):
        self.work, self.tmp, self.dst = work, tmp, dst

    def wait(self):
        self.work.wait()
        self.dst.copy_(self.tmp.reshape(self.dst.shape))


def _post_send(channel, t: torch.Tensor):
    """``(work, keep-alive)``: ``t`` leaves from the channel's device."""
    t = t.contiguous()
    if t.device != channel.device:
        t = t.to(channel.device)
    return channel.isend(t), t


def _post_recv(channel, t: torch.Tensor):
    if t.device == channel.device and t.is_contiguous():
        return channel.irecv(t)
    tmp = torch.empty(t.shape, dtype=t.dtype, device=channel.device)
    return _Staged(channel.irecv(tmp), tmp, t)


class PeerLink:
    """Pages of ``view`` to or from a peer as records, pipelined by chunk (see the module doc).

    Args:
        view: the device pages (:class:`PoolView`).
        namespace: both workers' namespace (its unsalted digest goes into every record).
        encode: records in the groups' configured codecs (``True``) or raw (identity).
        chunk_pages: pages per chunk (default: about :data:`LINK_CHUNK_BYTES`). Both sides must
            use the same value (the heads' receive is posted before they arrive).
        depth: chunks in flight per side (host slots or device buffers: ``depth * chunk_pages``
            pages); 1 serializes gather, send and scatter.
        device_link: gather into and decode from buffers on the pool's device, no host slots
            (``None``: when the pool and the channel are on CUDA; ``False``: stage through host
            slots; ``True``: always, e.g. a CPU pool, which is how CPU CI runs this path).
    """

    def __init__(self, view: PoolView, namespace: Namespace, encode: bool = False,
                 chunk_pages: int | None = None, depth: int = 3,
                 device_link: bool | None = None):
        self.view = view
        self.ns_digest = namespace.with_salt(None).digest
        self.specs = view.specs
        self.codecs = [get_codec(g.codec if encode else "identity") for g in self.specs]
        slot = slot_layout(self.specs, self.codecs, view.page_size)[2]
        if chunk_pages is None:
            chunk_pages = max(1, min(64, LINK_CHUNK_BYTES // slot))
        for name, v in (("chunk_pages", chunk_pages), ("depth", depth)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        self.chunk, self.depth = chunk_pages, depth
        self.cuda = view.device.type == "cuda"
        self.host = HostTier(self.specs, self.codecs, view.page_size, depth * chunk_pages * slot,
                             pin=self.cuda and torch.cuda.is_available())
        self.mover = Mover(view, self.host, self.codecs, chunk_pages, chunk_pages)
        #: records are the slots' bytes (no group is encoded on the CPU for the link)
        self.slot_records = all(host_codec(c) is c for c in self.codecs)
        if device_link and not self.slot_records:
            raise ValueError("device_link needs groups whose codecs run on the device "
                             "(encode=False, or device codecs only)")
        self.device_link = device_link
        self.head_bytes = head_bytes(self.specs, view.page_size)
        self._bufs: dict[str, torch.Tensor] = {}
        self._stand_ins: list | None = None
        self._row_headers = ([self.host.row_header(gi) for gi in range(len(self.specs))]
                             if self.slot_records else None)
        #: seconds spent, summed over transfers: ``gather_s`` (gather + encode + record heads and
        #: CRCs), ``wait_send_s`` (the sender waiting for the link), ``wait_recv_s`` (the
        #: receiver waiting for bytes), ``verify_s`` (records checked, CRCs included),
        #: ``scatter_s`` (decode into pool pages; launch time only on CUDA)
        self.timings = dict.fromkeys(("gather_s", "wait_send_s", "wait_recv_s", "verify_s",
                                      "scatter_s"), 0.0)

    # -- helpers -----------------------------------------------------------------------------------
    def _buffer(self, which: str, shape, device: torch.device | None = None) -> torch.Tensor:
        """A buffer kept across chunks and handoffs: a fresh buffer of a chunk (~20 MiB) costs
        more in page faults than the copy into it."""
        device = torch.device("cpu") if device is None else device
        n = int(np.prod(shape))
        b = self._bufs.get(which)
        if b is None or b.numel() < n or b.device != device:
            b = self._bufs[which] = torch.empty(n, dtype=torch.uint8, device=device)
        return b[:n].view(shape)

    def _on_device(self, channel) -> bool:
        if self.device_link is None:
            return self.cuda and self.slot_records and channel.device.type == "cuda"
        return self.device_link

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        return [(k, min(self.chunk, n - k)) for k in range(0, n, self.chunk)]

    def _rows(self, slots: Sequence[int], ring: int) -> torch.Tensor:
        """The host slots ``slots`` as one ``[n, slot_bytes]`` tensor: a view when consecutive
        (always, in this link's ring of slots), else a buffer (copy in/out by the caller)."""
        if list(slots) == list(range(slots[0], slots[0] + len(slots))):
            return self.host.rows(slots[0], len(slots))
        return self._buffer(f"rows{ring}", (len(slots), self.host.slot_bytes))

    def _pack_heads(self, heads: Sequence[bytes] | None, m: int, ring: int, data_bytes: int,
                    error: str | None = None) -> torch.Tensor:
        """``[1 + m, head_bytes]``: the control row (status, the chunk's data bytes, an error
        message) and one row per page (u32 length + its record head)."""
        out = self._buffer(f"heads{ring}", (m + 1, self.head_bytes))
        a = out.numpy()
        a[:, :4] = 0
        ctl = _CONTROL.pack(0 if error is None else _ERROR, data_bytes)
        a[0, :16] = np.frombuffer(ctl + _LEN.pack(crc32(ctl)), dtype=np.uint8)
        if error is not None:
            msg = error.encode()[:self.head_bytes - 16]
            a[0, 16:16 + len(msg)] = np.frombuffer(msg, dtype=np.uint8)
            a[0, 16 + len(msg):] = 0
            return out
        for j, h in enumerate(heads, start=1):
            if len(h) + 4 > self.head_bytes:       # a bug in head_bytes(), never the data
                raise PeerError(f"a record head of {len(h)} bytes exceeds the "
                                f"{self.head_bytes - 4} the wire reserves")
            a[j, :4] = np.frombuffer(_LEN.pack(len(h)), dtype=np.uint8)
            a[j, 4:4 + len(h)] = np.frombuffer(h, dtype=np.uint8)
        return out

    def _unpack_heads(self, buf: torch.Tensor) -> tuple[list[bytes] | str, int | None, bool]:
        """``(heads or what is wrong with them, the chunk's data bytes or None if the control
        row is damaged, the sender failed)``."""
        a = buf.cpu().numpy() if buf.device.type != "cpu" else buf.numpy()
        ctl = a[0, :12].tobytes()
        if crc32(ctl) != _LEN.unpack_from(a[0, 12:16].tobytes())[0]:
            return "a chunk's control row is damaged (CRC check failed)", None, False
        status, nbytes = _CONTROL.unpack(ctl)
        if status == _ERROR:
            return a[0, 16:].tobytes().rstrip(b"\0").decode(errors="replace"), 0, True
        out = []
        for j in range(1, a.shape[0]):
            n = _LEN.unpack_from(a[j, :4].tobytes())[0]
            if n > self.head_bytes - 4:
                return (f"the peer sent a {n}-byte record head; at most {self.head_bytes - 4} "
                        f"fit (does it use another chunk_pages or page size?)"), nbytes, False
            out.append(a[j, 4:4 + n].tobytes())
        return out, nbytes, False

    # -- sending -----------------------------------------------------------------------------------
    def send(self, channel, pages: Sequence[PageInfo]) -> int:
        """Send the device pages ``pages`` (``page_id``, hash, parent, tokens) as records;
        returns the bytes sent (payloads; heads not counted). Raises :class:`PeerError` if a
        codec refuses a page (NaN/Inf under NVFP4), after telling the peer (its :meth:`recv`
        raises too)."""
        dev = self._on_device(channel)
        inflight: deque = deque()       # (works, keep-alive, host slots)
        sent, err = 0, None
        try:
            for c, (k, m) in enumerate(self._chunks(len(pages))):
                ring = c % self.depth
                if len(inflight) == self.depth:
                    self._retire(inflight.popleft())
                chunk = pages[k:k + m]
                slots = [] if dev else self.host.take_slots(m)[0]
                data, heads = None, None
                if err is None:
                    t0 = time.perf_counter()
                    try:
                        data, heads = (self._gather_device if dev else self._gather_host)(
                            chunk, slots, ring)
                    except PeerError as e:
                        err = e
                    self.timings["gather_s"] += time.perf_counter() - t0
                if err is not None and (dev or self.slot_records):
                    # The peer posted this chunk's data receive: it gets the (unused) rows.
                    data = (self._buffer(f"dev{ring}", (m, self.host.slot_bytes),
                                         self.view.device) if dev else self._rows(slots, ring))
                works, keep = [], []
                inflight.append((works, keep, slots))
                hb = self._pack_heads(heads, m, ring, 0 if data is None else data.numel(),
                                      None if err is None else
                                      f"the peer could not send its pages: {err}")
                for t in (hb, data):
                    if t is not None:
                        w, kept = _post_send(channel, t)
                        works.append(w)
                        keep.append(kept)
                if err is None:
                    sent += data.numel()
        finally:
            while inflight:
                self._retire(inflight.popleft())
        if err is not None:
            raise err
        return sent

    def _retire(self, item) -> None:
        works, _, slots = item
        t0 = time.perf_counter()
        for w in works:
            w.wait()
        self.timings["wait_send_s"] += time.perf_counter() - t0
        if slots:
            self.host.give_back(slots)

    def _gather_host(self, chunk: Sequence[PageInfo], slots: list[int], ring: int):
        """Chunk ``chunk`` into host slots ``slots``; returns ``(data, heads)``."""
        rows = self._rows(slots, ring)
        apart = rows.data_ptr() != self.host.rows(slots[0]).data_ptr()    # not consecutive
        if self.cuda:       # async DMAs through the Mover's staging buffers
            entries, ev, refused = self.mover.demote(self.ns_digest, chunk, slots)
            if ev is not None:
                ev.synchronize()
            if apart:
                torch.cat([self.host.rows(s) for s in slots], out=rows)
        else:               # the slots are host memory: gather straight into them
            ids = torch.tensor([i.page_id for i in chunk], dtype=torch.long)
            headers, sizes, refused = self.mover.gather_rows(rows, ids)
            if apart:
                for j, s in enumerate(slots):
                    self.host.rows(s).copy_(rows[j:j + 1])
            entries = [HostEntry(info, self.ns_digest, s, h, z)
                       for info, s, h, z in zip(chunk, slots, headers, sizes)]
        if refused is not None and bool(refused.ne(0).any()):
            raise PeerError("a page could not be encoded for the link (NaN/Inf in the KV under "
                            "a lossy codec?)")
        recs = self.host.records(entries)
        heads = [bytes(r[0]) for r in recs]
        if self.slot_records:
            return rows, heads
        sizes = [sum(memoryview(p).nbytes for p in r[1:]) for r in recs]
        blob = self._buffer(f"send{ring}", (sum(sizes),))
        out, at = blob.numpy(), 0
        for r in recs:
            for part in r[1:]:
                n = memoryview(part).nbytes
                out[at:at + n] = np.frombuffer(part, dtype=np.uint8)
                at += n
        return blob, heads

    def _gather_device(self, chunk: Sequence[PageInfo], slots: list[int], ring: int):
        """Chunk ``chunk`` into device buffer ``ring`` (the NCCL path; unrun on CPU CI).

        The gather runs on the current stream; ``isend`` orders NCCL after it, and this buffer
        is gathered into again only after its send's ``wait()`` (:meth:`_retire`)."""
        m = len(chunk)
        rows = self._buffer(f"dev{ring}", (m, self.host.slot_bytes), self.view.device)
        ids = torch.tensor([i.page_id for i in chunk], dtype=torch.long, device=self.view.device)
        headers, sizes, refused = self.mover.gather_rows(rows, ids)
        if refused is not None and bool(refused.ne(0).any()):      # one sync, lossy codecs only
            raise PeerError("a page could not be encoded for the link (NaN/Inf in the KV under "
                            "a lossy codec?)")
        heads = []
        for info, hdrs, szs in zip(chunk, headers, sizes):
            # No payload CRC on the device path (module doc): checksum 0, sizes as declared.
            head = build_record(self.ns_digest, info, self.host.names,
                                [replace(h, checksum=0) for h in hdrs],
                                [range(n) for n in szs])[0]
            heads.append(bytes(head))
        return rows, heads

    # -- receiving ---------------------------------------------------------------------------------
    def recv(self, channel, pages: Sequence[PageInfo], page_ids: Sequence[int]) -> int:
        """Receive the records of ``pages`` (what the receiver expects) and decode them into its
        device pages ``page_ids``; returns the bytes received. Every record of a chunk is
        verified before anything of the chunk reaches the device; a bad one raises
        :class:`PeerError` naming the page, after the rest of the handoff was drained (both
        sides stay in step; earlier chunks are written: the caller frees the pages)."""
        if len(pages) != len(page_ids):
            raise ValueError(f"{len(pages)} pages but {len(page_ids)} page ids")
        dev = self._on_device(channel)
        ahead = dev or self.slot_records      # data sizes known before the heads arrive
        chunks = self._chunks(len(pages))
        posted: deque = deque()
        got, failed, nxt = 0, None, 0

        def post(c: int) -> None:
            k, m = chunks[c]
            ring = c % self.depth
            slots = [] if dev else self.host.take_slots(m)[0]
            if not dev:
                self.mover.fence_host_writes()      # no H2D copy still reads these slots
            hb = self._buffer(f"heads{ring}", (m + 1, self.head_bytes))
            works = [_post_recv(channel, hb)]
            data = None
            if ahead:
                data = (self._buffer(f"dev{ring}", (m, self.host.slot_bytes), self.view.device)
                        if dev else self._rows(slots, ring))
                works.append(_post_recv(channel, data))
            posted.append((c, slots, hb, data, works))

        try:
            while nxt < min(len(chunks), self.depth if ahead else 1):
                post(nxt)
                nxt += 1
            while posted:
                c, slots, hb, data, works = posted.popleft()
                k, m = chunks[c]
                try:
                    t0 = time.perf_counter()
                    works[0].wait()
                    heads, nbytes, refused = self._unpack_heads(hb)
                    if not ahead:
                        self.timings["wait_recv_s"] += time.perf_counter() - t0
                    if ahead:
                        works[1].wait()
                        self.timings["wait_recv_s"] += time.perf_counter() - t0
                        if nbytes is not None and not refused and nbytes != data.numel():
                            heads = (f"the peer sent {nbytes} bytes for a chunk of "
                                     f"{data.numel()}")
                        if not dev and data.data_ptr() != self.host.rows(slots[0]).data_ptr():
                            for j, s in enumerate(slots):
                                self.host.rows(s).copy_(data[j:j + 1])
                    elif nbytes is None:
                        raise PeerError(f"{heads}; the rest of the handoff cannot be framed: "
                                        "the link is out of step (reconnect)")
                    elif not refused:       # sized by the control row: damaged heads or not
                        data = self._buffer(f"recv{c % self.depth}", (nbytes,))
                        t0 = time.perf_counter()
                        _post_recv(channel, data).wait()
                        self.timings["wait_recv_s"] += time.perf_counter() - t0
                    if data is not None:
                        got += data.numel()
                    if isinstance(heads, str):
                        failed = failed or PeerError(f"received chunk {c} is damaged or "
                                                     f"refused: {heads}")
                    if failed is None:
                        failed = self._store(pages[k:k + m], page_ids[k:k + m], k, heads, data,
                                             slots, dev)
                finally:
                    if slots:
                        self.host.give_back(slots)
                # NOTE: chunk c's ring (buffers, slots) is free again only now; chunks
                # c+1 .. c+depth-1 arrived meanwhile. On CUDA the decode may still run: the NCCL
                # receive is ordered after it by the stream, a host copy by fence_host_writes().
                if nxt < len(chunks):
                    post(nxt)
                    nxt += 1
        finally:
            while posted:        # the link failed: nothing more will come
                _, slots, _, _, _ = posted.popleft()
                if slots:
                    self.host.give_back(slots)
        if failed is not None:
            raise failed
        return got

    def _store(self, chunk, ids, first: int, heads: list[bytes], data: torch.Tensor,
               slots: list[int], dev: bool) -> PeerError | None:
        """Verify a received chunk and decode it into pool pages ``ids``; returns the error of
        the first bad record (nothing of the chunk written) or ``None``."""
        if len(heads) != len(chunk):
            return PeerError(f"expected the records of {len(chunk)} pages, the peer sent "
                             f"{len(heads)}")
        entries = []
        at = 0
        t0 = time.perf_counter()
        mv = None if (dev or self.slot_records) else memoryview(data.numpy())
        for j, (info, h) in enumerate(zip(chunk, heads)):
            try:
                if dev:
                    entries.append(self._check_device_head(h, info))
                    continue
                sizes = payload_sizes(h)
                if len(sizes) != len(self.specs):
                    raise CorruptPageError(f"record has {len(sizes)} groups")
                if mv is None:
                    parts = [h, *(self.host.group_region(slots[j], gi)[:n].numpy().data
                                  for gi, n in enumerate(sizes))]
                else:
                    parts = [h]
                    for n in sizes:
                        parts.append(mv[at:at + n])
                        at += n
                if mv is not None and at > len(mv):
                    raise CorruptPageError(f"the heads describe more than the {len(mv)} "
                                           f"payload bytes of the chunk")
                rec = verify_record(parts, self.ns_digest, info, self.specs, self.codecs,
                                    self.view.page_size)
                entries.append(self.host.fill(slots[j], info, self.ns_digest, rec))
            except (CorruptPageError, ValueError) as e:
                return PeerError(f"received page {first + j} is damaged (CRC or identity "
                                 f"check failed: {e})")
        t1 = time.perf_counter()
        self.timings["verify_s"] += t1 - t0
        idt = torch.tensor(list(ids), dtype=torch.long, device=self.view.device)
        if dev:
            self.mover.scatter_rows(data, entries, idt, ids)
        elif self.cuda:
            self.mover.promote(entries, ids)      # async; the next post() fences the slots
        else:
            self.mover.scatter_rows(self.host.rows(slots[0], len(slots))
                                    if slots == list(range(slots[0], slots[0] + len(slots)))
                                    else torch.cat([self.host.rows(s) for s in slots]),
                                    entries, idt, ids)
        self.timings["scatter_s"] += time.perf_counter() - t1
        return None

    def _check_device_head(self, head: bytes, info: PageInfo) -> HostEntry:
        """A device-path head: the page asked for, this process's groups and codecs, payloads
        of the sizes the rows hold (no payload CRC on this path: module doc)."""
        if self._stand_ins is None:
            # Parsing wants payload parts of the declared sizes: slot 0's regions stand in (their
            # bytes are not read: there is no CRC to check on this path).
            self._stand_ins = [self.host.group_region(0, gi).numpy().data
                               for gi in range(len(self.specs))]
        rec = parse_record([head, *self._stand_ins])     # sizes other than the rows': an error
        check_identity(rec, self.ns_digest, info)
        check_record_groups(rec, self.specs, self.codecs, self.view.page_size)
        return HostEntry(info, self.ns_digest, -1, self._row_headers, self.host.max_sizes)
