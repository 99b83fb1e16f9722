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
                     "--max-tokens", "96", "--plot", str(tmp_path / "demo.png"),
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
