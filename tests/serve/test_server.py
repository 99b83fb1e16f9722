"""``kvstrata serve`` end to end: a real server process, the official ``openai`` client, and the
offline engine (``LLM.generate``) as the oracle for every greedy answer."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time

import openai
import pytest
import torch

from serverproc import API_KEY, MODEL, http_request, metrics, start_server, wait_idle
from kvstrata.runtime import LLM, CacheConfig, SamplingParams
from kvstrata.tokenizer import ByteTokenizer, decode, encode

MAX_SEQ_LEN, BATCH, BODY_LIMIT = 256, 16, 8192
CACHE = dict(max_batch_size=BATCH, max_seq_len=MAX_SEQ_LEN, target_codec="identity",
             draft_codec="identity")
ARGS = ["--max-seq-len", str(MAX_SEQ_LEN), "--max-batch-size", str(BATCH),
        "--target-codec", "identity", "--draft-codec", "identity",
        "--max-body-bytes", str(BODY_LIMIT)]
# Prefix-heavy: every prompt opens with the same class header (several full pages).
SHARED = ('import os\nimport sys\n\n\nclass Config:\n    """Settings read from the environment.'
          '"""\n\n    def __init__(self, env=None):\n        self.env = env or os.environ\n\n')
NAMES = ["path", "name", "size", "mode", "user", "home", "port", "host", "root", "lang",
         "shell", "term", "editor", "pager", "tmp", "cache"]
PROMPTS = [SHARED + f"    def get_{n}(self):\n" for n in NAMES]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def offline():
    """Greedy answers of the offline engine, keyed by (prompt text, max_tokens)."""
    threads = torch.get_num_threads()
    llm = LLM(MODEL, MODEL, cache=CacheConfig(**CACHE), device="cpu", num_threads=1)
    memo: dict[tuple[str, int], list[int]] = {}

    def answer(*prompts: str, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
        todo = [p for p in prompts if (p, max_tokens) not in memo]
        if todo:
            outs = llm.generate([encode(p) for p in todo], SamplingParams(max_tokens=max_tokens))
            for p, o in zip(todo, outs):
                assert o.error is None, o.error
                memo[p, max_tokens] = o.token_ids
        return [memo[p, max_tokens] for p in prompts]

    yield answer
    llm.close()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["synchronous", "overlapped"])
def server(request, tmp_path_factory):
    """The server, with synchronous steps (the CPU default) and with overlapped steps (the CUDA
    default): streaming, disconnects and load must not depend on a step being in flight."""
    env = {"KVSTRATA_API_KEY": API_KEY, "KVSTRATA_OVERLAP": str(int(request.param == "overlapped"))}
    srv = start_server(tmp_path_factory.mktemp("serve"), ARGS, env=env)
    yield srv
    rc = srv.stop()
    assert rc == 0, srv.log.read_text()    # a clean shutdown after everything the tests did


@pytest.fixture(autouse=True)
def _server_log_on_failure(request):
    yield
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed and "server" in request.fixturenames:
        print(request.getfixturevalue("server").log.read_text()[-8000:])


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                         timeout=120)


def test_completions_chat_and_stream_equal_offline(client, offline):
    model = client.models.list().data[0].id
    assert model == MODEL
    p0, p1, p2 = PROMPTS[:3]
    want = offline(p0, p1, p2)

    r = client.completions.create(model=model, prompt=p0, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == decode(want[0])
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(encode(p0)), MAX_TOKENS)
    assert r.usage.total_tokens == len(encode(p0)) + MAX_TOKENS

    # Same prompt again: served from the prefix cache, same answer, reuse reported in usage.
    again = client.completions.create(model=model, prompt=p0, max_tokens=MAX_TOKENS,
                                      temperature=0)
    assert again.choices[0].text == r.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens >= 16 * (len(SHARED) // 16)

    # Token ids as the prompt, and a batch of prompts (one choice each, in order).
    r = client.completions.create(model=model, prompt=encode(p1), max_tokens=MAX_TOKENS,
                                  temperature=0)
    assert r.choices[0].text == decode(want[1])
    r = client.completions.create(model=model, prompt=[p1, p2], max_tokens=MAX_TOKENS,
                                  temperature=0)
    assert [c.text for c in r.choices] == [decode(want[1]), decode(want[2])]
    assert [c.index for c in r.choices] == [0, 1]

    # Streaming: the chunks concatenate to the same answer; usage comes last when asked for.
    chunks = list(client.completions.create(model=model, prompt=p2, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == decode(want[2])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS

    # Several prompts in one stream: chunks interleave, each choice's text is its own answer.
    chunks = list(client.completions.create(model=model, prompt=[p1, p2], max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    for i, w in enumerate(want[1:]):
        assert "".join(c.choices[0].text for c in chunks
                       if c.choices and c.choices[0].index == i) == decode(w)
    assert chunks[-1].usage.completion_tokens == 2 * MAX_TOKENS
    assert chunks[-1].usage.prompt_tokens == len(encode(p1)) + len(encode(p2))

    # Chat through the model's template (the byte-level pair's renders Python comments).
    msgs = [{"role": "system", "content": "You complete Python."},
            {"role": "user", "content": "def fibonacci(n):"}]
    prompt = ByteTokenizer().apply_chat_template(msgs)
    assert prompt == ("# system: You complete Python.\n# user: def fibonacci(n):\n"
                      "# assistant:\n")
    (want_chat,) = offline(prompt, max_tokens=12)
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == decode(want_chat)
    assert r.usage.prompt_tokens == len(encode(prompt))
    stream = client.chat.completions.create(model=model, messages=msgs, max_tokens=12,
                                            temperature=0, stream=True)
    parts = [c.choices[0].delta.content or "" for c in stream]
    assert "".join(parts) == decode(want_chat)


def test_cache_salt_separates_prefixes(client):
    p = PROMPTS[5] + "        # salted\n"
    kw = dict(model=MODEL, prompt=p, max_tokens=2, temperature=0)
    a = client.completions.create(**kw, extra_body={"cache_salt": "alice"})
    b = client.completions.create(**kw, extra_body={"cache_salt": "bob"})
    c = client.completions.create(**kw, extra_body={"cache_salt": "alice"})
    assert b.usage.prompt_tokens_details.cached_tokens == 0   # bob shares nothing with alice
    assert c.usage.prompt_tokens_details.cached_tokens > 0
    assert a.choices[0].text == b.choices[0].text == c.choices[0].text


def test_auth_health_models_and_metrics(server):
    # /health is open; everything else needs the key.
    assert http_request(server, "GET", "/health", key=None)[0] == 200
    for path in ("/v1/models", "/metrics"):
        for key in (None, "wrong", API_KEY + "x", ""):
            status, body = http_request(server, "GET", path, key=key)
            assert status == 401, (path, key)
            assert json.loads(body)["error"]["type"] == "authentication_error"
    status, body = http_request(server, "POST", "/v1/completions", key=None,
                         body=json.dumps({"model": MODEL, "prompt": "x"}).encode())
    assert status == 401
    status, body = http_request(server, "GET", "/v1/models")
    doc = json.loads(body)
    assert status == 200 and doc["data"][0]["id"] == MODEL
    assert doc["data"][0]["max_model_len"] == MAX_SEQ_LEN
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0).models.list()
    m = metrics(server)
    assert m['kvstrata_pool_capacity_pages'] == BATCH * MAX_SEQ_LEN // 16
    assert f'kvstrata_model_info{{model="{MODEL}"}}' in m
    for tier in ("device", "host", "disk", "remote"):
        assert f'kvstrata_prefix_cached_tokens_total{{tier="{tier}"}}' in m
    # after a speculative request: the runner's verify width per batch size and the drafts'
    # estimated acceptance by block position
    openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0).completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
    m = metrics(server)
    widths = [v for k, v in m.items() if k.startswith("kvstrata_verify_width{batch=")]
    acc = [v for k, v in m.items() if k.startswith("kvstrata_draft_acceptance{position=")]
    assert widths and all(2 <= v <= 16 for v in widths)
    assert 'kvstrata_draft_acceptance{position="1"}' in m and all(0 < v <= 1 for v in acc)


def _error(status_body, status: int, code: str | None = None) -> str:
    got, body = status_body
    err = json.loads(body)["error"]
    assert got == status, (got, err)
    if code is not None:
        assert err["code"] == code, err
    assert err["message"]
    return err["message"]


def test_bad_requests_are_clean_4xx_and_the_server_keeps_serving(server, client, offline):
    def post(path, obj):
        return http_request(server, "POST", path,
                            obj if isinstance(obj, bytes) else json.dumps(obj).encode())

    good = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": MAX_TOKENS, "temperature": 0}
    _error(post("/v1/completions", b'{"model": "kvstrata-tiny-py", "prompt": '), 400,
           "invalid_json")
    _error(post("/v1/completions", b"[1, 2]"), 400, "invalid_json")
    assert "does not exist" in _error(post("/v1/completions", {**good, "model": "gpt-9"}), 404,
                                      "model_not_found")
    assert "max_tokens" in _error(post("/v1/completions", {**good, "max_tokens": -1}), 400)
    assert "max_seq_len" in _error(post("/v1/completions", {**good, "prompt": "x" * 300}), 400,
                                   "context_length_exceeded")
    _error(post("/v1/completions", {**good, "prompt": [0, 1, 99999]}), 400)
    # A prompt that fits with max_tokens past the context: refused with what would fit (as
    # OpenAI and vLLM do), in both endpoints; at the limit exactly it is served.
    near = {**good, "prompt": [65] * (MAX_SEQ_LEN - 4)}
    msg = _error(post("/v1/completions", {**near, "max_tokens": 5}), 400,
                 "context_length_exceeded")
    assert f"has {MAX_SEQ_LEN - 4} tokens" in msg and "at most 4" in msg, msg
    status, body = post("/v1/completions", {**near, "max_tokens": 4, "ignore_eos": True})
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 4, body
    assert "at most" in _error(post("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": MAX_SEQ_LEN}), 400, "context_length_exceeded")
    _error(post("/v1/completions", {**good, "prompt": ""}), 400)
    _error(post("/v1/completions", {**good, "n": 2}), 400)
    _error(post("/v1/completions", {**good, "temperature": -1}), 400)
    _error(post("/v1/completions", {k: v for k, v in good.items() if k != "prompt"}), 400)
    _error(post("/v1/chat/completions", {"model": MODEL, "messages": []}), 400)
    _error(post("/v1/chat/completions", {"model": MODEL,
                                         "messages": [{"role": "wizard", "content": "x"}]}), 400)
    # Bodies past --max-body-bytes, declared or streamed in chunks; prompt text past the bound.
    _error(post("/v1/completions", {**good, "prompt": "x" * BODY_LIMIT}), 413,
           "request_too_large")
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Authorization", f"Bearer {API_KEY}")
    conn.putheader("Transfer-Encoding", "chunked")
    conn.endheaders()
    chunk = b"x" * 4096
    for _ in range(3):
        conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    conn.send(b"0\r\n\r\n")
    r = conn.getresponse()
    assert r.status == 413 and json.loads(r.read())["error"]["code"] == "request_too_large"
    conn.close()
    # Prompt text past the default bound (16 characters per token of max_seq_len), in a body
    # that fits.
    _error(post("/v1/completions", {**good, "prompt": "y" * (16 * MAX_SEQ_LEN + 1)}), 413,
           "prompt_too_large")
    assert http_request(server, "GET", "/v1/nothing")[0] == 404
    assert http_request(server, "GET", "/v1/completions")[0] == 405
    # The openai client sees the same errors as exceptions.
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=-3)
    # ... and the server goes on serving, with nothing left allocated.
    status, body = post("/v1/completions", good)
    assert status == 200
    assert json.loads(body)["choices"][0]["text"] == decode(offline(PROMPTS[3])[0])
    m = wait_idle(server)
    assert m['kvstrata_rejected_requests_total{status="400"}'] >= 10


def _raw_request(server, path: str, obj: dict) -> socket.socket:
    body = json.dumps(obj).encode()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s"
              % (path.encode(), API_KEY.encode(), len(body), body))
    return s


def test_disconnects_abort_and_free_pages(server, client, offline):
    before = metrics(server).get('kvstrata_requests_total{finish_reason="abort"}', 0)
    # Long enough (no EOS, nearly max_seq_len) to still be running when the client leaves.
    long = {"model": MODEL, "prompt": "def main():\n", "max_tokens": MAX_SEQ_LEN - 20,
            "temperature": 0, "ignore_eos": True}
    # Streaming: read the first event, then hang up.
    s = _raw_request(server, "/v1/completions", {**long, "stream": True})
    got = b""
    while b"data: " not in got:
        chunk = s.recv(4096)
        assert chunk, got
        got += chunk
    assert got.startswith(b"HTTP/1.1 200")
    s.close()
    wait_idle(server)
    # Non-streaming: hang up once it is running (chat's max_tokens left out: what fits after
    # the templated prompt).
    s = _raw_request(server, "/v1/chat/completions",
                     {**{k: v for k, v in long.items() if k not in ("prompt", "max_tokens")},
                      "messages": [{"role": "user", "content": "def main():"}]})
    deadline = time.monotonic() + 60
    while metrics(server)["kvstrata_requests_in_flight"] == 0:
        assert time.monotonic() < deadline, "the chat request never ran"
        time.sleep(0.01)
    s.close()
    m = wait_idle(server)
    assert m['kvstrata_requests_total{finish_reason="abort"}'] == before + 2
    assert m['kvstrata_pool_pages{state="free"}'] + m['kvstrata_pool_pages{state="cached"}'] == \
        m["kvstrata_pool_capacity_pages"]
    # The next request is served, and exactly.
    r = client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=MAX_TOKENS,
                                  temperature=0)
    assert r.choices[0].text == decode(offline(PROMPTS[4])[0])


def test_load_64_streaming_clients(server, offline):
    clients, per_client = 64, 2
    want = dict(zip(PROMPTS, (decode(t) for t in offline(*PROMPTS))))
    base = wait_idle(server)
    aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                                 timeout=120)

    async def one_client(i: int) -> list[tuple[str, str, int]]:
        out = []
        for j in range(per_client):
            p = PROMPTS[(i * per_client + j) % len(PROMPTS)]
            stream = await aclient.completions.create(
                model=MODEL, prompt=p, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                stream_options={"include_usage": True})
            text, n = [], 0
            async for c in stream:
                if c.choices:
                    text.append(c.choices[0].text)
                if c.usage is not None:
                    n = c.usage.completion_tokens
            out.append((p, "".join(text), n))
        return out

    async def main():
        try:
            return await asyncio.wait_for(asyncio.gather(*(one_client(i) for i in range(clients))),
                                          timeout=150)
        finally:
            await aclient.close()

    t0 = time.monotonic()
    results = [r for rs in asyncio.run(main()) for r in rs]
    elapsed = time.monotonic() - t0
    assert len(results) == clients * per_client
    wrong = [(p[-20:], got, want[p]) for p, got, _ in results if got != want[p]]
    assert not wrong, f"{len(wrong)} answers differ from offline, e.g. {wrong[:2]}"
    assert all(n == MAX_TOKENS for _, _, n in results)
    m = wait_idle(server)
    assert m["kvstrata_generation_tokens_total"] - base["kvstrata_generation_tokens_total"] == \
        clients * per_client * MAX_TOKENS
    assert m['kvstrata_requests_total{finish_reason="length"}'] - \
        base['kvstrata_requests_total{finish_reason="length"}'] == clients * per_client
    assert m['kvstrata_pool_pages{state="in_use"}'] == base['kvstrata_pool_pages{state="in_use"}']
    # Prefix-heavy: most prompt tokens came from the cache.
    assert m['kvstrata_prefix_cached_tokens_total{tier="device"}'] > \
        base['kvstrata_prefix_cached_tokens_total{tier="device"}'] + 64 * len(SHARED) // 2
    print(f"load: {clients * per_client} streamed requests in {elapsed:.1f} s")
