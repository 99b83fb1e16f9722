"""Prefix hashing: determinism across processes, sensitivity to tokens, boundaries, namespace."""

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvstrata.pagepool import (LAYOUT_VERSION, KVGroupSpec, Namespace, hash_page,
                               namespace_differences, page_hashes, tokens_to_bytes)

G = (KVGroupSpec("target", 2, 2, 64, "bf16", "nvfp4"), KVGroupSpec("draft", 1, 2, 64, "bf16", "lossless"))
NS = Namespace("qwen3-tiny@1", G, 4, drafter="dflash-tiny@1")
tokens_st = st.lists(st.integers(0, 2**31), min_size=0, max_size=40)


def test_known_vector_is_stable():
    # Pinned: changing the hash scheme or namespace encoding must be a deliberate, versioned change.
    assert NS.digest.hex() == PINNED_DIGEST
    assert page_hashes(NS, list(range(8)))[1].hex() == PINNED_PAGE1


# Computed once when the scheme was fixed (layout version 1); a change here invalidates every
# stored page, so it must come with a LAYOUT_VERSION bump.
PINNED_DIGEST = "658b666143a7b1dc94bee670fe19226c"
PINNED_PAGE1 = "ab396d22e24200cb29c9d32d226b5731"


def test_deterministic_across_processes():
    code = (
        "from kvstrata.pagepool import KVGroupSpec, Namespace, page_hashes\n"
        "G=(KVGroupSpec('target',2,2,64,'bf16','nvfp4'),KVGroupSpec('draft',1,2,64,'bf16','lossless'))\n"
        "ns=Namespace('qwen3-tiny@1',G,4,drafter='dflash-tiny@1',cache_salt='s')\n"
        "print(' '.join(h.hex() for h in page_hashes(ns, list(range(0, 170, 7)))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PATH": ""}).stdout.split()
    here = [h.hex() for h in page_hashes(NS.with_salt("s"), list(range(0, 170, 7)))]
    assert out == here and len(out) == 6


@given(tokens_st)
def test_only_full_pages_and_chain(tokens):
    hs = page_hashes(NS, tokens)
    assert len(hs) == len(tokens) // 4
    parent = NS.digest
    for i, h in enumerate(hs):
        assert len(h) == 16
        assert h == hash_page(parent, tokens[4 * i:4 * i + 4])
        parent = h
    # incremental hashing from a page boundary gives the same chain
    if len(hs) >= 2:
        assert page_hashes(NS, tokens, start_page=1, parent=hs[0]) == hs[1:]


@given(st.lists(st.integers(0, 2**63 - 1), max_size=40))
def test_token_bytes_of_lists_are_numpys_little_endian_int64(tokens):
    # Lists and tuples of ints take the ``array`` path; arrays keep numpy's: same bytes.
    want = np.asarray(tokens, dtype="<i8").tobytes()
    assert tokens_to_bytes(tokens) == tokens_to_bytes(tuple(tokens)) == want
    assert tokens_to_bytes(np.asarray(tokens, dtype=np.int64)) == want


def test_token_bytes_of_odd_lists_behave_as_numpy_did():
    want = np.asarray([1, 2, 1], dtype="<i8").tobytes()
    assert tokens_to_bytes([np.int64(1), np.int32(2), True]) == want
    assert tokens_to_bytes([1.0, 2.0, 1.5]) == want            # numpy truncates floats
    for bad in ([3, -2], np.array([3, -2])):
        with pytest.raises(ValueError, match="non-negative, got -2"):
            tokens_to_bytes(bad)
    with pytest.raises(OverflowError):
        tokens_to_bytes([2**63])


@given(st.lists(st.integers(0, 1000), min_size=4, max_size=24), st.data())
def test_every_token_matters(tokens, data):
    i = data.draw(st.integers(0, len(tokens) - 1))
    other = list(tokens)
    other[i] = tokens[i] + data.draw(st.integers(1, 5))
    a, b = page_hashes(NS, tokens), page_hashes(NS, other)
    page = i // 4
    assert a[:page] == b[:page]
    assert all(x != y for x, y in zip(a[page:], b[page:]))   # the change propagates down the chain


def test_page_boundaries_matter():
    # the same 8 tokens split into pages of 4 vs 8 are different namespaces, and a token moving
    # across a boundary changes both pages
    ns8 = dataclasses.replace(NS, page_size=8)
    assert page_hashes(NS, list(range(8)))[-1] != page_hashes(ns8, list(range(8)))[-1]
    assert hash_page(NS.digest, [1, 2, 3, 4]) != hash_page(NS.digest, [1, 2, 3, 4 << 32])


@pytest.mark.parametrize("change", [
    dict(target="qwen3-tiny@2"), dict(drafter="none"), dict(page_size=8),
    dict(layout_version=LAYOUT_VERSION + 1), dict(cache_salt="tenant"), dict(cache_salt=""),
    dict(groups=(G[0],)), dict(groups=(G[1], G[0])),
    dict(groups=(dataclasses.replace(G[0], num_layers=3), G[1])),
    dict(groups=(dataclasses.replace(G[0], num_kv_heads=1), G[1])),
    dict(groups=(dataclasses.replace(G[0], head_dim=128), G[1])),
    dict(groups=(dataclasses.replace(G[0], dtype=torch.float16), G[1])),
    dict(groups=(dataclasses.replace(G[0], name="tgt"), G[1])),
])
def test_every_namespace_field_matters(change):
    other = dataclasses.replace(NS, **change)
    assert other.digest != NS.digest
    assert not set(page_hashes(other, list(range(16)))) & set(page_hashes(NS, list(range(16))))


def _differences(a: Namespace, b: Namespace) -> list[str]:
    return namespace_differences(a.shared_fields(), b.shared_fields(), "here", "there")


def test_namespace_differences_name_each_field_but_the_salt():
    assert _differences(NS, NS.with_salt("tenant")) == []      # a request's salt is not shared
    other = dataclasses.replace(NS, target="qwen3-tiny@2", page_size=8,
                                groups=(dataclasses.replace(G[0], num_layers=3), G[1]))
    assert _differences(NS, other) == [
        "page_size: 4 at here vs 8 at there",
        "target: 'qwen3-tiny@1' at here vs 'qwen3-tiny@2' at there",
        "groups: [['target', 2, 2, 64, 'bfloat16'], ['draft', 1, 2, 64, 'bfloat16']] at here vs "
        "[['target', 3, 2, 64, 'bfloat16'], ['draft', 1, 2, 64, 'bfloat16']] at there"]
    assert _differences(dataclasses.replace(NS, drafter="none"), NS) == [
        "drafter: here has no drafter ('none' at here vs 'dflash-tiny@1' at there); the draft "
        "KV cannot be shared"]


def test_codec_choice_does_not_change_namespace():
    # The device bytes do not depend on the cold-page codec; stored pages carry their codec id.
    other = dataclasses.replace(NS, groups=(dataclasses.replace(G[0], codec="identity"), G[1]))
    assert other.digest == NS.digest


@given(st.text(min_size=1, max_size=8), st.text(min_size=1, max_size=8))
def test_length_prefixing_prevents_field_shifts(a, b):
    # moving characters between adjacent fields ("ab"|"c" vs "a"|"bc") never collides
    x = Namespace(a + b, G, 4, drafter=b)
    y = Namespace(a, G, 4, drafter=b + b)
    assert x.digest != y.digest


def test_namespace_validation():
    with pytest.raises(ValueError, match="fingerprint"):
        Namespace("", G, 4)
    with pytest.raises(ValueError, match="cache_salt"):
        Namespace("m", G, 4, cache_salt=3)
    with pytest.raises(ValueError, match="1-D"):
        page_hashes(NS, [[1, 2]])
