"""A server with a disk tier, stopped with SIGINT and started again: the second process serves the
prompt's prefix from the disk tier (written down on shutdown) and answers exactly as the first."""

from __future__ import annotations

import openai

from serverproc import API_KEY, MODEL, metrics, start_server

PROMPT = ("import os\nimport sys\n\n\ndef main(argv=None):\n"
          "    parser = argparse.ArgumentParser()\n")           # 83 tokens: 5 full pages
ARGS = ["--max-seq-len", "256", "--max-batch-size", "4", "--target-codec", "identity",
        "--draft-codec", "identity", "--host-tier-bytes", "16M"]


def _serve_once(tmp_path, disk) -> tuple[str, int, dict]:
    srv = start_server(tmp_path, [*ARGS, "--disk-tier", str(disk)],
                       env={"KVSTRATA_API_KEY": API_KEY})
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=API_KEY, max_retries=0,
                               timeout=60)
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
        return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens, metrics(srv)
    except BaseException:
        print(srv.log.read_text()[-8000:])
        raise
    finally:
        assert srv.stop() == 0, srv.log.read_text()


def test_restart_reuses_the_disk_tier(tmp_path):
    disk = tmp_path / "disk"
    text1, cached1, _ = _serve_once(tmp_path, disk)
    text2, cached2, m = _serve_once(tmp_path, disk)
    assert cached1 == 0
    assert cached2 == 80                      # 5 full pages; the last prompt token is recomputed
    assert text2 == text1
    assert sum(v for k, v in m.items() if k.startswith("kvstrata_prefix_cached_tokens_total")
               and 'tier="device"' not in k) == 80
    assert m['kvstrata_tier_pages{tier="disk"}'] >= 5
