"""Output text: the fast paths of :class:`Detokenizer` (ASCII bytes without a decode, a step's ids
at once) and of :meth:`Request.append` (a step's tokens at once, stop strings searched in a
window) against the token-by-token originals kept here as references. Same tokens, text, streamed
deltas, stop cut, finish reason and return values, for the byte tokenizer and a Hugging Face one:
partial, invalid and multi-byte UTF-8 split across tokens, special ids, stop strings across
token boundaries, ``min_tokens``."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstrata.runtime.sampling import SamplingParams
from kvstrata.runtime.scheduler import DECODE, DONE, Request
from kvstrata.tokenizer import EOS, ByteTokenizer, Detokenizer, HFTokenizer, encode


# -- references: the token-by-token code the fast paths replace --------------------------------
def window_decoder(tok) -> Detokenizer:
    """The original :class:`Detokenizer`: its window decode, two decodes per id, for every id
    (the ASCII fast path off; :meth:`Detokenizer.extend` then pushes one by one)."""
    d = Detokenizer(tok)
    d._ascii = False
    return d


class RefRequest:
    """The original :meth:`Request.append`: push, then stop id, then the whole text searched."""

    def __init__(self, prompt, params, max_length, stop_ids, detok):
        self.prompt, self.params, self.max_length = prompt, params, max_length
        self.stop_ids, self.detok = stop_ids, detok
        self.tokens, self.text, self.state, self.finish_reason = list(prompt), "", DECODE, None

    def append(self, new):
        sp = self.params
        for j, t in enumerate(new):
            self.tokens.append(t)
            before = len(self.text)
            if self.detok is not None:
                self.text += self.detok.push(t)
            g = len(self.tokens) - len(self.prompt)
            if t in self.stop_ids and g > sp.min_tokens:
                self.finish("stop")
                return j + 1
            if sp.stop and g >= sp.min_tokens and self._cut_stop_string(before):
                self.finish("stop")
                return j + 1
        if len(self.tokens) >= self.max_length:
            self.finish("length")
        return len(new)

    def _cut_stop_string(self, before):
        cut = [i for i in (self.text.find(s, max(0, before - len(s) + 1))
                           for s in self.params.stop) if i >= 0]
        if not cut:
            return False
        self.text = self.text[:min(cut)]
        return True

    def finish(self, reason):
        if self.detok is not None and reason != "stop":
            self.text += self.detok.flush()
        self.state, self.finish_reason = DONE, reason


# -- token streams ------------------------------------------------------------------------------
# Byte tokenizer: mostly ASCII (the fast path), with every multi-byte length, stray and truncated
# UTF-8, and special / unused ids (dropped by the decode) mixed in.
_PIECES = ["a", "b", " ", "\n", "ab", "é", "€", "😀", "\x00", "\x7f"]
byte_piece = st.one_of(
    st.sampled_from(_PIECES).map(encode),
    st.lists(st.integers(0, 255), min_size=1, max_size=3),            # any bytes at all
    st.sampled_from([[0xE2, 0x82], [0xF0, 0x9F], [0xC3], [0x80], [0xFF], [0xE0, 0x80]]),
    st.lists(st.integers(256, 319), min_size=1, max_size=2))          # BOS, EOS, PAD, MASK, unused
byte_tokens = st.lists(byte_piece, max_size=30).map(lambda ps: [t for p in ps for t in p])


def _chunks(data, tokens):
    """``tokens`` cut where a step would cut them (accepted blocks of 1..6)."""
    out, i = [], 0
    while i < len(tokens):
        n = data.draw(st.integers(1, 6))
        out.append(tokens[i:i + n])
        i += n
    return out


def _check_detokenizer(tok, tokens, data):
    fast, ref = Detokenizer(tok), window_decoder(tok)
    for chunk in _chunks(data, tokens):
        if data.draw(st.booleans()):
            assert fast.extend(chunk) == "".join(ref.push(t) for t in chunk)
        else:
            assert [fast.push(t) for t in chunk] == [ref.push(t) for t in chunk]
        assert (fast.ids, fast._prefix, fast._read) == (ref.ids, ref._prefix, ref._read)
    assert fast.flush() == ref.flush()


@given(byte_tokens, st.data())
def test_byte_detokenizer_equals_the_window_decode(tokens, data):
    _check_detokenizer(ByteTokenizer(), tokens, data)


def test_ascii_fast_path_after_held_back_and_invalid_bytes():
    # The cases the fast path must leave to the window decode, written out.
    d, ref = Detokenizer(ByteTokenizer()), window_decoder(ByteTokenizer())
    for t in [0xE2, 0x41, 0xE2, 0x82, 0x41, 0xC3, EOS, 0xA9, 0x80, 0x41, 0x42, 0xF0, 0x9F]:
        assert d.push(t) == ref.push(t)
    tail = [0x98, 0x80, 0x41]
    assert d.extend(tail) == "".join(ref.push(t) for t in tail) == "😀A"
    assert d.flush() == ref.flush() == ""
    assert d.extend([]) == "" and d.extend([0x61, 0x62]) == "ab" and d.ids[-2:] == [0x61, 0x62]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        d.extend([0x61, 400])


# -- requests ---------------------------------------------------------------------------------
_STOP_ALPHABET = "ab é€"


@st.composite
def request_case(draw, tokens=byte_tokens):
    """Sampling params whose stop strings and ids actually occur in ``tokens``."""
    stop = tuple(draw(st.lists(st.text(_STOP_ALPHABET, min_size=1, max_size=3), max_size=2)))
    stop_ids = frozenset(draw(st.lists(st.sampled_from([ord("a"), ord(" "), 0xE2, EOS]),
                                       max_size=2)))
    max_tokens = draw(st.integers(1, 60))
    sp = SamplingParams(max_tokens=max_tokens, stop=stop, stop_token_ids=tuple(stop_ids),
                        min_tokens=draw(st.integers(0, min(max_tokens, 8))))
    return sp, stop_ids, draw(tokens)


def _check_requests(tok, sp, stop_ids, tokens, data):
    prompt = [1, 2, 3]
    kw = dict(prompt=prompt, params=sp, max_length=len(prompt) + sp.max_tokens, stop_ids=stop_ids)
    fast = Request(request_id="r", tokens=list(prompt), state=DECODE, detok=Detokenizer(tok), **kw)
    ref = RefRequest(detok=window_decoder(tok), **kw)
    sent, deltas, ref_deltas = 0, [], []
    for chunk in _chunks(data, tokens):
        if ref.state == DONE:
            break
        assert fast.append(chunk) == ref.append(chunk)
        assert (fast.tokens, fast.state, fast.finish_reason) == \
            (ref.tokens, ref.state, ref.finish_reason)
        if data.draw(st.booleans()):          # a stream reads the text after some steps only
            deltas.append(fast.text[sent:])
            ref_deltas.append(ref.text[sent:])
            sent = len(ref.text)
    if ref.state != DONE:
        fast.finish("abort")
        ref.finish("abort")
    assert deltas == ref_deltas and fast.text == ref.text
    assert fast.finish_reason == ref.finish_reason


@given(request_case(), st.data())
def test_byte_request_append_equals_token_by_token(case, data):
    _check_requests(ByteTokenizer(), *case, data)


def test_stop_string_across_tokens_after_min_tokens():
    tok = ByteTokenizer()
    for stop, min_tokens, want in [("€x", 0, "a"), ("€x", 5, "a"), ("€x", 6, "a€x")]:
        sp = SamplingParams(max_tokens=40, stop=(stop,), min_tokens=min_tokens)
        r = Request(request_id="r", prompt=[1], params=sp, max_length=41, tokens=[1],
                    state=DECODE, detok=Detokenizer(tok))
        ids = encode("a€x€x!")
        n = sum(r.append(ids[i:i + 2]) for i in range(0, len(ids), 2) if r.state != DONE)
        assert (r.text, r.finish_reason) == (want, "stop")
        assert n == {0: 5, 5: 5, 6: 9}[min_tokens]


@pytest.mark.parametrize("stop", [(), ("zz",)])
def test_stop_id_ends_only_past_min_tokens(stop):
    # Both paths (at once; token by token for stop strings): a stop id at generated token number
    # ``min_tokens`` is a plain token, at ``min_tokens + 1`` it ends the request.
    sp = SamplingParams(max_tokens=20, stop=stop, stop_token_ids=(7,), min_tokens=3)
    r = Request(request_id="r", prompt=[1], params=sp, max_length=21, tokens=[1], state=DECODE,
                stop_ids=frozenset({7}), detok=Detokenizer(ByteTokenizer()))
    assert r.append([97, 98, 7]) == 3 and r.state == DECODE
    assert r.append([7, 99]) == 1 and (r.finish_reason, r.text) == ("stop", "ab\x07\x07")


# -- a Hugging Face tokenizer (byte-level BPE, trained here) ------------------------------------
@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["ab é€ ab a b éé €€ 😀 abab", "def f(x):\n    return x"] * 4,
                            trainer)
    d = tmp_path_factory.mktemp("hf-tok")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return HFTokenizer(d)


def _hf_tokens(tok):
    n = tok.vocab_size
    return st.lists(st.one_of(st.integers(0, n - 1), st.sampled_from(_PIECES).map(tok.encode)
                              .map(lambda ids: ids[0] if ids else 0)), max_size=40)


@given(data=st.data())
def test_hf_detokenizer_equals_the_window_decode(hf_tokenizer, data):
    _check_detokenizer(hf_tokenizer, data.draw(_hf_tokens(hf_tokenizer)), data)


@given(data=st.data())
def test_hf_request_append_equals_token_by_token(hf_tokenizer, data):
    _check_requests(hf_tokenizer, *data.draw(request_case(_hf_tokens(hf_tokenizer))), data)
