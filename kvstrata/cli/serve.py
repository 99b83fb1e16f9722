"""``kvstrata serve``: an OpenAI-compatible HTTP server over the speculative engine.

    kvstrata serve kvstrata-tiny-py --drafter kvstrata-tiny-py --port 8000
    curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "kvstrata-tiny-py", "prompt": "def add(a, b):", "max_tokens": 32}'

Endpoints: /v1/completions, /v1/chat/completions (streaming by server-sent events), /v1/models,
/health, /metrics (Prometheus). Binds 127.0.0.1 unless --host says otherwise; --api-key (or the
KVSTRATA_API_KEY environment variable) makes every endpoint but /health require
``Authorization: Bearer <key>``. docs/serving.md has the details.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import socket
import sys

HELP = "OpenAI-compatible HTTP server (completions, chat, SSE streaming, /metrics)"

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """``"4G"``, ``"512MiB"``, ``"1048576"`` -> bytes (binary units)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1048576, 512M, 4GiB)")
    return int(float(m.group(1)) * (1 << (10 * " kmgt".index(m.group(2).lower() or " "))))


def parse_port(text: str) -> int:
    """A TCP port, 0-65535 (0: one the system picks; the printed URL says which)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"not a port: {text!r} (0-65535; 0 picks a free one)")
    return port


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` before the model loads (minutes for a large one), so an
    address in use fails at once; uvicorn listens on it. ``ValueError`` when it cannot bind."""
    sock = None
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                           flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn binds
        sock.bind(addr)
    except OSError as e:
        if sock is not None:
            sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", metavar="TARGET",
                   help="Qwen3 checkpoint directory or shipped model name (kvstrata-tiny-py)")
    p.add_argument("--drafter", metavar="DIR",
                   help="DFlash drafter directory or shipped name (none: plain decoding)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=parse_port, default=8000,
                   help="TCP port (default 8000; 0: a free one, printed at start)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every endpoint but "
                   "/health; prefer the KVSTRATA_API_KEY environment variable (a command line "
                   "is visible to other users in ps)")
    p.add_argument("--served-model-name", help="model name clients send (default: the "
                   "model's own name)")
    p.add_argument("--max-body-bytes", type=parse_bytes, default=1 << 20,
                   help="larger request bodies get 413")
    p.add_argument("--max-prompt-chars", type=int,
                   help="longer prompt text gets 413 (default: 16 x max_seq_len)")
    g = p.add_argument_group("engine and cache")
    g.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda:1")
    g.add_argument("--dtype", default="auto", help="auto keeps each checkpoint's dtype")
    g.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (0: the engine's choice, 1 for small models)")
    g.add_argument("--max-batch-size", type=int, default=16)
    g.add_argument("--max-seq-len", type=int, help="default: the models' limit")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--kv-cache-bytes", type=parse_bytes,
                   help="KV pool budget, e.g. 8G (default: max_batch_size x max_seq_len)")
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--target-codec", default="nvfp4", help="cold-page codec of target pages")
    g.add_argument("--draft-codec", default="lossless", help="cold-page codec of draft pages")
    g.add_argument("--host-tier-bytes", type=parse_bytes,
                   help="enable the host tier with this many bytes")
    g.add_argument("--disk-tier", metavar="PATH",
                   help="enable the disk tier in PATH (needs --host-tier-bytes)")
    g.add_argument("--disk-tier-bytes", type=parse_bytes, default=1 << 30,
                   help="disk tier map size")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])


def cache_config(args: argparse.Namespace):
    """``CacheConfig`` from the command line (``ValueError`` on a bad combination)."""
    from kvstrata.runtime import CacheConfig

    tiers = None
    if args.disk_tier and args.host_tier_bytes is None:
        raise ValueError("--disk-tier needs --host-tier-bytes (the host tier stages every "
                         "transfer)")
    if args.host_tier_bytes is not None:
        tiers = {"host_bytes": args.host_tier_bytes}
        if args.disk_tier:
            from kvstrata.tiers import DiskTier
            tiers["disk"] = DiskTier(args.disk_tier, map_size=args.disk_tier_bytes)
    return CacheConfig(kv_cache_bytes=args.kv_cache_bytes, page_size=args.page_size,
                       max_seq_len=args.max_seq_len, max_batch_size=args.max_batch_size,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       target_codec=args.target_codec, draft_codec=args.draft_codec,
                       tiers=tiers)


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from kvstrata.serve import ServerConfig, build_app
    except ModuleNotFoundError as e:
        print(f"kvstrata serve: {e.name} is missing; install the server extra: "
              f"pip install 'kvstrata[serve]'", file=sys.stderr)
        return 2
    from kvstrata.devices import resolve_device
    from kvstrata.runtime import LLM

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    llm = sock = None
    try:
        device = resolve_device(args.device)
        api_key = args.api_key or os.environ.get("KVSTRATA_API_KEY") or None
        config = ServerConfig(model_name=args.served_model_name, api_key=api_key,
                              max_body_bytes=args.max_body_bytes,
                              max_prompt_chars=args.max_prompt_chars)
        cache = cache_config(args)
        try:
            sock = listen(args.host, args.port)
            llm = LLM(args.target, args.drafter, cache=cache, device=device, dtype=args.dtype,
                      num_threads=args.threads or None)
        finally:
            disk = (cache.tiers or {}).get("disk")
            if llm is None and disk is not None:
                disk.close()
        app = build_app(llm, config)
    except BaseException as e:
        if sock is not None:
            sock.close()
        if llm is not None:
            llm.close()
        if not isinstance(e, (ValueError, RuntimeError)):
            raise
        print(f"kvstrata serve: error: {e}", file=sys.stderr)
        return 2
    srv = app.state.server
    port = sock.getsockname()[1]
    if args.host not in ("127.0.0.1", "localhost", "::1") and config.api_key is None:
        logging.getLogger("kvstrata.serve").warning(
            "listening on %s without an API key: anyone who can reach it can use it", args.host)
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"kvstrata serve: {srv.model} on {device}, max_seq_len={srv.max_seq_len}, "
          f"http://{host}:{port}/v1", flush=True)
    served = uvicorn.Config(app, host=args.host, port=port, log_level=args.log_level,
                            timeout_graceful_shutdown=5)
    try:
        uvicorn.Server(served).run(sockets=[sock])
    except KeyboardInterrupt:
        pass      # the server re-raises the SIGINT it shut down on (as uvicorn.run, exit 0)
    finally:
        sock.close()
    return 0
