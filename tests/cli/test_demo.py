"""`kvstrata demo` on the CPU in a tiny setting: real reuse, tier traffic, plot, JSON, AL order."""

from __future__ import annotations

import json

import pytest
import torch

from kvstrata.cli.main import main
from kvstrata.tiers import TierManager


def _demo(tmp_path, *extra):
    threads = torch.get_num_threads()
    try:
        return main(["demo", "--device", "cpu", "--conversations", "2", "--turns", "2",
                     "--max-tokens", "96", "--context-bytes", "400", "--user-bytes", "32",
                     "--plot", str(tmp_path / "demo.png"),
                     "--json", str(tmp_path / "demo.json"), *extra])
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("demo")
    rc = _demo(tmp)
    return rc, tmp, json.loads((tmp / "demo.json").read_text())


def test_demo_runs_clean(demo):
    rc, _, doc = demo
    assert rc == 0 and doc["ok"] and doc["problems"] == []
    assert doc["checked_requests"] >= 2          # turn 1 reuses exact pages only: compared
    assert doc["disk_pages_verified"] > 0


def test_demo_reuses_prefixes_through_the_tiers(demo):
    _, _, doc = demo
    t1, t2 = doc["turns"]
    assert set(t2) >= {"turn", "prompt_tokens", "reused_device", "reused_host", "reused_disk",
                       "al_paged", "al_arena", "ttft_s_paged", "ttft_s_arena",
                       "tokens_per_s_paged", "tokens_per_s_arena"}
    assert t2["prompt_tokens"] > t1["prompt_tokens"]
    reused = t2["reused_device"] + t2["reused_host"] + t2["reused_disk"]
    assert reused >= t1["prompt_tokens"] // 2 and reused % 16 == 0
    assert t2["reused_host"] + t2["reused_disk"] > 0          # the pool is smaller than the set
    for run in doc["runs"].values():
        s = run["tiers"]
        assert s["d2h_pages"] > 0 and s["h2d_pages"] > 0 and s["host_to_disk_pages"] > 0
        assert s["checksum_failures"] == 0 and s["mismatches"] == 0
    comp = doc["runs"]["paged"]["compression"]
    assert comp["draft"]["bit_exact"] and comp["draft"]["codec"] == "lossless"
    assert comp["target"]["codec"] == "nvfp4" and comp["target"]["ratio"] > 3


def test_demo_paged_drafter_keeps_al_after_a_prefix_hit(demo):
    _, _, doc = demo
    t2 = doc["turns"][1]
    assert t2["al_paged"] >= t2["al_arena"] > 1.0
    assert doc["runs"]["arena"]["compression"].keys() == {"target"}   # no draft group in the pool


def test_demo_plot_is_a_png(demo):
    _, tmp, doc = demo
    data = (tmp / "demo.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert doc["plot"].endswith("demo.png")


def test_demo_fails_on_corrupt_pages(tmp_path, monkeypatch, capsys):
    real = TierManager.stats

    def with_failure(self):
        out = real(self)
        out["checksum_failures"] += 1
        return out
    monkeypatch.setattr(TierManager, "stats", with_failure)
    assert _demo(tmp_path, "--turns", "1", "--max-tokens", "8") == 1
    assert "FAILED" in capsys.readouterr().out


def test_demo_reports_first_steps_and_what_the_al_compares(demo):
    _, _, doc = demo
    assert doc["config"]["context_bytes"] == 400 and doc["config"]["snippet_bytes"] == 32
    t1, t2 = doc["turns"]
    assert t1["prompt_tokens"] > 2 * 400 * 0.8          # the first turn pastes the context
    for t in (t1, t2):
        assert t["al_first_steps_paged"] >= 1.0 and t["al_first_steps_arena"] >= 1.0
    assert doc["al_gain"] == pytest.approx(doc["al"]["paged"] / doc["al"]["arena"] - 1)
    assert doc["al_texts"].startswith(("identical texts", "near-identical texts"))
    assert all(d["near_tie"] for d in doc["divergences"])


def _result(paged, arena, prompts, dtype=torch.float32):
    """A two-backend DemoResult over given answers (one turn, exact K/V everywhere)."""
    from kvstrata.demo.runner import BackendRun, DemoConfig, DemoResult, _check_tokens

    runs = {b: BackendRun(b, [], [outs], [[False] * len(outs)], {}, {}, {}, "", 0.0)
            for b, outs in (("paged", paged), ("arena", arena))}
    res = DemoResult(DemoConfig(workdir="/nonexistent", dtype=dtype), ["a.py"] * len(paged),
                     runs)
    _check_tokens(res, [prompts])
    return res


def test_token_check_allows_near_ties_only(monkeypatch):
    """Issue 14 item 9: answers over exact K/V may part only where the target's float32 logits
    of the two tokens are within the dtype's tolerance of the maximum."""
    from kvstrata.assets.corpus import heldout_prompts
    from kvstrata.demo.check import TIE_TOLERANCE, ReferenceTarget

    prompt = heldout_prompts(1, 64, seed=3)[0]
    logits = ReferenceTarget("kvstrata-tiny-py").next_logits(prompt)
    top = logits.topk(2)
    best, second = int(top.indices[0]), int(top.indices[1])
    gap = float(top.values[0] - top.values[1])
    worst = int(logits.argmin())
    same = _result([[best, 1]], [[best, 1]], [prompt])
    assert same.ok and same.checked_requests == 1 and not same.divergences
    # a real bug: the arena run commits a token the target ranks last
    bug = _result([[best, 1]], [[worst, 1]], [prompt])
    assert not bug.ok and "no near-tie" in bug.problems[0]
    assert bug.divergences[0].gaps[0] == 0.0 and bug.divergences[0].gaps[1] > 1.0
    # the runner-up: a near-tie exactly when the gap is within the run's dtype tolerance
    for tol, ok in ((gap + 0.01, True), (gap - 0.01, False)):
        monkeypatch.setitem(TIE_TOLERANCE, torch.bfloat16, tol)
        tie = _result([[best]], [[second]], [prompt], dtype=torch.bfloat16)
        assert tie.ok is ok and tie.divergences[0].near_tie is ok
        assert tie.divergences[0].gaps == pytest.approx((0.0, gap), abs=1e-4)
    # one answer a strict prefix of the other: nothing to compare, always a problem
    cut = _result([[best, 1]], [[best]], [prompt])
    assert not cut.ok and "strict prefix" in cut.problems[0]


def test_long_preset_and_bad_options(tmp_path, capsys):
    from kvstrata.cli.demo import DEFAULT, LONG

    assert LONG["turns"] > DEFAULT["turns"] and LONG["context_bytes"] >= DEFAULT["context_bytes"]
    assert _demo(tmp_path, "--context-bytes", "-1") == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("kvstrata demo: ") and "context_bytes " \
        "(--context-bytes) must be an integer >= 0" in err, err
