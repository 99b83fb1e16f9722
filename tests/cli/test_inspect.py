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
    mgr = KVCacheManager(pool, ns, tiers=tiers)
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
    # the segment files hold every record (head + payloads) behind a 52-byte frame
    assert doc["segment_file_bytes"] == doc["stored_bytes"] + 6 * (12 + 16 + 3 * 8)
    assert doc["stored_bytes"] > sum(g["stored_bytes"] for g in doc["groups"].values())
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
    assert main(["inspect", str(tmp_path / "d"), "--page", "ff" * 16]) == 2


def test_verify_names_bad_pages(tmp_path, capsys):
    _, ns, prompts = _fill(tmp_path / "d")
    rc, doc = _json(capsys, tmp_path / "d", "--verify")
    assert rc == 0 and doc == {"pages": 6, "bad": [], "index": "ok"}
    victim = page_hashes(ns, prompts[1])[1]
    with DiskTier(tmp_path / "d", readonly=True) as d:
        seg, off, lens = d.where(victim)
    _flip(seg, off + lens[0] // 2, 0x40)                       # a bit of the record's head
    rc, doc = _json(capsys, tmp_path / "d", "--verify")
    assert rc == 1 and [b["hash"] for b in doc["bad"]] == [victim.hex()]
    assert main(["inspect", str(tmp_path / "d"), "--verify"]) == 1
    assert victim.hex() in capsys.readouterr().out


def test_verify_names_a_page_whose_payload_was_damaged_in_its_segment(tmp_path, capsys):
    _, ns, prompts = _fill(tmp_path / "d")
    victim = page_hashes(ns, prompts[2])[0]
    with DiskTier(tmp_path / "d", readonly=True) as d:
        seg, off, lens = d.where(victim)
    _flip(seg, off + lens[0] + lens[1] + lens[2] // 2, 0x01)   # a bit of the draft payload
    rc, doc = _json(capsys, tmp_path / "d", "--verify")
    assert rc == 1 and [b["hash"] for b in doc["bad"]] == [victim.hex()]
    assert "draft" in doc["bad"][0]["error"]            # the group whose CRC failed
    rc, doc = _json(capsys, tmp_path / "d")               # the summary still reads it
    assert rc == 0 and doc["pages"] == 6


def _flip(path, pos, bit):
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ bit]))


def test_missing_path_is_a_clear_error(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope"), "--json"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "no such directory" in out.err and out.err.count("\n") == 1


def test_works_while_an_engine_holds_the_tier_open(tmp_path):
    tiers, _, _ = _fill(tmp_path / "d", keep_open=True)
    try:
        out = subprocess.run([sys.executable, "-m", "kvstrata.cli.main", "inspect",
                              str(tmp_path / "d"), "--verify", "--json"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == {"pages": 6, "bad": [], "index": "ok"}
    finally:
        tiers.close()


@pytest.fixture
def cli(capsys):
    """``cli(*args) -> (exit status, stdout, stderr)`` of ``kvstrata inspect`` (in process: an
    exception would fail the test, so "no traceback" holds by construction)."""
    def run(*args):
        rc = main(["inspect", *map(str, args)])
        out = capsys.readouterr()
        return rc, out.out, out.err
    return run


def test_a_directory_or_file_that_is_no_tier_is_one_line_exit_2(tmp_path, cli):
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("hello")
    (tmp_path / "file").write_text("hello")
    for path, says in ((tmp_path / "empty", "no data.mdb"), (tmp_path / "other", "no data.mdb"),
                       (tmp_path / "file", "is a file")):
        rc, out, err = cli(path, "--json")
        assert (rc, out) == (2, ""), err
        assert says in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_usage_errors_exit_2_with_one_line(tmp_path, capsys):
    _fill(tmp_path / "d", codecs=("identity", "identity"), n_prompts=1)
    for args in (["--page", "zz"], ["--list", "-1"], ["--page", "0"]):
        assert main(["inspect", str(tmp_path / "d"), *args]) == 2, args
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1, (args, err)


def test_list_takes_a_limit_and_page_prints_dates(tmp_path, capsys):
    _fill(tmp_path / "d", codecs=("identity", "identity"))
    rc, rows = _json(capsys, tmp_path / "d", "--list", 2)
    assert rc == 0 and len(rows) == 2
    rc, every = _json(capsys, tmp_path / "d", "--list")
    assert rc == 0 and len(every) == 6 and every[:2] == rows
    assert main(["inspect", str(tmp_path / "d"), "--list", "2"]) == 0
    assert "2 of 6 pages" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "d"), "--page", rows[0]["hash"][:12]]) == 0
    import datetime as dt
    today = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    out = capsys.readouterr().out
    assert f"{today} " in out and " UTC" in out
    rc, page = _json(capsys, tmp_path / "d", "--page", rows[0]["hash"])
    assert page["created_utc"].startswith(today) and page["created_utc"].endswith(" UTC")


def test_verify_shows_progress_on_stderr(tmp_path, capsys, monkeypatch):
    from kvstrata.cli import inspect as cli_inspect
    _fill(tmp_path / "d")
    monkeypatch.setattr(cli_inspect, "PROGRESS_EVERY_S", 0.0)
    assert main(["inspect", str(tmp_path / "d"), "--verify", "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["pages"] == 6
    assert "kvstrata inspect: verified 6/6" in out.err.splitlines()


@pytest.mark.parametrize("kind", ["damage_meta", "truncate", "delete"])
def test_damaged_tier_says_what_is_damaged_exit_1_and_repair_rebuilds(tmp_path, kind, cli):
    from kvstrata.testing import damage
    _fill(tmp_path / "d")
    getattr(damage, kind)(tmp_path / "d")
    rc, out, err = cli(tmp_path / "d", "--json")
    assert rc == 1 and "Traceback" not in err and "the index is damaged" in err
    doc = json.loads(out)
    assert doc["recoverable_pages"] == 6 and "--repair" in doc["repair"]
    rc, out, err = cli(tmp_path / "d")                       # the human-readable form
    assert rc == 1 and "6 pages" in out and "Traceback" not in err
    rc, out, err = cli(tmp_path / "d", "--repair", "--json")
    assert rc == 0, err
    assert json.loads(out) == {"path": str(tmp_path / "d"), "index": "rebuilt",
                               "index_problem": json.loads(out)["index_problem"],
                               "moved_aside": False, "pages": 6, "removed_bad_pages": 0}
    rc, out, err = cli(tmp_path / "d", "--verify", "--json")
    assert rc == 0 and json.loads(out) == {"pages": 6, "bad": [], "index": "ok"}


def test_verify_walks_the_index_and_repair_removes_bad_pages(tmp_path, capsys):
    from kvstrata.testing import damage
    _, ns, prompts = _fill(tmp_path / "d")
    victim = page_hashes(ns, prompts[0])[0]
    with DiskTier(tmp_path / "d", readonly=True) as d:
        seg, off, lens = d.where(victim)
    _flip(seg, off + lens[0] + 1, 0x01)
    damage.flip_page_type(tmp_path / "d", [damage.root_page(tmp_path / "d", b"byseg")])
    rc, doc = _json(capsys, tmp_path / "d", "--verify")      # reads work; the walk finds it
    assert rc == 1 and doc["index"].startswith("reading the index failed")
    assert [b["hash"] for b in doc["bad"]] == [victim.hex()]
    assert main(["inspect", str(tmp_path / "d"), "--repair"]) == 0
    assert "index rebuilt" in capsys.readouterr().out
    rc, doc = _json(capsys, tmp_path / "d", "--verify")
    assert rc == 0 and doc == {"pages": 5, "bad": [], "index": "ok"}


def test_repair_refuses_while_an_engine_writes(tmp_path, capsys):
    tiers, _, _ = _fill(tmp_path / "d", keep_open=True)
    try:
        assert main(["inspect", str(tmp_path / "d"), "--repair"]) == 2
        assert "open for writing" in capsys.readouterr().err
    finally:
        tiers.close()
