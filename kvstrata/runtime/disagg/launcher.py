"""Start one context and one generation worker (1P1D) as two processes over ``torch.distributed``.

Rank 0 is the context worker, rank 1 the generation worker. On ``device="cuda"`` rank ``r`` uses
``cuda:r`` and pages move over NCCL; on the CPU they move over Gloo.

    python -m kvstrata.runtime.disagg.launcher --target kvstrata-tiny-py \\
        --drafter kvstrata-tiny-py --num-prompts 4 --max-tokens 32
"""

from __future__ import annotations

import argparse
import datetime
import socket
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..config import CacheConfig
from ..outputs import RequestOutput
from ..sampling import SamplingParams
from .transport import NamespaceMismatchError, TransferStats


@dataclass
class DisaggResult:
    """What :func:`launch_1p1d` returns.

    ``outputs`` in prompt order (from the generation worker); ``transfers`` one
    :class:`TransferStats` per handoff (as the generation worker measured it); ``errors`` from
    either worker (a refused handshake, a cut link, failed handoffs); ``seconds`` wall time of
    serving (models loaded and connected).
    """

    outputs: list[RequestOutput] = field(default_factory=list)
    transfers: list[TransferStats] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for the workers' rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collect_reports(q, procs: Sequence, timeout_s: float | None = None) -> list:
    """What the worker processes ``procs`` put on ``q``, one item each: returns once every one
    reported, one died without reporting, or ``timeout_s`` passed (None: no limit); every
    process is joined before it returns (one still alive after 10 s is killed)."""
    got: list = []
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while len(got) < len(procs) and (deadline is None or time.monotonic() < deadline):
        if not q.empty():
            got.append(q.get())
        elif any(p.exitcode not in (None, 0) for p in procs) and q.empty():
            break               # a worker died without reporting
        else:
            time.sleep(0.02)
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()
    return got


def _worker(rank: int, cfg: dict[str, Any], q) -> None:
    from ..engine import LLM
    from .transport import PageChannel
    from .workers import ContextWorker, GenerationWorker

    role = "context" if rank == 0 else "generation"
    try:
        if cfg["threads"]:
            torch.set_num_threads(cfg["threads"])
        cuda = cfg["device"] == "cuda"
        device = torch.device(f"cuda:{rank}") if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo",
                                init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank,
                                world_size=2,
                                timeout=datetime.timedelta(seconds=cfg["timeout_s"]))
        ch = PageChannel(1 - rank, device=device)
        side = cfg["context"] if rank == 0 else cfg["generation"]
        llm = LLM(side["target"], side["drafter"], cache=side["cache"], device=device,
                  dtype=cfg["dtype"])
        worker = (ContextWorker(llm, ch, encode=cfg["encode"], retries=cfg["retries"])
                  if rank == 0 else GenerationWorker(llm, ch))
        try:
            worker.connect()
        except NamespaceMismatchError as e:
            q.put((role, "refused", str(e)))
            return
        t0 = time.perf_counter()
        if rank == 0:
            worker.serve(cfg["prompts"], cfg["params"], cfg["cache_salt"])
            q.put((role, "ok", {"failed": worker.failed}))
        else:
            outs = worker.serve()
            q.put((role, "ok", {"outputs": outs, "transfers": worker.transfers,
                                "errors": worker.errors,
                                "seconds": time.perf_counter() - t0}))
    except Exception:  # noqa: BLE001 - report, never hang the launcher
        q.put((role, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch_1p1d(prompts: Sequence[Sequence[int]],
                params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                target, drafter=None, cache: CacheConfig | None = None,
                generation: dict[str, Any] | None = None, device: str = "cpu",
                dtype: str = "auto", cache_salt: str | None = None, encode: str = "never",
                retries: int = 1, threads: int | None = 1, timeout_s: float = 300.0
                ) -> DisaggResult:
    """Serve ``prompts`` with a context worker and a generation worker in two fresh processes.

    ``target``/``drafter``/``cache`` configure both engines (checkpoint directories or shipped
    names: they are loaded in each process); ``generation`` overrides any of the three for the
    generation worker (e.g. ``{"drafter": None}`` to see the handshake refuse it). ``threads``:
    torch CPU threads per worker. Raises ``RuntimeError`` if a worker crashed.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and torch.cuda.device_count() < 2:
        raise ValueError(f"1P1D on CUDA needs 2 GPUs, {torch.cuda.device_count()} visible")
    ctx_side = {"target": target, "drafter": drafter, "cache": cache}
    cfg = {"prompts": [list(p) for p in prompts], "params": params, "cache_salt": cache_salt,
           "device": device, "dtype": dtype, "encode": encode, "retries": retries,
           "threads": threads, "timeout_s": timeout_s, "port": _free_port(),
           "context": ctx_side, "generation": {**ctx_side, **(generation or {})}}
    mpctx = mp.get_context("spawn")
    q = mpctx.SimpleQueue()
    procs = [mpctx.Process(target=_worker, args=(rank, cfg, q)) for rank in (0, 1)]
    for p in procs:
        p.start()
    res, crashed = DisaggResult(), []
    got = {role: (status, payload)
           for role, status, payload in collect_reports(q, procs, timeout_s)}
    for rank, role in enumerate(("context", "generation")):
        status, payload = got.get(role, ("lost", f"exit code {procs[rank].exitcode}"))
        if status in ("error", "lost"):
            crashed.append(f"{role} worker: {payload}")
        elif status == "refused":
            res.errors.append(f"{role} worker: {payload}")
        elif role == "context":
            res.errors += [f"request {k}: {v}" for k, v in payload["failed"].items()]
        else:
            res.outputs, res.transfers = payload["outputs"], payload["transfers"]
            res.errors += payload["errors"]
            res.seconds = payload["seconds"]
    if crashed:
        raise RuntimeError("1P1D worker failed:\n" + "\n".join(crashed))
    return res


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="kvstrata-tiny-py")
    ap.add_argument("--drafter", default="kvstrata-tiny-py")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--encode", choices=("never", "always", "auto"), default="never")
    ap.add_argument("--drafter-backend", choices=("paged", "arena"), default="paged")
    ap.add_argument("--max-seq-len", type=int, default=512)
    a = ap.parse_args(argv)
    from ...assets.corpus import heldout_prompts
    prompts = heldout_prompts(a.num_prompts, a.prompt_len, 0)
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, seed=a.seed)
    cache = CacheConfig(max_seq_len=a.max_seq_len, max_batch_size=max(1, a.num_prompts),
                        drafter_backend=a.drafter_backend)
    res = launch_1p1d(prompts, sp, target=a.target, drafter=a.drafter or None, cache=cache,
                      device=a.device, encode=a.encode)
    for o in res.outputs:
        print(f"request {o.request_id}: {len(o.token_ids)} tokens, AL "
              f"{o.mean_acceptance_length:.2f}, {o.finish_reason}"
              + (f", error: {o.error}" if o.error else ""))
    n = sum(t.bytes for t in res.transfers)
    s = sum(t.seconds for t in res.transfers)
    print(f"{len(res.transfers)} handoffs, {n / 1e6:.2f} MB in {s * 1e3:.1f} ms; "
          f"serving {res.seconds:.2f} s")
    for e in res.errors:
        print("error:", e)
    return 1 if res.errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
