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

from typing import Iterable

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


class ByteTokenizer:
    """Object form of this module (for code that expects a tokenizer instance)."""

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

    def __repr__(self) -> str:
        return f"ByteTokenizer({NAME!r}, vocab_size={VOCAB_SIZE})"


def tokenizer_config() -> dict:
    """The ``tokenizer_config.json`` written next to a model trained with this tokenizer."""
    return {"tokenizer_class": "kvstrata.tokenizer.ByteTokenizer", "name": NAME,
            "vocab_size": VOCAB_SIZE, "bos_token_id": BOS, "eos_token_id": EOS,
            "pad_token_id": PAD, "mask_token_id": MASK}


__all__ = ["BOS", "EOS", "MASK", "NAME", "NUM_BYTES", "PAD", "SPECIAL_TOKENS", "VOCAB_SIZE",
           "ByteTokenizer", "decode", "encode", "encode_bytes", "tokenizer_config"]
