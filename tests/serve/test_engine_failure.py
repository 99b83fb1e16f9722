"""Fault injection: ``LLM.step`` itself raises mid-stream (a bug, not a bad request).

The open request ends with an error event, ``/health`` turns 503, new requests get a 503 (never a
hang), and the server still shuts down cleanly. The server runs in-process (uvicorn in a thread)
around the real engine, whose ``step`` is wrapped to fail from the fourth call on.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import uvicorn

from serverproc import MODEL

from kvstrata.runtime import LLM, CacheConfig
from kvstrata.serve import ServerConfig, build_app
from kvstrata.testing.redis import free_port


def test_step_failure_fails_open_requests_and_health():
    llm = LLM(MODEL, MODEL, CacheConfig(max_batch_size=4, max_seq_len=128), device="cpu")
    real_step, calls = llm.step, []

    def failing_step():
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("injected step failure")
        return real_step()

    llm.step = failing_step
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(llm, ServerConfig()), host="127.0.0.1",
                                           port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.05)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=30)
        text = []
        with pytest.raises(openai.APIError, match="injected step failure"):
            for chunk in client.completions.create(model=MODEL, prompt="def main():\n",
                                                   max_tokens=100, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True}):
                text.append(chunk.choices[0].text)
        assert 0 < len(calls) <= 5        # it failed at the fourth step, not at the end
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{url}/health", timeout=10)
        assert e.value.code == 503
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert e.value.status_code == 503 and "injected step failure" in str(e.value)
    finally:
        server.should_exit = True
        thread.join(30)
    assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):     # the lifespan closed the engine
        llm.add_request("x")
