"""The engine thread: the one thread that calls ``LLM.add_request / step / abort / stats``.

The engine is single-threaded (``docs/serving.md``). HTTP handlers run on the asyncio event loop
and never touch it: they put commands on a thread-safe queue (``add``, ``abort``, ``stats``) and
get answers back through futures and per-request ``asyncio.Queue`` objects, filled from this
thread with ``loop.call_soon_threadsafe``. Between two steps the thread drains every pending
command, so a request arriving mid-batch joins the next step and an abort frees its pages before
the next step runs. With no work it blocks on the queue (no spinning).

If ``step()`` raises, the engine's state can no longer be trusted: every open request finishes
with ``finish_reason="error"``, the worker stops taking requests and ``/health`` answers 503.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..runtime import RequestDelta
from .metrics import ServerMetrics

log = logging.getLogger("kvstrata.serve")

__all__ = ["EngineWorker", "RequestStream", "WorkerDown"]


class WorkerDown(RuntimeError):
    """The engine thread is not running (stopped, or failed in a step)."""


@dataclass(eq=False)
class RequestStream:
    """One request's deltas, in order, on the event loop. The last one has ``finished=True``."""

    request_id: str
    deltas: asyncio.Queue
    arrival: float
    finished: bool = False
    seen_first: bool = field(default=False, repr=False)   # engine-thread bookkeeping
    seen_token: bool = field(default=False, repr=False)


class EngineWorker:
    """Owns the engine thread. ``start`` on the event loop that will consume the streams."""

    def __init__(self, llm, metrics: ServerMetrics):
        self.llm = llm
        self.metrics = metrics
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}        # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.failure: str | None = None

    # -- event-loop side ----------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="kvstrata-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.failure is None

    def _check(self) -> None:
        if not self.alive:
            raise WorkerDown(self.failure or "the engine is not running")

    async def add(self, prompt: list[int], params, request_id: str, cache_salt: str | None,
                  arrival: float) -> RequestStream:
        """Queue a request; returns its stream once the engine accepted it.

        Raises ``ValueError`` (the engine's one-line reason) when it is rejected; nothing is
        allocated then.
        """
        self._check()
        stream = RequestStream(request_id, asyncio.Queue(), arrival)
        fut = self._loop.create_future()
        self._inbox.put(("add", stream, (prompt, params, request_id, cache_salt), fut))
        try:
            await fut
        except asyncio.CancelledError:
            self.abort(stream)      # queued after the add: the engine frees it right away
            raise
        return stream

    def abort(self, stream: RequestStream) -> None:
        """Abort a request that has not finished (idempotent; non-blocking)."""
        if not stream.finished:
            stream.finished = True
            self._inbox.put(("abort", stream.request_id, None, None))

    async def stats(self) -> dict:
        """``LLM.stats()``, taken by the engine thread between two steps."""
        self._check()
        fut = self._loop.create_future()
        self._inbox.put(("stats", None, None, fut))
        return await fut

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is running, stop the thread, then close the engine."""
        self._inbox.put(("stop", None, None, None))
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                # Still inside a step: closing now would touch the engine from a second thread.
                log.error("the engine thread did not stop within %.0f s; the engine is left open",
                          timeout)
                return
        self.llm.close()

    # -- engine thread ---------------------------------------------------------------------------
    def _reply(self, fut, result: Any = None, exc: BaseException | None = None) -> None:
        def settle():
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)
        self._loop.call_soon_threadsafe(settle)

    def _handle(self, cmd) -> None:
        kind, a, b, fut = cmd
        if kind == "add":
            stream, (prompt, params, request_id, salt) = a, b
            try:
                self.llm.add_request(prompt, params, request_id=request_id, cache_salt=salt)
            except ValueError as e:
                self._reply(fut, exc=e)
                return
            self._streams[request_id] = stream
            self.metrics.running.inc()
            self._reply(fut, stream)
        elif kind == "abort":
            if self._streams.pop(a, None) is not None:
                self.metrics.running.dec()
                self.metrics.requests.labels("abort").inc()
            self.llm.abort(a)
        elif kind == "stats":
            try:
                self._reply(fut, self.llm.stats())
            except Exception as e:          # a stats bug must not take the engine down
                self._reply(fut, exc=e)

    def _drain(self, block: bool) -> bool:
        """Handle pending commands (wait for one when ``block``); False once told to stop."""
        try:
            cmd = self._inbox.get() if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd[0] == "stop":
                return False
            self._handle(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _dispatch(self, deltas: list) -> None:
        now = time.perf_counter()
        out = []
        for d in deltas:
            stream = self._streams.get(d.request_id)
            if stream is None:
                continue                    # aborted meanwhile
            m = self.metrics
            if not stream.seen_first:
                stream.seen_first = True
                m.observe_admitted(d)
            if d.new_token_ids and not stream.seen_token:
                stream.seen_token = True
                m.ttft.observe(now - stream.arrival)
            m.observe(d)
            if d.finished:
                del self._streams[d.request_id]
                m.running.dec()
            out.append((stream, d))
        if out:
            self._loop.call_soon_threadsafe(_deliver, out)

    def _fail_all(self, reason: str) -> None:
        self.failure = reason
        out = [(s, _error_delta(request_id, reason)) for request_id, s in self._streams.items()]
        self._streams.clear()
        if out:
            self._loop.call_soon_threadsafe(_deliver, out)

    def _run(self) -> None:
        llm = self.llm
        try:
            while self._drain(block=not llm.has_unfinished()):
                if llm.has_unfinished():
                    self._dispatch(llm.step())
        except Exception as e:                                   # noqa: BLE001
            log.exception("engine step failed; the server stops taking requests")
            self._fail_all(f"engine failure: {type(e).__name__}: {e}")
        else:
            for request_id in list(self._streams):      # shutting down
                llm.abort(request_id)
            self._fail_all("the server is shutting down")
        # Answer what arrived after the end instead of leaving callers waiting.
        while True:
            try:
                kind, _, _, fut = self._inbox.get_nowait()
            except queue.Empty:
                break
            if fut is not None:
                self._reply(fut, exc=WorkerDown(self.failure))


def _deliver(items: list) -> None:
    """Event-loop side of ``_dispatch``: hand each delta to its stream's queue."""
    for stream, delta in items:
        stream.deltas.put_nowait(delta)


def _error_delta(request_id: str, reason: str) -> RequestDelta:
    """The final delta of a request whose engine failed or is shutting down."""
    return RequestDelta(request_id=request_id, new_token_ids=[], new_text="", finished=True,
                        finish_reason="error", acceptance_length=None, num_prompt_tokens=0,
                        num_cached_tokens=0, cached_by_tier={}, ttft_s=None, error=reason)
