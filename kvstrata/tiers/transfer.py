"""Page copies between the pool's device and host slots, encoding on the way down.

Host slots hold device-codec output (identity or NVFP4, written by the codec's batch path
straight into the staging rows) or, for a CPU-only lossless codec (``lossless``: byte planes +
zstd), the raw page bytes under an identity header (:func:`~kvstrata.tiers.host.host_codec`):
such a group moves exactly like an identity group, one gather per chunk, never a per-page encode
or a device sync. CPU codecs run at the disk boundary (the
:class:`~kvstrata.tiers.manager.TierManager` encodes host bytes into records and decodes records
into host slots). Only a lossy codec without a device batch path would be encoded page by page
here (none exists today).

A batch of pages moves in chunks through two staging buffers ``[chunk, slot_bytes]`` uint8 on the
pool's device, allocated once, laid out exactly like a host slot and used in turn. Down: gather +
encode chunk k into its staging buffer (device work, one op per identity group), then copy its
rows to their host slots. Up: copy chunk k's host slots into a staging buffer, then decode every
group into the pool pages. The host side is touched by whole-slot copies only, and on CUDA a run
of consecutive slots is one DMA.

On CUDA each direction has two streams: ``work`` gathers/encodes (or decodes) and ``copy`` runs
the DMAs, ordered by events, so chunk k's copy overlaps chunk k+1's encode (or decode) and the
copy engine does not wait for the encoder::

    work:  [enc 0][enc 1]          [enc 2] ...     (enc k+2 waits for copy k: same buffer)
    copy:         [copy 0 ][copy 1 ][copy 2 ] ...  (copy k waits for enc k)

A batch starts after the current (compute) stream's work so far (the pages are final). Down, the
compute stream waits only for the last gather/encode (the pages have been read, it may reuse
them), and the host entries become visible once the last copy's event has completed; up, the
compute stream waits for the last decode. On the CPU the same code runs synchronously (no
streams, no events). ``chunk_pages >= batch_pages`` is the serialized variant: one chunk per
batch, encode then copy.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Iterator, Sequence

import torch

from ..codecs import Codec, EncodedPage
from ..pagepool import PageInfo, PoolView
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


class _Pipe:
    """One direction's staging buffers (used in turn) and its two streams (CUDA only).

    ``free[b]``: the event after which buffer ``b``'s last reader (a copy down, a decode up) is
    done with it; the next writer of the buffer waits for it. Kept across batches.
    """

    def __init__(self, device: torch.device, chunk: int, nbuf: int, slot_bytes: int, cuda: bool):
        self.bufs = [torch.empty((chunk, slot_bytes), dtype=torch.uint8, device=device)
                     for _ in range(nbuf)]
        self.free: list[object] = [None] * nbuf
        self.work = torch.cuda.Stream(device) if cuda else None
        self.copy = torch.cuda.Stream(device) if cuda else None
        self._views: dict[tuple, torch.Tensor] = {}

    def view(self, b: int, m: int, cols: tuple[int, int] | None = None) -> torch.Tensor:
        """Buffer ``b``'s first ``m`` rows (bytes ``cols[0]:cols[1]`` of each), cached: a torch
        slice costs ~4 us of host time, and a batch takes several per chunk."""
        key = (b, m, cols)
        v = self._views.get(key)
        if v is None:
            v = self.bufs[b][:m] if cols is None else self.view(b, m)[:, cols[0]:cols[1]]
            self._views[key] = v
        return v


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else nullcontext()


def _mark(stream):
    """An event recorded on ``stream`` now (``None`` on the CPU, where work is already done)."""
    if stream is None:
        return None
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


def _after(stream, ev) -> None:
    """``stream``'s later work waits for ``ev`` (no-op on the CPU or without an event)."""
    if stream is not None and ev is not None:
        stream.wait_event(ev)


#: Bytes per pipelined chunk by default. Measured on an H200 (docs/benchmarks.md, Tiers): a
#: chunk's copy must outlast the host-side launch of the next chunk's encode (~0.1-0.2 ms of
#: Python and driver calls), or the copy engine idles; 16 MiB take ~0.3 ms over PCIe 5.
CHUNK_BYTES = 16 << 20


def default_chunk_pages(slot_bytes: int, batch_pages: int) -> int:
    """Pages per chunk: about :data:`CHUNK_BYTES` of host slots, at least 4 pages."""
    return max(1, min(batch_pages, max(4, -(-CHUNK_BYTES // max(slot_bytes, 1)))))


class Mover:
    """Encodes/decodes and copies batches of pages between the device pages of ``view`` (a
    :class:`~kvstrata.pagepool.PoolView`) and ``host``'s slots.

    ``codecs`` are the groups' configured codecs; pages move in each group's host format,
    :attr:`host_codecs` (``host_codec`` of each: identity for CPU-only lossless codecs)."""

    def __init__(self, view: PoolView, host: HostTier, codecs: Sequence[Codec], batch_pages: int,
                 chunk_pages: int | None = None):
        self.view, self.host, self.codecs = view, host, list(codecs)
        self.host_codecs = host.host_codecs
        self.specs = view.specs
        self.device = view.device
        self.cuda = self.device.type == "cuda"
        self.batch_pages = batch_pages
        if chunk_pages is None:
            chunk_pages = default_chunk_pages(host.slot_bytes, batch_pages)
        if not isinstance(chunk_pages, int) or chunk_pages <= 0:
            raise ValueError(f"chunk_pages must be a positive integer, got {chunk_pages!r}")
        self.chunk_pages = min(chunk_pages, batch_pages)
        self.timings = {"encode_s": 0.0, "decode_s": 0.0}
        self._timers: list[tuple[str, object, object]] = []
        # Two buffers per direction when a batch has several chunks (one is filled while the
        # other is copied), one when a batch is a single chunk (nothing to overlap within it).
        nbuf = 2 if self.chunk_pages < batch_pages else 1
        self._demotes = _Pipe(self.device, self.chunk_pages, nbuf, host.slot_bytes, self.cuda)
        self._promotes = _Pipe(self.device, self.chunk_pages, nbuf, host.slot_bytes, self.cuda)
        self._last_promote = None     # event after which no H2D batch reads host slots any more

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
        if self._last_promote is not None:
            self._last_promote.synchronize()
            self._last_promote = None

    # -- device -> host -----------------------------------------------------------------------------
    def _chunks(self, n: int) -> Iterator[tuple[int, int, int]]:
        """``(chunk index, first page, pages)`` of a batch of ``n``."""
        for c, k in enumerate(range(0, n, self.chunk_pages)):
            yield c, k, min(self.chunk_pages, n - k)

    def demote(self, ns: bytes, infos: Sequence[PageInfo], slots: Sequence[int]):
        """Encode pages ``infos[i].page_id`` into host slots ``slots[i]``.

        Returns ``(entries, event, refused)``: pass them to :meth:`HostTier.add` (the event
        follows the batch's last copy, ``None`` on the CPU; ``refused`` is ``None`` or a host
        tensor ``[n, ...]``, readable once the event completed, nonzero for a page its codec
        refused, e.g. NVFP4 and NaN/Inf).
        """
        n = len(infos)
        if n > self.batch_pages:
            raise ValueError(f"a batch holds at most {self.batch_pages} pages, got {n}")
        if len(slots) != n:
            raise ValueError(f"{n} pages but {len(slots)} host slots")
        p = self._demotes
        headers: list[list[EncodedPage]] = [[] for _ in range(n)]
        sizes: list[list[int]] = [[] for _ in range(n)]
        compute = torch.cuda.current_stream(self.device) if self.cuda else None
        if self.cuda:
            p.work.wait_stream(compute)            # the pages are final
        encoded = done = None
        refusals: list[torch.Tensor] = []   # per chunk: nonzero = a page its codec refused
        refused: torch.Tensor | None = None
        with _on(p.work):                          # allocations below belong to the work stream
            ids = torch.tensor([i.page_id for i in infos], dtype=torch.long, device=self.device)
            for c, k, m in self._chunks(n):
                b = c % len(p.bufs)
                stage = p.view(b, m)
                _after(p.work, p.free[b])          # the copy that last read this buffer is done
                bad = self._gather(stage, ids if m == n else ids[k:k + m], headers[k:k + m],
                                   sizes[k:k + m], (p, b))
                if bad is not None:
                    refusals.append(bad)
                flags = bool(refusals) and k + m == n   # last chunk: the batch's refusals travel
                if flags:
                    # every chunk runs the same codecs: one refusal tensor per chunk
                    bad_dev = refusals[0] if len(refusals) == 1 else torch.cat(refusals)
                encoded = _mark(p.work)
                _after(p.copy, encoded)
                if c == 0:
                    _after(p.copy, self._last_promote)  # slots being reused may still feed an H2D
                with _on(p.copy):
                    self._rows_to_slots(stage, slots[k:k + m])
                    if flags:
                        # The flags travel with the last copy: read once `done` has completed.
                        refused = torch.empty(bad_dev.shape, dtype=bad_dev.dtype,
                                              pin_memory=self.cuda)
                        refused.copy_(bad_dev, non_blocking=self.cuda)
                        if self.cuda:     # made on the work stream, read here: keep it alive
                            bad_dev.record_stream(p.copy)
                p.free[b] = done = _mark(p.copy)
        # NOTE: the compute stream only waits until the pages have been read; a page becomes
        # visible in the host tier once `done` (the last copy; copies run in order) completed,
        # and only if no codec refused it. Nothing here waits for the device.
        _after(compute, encoded)
        entries = [HostEntry(info.key, ns, s, headers[j], sizes[j]) for j, (info, s) in
                   enumerate(zip(infos, slots))]
        return entries, done, refused

    def _gather(self, stage: torch.Tensor, ids: torch.Tensor, headers: list[list[EncodedPage]],
                sizes: list[list[int]], buf: tuple[_Pipe, int] | None = None
                ) -> torch.Tensor | None:
        """Every group of pages ``ids`` into staging rows; returns the device refusals ``[m, ..]``
        (nonzero: refused) or None.

        Host formats with a device batch path (identity, also for CPU-only lossless codecs: a
        gather; NVFP4: one kernel) write straight into the staging rows and never wait for the
        device; others encode page by page."""
        n = len(headers)
        bad = None
        for gi, (spec, codec) in enumerate(zip(self.specs, self.host_codecs)):
            off = self.host.offsets[gi]
            kv, src = self.view.page_major(gi), ids
            if kv is None:           # another engine's layout: gather into canonical pages first
                kv = self.view.read(gi, ids)
                src = torch.arange(n, device=self.device)
            if codec.rows_path:
                nb = self.host.max_sizes[gi]
                timer = nullcontext() if codec.name == "identity" else self._timed(
                    "encode_s", self._demotes.work)
                rows = (stage[:, off:off + nb] if buf is None
                        else buf[0].view(buf[1], n, (off, off + nb)))
                with timer:
                    refused = codec.encode_rows(kv, src, rows)
                if refused is not None:
                    refused = refused.reshape(n, -1)
                    bad = refused if bad is None else torch.cat((bad, refused), dim=1)
                hdr = self.host.row_header(gi)
                for j in range(n):
                    headers[j].append(hdr)
                    sizes[j].append(nb)
                continue
            with self._timed("encode_s", self._demotes.work):
                encs = [codec.encode(kv[i]) for i in src.tolist()]
            for j, enc in enumerate(encs):
                if enc.nbytes > self.host.max_sizes[gi]:
                    raise ValueError(f"codec {codec.name!r} produced {enc.nbytes} bytes for "
                                     f"group {spec.name!r}; its bound is {self.host.max_sizes[gi]}")
                stage[j, off:off + enc.nbytes] = enc.payload.reshape(-1)
                headers[j].append(replace(enc, payload=_EMPTY))
                sizes[j].append(enc.nbytes)
        return bad

    def gather_rows(self, rows: torch.Tensor, ids: torch.Tensor
                    ) -> tuple[list[list[EncodedPage]], list[list[int]], torch.Tensor | None]:
        """Every group of pages ``ids`` straight into ``rows`` (``[len(ids), slot_bytes]``
        uint8 laid out like a host slot: host slots on the CPU, a device buffer for a device
        link), on the current stream, without staging. Returns ``(headers, sizes, refused)``
        per page, as :meth:`demote` builds its entries (``refused``: see :meth:`demote`)."""
        n = ids.numel()
        headers: list[list[EncodedPage]] = [[] for _ in range(n)]
        sizes: list[list[int]] = [[] for _ in range(n)]
        return headers, sizes, self._gather(rows, ids, headers, sizes)

    def scatter_rows(self, rows: torch.Tensor, entries: Sequence[HostEntry], ids: torch.Tensor,
                     page_ids: Sequence[int]) -> None:
        """Decode ``rows`` (laid out like host slots, described by ``entries``' headers and
        sizes) into pool pages ``ids``, on the current stream, without staging."""
        self._decode(rows, entries, ids, page_ids)

    def _rows_to_slots(self, stage: torch.Tensor, slots: Sequence[int]) -> None:
        for row, slot, k in _runs(slots):
            src = stage if row == 0 and k == stage.shape[0] else stage[row:row + k]
            self.host.rows(slot, k).copy_(src, non_blocking=self.cuda)

    # -- host -> device -----------------------------------------------------------------------------
    def promote(self, entries: Sequence[HostEntry], page_ids: Sequence[int]):
        """Decode host entries into pool pages ``page_ids``. Returns the batch's event (or None)."""
        n = len(entries)
        if n > self.batch_pages:
            raise ValueError(f"a batch holds at most {self.batch_pages} pages, got {n}")
        p = self._promotes
        slots = [e.slot for e in entries]
        compute = torch.cuda.current_stream(self.device) if self.cuda else None
        if self.cuda:
            p.work.wait_stream(compute)            # compute is done with the pages' old content
        done = None
        with _on(p.work):                          # allocations below belong to the work stream
            ids = torch.tensor(list(page_ids), dtype=torch.long, device=self.device)
            for c, k, m in self._chunks(n):
                b = c % len(p.bufs)
                stage = p.view(b, m)
                _after(p.copy, p.free[b])          # the decode that last read this buffer is done
                with _on(p.copy):
                    for row, slot, r in _runs(slots[k:k + m]):
                        dst = stage if row == 0 and r == m else stage[row:row + r]
                        dst.copy_(self.host.rows(slot, r), non_blocking=self.cuda)
                _after(p.work, _mark(p.copy))
                self._decode(stage, entries[k:k + m], ids if m == n else ids[k:k + m],
                             page_ids[k:k + m], (p, b))
                p.free[b] = done = _mark(p.work)
        # `done` follows the last decode, which follows every copy of the batch.
        _after(compute, done)
        if done is not None:
            self._last_promote = done
        return done

    def _decode(self, stage: torch.Tensor, entries: Sequence[HostEntry], ids: torch.Tensor,
                page_ids: Sequence[int], buf: tuple[_Pipe, int] | None = None) -> None:
        """Every group of staged host slots into pool pages ``ids`` (one op per group when its
        host format has a device batch path and every entry is in its row format)."""
        n = len(entries)
        for gi, (spec, codec) in enumerate(zip(self.specs, self.host_codecs)):
            off = self.host.offsets[gi]
            kv, dst = self.view.page_major(gi), ids
            if kv is None:           # another engine's layout: decode into canonical pages first
                kv = torch.empty((n, *spec.page_shape(self.view.page_size)), dtype=spec.dtype,
                                 device=self.device)
                dst = torch.arange(n, device=self.device)
            shape = spec.page_shape(self.view.page_size)
            done = False
            if codec.rows_path:
                want = self.host.row_header(gi)
                nb = self.host.max_sizes[gi]
                if all(_same_format(e.headers[gi], want) and e.sizes[gi] == nb for e in entries):
                    timer = nullcontext() if codec.name == "identity" else self._timed(
                        "decode_s", self._promotes.work)
                    rows = (stage[:n, off:off + nb] if buf is None
                            else buf[0].view(buf[1], n, (off, off + nb)))
                    with timer:
                        codec.decode_rows(rows, kv, dst)
                    done = True
            if not done:
                # Host bytes were verified when they arrived: no second checksum pass.
                with self._timed("decode_s", self._promotes.work):
                    for j, (e, pid) in enumerate(zip(entries, dst.tolist())):
                        enc = replace(e.headers[gi], checksum=None,
                                      payload=stage[j, off:off + e.sizes[gi]])
                        kv[pid].copy_(codec.decode(enc, self.device).reshape(shape))
            if dst is not ids:
                self.view.write(gi, ids, kv)


def _same_format(h: EncodedPage, want: EncodedPage) -> bool:
    return (h.codec == want.codec and h.version == want.version and h.shape == want.shape
            and h.dtype == want.dtype)
