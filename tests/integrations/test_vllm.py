"""KVStrataConnector inside vLLM's real CPU engine (offline ``LLM.generate``).

One engine per module (start-up is the expensive part); each test uses its own prompt so the
pages of one test never serve another. Prompts are 100 tokens: a hit covers
``(100 - 1) // 32 = 3`` blocks = 96 tokens, and vLLM computes the last 4.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from integrations_util import require

require("vllm")

from vllm_run import BLOCK, connector, generate, make_llm  # noqa: E402

from kvstrata.assets.corpus import heldout_prompts  # noqa: E402
from kvstrata.pagepool import PageInfo, page_hashes  # noqa: E402
from kvstrata.pagepool.view import PAGE_MAJOR, GroupView, PoolView  # noqa: E402

HERE = Path(__file__).resolve().parent
PROMPT_LEN = 100
HIT = (PROMPT_LEN - 1) // BLOCK * BLOCK


_PROMPTS = heldout_prompts(6, PROMPT_LEN, seed=16)   # [4] continues with spaces only: unused


def prompt(i: int) -> list[int]:
    """Held-out Python source the test model was trained to continue (its tokens then depend on
    what it attends over, unlike on random ids, where it mostly emits spaces)."""
    return list(_PROMPTS[i])


@pytest.fixture(scope="module")
def disk(tmp_path_factory):
    return tmp_path_factory.mktemp("kvstrata-vllm-disk")


@pytest.fixture(scope="module")
def llm(disk):
    engine = make_llm({"disk_path": str(disk), "disk_bytes": 64 << 20})
    yield engine
    connector().shutdown()


def counters() -> dict:
    return dict(connector().stats()["store"])


def delta(before: dict) -> dict:
    now = counters()
    return {k: now[k] - before[k] for k in now if now[k] != before[k]}


def test_second_run_loads_the_prefix_and_generates_the_same_tokens(llm):
    p = prompt(1)
    before = counters()
    cold, cached = generate(llm, [p])
    assert cached == [0]
    d = delta(before)
    # 100 prompt tokens + 23 computed outputs (the 24th is sampled, never computed): 3 full blocks
    assert d["saved_pages"] == 3 and d.get("loaded_pages", 0) == 0

    before = counters()
    warm, cached = generate(llm, [p])
    assert cached == [HIT]                   # vLLM's own counter: 96 tokens came from kvstrata
    assert warm == cold                      # lossless codec: the same greedy tokens
    d = delta(before)
    assert d["loaded_pages"] == 3 and d.get("corrupt_records", 0) == 0


def test_another_cache_salt_gets_no_hit(llm):
    p = prompt(2)
    cold, _ = generate(llm, [p], ["tenant-a"])
    _, cached = generate(llm, [p], ["tenant-a"])
    assert cached == [HIT]
    before = counters()
    other, cached = generate(llm, [p], ["tenant-b"])
    assert cached == [0] and delta(before).get("loaded_pages", 0) == 0
    assert other == cold                     # same model: the salt changes reuse, not tokens


def test_loaded_kv_decides_the_tokens(llm):
    """The test model's tokens depend on the K/V it loads: zero K/V under valid records (right
    hashes, right CRCs) changes them. (vLLM's dummy weights would not notice.)"""
    p = prompt(3)
    cold, _ = generate(llm, [p])
    store = connector().store
    ns = connector().namespace
    hashes = page_hashes(ns, p[:HIT])
    infos = [PageInfo(i, h, hashes[i - 1] if i else ns.digest, tuple(p[i * BLOCK:(i + 1) * BLOCK]))
             for i, h in enumerate(hashes)]
    assert store.tiers[0].delete(hashes) == 3      # a tier keeps a record it already holds
    spec = store.specs[0]
    zeros = torch.zeros((len(infos), *spec.page_shape(BLOCK)), dtype=spec.dtype)
    view = PoolView((GroupView(spec, PAGE_MAJOR, (zeros,)),), len(infos), BLOCK)
    assert store.save(view, range(len(infos)), infos) == [True] * 3
    zeroed, cached = generate(llm, [p])
    assert cached == [HIT]
    assert zeroed != cold


def _flip_payload_byte(disk: Path, pos: int = 1000) -> None:
    """Flip one byte in the newest segment file (payload bytes of the latest records)."""
    segs = sorted((disk / "segments").glob("*.seg"), key=lambda f: f.stat().st_mtime_ns)
    f = segs[-1]
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.seek(size - pos)
        b = fh.read(1)
        fh.seek(size - pos)
        fh.write(bytes([b[0] ^ 0x40]))


def test_a_flipped_byte_is_a_failed_load_then_a_recompute(llm, disk):
    p = prompt(0)
    cold, _ = generate(llm, [p])
    # the newest payload bytes belong to this prompt's last block (its records were the last
    # ones written)
    _flip_payload_byte(disk)
    before = counters()
    again, _ = generate(llm, [p])
    assert again == cold                     # recomputed, correct tokens
    d = delta(before)
    assert d["corrupt_records"] == 1         # counted, never used
    assert d.get("loaded_pages", 0) == 2     # the two good blocks before it were loaded
    # the recomputed block was saved again: the next run hits all three
    before = counters()
    third, cached = generate(llm, [p])
    assert third == cold and cached == [HIT]
    assert delta(before)["loaded_pages"] == 3


def run_new_process(extra: dict, prompts: list[list[int]], runs: int = 1, **more) -> list[dict]:
    args = {"extra": extra, "prompts": prompts, "runs": runs, **more}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH",
                                                                                  "")]))
    out = subprocess.run([sys.executable, str(HERE / "vllm_run.py"), json.dumps(args)],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["runs"]


def test_a_new_process_reads_the_disk_tier(llm, disk):
    p = prompt(5)
    cold, _ = generate(llm, [p])
    # this engine holds the disk tier for writing: the new process opens it read-only
    (res,) = run_new_process({"disk_path": str(disk), "disk_bytes": 64 << 20}, [p])
    assert res["cached"] == [HIT]
    assert res["tokens"] == cold
    assert res["stats"]["loaded_pages"] == 3 and res["stats"]["corrupt_records"] == 0


def test_nvfp4_pages(tmp_path, llm):
    """``codec: nvfp4`` in another process (its own disk tier): the K/V pages are stored 7x
    smaller than fp32 and a second run loads them; the tokens may differ from the lossless run
    (NVFP4 is lossy), so only the hit and the record sizes are asserted."""
    p = prompt(1)
    first, second = run_new_process({"disk_path": str(tmp_path / "nv"), "disk_bytes": 64 << 20,
                                     "codec": "nvfp4"}, [p], runs=2)
    assert first["cached"] == [0] and second["cached"] == [HIT]
    assert second["stats"]["loaded_pages"] == 3
    spec = connector().store.specs[0]       # the same model: the same page shape, fp32
    raw = spec.bytes_per_page(BLOCK)
    per_page = first["stats"]["saved_bytes"] / first["stats"]["saved_pages"]
    # 4 bits per value + an E4M3 scale per 16 values + the header: ~4.6 bits instead of 32
    assert raw / 7.5 < per_page < raw / 6.5, (raw, per_page)


def test_preempted_requests_resume_from_their_saved_blocks(tmp_path, llm):
    """Eight 32-token blocks for three requests that grow to 99 tokens: vLLM preempts. The full
    blocks a preempted request had were saved in the steps that filled them, so when it resumes
    its prefix comes back from kvstrata's host tier (the new process's tiers start empty and the
    prompts share no block: every load is a resumption), and its tokens equal an undisturbed
    run's."""
    prompts = [prompt(i)[:40] for i in (0, 1, 5)]
    alone = [generate(llm, [p], ["preempt"], max_tokens=60)[0][0] for p in prompts]
    (res,) = run_new_process({"host_bytes": 8 << 20, "disk_path": str(tmp_path / "pre"),
                              "disk_bytes": 64 << 20},
                             prompts, salts=["preempt"] * 3, max_tokens=60,
                             llm={"num_gpu_blocks_override": 8, "max_model_len": 224,
                                  "max_num_seqs": 3})
    assert res["tokens"] == alone
    assert res["stats"]["loaded_pages"] > 0 and res["stats"]["corrupt_records"] == 0
    # the host tier (in front of disk) served them
    assert res["tiers"]["host"]["hits"] == res["stats"]["loaded_pages"]
    assert res["tiers"]["disk"]["hits"] == 0
