"""`kvstrata inspect`: summary, list, page, verify (exit 1 naming bad pages), JSON, live writer."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch

from kvstrata.cli.main import main
from kvstrata.pagepool import KVCacheManager, KVGroupSpec, Namespace, PagePool, page_hashes
from kvstrata.tiers import DiskTier, TierManager

P = 4


def _fill(path, codecs=("nvfp4", "lossless"), n_prompts=3, pages=2, keep_open=False):
    groups = [KVGroupSpec("target", 2, 1, 16, torch.bfloat16, codecs[0]),
              KVGroupSpec("draft", 1, 1, 16, torch.bfloat16, codecs[1])]
    ns = Namespace("inspect-test", groups, P)
    pool = PagePool(groups, 16, P)
    tiers = TierManager(pool, ns, host_bytes=4 * TierManager.slot_bytes_for(pool),
                        disk=DiskTier(path, map_size=1 << 22))
    mgr = KVCacheManager(pool, ns, lower=tiers)
    rng = random.Random(0)
    prompts = [[rng.randrange(100) for _ in range(pages * P + 1)] for _ in range(n_prompts)]
    for i, p in enumerate(prompts):
        mgr.admit(i, p)
        mgr.reserve(i, len(p))
        for g in groups:
            pool.kv[g.name].normal_()
        mgr.commit(i, p)
        mgr.free(i)
    pool.evict(pool.num_cached)
    if keep_open:
        tiers.drain_host()
        return tiers, ns, prompts
    tiers.close()
    return None, ns, prompts


def _json(capsys, *args):
    rc = main(["inspect", *map(str, args), "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_summary(tmp_path, capsys):
    _fill(tmp_path / "d")
    rc, doc = _json(capsys, tmp_path / "d")
    assert rc == 0 and doc["pages"] == 6 and doc["unreadable"] == 0
    assert doc["groups"]["target"]["codecs"] == {"nvfp4 v1": 6}
    assert doc["groups"]["target"]["ratio"] == pytest.approx(3.2, abs=0.01)
    assert doc["groups"]["draft"]["codecs"] == {"lossless v1": 6}
    assert doc["capacity_bytes"] == (1 << 22) // 2
    assert list(doc["namespaces"].values()) == [6]
    assert doc["segments"] >= 1
    assert doc["segment_file_bytes"] == sum(g["stored_bytes"] for g in doc["groups"].values())
    assert 0 <= doc["newest_age_s"] <= doc["oldest_age_s"] < 600
    assert main(["inspect", str(tmp_path / "d")]) == 0     # the rich rendering runs too
    assert "groups" in capsys.readouterr().out


def test_list_and_page(tmp_path, capsys):
    _fill(tmp_path / "d", codecs=("identity", "identity"))
    with DiskTier(tmp_path / "d", readonly=True) as d:
        order = [h.hex() for h in d.keys_by_age()]
    rc, rows = _json(capsys, tmp_path / "d", "--list")
    assert rc == 0 and [r["hash"] for r in rows] == order
    rc, page = _json(capsys, tmp_path / "d", "--page", order[0][:10])
    assert rc == 0 and page["hash"] == order[0] and len(page["token_ids"]) == P
    assert [g["codec"] for g in page["groups"]] == ["identity", "identity"]
    assert main(["inspect", str(tmp_path / "d"), "--page", "ff" * 16]) == 1


def test_verify_names_bad_pages(tmp_path, capsys):
    _, ns, prompts = _fill(tmp_path / "d")
    rc, doc = _json(capsys, tmp_path / "d", "--verify")
    assert rc == 0 and doc == {"pages": 6, "bad": []}
    victim = page_hashes(ns, prompts[1])[1]
    with DiskTier(tmp_path / "d", map_size=1 << 22) as d:
        with d.env.begin(write=True, db=d._pages) as txn:
            v = bytearray(txn.get(victim))
            v[len(v) // 2] ^= 0x40
            txn.put(victim, bytes(v))
    rc, doc = _json(capsys, tmp_path / "d", "--verify")
    assert rc == 1 and [b["hash"] for b in doc["bad"]] == [victim.hex()]
    assert main(["inspect", str(tmp_path / "d"), "--verify"]) == 1
    assert victim.hex() in capsys.readouterr().out


def test_verify_names_a_page_whose_payload_was_damaged_in_its_segment(tmp_path, capsys):
    _, ns, prompts = _fill(tmp_path / "d")
    from kvstrata.tiers import disk as disk_mod
    victim = page_hashes(ns, prompts[2])[0]
    with DiskTier(tmp_path / "d", readonly=True) as d:
        with d.env.begin() as txn:
            seg, off, lens = disk_mod._loc(txn.get(victim, db=d._index))
        seg_path = d._seg_path(seg)
    with open(seg_path, "r+b") as f:
        f.seek(off + lens[0] + lens[1] // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x01]))
    rc, doc = _json(capsys, tmp_path / "d", "--verify")
    assert rc == 1 and [b["hash"] for b in doc["bad"]] == [victim.hex()]
    assert "draft" in doc["bad"][0]["error"]            # the group whose CRC failed
    rc, doc = _json(capsys, tmp_path / "d")               # the summary still reads it
    assert rc == 0 and doc["pages"] == 6


def test_missing_path_is_a_clear_error(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope")]) == 2
    assert "no such directory" in capsys.readouterr().out


def test_works_while_an_engine_holds_the_tier_open(tmp_path):
    tiers, _, _ = _fill(tmp_path / "d", keep_open=True)
    try:
        out = subprocess.run([sys.executable, "-m", "kvstrata.cli.main", "inspect",
                              str(tmp_path / "d"), "--verify", "--json"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == {"pages": 6, "bad": []}
    finally:
        tiers.close()
