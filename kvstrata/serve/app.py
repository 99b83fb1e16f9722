"""The OpenAI-compatible HTTP application (Starlette) over one :class:`EngineWorker`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or server-sent events
with ``"stream": true``), ``GET /v1/models``, ``GET /health`` (never behind the API key),
``GET /metrics`` (Prometheus text). Every error is OpenAI's error object with a 4xx status (5xx only
when the engine itself failed); the server keeps serving after any of them. A client that goes away
before its answer is complete has its request aborted, which frees its pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..runtime import SamplingParams
from .metrics import CONTENT_TYPE_LATEST, ServerMetrics
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, ValidationError,
                       error_body, validation_message)
from .worker import EngineWorker, RequestStream, WorkerDown

log = logging.getLogger("kvstrata.serve")

__all__ = ["ServerConfig", "build_app"]

OPEN_PATHS = frozenset({"/health"})


@dataclass(frozen=True)
class ServerConfig:
    """Server-side limits and access.

    Args:
        model_name: the name clients put in ``model`` (default: ``llm.model_name``).
        api_key: when set, every endpoint but ``/health`` needs ``Authorization: Bearer <key>``.
        max_body_bytes: larger request bodies are refused with 413 before they are parsed.
        max_prompt_chars: longer prompt text (all messages together, for chat) is refused with
            413 before it is tokenized; ``None``: 16 characters per token of ``max_seq_len`` (no
            tokenizer of ours packs more, so nothing refused here could have fit).
    """

    model_name: str | None = None
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    max_prompt_chars: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be an integer >= 1024, got "
                             f"{self.max_body_bytes!r}")
        if self.max_prompt_chars is not None and (not isinstance(self.max_prompt_chars, int)
                                                  or self.max_prompt_chars < 1):
            raise ValueError(f"max_prompt_chars must be a positive integer, got "
                             f"{self.max_prompt_chars!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be a non-empty string (or None for no key)")


def _json_error(status: int, message: str, type: str = "invalid_request_error",
                code: str | None = None, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type, code, param), status_code=status)


class _APIKeyGuard:
    """ASGI middleware: ``Authorization: Bearer <key>`` on every path but ``/health``.

    Both sides are hashed first, so ``hmac.compare_digest`` compares equal-length digests and
    the time taken says nothing about the key, not even its length.
    """

    def __init__(self, app, api_key: str):
        self.app = app
        self._want = hashlib.sha256(f"Bearer {api_key}".encode()).digest()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(hashlib.sha256(got).digest(), self._want):
                resp = _json_error(401, "missing or wrong API key: send 'Authorization: Bearer "
                                   "<key>'", "authentication_error", "invalid_api_key")
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _EventStream(StreamingResponse):
    """Server-sent events; ``on_close`` runs however the response ends (done, disconnect, error)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


@dataclass
class _Result:
    text: str
    num_tokens: int
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int


def _usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


class _Server:
    """Request handlers over one engine worker (held by the app; no module-level state)."""

    def __init__(self, llm, config: ServerConfig):
        if llm.tokenizer is None:
            raise ValueError("serving needs a tokenizer: the target directory has neither "
                             "tokenizer.json nor the kvstrata byte tokenizer's config")
        self.llm = llm
        self.cfg = config
        self.tok = llm.tokenizer
        self.model = config.model_name or llm.model_name
        self.max_seq_len = llm.max_seq_len
        self.max_prompt_chars = config.max_prompt_chars or 16 * llm.max_seq_len
        self.metrics = ServerMetrics(self.model, getattr(llm, "block_size", 16))
        self.worker = EngineWorker(llm, self.metrics)
        self.created = int(time.time())

    # -- plumbing ---------------------------------------------------------------------------
    async def read_json(self, request: Request) -> dict:
        limit = self.cfg.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit} "
                           f"bytes", code="request_too_large")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes",
                               code="request_too_large")
        try:
            obj = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json")
        if not isinstance(obj, dict):
            raise APIError(400, "request body must be a JSON object", code="invalid_json")
        return obj

    def check_model(self, name: str) -> None:
        if name != self.model:
            raise APIError(404, f"model {name!r} does not exist; this server serves "
                           f"{self.model!r}", code="model_not_found", param="model")

    def check_prompt_size(self, chars: int) -> None:
        if chars > self.max_prompt_chars:
            raise APIError(413, f"prompt of {chars} characters exceeds the limit of "
                           f"{self.max_prompt_chars}", code="prompt_too_large", param="prompt")

    def check_fits(self, prompt_ids: list[int], max_tokens: int) -> None:
        """A prompt that fits whose ``max_tokens`` would run past ``max_seq_len`` is refused, as
        OpenAI and vLLM refuse it, not answered with a completion cut short at the limit (a
        prompt that does not fit at all is the engine's own 400)."""
        n = len(prompt_ids)
        if n < self.max_seq_len < n + max_tokens:
            raise APIError(400, f"max_tokens={max_tokens} does not fit: the prompt has {n} "
                           f"tokens and the context holds {self.max_seq_len}; ask for at most "
                           f"{self.max_seq_len - n}", code="context_length_exceeded",
                           param="max_tokens")

    def sampling(self, req, max_tokens: int) -> SamplingParams:
        kw = dict(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                  top_k=req.top_k, seed=req.seed)
        # Only fields the client set: defaults stay the engine's own.
        if req.stop_strings:
            kw["stop"] = req.stop_strings
        if req.stop_token_ids:
            kw["stop_token_ids"] = tuple(req.stop_token_ids)
        if req.min_tokens:
            kw["min_tokens"] = req.min_tokens
        if req.ignore_eos:
            kw["ignore_eos"] = True
        try:
            return SamplingParams(**kw)
        except ValueError as e:
            raise APIError(400, str(e))

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            self.check_prompt_size(len(prompt))
            return self.tok.encode(prompt)
        return list(prompt)

    async def submit(self, prompt_ids: list[int], params: SamplingParams, salt: str | None,
                     prefix: str, arrival: float) -> RequestStream:
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        try:
            return await self.worker.add(prompt_ids, params, request_id, salt, arrival)
        except ValueError as e:
            code = "context_length_exceeded" if "max_seq_len" in str(e) else None
            raise APIError(400, str(e), code=code)
        except WorkerDown as e:
            raise APIError(503, str(e), "server_error", "engine_unavailable")

    @staticmethod
    async def deltas(stream: RequestStream):
        while True:
            d = await stream.deltas.get()
            if d.finished:
                stream.finished = True
            yield d
            if d.finished:
                return

    async def collect(self, stream: RequestStream) -> _Result:
        text, n, last = [], 0, None
        async for d in self.deltas(stream):
            text.append(d.new_text)
            n += len(d.new_token_ids)
            last = d
        if last.finish_reason == "error":
            raise APIError(500, last.error or "the engine failed", "server_error")
        return _Result("".join(text), n, last.finish_reason, last.num_prompt_tokens,
                       last.num_cached_tokens)

    async def run_to_end(self, request: Request, streams: list[RequestStream]) -> list[_Result]:
        """Every stream's result, or ``ClientDisconnect`` (all aborted) if the client leaves."""
        gather = asyncio.ensure_future(asyncio.gather(*(self.collect(s) for s in streams)))
        watch = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({gather, watch}, return_when=asyncio.FIRST_COMPLETED)
            if gather.done():
                return gather.result()
            raise ClientDisconnect()
        finally:
            for t in (gather, watch):
                t.cancel()
            for s in streams:
                self.worker.abort(s)

    # -- endpoints ----------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        arrival = time.perf_counter()
        req = _parse(CompletionRequest, await self.read_json(request))
        self.check_model(req.model)
        try:
            prompts = req.prompts()
        except ValueError as e:
            raise APIError(400, str(e), param="prompt")
        ids = [self.encode(p) for p in prompts]
        params = self.sampling(req, 16 if req.max_tokens is None else req.max_tokens)
        for p in ids:
            self.check_fits(p, params.max_tokens)
        streams: list[RequestStream] = []
        try:
            for p in ids:
                streams.append(await self.submit(p, params, req.cache_salt, "cmpl", arrival))
        except APIError:
            for s in streams:
                self.worker.abort(s)
            raise
        if req.stream:
            return self.stream_response(streams, req, chat=False)
        results = await self.run_to_end(request, streams)
        return self.reply(streams[0], "text_completion", results, [
            {"index": i, "text": r.text, "logprobs": None, "finish_reason": r.finish_reason}
            for i, r in enumerate(results)])

    async def chat_completions(self, request: Request) -> Response:
        arrival = time.perf_counter()
        req = _parse(ChatCompletionRequest, await self.read_json(request))
        self.check_model(req.model)
        try:
            messages = req.message_dicts()
            self.check_prompt_size(sum(len(m["content"]) for m in messages))
            # The model's own template (the shipped byte-level pair has a documented one);
            # a tokenizer without one raises ValueError, which is the client's 400.
            text = self.tok.apply_chat_template(messages)
        except ValueError as e:
            raise APIError(400, str(e), param="messages")
        ids = self.encode(text)
        if req.max_new_tokens:
            self.check_fits(ids, req.max_new_tokens)
        max_tokens = req.max_new_tokens or max(1, self.max_seq_len - len(ids))
        stream = await self.submit(ids, self.sampling(req, max_tokens), req.cache_salt,
                                   "chatcmpl", arrival)
        if req.stream:
            return self.stream_response([stream], req, chat=True)
        r = (await self.run_to_end(request, [stream]))[0]
        return self.reply(stream, "chat.completion", [r], [
            {"index": 0, "message": {"role": "assistant", "content": r.text}, "logprobs": None,
             "finish_reason": r.finish_reason}])

    def reply(self, stream: RequestStream, obj: str, results: list[_Result], choices: list
              ) -> JSONResponse:
        """A non-streamed answer; usage sums every choice's."""
        return JSONResponse({
            "id": stream.request_id, "object": obj, "created": int(time.time()),
            "model": self.model, "choices": choices,
            "usage": _usage(sum(r.num_prompt_tokens for r in results),
                            sum(r.num_tokens for r in results),
                            sum(r.num_cached_tokens for r in results))})

    def stream_response(self, streams: list[RequestStream], req, chat: bool) -> Response:
        def abort_all():
            for st in streams:
                self.worker.abort(st)
        return _EventStream(self.events(streams, req, chat), abort_all)

    async def merged(self, streams: list[RequestStream]):
        """``(choice index, delta)`` of every stream, in arrival order, until all finished."""
        if len(streams) == 1:           # the common case needs no pump tasks
            async for d in self.deltas(streams[0]):
                yield 0, d
            return
        out: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, st: RequestStream):
            async for d in self.deltas(st):
                out.put_nowait((i, d))

        tasks = [asyncio.ensure_future(pump(i, st)) for i, st in enumerate(streams)]
        try:
            for _ in streams:
                while True:
                    i, d = await out.get()
                    yield i, d
                    if d.finished:
                        break
        finally:
            for t in tasks:
                t.cancel()

    async def events(self, streams: list[RequestStream], req, chat: bool) -> AsyncIterator[str]:
        head = {"id": streams[0].request_id, "created": int(time.time()), "model": self.model,
                "object": "chat.completion.chunk" if chat else "text_completion"}

        def chunk(i: int, text: str | None, finish: str | None) -> str:
            if chat:
                delta = {} if text is None else {"content": text}
                choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": i, "text": text or "", "logprobs": None,
                          "finish_reason": finish}
            return _sse({**head, "choices": [choice]})

        if chat:
            yield _sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                  "content": ""},
                                             "logprobs": None, "finish_reason": None}]})
        done: list[_Result] = []
        n = [0] * len(streams)
        async for i, d in self.merged(streams):
            n[i] += len(d.new_token_ids)
            if d.finish_reason == "error":
                yield _sse(error_body(d.error or "the engine failed", "server_error"))
                break
            if d.new_text:
                yield chunk(i, d.new_text, None)
            if d.finished:
                yield chunk(i, None, d.finish_reason)
                done.append(_Result("", n[i], d.finish_reason, d.num_prompt_tokens,
                                    d.num_cached_tokens))
        else:
            if req.include_usage:
                yield _sse({**head, "choices": [], "usage": _usage(
                    sum(r.num_prompt_tokens for r in done), sum(r.num_tokens for r in done),
                    sum(r.num_cached_tokens for r in done))})
        yield "data: [DONE]\n\n"

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.model, "object": "model", "created": self.created, "owned_by": "kvstrata",
            "max_model_len": self.max_seq_len}]})

    async def health(self, request: Request) -> Response:
        if not self.worker.alive:
            return _json_error(503, self.worker.failure or "the engine is not running",
                               "server_error", "engine_unavailable")
        return JSONResponse({"status": "ok"})

    async def metrics_text(self, request: Request) -> Response:
        try:
            stats = await self.worker.stats()
        except WorkerDown:
            stats = {}
        return Response(self.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)


def _parse(model, body: dict):
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise APIError(400, validation_message(e))


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _endpoint(srv: _Server, fn):
    async def handle(request: Request) -> Response:
        try:
            return await fn(request)
        except APIError as e:
            if e.status < 500:
                srv.metrics.rejected.labels(str(e.status)).inc()
            return JSONResponse(e.body(), status_code=e.status)
        except ClientDisconnect:
            return Response(status_code=499)      # nobody reads it; the request is aborted
    return handle


def build_app(llm, config: ServerConfig | None = None) -> Starlette:
    """The ASGI app serving ``llm`` (an :class:`~kvstrata.runtime.LLM`); its lifespan starts and
    stops the engine thread (``llm`` is closed on shutdown)."""
    srv = _Server(llm, config or ServerConfig())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        srv.worker.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.to_thread(srv.worker.stop)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        return _json_error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                           code="not_found" if exc.status_code == 404 else None)

    routes = [Route("/v1/completions", _endpoint(srv, srv.completions), methods=["POST"]),
              Route("/v1/chat/completions", _endpoint(srv, srv.chat_completions),
                    methods=["POST"]),
              Route("/v1/models", _endpoint(srv, srv.models), methods=["GET"]),
              Route("/health", srv.health, methods=["GET"]),
              Route("/metrics", srv.metrics_text, methods=["GET"])]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: http_error})
    app.state.server = srv
    if srv.cfg.api_key is not None:
        app.add_middleware(_APIKeyGuard, api_key=srv.cfg.api_key)
    return app
