"""Run vLLM's offline ``LLM`` (CPU backend) with KVStrataConnector: a helper for the tests.

As a module: :func:`make_llm` builds the engine in this process and :func:`generate` runs greedy
generations. As a script (a *new process*)::

    python vllm_run.py '{"extra": {...}, "prompts": [[...]], "salts": [null], "max_tokens": 24,
                         "runs": 1, "llm": {...}}'

runs the prompts ``runs`` times and prints one JSON line ``{"runs": [{"tokens": [[...]],
"cached": [n, ...], "stats": {...}, "tiers": {...}}, ...]}`` (``cached``: vLLM's own
``RequestOutput.num_cached_tokens``; ``stats``: the connector's store counters after the run;
``tiers``: each tier's counters).

Engine settings the tests rely on: prefix caching off (so a second run of a prompt can only get
its prefix from the connector), block size 32 (vLLM's CPU attention takes multiples of 32), the
engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so tests can read the
connector's counters, and kvstrata's shipped Qwen3 target (trained weights, so the tokens depend
on the K/V it attends over).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

BLOCK = 32


def model_dir() -> str:
    from kvstrata.assets import resolve_model
    return str(resolve_model("kvstrata-tiny-py/target"))


def make_llm(extra: dict, **overrides):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(kv_connector="KVStrataConnector",
                           kv_connector_module_path="kvstrata.integrations.vllm",
                           kv_role="kv_both", kv_load_failure_policy="recompute",
                           kv_connector_extra_config=extra)
    kw = dict(model=model_dir(), skip_tokenizer_init=True, dtype="float32", block_size=BLOCK,
              max_model_len=512, max_num_seqs=4, max_num_batched_tokens=512,
              enforce_eager=True, enable_prefix_caching=False, seed=0, kv_transfer_config=ktc)
    kw.update(overrides)
    return LLM(**kw)


def generate(llm, prompts: list[list[int]], salts: list[str | None] | None = None,
             max_tokens: int = 24) -> tuple[list[list[int]], list[int]]:
    from vllm import SamplingParams

    salts = salts or [None] * len(prompts)
    inputs = []
    for p, s in zip(prompts, salts):
        d = {"prompt_token_ids": list(p)}
        if s is not None:
            d["cache_salt"] = s
        inputs.append(d)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                        detokenize=False)
    outs = llm.generate(inputs, sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [int(o.num_cached_tokens or 0)
                                                          for o in outs]


def connector():
    """The worker-side connector of the engine in this process."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    return get_kv_transfer_group()


if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    llm = make_llm(args["extra"], **args.get("llm", {}))
    runs = []
    for _ in range(args.get("runs", 1)):
        tokens, cached = generate(llm, args["prompts"], args.get("salts"),
                                  args.get("max_tokens", 24))
        stats = connector().stats()
        runs.append({"tokens": tokens, "cached": cached, "stats": stats.pop("store"),
                     "tiers": stats})
    print(json.dumps({"runs": runs}), flush=True)
