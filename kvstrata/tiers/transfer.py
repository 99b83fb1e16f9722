"""Page copies between the pool's device and host slots, encoding on the way down.

Both directions go through a staging buffer ``[batch, slot_bytes]`` uint8 on the pool's device,
allocated once, laid out exactly like a host slot. Down: gather + encode every group of a batch of
pages into staging rows (device work, one op per identity group), then copy rows to their host
slots. Up: copy host slots into staging rows, then decode every group into the pool pages. So the
host side is touched by whole-slot copies only, and on CUDA a run of consecutive slots is one DMA.

On CUDA each direction has its own stream. A batch starts after the current (compute) stream's
work so far (the pages are final), the current stream then waits for the batch's event before it
can reuse a page, and the host entries a D2H batch fills become visible only once its event has
completed. On the CPU the same code runs synchronously (no streams, no events).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Iterator, Sequence

import torch

from ..codecs import Codec, EncodedPage
from ..dtypes import dtype_name
from ..pagepool import PageInfo, PagePool
from .host import HostEntry, HostTier

_EMPTY = torch.empty(0, dtype=torch.uint8)


def _runs(slots: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """``(first row, first slot, length)`` of each run of consecutive slots."""
    i = 0
    while i < len(slots):
        j = i + 1
        while j < len(slots) and slots[j] == slots[j - 1] + 1:
            j += 1
        yield i, slots[i], j - i
        i = j


class Mover:
    """Encodes/decodes and copies batches of pages between ``pool`` and ``host``."""

    def __init__(self, pool: PagePool, host: HostTier, codecs: Sequence[Codec], batch_pages: int):
        self.pool, self.host, self.codecs = pool, host, list(codecs)
        self.specs = list(pool.groups)
        self.device = pool.device
        self.cuda = self.device.type == "cuda"
        self.batch_pages = batch_pages
        self.timings = {"encode_s": 0.0, "decode_s": 0.0}
        self._timers: list[tuple[str, object, object]] = []
        # Staging rows mirror the host slot layout; allocated once per direction.
        shape = (batch_pages, host.slot_bytes)
        self._down = torch.empty(shape, dtype=torch.uint8, device=self.device)
        self._up = torch.empty(shape, dtype=torch.uint8, device=self.device)
        if self.cuda:
            self._d2h = torch.cuda.Stream(self.device)
            self._h2d = torch.cuda.Stream(self.device)
        self._last_up = None     # event of the latest H2D batch (host slots it reads)

    # -- stream plumbing ------------------------------------------------------------------------
    @contextmanager
    def _on(self, stream) -> Iterator[object]:
        """Run the block on ``stream`` after the compute stream's work so far; yields the
        compute stream (inside the block ``current_stream()`` is the side stream)."""
        if not self.cuda:
            yield None
            return
        compute = torch.cuda.current_stream(self.device)
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            yield compute

    def _finish(self, stream, compute):
        """Event after the batch; the compute stream waits for it before touching the pages."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(stream)
        compute.wait_event(ev)
        return ev

    @contextmanager
    def _timed(self, key: str, stream=None) -> Iterator[None]:
        if not self.cuda:
            t0 = time.perf_counter()
            yield
            self.timings[key] += time.perf_counter() - t0
            return
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        yield
        b.record(stream)
        self._timers.append((key, a, b))

    def collect_timings(self) -> dict[str, float]:
        for key, a, b in self._timers:
            b.synchronize()
            self.timings[key] += a.elapsed_time(b) / 1e3
        self._timers.clear()
        return dict(self.timings)

    def fence_host_writes(self) -> None:
        """Before the CPU writes into host slots: no H2D copy may still be reading them."""
        if self._last_up is not None:
            self._last_up.synchronize()
            self._last_up = None

    # -- device -> host -----------------------------------------------------------------------------
    def down(self, ns: bytes, infos: Sequence[PageInfo], slots: Sequence[int]):
        """Encode pages ``infos[i].page_id`` into host slots ``slots[i]``.

        Returns ``(entries, event)``: pass both to :meth:`HostTier.add`.
        """
        n = len(infos)
        if n > self.batch_pages:
            raise ValueError(f"a batch holds at most {self.batch_pages} pages, got {n}")
        ids = torch.tensor([i.page_id for i in infos], dtype=torch.long, device=self.device)
        headers: list[list[EncodedPage]] = [[] for _ in range(n)]
        sizes: list[list[int]] = [[] for _ in range(n)]
        stream = self._d2h if self.cuda else None
        with self._on(stream) as compute:
            if self.cuda and self._last_up is not None:
                self._d2h.wait_event(self._last_up)   # slots being reused may still feed an H2D
            stage = self._down[:n]
            for gi, (spec, codec) in enumerate(zip(self.specs, self.codecs)):
                off = self.host.offsets[gi]
                kv = self.pool.kv[spec.name]
                if codec.name == "identity":
                    pages = kv.index_select(0, ids)
                    nb = spec.bytes_per_page(self.pool.page_size)
                    stage[:, off:off + nb] = pages.reshape(n, -1).view(torch.uint8)
                    hdr = EncodedPage(codec.name, codec.version, tuple(pages.shape[1:]),
                                      dtype_name(spec.dtype), _EMPTY)
                    for j in range(n):
                        headers[j].append(hdr)
                        sizes[j].append(nb)
                    continue
                with self._timed("encode_s", stream):
                    encs = self._encode(codec, kv, ids)
                for j, enc in enumerate(encs):
                    if enc.nbytes > self.host.max_sizes[gi]:
                        raise ValueError(f"codec {codec.name!r} produced {enc.nbytes} bytes for "
                                         f"group {spec.name!r}; its bound is {self.host.max_sizes[gi]}")
                self._stage_payloads(stage, off, encs)
                for j, enc in enumerate(encs):
                    headers[j].append(replace(enc, payload=_EMPTY))
                    sizes[j].append(enc.nbytes)
            self._rows_to_slots(stage, slots)
            ev = self._finish(stream, compute)
        entries = [HostEntry(info, ns, s, headers[j], sizes[j]) for j, (info, s) in
                   enumerate(zip(infos, slots))]
        return entries, ev

    def _stage_payloads(self, stage: torch.Tensor, off: int, encs: list[EncodedPage]) -> None:
        sizes = {e.nbytes for e in encs}
        if len(sizes) == 1 and all(e.payload.device == self.device for e in encs):
            # Fixed-size codec output on the pool's device: one copy for the whole batch.
            nb = sizes.pop()
            stage[:, off:off + nb] = torch.stack([e.payload.reshape(-1) for e in encs])
            return
        for j, enc in enumerate(encs):
            stage[j, off:off + enc.nbytes] = enc.payload.reshape(-1)

    @staticmethod
    def _encode(codec: Codec, kv: torch.Tensor, ids: torch.Tensor) -> list[EncodedPage]:
        batch = getattr(codec, "encode_batch", None)
        if batch is not None:
            # Batched codecs read the pool in place (no gather) and encode in one launch.
            return list(batch(kv, ids))
        return [codec.encode(kv[i]) for i in ids.tolist()]

    def _rows_to_slots(self, stage: torch.Tensor, slots: Sequence[int]) -> None:
        buf = self.host.buf
        for row, slot, k in _runs(slots):
            buf[slot:slot + k].copy_(stage[row:row + k], non_blocking=self.cuda)

    # -- host -> device -----------------------------------------------------------------------------
    def up(self, entries: Sequence[HostEntry], page_ids: Sequence[int]):
        """Decode host entries into pool pages ``page_ids``. Returns the batch's event (or None)."""
        n = len(entries)
        if n > self.batch_pages:
            raise ValueError(f"a batch holds at most {self.batch_pages} pages, got {n}")
        slots = [e.slot for e in entries]
        stream = self._h2d if self.cuda else None
        with self._on(stream) as compute:
            stage = self._up[:n]
            for row, slot, k in _runs(slots):
                stage[row:row + k].copy_(self.host.buf[slot:slot + k], non_blocking=self.cuda)
            ids = torch.tensor(list(page_ids), dtype=torch.long, device=self.device)
            for gi, (spec, codec) in enumerate(zip(self.specs, self.codecs)):
                off = self.host.offsets[gi]
                kv = self.pool.kv[spec.name]
                shape = spec.page_shape(self.pool.page_size)
                if all(e.headers[gi].codec == "identity" for e in entries):
                    nb = spec.bytes_per_page(self.pool.page_size)
                    src = stage[:, off:off + nb].view(spec.dtype).reshape(n, *shape)
                    kv.index_copy_(0, ids, src)
                    continue
                # Host bytes were verified when they arrived: no second checksum pass.
                encs = [replace(e.headers[gi], checksum=None,
                                payload=stage[j, off:off + e.sizes[gi]])
                        for j, e in enumerate(entries)]
                with self._timed("decode_s", stream):
                    batch = getattr(codec, "decode_batch_into", None)
                    if batch is not None:
                        batch(encs, kv, ids)
                        continue
                    for enc, pid in zip(encs, page_ids):
                        kv[pid].copy_(codec.decode(enc, self.device).reshape(shape))
            ev = self._finish(stream, compute)
        if ev is not None:
            self._last_up = ev
        return ev
