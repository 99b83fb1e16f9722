"""A Hugging Face style model directory through the server: ``tokenizer.json`` (byte-level BPE,
trained here with the ``tokenizers`` library) and a ChatML chat template in
``tokenizer_config.json``, as Qwen3 checkpoints ship them, over a tiny random Qwen3 target and
DFlash drafter. Chat goes through that template; text made of multi-token characters streams
back exactly as the offline engine decodes it (a random target writes partial and invalid
UTF-8)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import openai
import pytest

from serverproc import API_KEY, start_server

pytest.importorskip("transformers")
pytest.importorskip("dflash.model")
pytest.importorskip("tokenizers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
import tiny_dflash as td  # noqa: E402

from kvstrata.runtime import LLM, CacheConfig, SamplingParams  # noqa: E402

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _write_tokenizer(d: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # 256 byte symbols + 3 specials + a few merges: every id stays below the model's vocabulary.
    trainer = trainers.BpeTrainer(vocab_size=td.VOCAB - 4, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = Path(td.__file__).read_text().splitlines() * 4
    tok.train_from_iterator(corpus, trainer)
    assert tok.get_vocab_size() < td.MASK
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None}))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    target, drafter = root / "tiny-qwen3", root / "tiny-dflash"
    td.make_target(target)            # random: its output is byte soup, partial characters included
    td.make_drafter(drafter)
    _write_tokenizer(target)
    return target, drafter


def test_hf_tokenizer_chat_template_and_streaming(model_dirs, tmp_path):
    target, drafter = model_dirs
    msgs = [{"role": "system", "content": "Réponds en français."},
            {"role": "user", "content": "naïve café — ünïcödé ✓"}]
    prompt = "def naïve_café(ü):  # ✓\n"
    cache = dict(max_batch_size=4, max_seq_len=128, target_codec="identity",
                 draft_codec="identity")
    with LLM(str(target), str(drafter), CacheConfig(**cache), device="cpu", num_threads=1) as llm:
        chat_prompt = llm.tokenizer.apply_chat_template(msgs)
        assert chat_prompt.endswith("<|im_start|>assistant\n")
        want_chat, want = llm.generate([chat_prompt, prompt], SamplingParams(max_tokens=24))

    srv = start_server(tmp_path, ["--max-seq-len", "128", "--max-batch-size", "4",
                                  "--target-codec", "identity", "--draft-codec", "identity"],
                       env={"KVSTRATA_API_KEY": API_KEY}, target=str(target),
                       drafter=str(drafter))
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=API_KEY, max_retries=0,
                               timeout=60)
        model = client.models.list().data[0].id
        assert model == "tiny-qwen3"
        r = client.chat.completions.create(model=model, messages=msgs, max_tokens=24,
                                           temperature=0)
        assert r.choices[0].message.content == want_chat.text
        assert r.usage.prompt_tokens == len(want_chat.prompt_token_ids)
        assert r.usage.completion_tokens == len(want_chat.token_ids)
        parts = [c.choices[0].text for c in client.completions.create(
            model=model, prompt=prompt, max_tokens=24, temperature=0, stream=True)]
        # A random model writes byte soup (bytes of partial and invalid UTF-8): the chunks,
        # joined, are exactly the offline engine's text.
        assert len(parts) > 4 and "".join(parts) == want.text
    except BaseException:
        print(srv.log.read_text()[-8000:])
        raise
    finally:
        assert srv.stop() == 0
