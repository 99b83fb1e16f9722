"""Serving benchmark: ``kvstrata serve`` under concurrent streaming clients (issue 18).

Two parts, both against a real server process on a loopback port, driven by the official
``openai`` client (a dev dependency):

1. **Concurrency sweep**, prefix-heavy: every prompt is one shared header (a system prompt of
   ``--shared-bytes``) plus a short unique question. ``c`` clients each send ``--per-client``
   streaming requests one after another; reported: generated tokens/s, requests/s, client-side TTFT
   p50/p99 (request sent -> first streamed text), and the CPU both processes used. The ceiling,
   measured right after each server run in the same process as the clients (the server idle), is
   the engine alone under the same closed loop (``c`` clients on ``add_request``/``step``, no
   HTTP, same cache configuration and threads).
2. **TTFT with tier hits vs without** at concurrency 1: a device pool of two sequences and a host
   tier. Cold prompts (nothing cached); the last prompt again (a device-pool hit); the first prompts
   again (evicted from the device by then, so their prefix comes back from the host tier;
   ``kvstrata_tier_promoted_pages_total`` in ``/metrics`` confirms it).

    python benchmarks/serve_bench.py --threads 1 --out /tmp/serve.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from _report import emit  # benchmarks/ is on sys.path when a script here runs

from kvstrata.testing.redis import free_port

MODEL = "kvstrata-tiny-py"
QUESTIONS = ["path", "name", "size", "mode", "user", "home", "port", "host", "root", "lang",
             "shell", "term", "editor", "pager", "tmp", "cache"]


def _shared_header(nbytes: int) -> str:
    """A Python module header of about ``nbytes`` characters (ASCII, one byte per token)."""
    lines = ['"""Settings of the service, read once from the environment."""', "",
             "import os", "import sys", "", ""]
    i = 0
    while sum(len(x) + 1 for x in lines) < nbytes:
        lines.append(f"DEFAULT_{i} = os.environ.get('SETTING_{i}', '{i}')")
        i += 1
    return "\n".join(lines)[:nbytes] + "\n\n\n"


def _prompt(shared: str, k: int) -> str:
    q = QUESTIONS[k % len(QUESTIONS)]
    return f"{shared}def get_{q}_{k}(config):\n"


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _by_tier(counts: dict[str, float]) -> str:
    return ", ".join(f"{int(v)} {t}" for t, v in counts.items() if v) or "0"


class _Server:
    device = "cpu"

    def __init__(self, args: list[str], threads: int, workdir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(workdir / f"server-{self.port}.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstrata", "serve", MODEL, "--drafter", MODEL,
             "--port", str(self.port), "--threads", str(threads), "--device", self.device,
             "--log-level", "warning", *args], stdout=self.log, stderr=subprocess.STDOUT,
            cwd=workdir)
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited; log: {self.log.name}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server not healthy; log: {self.log.name}")
                time.sleep(0.3)

    def metrics(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            text = r.read().decode()
        return {f"{s.name}{json.dumps(s.labels, sort_keys=True) if s.labels else ''}": s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


async def _stream_one(client, prompt: str, max_tokens: int) -> tuple[float, int, float]:
    """(TTFT s, generated tokens, total s) of one streamed completion."""
    t0 = time.perf_counter()
    ttft, n = None, 0
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                             temperature=0, stream=True,
                                             stream_options={"include_usage": True})
    async for c in stream:
        if ttft is None and c.choices and c.choices[0].text:
            ttft = time.perf_counter() - t0
        if c.usage is not None:
            n = c.usage.completion_tokens
    return ttft, n, time.perf_counter() - t0


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _sweep_point(url: str, server_pid: int, shared: str, c: int, per_client: int,
                       max_tokens: int, start: int) -> dict:
    import openai
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                timeout=600)

    async def one_client(i: int):
        return [await _stream_one(client, _prompt(shared, start + i * per_client + j),
                                  max_tokens) for j in range(per_client)]

    t0, cpu0, srv0 = time.perf_counter(), time.process_time(), _cpu_s(server_pid)
    res = [r for rs in await asyncio.gather(*(one_client(i) for i in range(c))) for r in rs]
    wall = time.perf_counter() - t0
    cpu, srv_cpu = time.process_time() - cpu0, _cpu_s(server_pid) - srv0
    await client.close()
    toks = sum(r[1] for r in res)
    return {"requests": len(res), "tok_s": toks / wall, "req_s": len(res) / wall,
            "ttfts": [r[0] for r in res], "client_cpu": cpu / wall, "server_cpu": srv_cpu / wall}


class _EngineAlone:
    """The engine alone, same closed loop: ``c`` in-process clients, each adding its next request
    (``LLM.add_request``) when its previous one finished, driven by ``LLM.step`` (no HTTP, no
    thread hand-off). TTFT is the engine's (``add_request`` to the first token)."""

    def __init__(self, args, shared: str):
        from kvstrata.runtime import LLM, CacheConfig, SamplingParams
        self.args, self.shared = args, shared
        self.llm = LLM(MODEL, MODEL, CacheConfig(max_batch_size=args.max_batch_size,
                                                 max_seq_len=args.max_seq_len,
                                                 target_codec="identity", draft_codec="identity"),
                       device=args.device, num_threads=args.threads)
        self.sp = SamplingParams(max_tokens=args.max_tokens)
        self.llm.generate([_prompt(shared, 10_000)], self.sp)   # warm: the shared header cached

    def point(self, c: int, start: int) -> dict:
        llm, per = self.llm, self.args.per_client
        todo = {i: [_prompt(self.shared, start + i * per + j) for j in range(per)]
                for i in range(c)}
        owner, ttfts, toks = {}, [], 0
        t0, cpu0 = time.perf_counter(), time.process_time()
        for i in range(c):
            owner[llm.add_request(todo[i].pop(0), self.sp)] = i
        while llm.has_unfinished():
            for d in llm.step():
                toks += len(d.new_token_ids)
                if d.ttft_s is not None:
                    ttfts.append(d.ttft_s)
                if d.finished and todo[owner[d.request_id]]:
                    i = owner.pop(d.request_id)
                    owner[llm.add_request(todo[i].pop(0), self.sp)] = i
        wall = time.perf_counter() - t0
        return {"tok_s": toks / wall, "ttfts": ttfts, "cpu": (time.process_time() - cpu0) / wall}


def _tier_ttft(args, workdir: Path, page_bytes: int) -> list[dict]:
    """TTFT of cold prompts, device-pool hits and host-tier hits, one request at a time."""
    import openai
    seq_pages = -(-args.max_seq_len // 16)
    srv = _Server(["--max-seq-len", str(args.max_seq_len), "--max-batch-size", "2",
                   "--kv-cache-bytes", str(2 * seq_pages * page_bytes),
                   "--host-tier-bytes", "512M", "--target-codec", "identity",
                   "--draft-codec", "identity"], args.threads, workdir)
    rows = []
    try:
        client = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0,
                                    timeout=600)
        n = args.tier_prompts
        # Distinct long prompts: nothing shared, each ~shared-bytes long.
        prompts = [_prompt(f"# module {k}\n" + _shared_header(args.shared_bytes), k)
                   for k in range(n)]

        async def run(label: str, ps: list[str]):
            before = srv.metrics()
            t = [(await _stream_one(client, p, 4))[0] for p in ps]
            after = srv.metrics()
            key = 'kvstrata_tier_promoted_pages_total{"tier": "host"}'
            promoted = after.get(key, 0) - before.get(key, 0)
            cached = {k.split('"')[3]: v - before.get(k, 0) for k, v in after.items()
                      if k.startswith("kvstrata_prefix_cached_tokens_total")}
            rows.append({"case": label, "requests": len(ps), "ttft_p50_ms": 1e3 * _pct(t, .5),
                         "ttft_max_ms": 1e3 * max(t), "cached_tokens": cached,
                         "promoted": promoted})

        async def main():
            await _stream_one(client, _prompt("warm-up\n", 0), 2)
            await run("cold (no prefix cached)", prompts)
            await run("device-pool hit (same prompt again)", [prompts[-1]] * 3)
            await run("host-tier hit (evicted from the device)", prompts[:3])
            await client.close()

        asyncio.run(main())
    finally:
        srv.stop()
    return rows


def _summary(c: int, srv_pts: list[dict], eng_pts: list[dict]) -> dict:
    med = statistics.median
    st = [t for p in srv_pts for t in p["ttfts"]]
    et = [t for p in eng_pts for t in p["ttfts"]]
    tok, etok = med(p["tok_s"] for p in srv_pts), med(p["tok_s"] for p in eng_pts)
    return {"clients": c, "tok_s": tok, "req_s": med(p["req_s"] for p in srv_pts),
            "ttft_p50_ms": 1e3 * _pct(st, .5), "ttft_p99_ms": 1e3 * _pct(st, .99),
            "engine_tok_s": etok, "ratio": tok / etok, "engine_ttft_p50_ms": 1e3 * _pct(et, .5),
            "engine_ttft_p99_ms": 1e3 * _pct(et, .99),
            "server_cpu": med(p["server_cpu"] for p in srv_pts),
            "client_cpu": med(p["client_cpu"] for p in srv_pts),
            "engine_cpu": med(p["cpu"] for p in eng_pts)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    p.add_argument("--per-client", type=int, default=2, help="requests per client, in turn")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--shared-bytes", type=int, default=384, help="shared header length")
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="torch threads of server and ceiling")
    p.add_argument("--repeats", type=int, default=3, help="runs per concurrency level")
    p.add_argument("--tier-prompts", type=int, default=6)
    p.add_argument("--device", default="cpu", help="device of the server and the engine alone")
    p.add_argument("--skip-tiers", action="store_true")
    p.add_argument("--out", help="write the markdown tables here too")
    args = p.parse_args(argv)
    _Server.device = args.device
    levels = [int(x) for x in args.concurrency.split(",")]
    shared = _shared_header(args.shared_bytes)
    workdir = Path(tempfile.mkdtemp(prefix="kvstrata-serve-bench-"))
    if args.device == "cpu":      # the Triton kernels run through the interpreter on a CPU
        os.environ.setdefault("TRITON_INTERPRET", "1")

    engine = _EngineAlone(args, shared)
    srv = _Server(["--max-seq-len", str(args.max_seq_len), "--max-batch-size",
                   str(args.max_batch_size), "--target-codec", "identity", "--draft-codec",
                   "identity"], args.threads, workdir)
    rows, k = [], 20_000
    try:
        asyncio.run(_sweep_point(srv.url, srv.proc.pid, shared, 1, 1, args.max_tokens, 10_000))
        for c in levels:
            # Server and engine alone back to back, repeated: the machine is shared and its load
            # drifts; the ratio of medians compares like with like.
            srv_pts, eng_pts = [], []
            for _ in range(args.repeats):
                srv_pts.append(asyncio.run(_sweep_point(srv.url, srv.proc.pid, shared, c,
                                                        args.per_client, args.max_tokens, k)))
                k += c * args.per_client
                eng_pts.append(engine.point(c, k))
                k += c * args.per_client
            rows.append(_summary(c, srv_pts, eng_pts))
            print(json.dumps(rows[-1]), flush=True)
        m = srv.metrics()
    finally:
        srv.stop()
        page_bytes = engine.llm.plan.bytes_per_page
        engine.llm.close()
    reused = sum(v for key, v in m.items() if key.startswith("kvstrata_prefix_cached_tokens_total"))
    prompt_tokens = m.get("kvstrata_prompt_tokens_total", 0)
    lines = [f"Prompt: {len(shared)}-token shared header + a unique ~20-token question; "
             f"{args.max_tokens} new tokens, greedy; {args.per_client} streaming requests per "
             f"client in turn; max_batch_size={args.max_batch_size}, max_seq_len="
             f"{args.max_seq_len}, page 16, fp32, {args.threads} torch thread(s); median of "
             f"{args.repeats} runs per row, each beside an engine-alone run; prefix tokens "
             f"reused by the server: {reused:.0f} of {prompt_tokens:.0f}.", "",
             "| clients | tok/s | req/s | TTFT p50 ms | TTFT p99 ms | engine alone tok/s | "
             "server / engine alone | engine alone TTFT p50 / p99 ms | CPU: server / client / "
             "engine alone |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['clients']} | {r['tok_s']:.0f} | {r['req_s']:.2f} | "
                     f"{r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['engine_tok_s']:.0f} | "
                     f"{r['ratio']:.2f} | {r['engine_ttft_p50_ms']:.0f} / "
                     f"{r['engine_ttft_p99_ms']:.0f} | {r['server_cpu']:.0%} / "
                     f"{r['client_cpu']:.0%} / {r['engine_cpu']:.0%} |")
    if not args.skip_tiers:
        rows = _tier_ttft(args, workdir, page_bytes)
        lines += ["", "| case (one request at a time) | requests | TTFT p50 ms | TTFT max ms | "
                  "prompt tokens from cache, by tier | pages promoted from the host tier |",
                  "|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['case']} | {r['requests']} | {r['ttft_p50_ms']:.1f} | "
                         f"{r['ttft_max_ms']:.1f} | {_by_tier(r['cached_tokens'])} | "
                         f"{r['promoted']:.0f} |")
    emit("\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
