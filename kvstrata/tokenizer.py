"""Byte-level tokenizer of the shipped kvstrata models (``kvstrata-tiny-py``).

Ids ``0..255`` are the bytes of the UTF-8 encoding, so any text round-trips and no vocabulary file
is needed. Four special ids follow the bytes:

=========  ===  ==============================================================
``BOS``    256  start of a document (training prepends it to every file)
``EOS``    257  end of a document
``PAD``    258  padding (never trained on)
``MASK``   259  the DFlash drafter's mask token (``dflash_config.mask_token_id``)
=========  ===  ==============================================================

The vocabulary is padded to :data:`VOCAB_SIZE` = 320 (a multiple of 64, friendly to GEMM tiles);
ids ``260..319`` are unused. :func:`decode` drops special and unused ids and decodes the bytes with
``errors="replace"``, so a model that stops mid-character still decodes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Protocol, Sequence

NUM_BYTES = 256
BOS = 256
EOS = 257
PAD = 258
MASK = 259
SPECIAL_TOKENS = {"<bos>": BOS, "<eos>": EOS, "<pad>": PAD, "<mask>": MASK}
VOCAB_SIZE = 320
NAME = "kvstrata-bytes-v1"


def encode(text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
    """``text`` -> token ids (its UTF-8 bytes), optionally wrapped in ``BOS``/``EOS``."""
    if not isinstance(text, str):
        raise ValueError(f"encode() takes a str, got {type(text).__name__}; "
                         "use encode_bytes() for bytes")
    return encode_bytes(text.encode("utf-8"), bos=bos, eos=eos)


def encode_bytes(data: bytes, *, bos: bool = False, eos: bool = False) -> list[int]:
    """Raw ``bytes`` -> token ids, optionally wrapped in ``BOS``/``EOS``."""
    ids = list(data)
    if bos:
        ids.insert(0, BOS)
    if eos:
        ids.append(EOS)
    return ids


def decode(ids: Iterable[int]) -> str:
    """Token ids -> text; special/unused ids are dropped, invalid UTF-8 becomes U+FFFD."""
    out = bytearray()
    for i in ids:
        i = int(i)
        if i < 0 or i >= VOCAB_SIZE:
            raise ValueError(f"token id {i} is outside the vocabulary [0, {VOCAB_SIZE})")
        if i < NUM_BYTES:
            out.append(i)
    return out.decode("utf-8", errors="replace")


#: Chat template of the shipped byte-level pair. The pair was trained on Python source only, so a
#: conversation is rendered as Python comments (``# role: text``), one line per message line,
#: and the assistant's turn starts on a fresh line after ``# assistant:``; anything the model
#: writes there is its answer. Documented in docs/serving.md.
BYTE_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% for line in m['content'].split('\\n') %}# {{ m['role'] }}: {{ line }}\n{% endfor %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}# assistant:\n{% endif %}")


class ByteTokenizer:
    """Object form of this module (the :class:`TextTokenizer` of the shipped pair)."""

    name = NAME
    vocab_size = VOCAB_SIZE
    bos_token_id = BOS
    eos_token_id = EOS
    pad_token_id = PAD
    mask_token_id = MASK

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        return encode(text, bos=bos, eos=eos)

    def decode(self, ids: Iterable[int]) -> str:
        return decode(ids)

    chat_template = BYTE_CHAT_TEMPLATE

    def apply_chat_template(self, messages: Sequence[dict]) -> str:
        return render_chat(self.chat_template, messages, bos_token="", eos_token="")

    def __repr__(self) -> str:
        return f"ByteTokenizer({NAME!r}, vocab_size={VOCAB_SIZE})"


class TextTokenizer(Protocol):
    """What the engine needs of a tokenizer (the byte tokenizer or a Hugging Face one)."""

    chat_template: str | None

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Iterable[int]) -> str: ...
    def apply_chat_template(self, messages: Sequence[dict]) -> str: ...


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` library (Rust, the reference
    implementation of every HF fast tokenizer), plus the ``chat_template`` of
    ``tokenizer_config.json`` (or ``chat_template.jinja``) rendered with Jinja2 in a sandbox."""

    def __init__(self, directory: str | os.PathLike):
        from tokenizers import Tokenizer
        d = Path(directory)
        self.path = d
        self._tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        cfg = _read_json(d / "tokenizer_config.json")
        tmpl = cfg.get("chat_template")
        if isinstance(tmpl, list):      # [{"name": "default", "template": ...}, ...]
            tmpl = next((t.get("template") for t in tmpl if t.get("name") == "default"), None)
        if tmpl is None and (d / "chat_template.jinja").is_file():
            tmpl = (d / "chat_template.jinja").read_text()
        self.chat_template: str | None = tmpl
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"encode() takes a str, got {type(text).__name__}")
        return list(self._tok.encode(text).ids)

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def apply_chat_template(self, messages: Sequence[dict]) -> str:
        if self.chat_template is None:
            raise ValueError(f"the tokenizer in {self.path} has no chat template; use "
                             "/v1/completions with a plain prompt")
        return render_chat(self.chat_template, messages, bos_token=self.bos_token or "",
                           eos_token=self.eos_token or "")

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


def _read_json(path: Path) -> dict:
    try:
        with open(path) as f:
            out = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not readable JSON ({e})") from None
    return out if isinstance(out, dict) else {}


def _token_text(tok: Any) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


def render_chat(template: str, messages: Sequence[dict], **extra: Any) -> str:
    """Render a Jinja2 chat template (sandboxed) with ``add_generation_prompt=True``.

    ``messages``: ``[{"role": str, "content": str}, ...]``; anything else is a ``ValueError``.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or \
                not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must be an object with string 'role' and 'content'")
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg):
        raise ValueError(f"chat template: {msg}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=list(messages),
                                                add_generation_prompt=True, **extra)
    except TemplateError as e:
        raise ValueError(f"chat template failed: {e}") from None


def load_tokenizer(directory: str | os.PathLike) -> TextTokenizer | None:
    """The tokenizer of a model directory: the shipped byte tokenizer (named in its
    ``tokenizer_config.json``), a Hugging Face ``tokenizer.json``, or ``None`` (token ids only)."""
    d = Path(directory)
    cfg = _read_json(d / "tokenizer_config.json")
    if cfg.get("tokenizer_class") == "kvstrata.tokenizer.ByteTokenizer" or cfg.get("name") == NAME:
        return ByteTokenizer()
    if (d / "tokenizer.json").is_file():
        return HFTokenizer(d)
    return None


def eos_token_ids(directory: str | os.PathLike) -> tuple[int, ...]:
    """End-of-sequence ids of a model directory: ``config.json``'s ``eos_token_id`` and
    ``generation_config.json``'s (each an int or a list), in that order, without repeats."""
    d = Path(directory)
    out: list[int] = []
    for name in ("config.json", "generation_config.json"):
        v = _read_json(d / name).get("eos_token_id")
        for t in (v if isinstance(v, list) else [v]):
            if isinstance(t, int) and not isinstance(t, bool) and t >= 0 and t not in out:
                out.append(t)
    return tuple(out)


class Detokenizer:
    """Incremental detokenization of one request's output.

    Text is emitted only once it is stable: a window of ids is decoded with the ids before it as
    context (so leading spaces of BPE / SentencePiece pieces survive), and a trailing U+FFFD (an
    incomplete UTF-8 sequence) is held back until the next id completes it or :meth:`flush`.

    With the byte tokenizer an ASCII id pushed while nothing is held back skips both decodes: a
    byte below 0x80 never continues a UTF-8 sequence, so for any bytes ``b`` and ASCII byte ``a``,
    ``(b + a).decode(errors="replace") == b.decode(errors="replace") + chr(a)`` and the window
    decode would emit exactly ``chr(a)`` (tests/runtime/test_output_text.py pins the two paths
    to each other). Every other id takes the window decode.
    """

    def __init__(self, tokenizer: TextTokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self._prefix = 0       # ids[_prefix:_read] decode to text already emitted
        self._read = 0
        self._ascii = type(tokenizer) is ByteTokenizer   # the fast path above applies

    def push(self, token_id: int) -> str:
        """Add one id; return the newly stable text (often ``""`` mid-character)."""
        token_id = int(token_id)
        if self._ascii and 0 <= token_id < 0x80 and self._read == len(self.ids):
            self.ids.append(token_id)
            self._prefix, self._read = self._read, self._read + 1
            return chr(token_id)
        self.ids.append(token_id)
        before = self.tok.decode(self.ids[self._prefix:self._read])
        now = self.tok.decode(self.ids[self._prefix:])
        if now.endswith("\ufffd") or len(now) < len(before):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return now[len(before):]

    def extend(self, token_ids: Sequence[int]) -> str:
        """Add several ids; return what :meth:`push` would return for each, joined. With the
        byte tokenizer, ASCII ids and nothing held back (a step of ASCII text, the common case),
        that is one ``bytes`` call."""
        # A list only: ``bytes()`` of an array would copy its buffer, not its values.
        if self._ascii and self._read == len(self.ids) and isinstance(token_ids, list):
            try:
                data = bytes(token_ids)
            except (TypeError, ValueError):      # an id outside 0..255 (or not an int)
                data = None
            if data is not None and data.isascii():
                if data:
                    self.ids += data
                    self._prefix, self._read = len(self.ids) - 1, len(self.ids)
                return data.decode("ascii")
        return "".join([self.push(t) for t in token_ids])

    def flush(self) -> str:
        """The held-back tail (decoded with replacement characters)."""
        if self._read == len(self.ids):
            return ""
        before = self.tok.decode(self.ids[self._prefix:self._read])
        now = self.tok.decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return now[len(before):]


def tokenizer_config() -> dict:
    """The ``tokenizer_config.json`` written next to a model trained with this tokenizer."""
    return {"tokenizer_class": "kvstrata.tokenizer.ByteTokenizer", "name": NAME,
            "vocab_size": VOCAB_SIZE, "bos_token_id": BOS, "eos_token_id": EOS,
            "pad_token_id": PAD, "mask_token_id": MASK}


__all__ = ["BOS", "BYTE_CHAT_TEMPLATE", "EOS", "MASK", "NAME", "NUM_BYTES", "PAD",
           "SPECIAL_TOKENS", "VOCAB_SIZE", "ByteTokenizer", "Detokenizer", "HFTokenizer",
           "TextTokenizer", "decode", "encode", "encode_bytes", "eos_token_ids", "load_tokenizer",
           "render_chat", "tokenizer_config"]
