"""Context and generation workers: one request's prefill on one engine, its decoding on another.

The context worker runs :meth:`LLM.prefill` (prefix reuse included: target K/V and draft context
K/V written, pages committed, first token sampled), then hands every request over with
:func:`send_sequence`: the pages of both groups plus the request's state (token ids, first token,
sampling parameters, the RNG state of a seeded request). The generation worker admits each one
into its own pool with :func:`recv_sequence` (prefix pages it already holds are not sent) and
decodes them all with speculation through :meth:`LLM.resume`.

Wire protocol on top of the transport, context -> generation, one message per request:

- ``{"op": "handoff", "request_id": i}`` followed by one :func:`send_sequence` exchange;
- ``{"op": "output", "output": {...}}``: a request that is final without decoding (rejected, or
  finished at its first token);
- ``{"op": "failed", "request_id": i, "prompt": [...], "error": "..."}``: a handoff that failed
  ``retries + 1`` times;
- ``{"op": "end"}``: no more requests; the generation worker decodes what it received.

A refused or damaged handoff keeps both sides in step (the transport answers ``ok: False``), so the
context worker can retry it. A cut link (the peer died) ends the generation worker's receive loop:
it decodes what it fully received and reports the error; nothing partial stays in its pool.
"""

from __future__ import annotations

import dataclasses
import queue
from typing import Any, Sequence

import torch

from ..engine import LLM
from ..outputs import RequestOutput
from ..sampling import SamplingParams
from ..scheduler import DECODE, Request
from .transport import (TransferError, TransferStats, handshake, recv_sequence, send_sequence)

ENCODE_MODES = ("never", "always", "auto")


class LoopbackChannel:
    """In-process stand-in for :class:`PageChannel` (same methods); one end of a pair.

    Tensors are cloned on send, as a real link copies them. ``close()`` cuts the link: the peer's
    next receive raises :class:`ConnectionError`, as Gloo does when the peer process dies.
    """

    _CLOSED = object()

    def __init__(self, inbox: queue.Queue, outbox: queue.Queue, timeout_s: float = 60.0,
                 device: torch.device | str = "cpu"):
        self._in, self._out, self.timeout_s = inbox, outbox, timeout_s
        self.device = torch.device(device)

    def _get(self):
        try:
            item = self._in.get(timeout=self.timeout_s)
        except queue.Empty:
            raise TimeoutError(f"loopback peer sent nothing for {self.timeout_s} s") from None
        if item is self._CLOSED:
            self._in.put(item)            # every later receive fails too
            raise ConnectionError("loopback peer closed the link")
        return item

    def send_obj(self, obj: Any) -> None:
        self._out.put(("obj", obj))

    def recv_obj(self) -> Any:
        kind, obj = self._get()
        if kind != "obj":
            raise TransferError(f"expected a message, got a {kind}")
        return obj

    def send_tensor(self, t: torch.Tensor) -> None:
        self._out.put(("tensor", t.detach().to(self.device, copy=True).contiguous()))

    def recv_tensor(self, shape, dtype) -> torch.Tensor:
        kind, t = self._get()
        if kind != "tensor" or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise TransferError(f"expected a tensor {tuple(shape)} {dtype}, got {kind} "
                                f"{getattr(t, 'shape', None)}")
        return t

    def isend(self, t: torch.Tensor) -> "_Posted":
        self.send_tensor(t)                 # queued (a copy): complete at once
        return _Posted(None)

    def irecv(self, t: torch.Tensor) -> "_Posted":
        """Receive into ``t`` at ``wait()``; wait in posting order, as receives match sends."""
        return _Posted(lambda: t.copy_(self.recv_tensor(tuple(t.shape), t.dtype)))

    def close(self) -> None:
        self._out.put(self._CLOSED)


class _Posted:
    """A loopback ``isend``/``irecv``: ``wait()`` completes it."""

    def __init__(self, finish):
        self._finish = finish

    def wait(self) -> None:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()


def loopback_pair(timeout_s: float = 60.0) -> tuple[LoopbackChannel, LoopbackChannel]:
    """``(context end, generation end)`` of one in-process link."""
    a, b = queue.Queue(), queue.Queue()
    return LoopbackChannel(a, b, timeout_s), LoopbackChannel(b, a, timeout_s)


# -- request state on the wire -----------------------------------------------------------------
def export_request(r: Request) -> dict[str, Any]:
    """What the generation worker needs besides the pages (msgpack-able)."""
    gen = r.generator
    return {"request_id": r.request_id, "prompt": list(r.prompt),
            "generated": r.tokens[len(r.prompt):],
            "params": dataclasses.asdict(r.params), "salt": r.salt,
            "num_cached_tokens": r.num_cached_tokens, "ttft_s": r.t_first - r.t_admit,
            # A seeded request carries its RNG on: its samples equal the aggregated run's.
            "rng_state": gen.get_state().numpy().tobytes() if gen is not None else None}


def import_request(llm: LLM, seq_id: object, state: dict[str, Any]) -> Request:
    """Rebuild a handed-over request as a DECODE request of ``llm`` (sequence ``seq_id``)."""
    p = dict(state["params"])
    p["stop_token_ids"] = tuple(p.get("stop_token_ids") or ())
    sp = SamplingParams(**p)
    prompt = [int(t) for t in state["prompt"]]
    gen = None
    if state.get("rng_state") is not None:
        gen = torch.Generator(device=llm.device)
        gen.set_state(torch.frombuffer(bytearray(state["rng_state"]), dtype=torch.uint8))
    return Request(request_id=int(state["request_id"]), prompt=prompt, params=sp,
                   salt=state.get("salt"),
                   max_length=min(len(prompt) + sp.max_tokens, llm.max_seq_len),
                   tokens=prompt + [int(t) for t in state["generated"]],
                   num_computed=len(prompt), state=DECODE, generator=gen, seq_id=seq_id,
                   num_cached_tokens=int(state.get("num_cached_tokens", 0)))


# -- workers -----------------------------------------------------------------------------------
class ContextWorker:
    """Prefills requests and hands them to the generation worker at the other end of ``channel``.

    Args:
        llm: the context engine (its pool keeps the prompts' pages cached for prefix reuse).
        channel: :class:`PageChannel` (or :class:`LoopbackChannel`) to the generation worker.
        encode: ``"never"`` (raw pages), ``"always"`` (each group's codec), or ``"auto"``
            (encode once a raw handoff measured below ``slow_link_gbps``).
        retries: further attempts for a handoff the receiver refused or could not store.
    """

    def __init__(self, llm: LLM, channel, encode: str = "never", slow_link_gbps: float = 2.0,
                 retries: int = 1):
        if encode not in ENCODE_MODES:
            raise ValueError(f"encode must be one of {ENCODE_MODES}, got {encode!r}")
        if not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be an integer >= 0, got {retries!r}")
        self.llm, self.channel, self.encode = llm, channel, encode
        self.slow_link_gbps, self.retries = slow_link_gbps, retries
        self.transfers: list[TransferStats] = []
        self.failed: dict[int, str] = {}
        self._slow = encode == "always"
        self._links: dict = {}       # PeerLink per mode (staging buffers kept across handoffs)

    def connect(self) -> None:
        """Agree on the namespace with the peer (raises :class:`NamespaceMismatchError`)."""
        handshake(self.channel, self.llm.namespace, "context")

    def serve(self, prompts: Sequence[Sequence[int]],
              params: SamplingParams | Sequence[SamplingParams] | None = None,
              cache_salt: str | None = None, end: bool = True) -> None:
        """Prefill ``prompts`` and hand each over; ``end`` tells the peer no more will come."""
        ch = self.channel
        for item in self.llm.prefill(prompts, params, cache_salt):
            if isinstance(item, RequestOutput):
                ch.send_obj({"op": "output", "output": dataclasses.asdict(item)})
                continue
            try:
                self._hand_over(item)
            finally:
                self.llm.release(item)   # our copy stays cached (prefix reuse), not in use
        if end:
            ch.send_obj({"op": "end"})

    def _hand_over(self, r: Request) -> None:
        state, err = export_request(r), None
        for _ in range(self.retries + 1):
            self.channel.send_obj({"op": "handoff", "request_id": r.request_id})
            try:
                stats = send_sequence(self.channel, self.llm.mgr, r.seq_id, extra=state,
                                      encode=self._slow, links=self._links)
            except TransferError as e:   # refused or not stored: both sides are still in step
                err = str(e)
                continue
            self.transfers.append(stats)
            if self.encode == "auto" and not self._slow and stats.bytes:
                self._slow = stats.gbps < self.slow_link_gbps
            return
        self.failed[r.request_id] = err
        self.channel.send_obj({"op": "failed", "request_id": r.request_id, "prompt": list(r.prompt),
                               "error": err})


class GenerationWorker:
    """Receives handed-over requests into its own pool and decodes them with speculation."""

    def __init__(self, llm: LLM, channel):
        self.llm, self.channel = llm, channel
        self._links: dict = {}       # PeerLink per mode (staging buffers kept across handoffs)
        self.transfers: list[TransferStats] = []
        self.errors: list[str] = []
        self._info: dict[int, dict[str, float]] = {}

    def connect(self) -> None:
        handshake(self.channel, self.llm.namespace, "generation")

    def receive(self) -> tuple[list[Request], dict[int, RequestOutput]]:
        """Receive until ``end`` (or a cut link): admitted requests and final outputs."""
        reqs: list[Request] = []
        final: dict[int, RequestOutput] = {}
        while True:
            try:
                msg = self.channel.recv_obj()
            except Exception as e:  # noqa: BLE001 - the context worker is gone
                self.errors.append(f"link lost: {type(e).__name__}: {e}")
                break
            op = msg.get("op")
            if op == "end":
                break
            if op == "output":
                o = RequestOutput(**msg["output"])
                final[o.request_id] = o
            elif op == "failed":
                final[msg["request_id"]] = RequestOutput(msg["request_id"], list(msg["prompt"]),
                                                  finish_reason="failed", error=msg["error"])
            elif op == "handoff":
                try:
                    seq, state, stats = recv_sequence(self.channel, self.llm.mgr,
                                                      links=self._links)
                except TransferError as e:
                    # The pool is unchanged; the sender retries or gives up ("failed").
                    self.errors.append(f"request {msg.get('request_id')}: {e}")
                    continue
                r = import_request(self.llm, seq.seq_id, state)
                self.transfers.append(stats)
                self._info[r.request_id] = {"ttft_s": float(state.get("ttft_s", 0.0)),
                                     "transfer_s": stats.seconds,
                                     "pages_received": stats.pages_sent,
                                     "pages_reused": stats.pages_skipped}
                reqs.append(r)
            else:
                self.errors.append(f"unknown message {op!r}; stopping")
                break
        return reqs, final

    def serve(self) -> list[RequestOutput]:
        """Receive every request, decode them, and return outputs sorted by request id."""
        reqs, final = self.receive()
        for o in self.llm.resume(reqs) if reqs else []:
            info = self._info.pop(o.request_id, {})
            # ttft_s is the context worker's (admission to first token); transfer_s is extra.
            o.metrics.update(info)
            final[o.request_id] = o
        return [final[k] for k in sorted(final)]
