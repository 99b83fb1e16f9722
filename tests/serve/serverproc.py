"""Helpers of the server tests: a real ``kvstrata serve`` process on a free loopback port (run in
a temporary directory, stopped with SIGINT, then SIGKILL, by whoever started it), raw HTTP, and
``/metrics`` parsed with prometheus_client's own parser.

The server runs the shipped pair on the CPU with one torch thread (2-core machines).
"""

from __future__ import annotations

import http.client
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

MODEL = "kvstrata-tiny-py"
API_KEY = "test-key-0123456789"


@dataclass
class Server:
    url: str
    port: int
    proc: subprocess.Popen
    log: Path

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def start_server(tmp: Path, args: list[str], env: dict | None = None, timeout: float = 90.0,
                 target: str = MODEL, drafter: str = MODEL) -> Server:
    """``kvstrata serve --port 0``: the system picks a free port (no race with another process
    between choosing one and binding it) and the server prints its URL once bound."""
    fd, name = tempfile.mkstemp(prefix="server-", suffix=".log", dir=tmp)
    os.close(fd)
    log = Path(name)
    cmd = [sys.executable, "-m", "kvstrata", "serve", target, "--drafter", drafter,
           "--host", "127.0.0.1", "--port", "0", "--threads", "1", "--device", "cpu",
           "--log-level", "warning", *args]
    full_env = {**os.environ, "TRITON_INTERPRET": "1", **(env or {})}
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=tmp, env=full_env)
    srv = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        if srv is None:
            m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", log.read_text())
            if m is None:
                time.sleep(0.3)
                continue
            port = int(m.group(1))
            srv = Server(f"http://127.0.0.1:{port}", port, proc, log)
        try:
            with urllib.request.urlopen(f"{srv.url}/health", timeout=2) as r:
                if r.status == 200:
                    return srv
        except OSError:
            time.sleep(0.3)
    Server("", 0, proc, log).stop()
    raise RuntimeError(f"server did not become healthy in {timeout} s:\n{log.read_text()}")


def http_request(server, method: str, path: str, body: bytes | None = None,
                 key: str | None = API_KEY, headers: dict | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    h = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        h["Authorization"] = f"Bearer {key}"
    conn.request(method, path, body=body, headers=h)
    r = conn.getresponse()
    out = r.status, r.read()
    conn.close()
    return out


def metrics(server) -> dict[str, float]:
    """``/metrics`` as ``{'name{label="v"}': value}`` (labels sorted)."""
    status, body = http_request(server, "GET", "/metrics")
    assert status == 200
    return parse_metrics(body)


def parse_metrics(text: bytes) -> dict[str, float]:
    """Prometheus exposition text as ``{'name{label="v"}': value}`` (labels sorted)."""
    out = {}
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_idle(server, timeout: float = 30.0) -> dict[str, float]:
    """Metrics once no request is in flight and no page is in use."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if m["kvstrata_requests_in_flight"] == 0 and m['kvstrata_pool_pages{state="in_use"}'] == 0:
            return m
        assert time.monotonic() < deadline, f"server not idle after {timeout} s: {m}"
        time.sleep(0.1)
