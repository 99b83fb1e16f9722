"""Preemption through the server: a pool far smaller than ``max_batch_size x max_seq_len``.

Eight long requests at once need ~120 pages; the pool has 40 (one ``max_seq_len`` sequence needs
16). The engine preempts under pressure (pages demoted to the host tier) and resumes later; every
answer must equal an undisturbed offline run, the preemptions must show in ``/metrics``, and the
pool must be empty of requests afterwards.
"""

from __future__ import annotations

import asyncio

import openai
import torch

from serverproc import API_KEY, MODEL, metrics, start_server, wait_idle
from kvstrata.assets.corpus import heldout_prompts
from kvstrata.runtime import LLM, CacheConfig, SamplingParams
from kvstrata.tokenizer import decode

MAX_SEQ_LEN, BATCH, POOL_PAGES, MAX_TOKENS, PROMPT_LEN = 256, 8, 40, 150, 96


def test_preemption_gives_undisturbed_answers(tmp_path):
    prompts = heldout_prompts(BATCH, PROMPT_LEN, seed=3)      # byte token ids
    threads = torch.get_num_threads()
    try:
        with LLM(MODEL, MODEL, CacheConfig(max_batch_size=BATCH, max_seq_len=MAX_SEQ_LEN,
                                           target_codec="identity", draft_codec="identity"),
                 device="cpu", num_threads=1) as llm:
            want = [o.token_ids for o in
                    llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))]
            page_bytes = llm.plan.bytes_per_page
    finally:
        torch.set_num_threads(threads)
    srv = start_server(tmp_path, [
        "--max-seq-len", str(MAX_SEQ_LEN), "--max-batch-size", str(BATCH),
        "--kv-cache-bytes", str(POOL_PAGES * page_bytes), "--host-tier-bytes", "64M",
        "--target-codec", "identity", "--draft-codec", "identity"],
        env={"KVSTRATA_API_KEY": API_KEY})
    try:
        m0 = metrics(srv)
        assert m0["kvstrata_pool_capacity_pages"] == POOL_PAGES
        client = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key=API_KEY, max_retries=0,
                                    timeout=300)

        async def main():
            try:
                return await asyncio.wait_for(asyncio.gather(*(
                    client.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS,
                                              temperature=0) for p in prompts)), timeout=300)
            finally:
                await client.close()

        got = asyncio.run(main())
        for w, r in zip(want, got):
            assert r.choices[0].text == decode(w)
            assert r.usage.completion_tokens == len(w)
        m = wait_idle(srv)
        assert m["kvstrata_engine_preemptions_total"] > 0
        assert m['kvstrata_tier_demoted_pages_total{tier="host"}'] > 0
        assert m['kvstrata_pool_pages{state="in_use"}'] == 0
    except BaseException:
        print(srv.log.read_text()[-8000:])
        raise
    finally:
        assert srv.stop() == 0
