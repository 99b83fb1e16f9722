"""`kvstrata stress` on the CPU for a short bound: passes, and fails when pages come back wrong."""

from __future__ import annotations

import pytest
import torch

from kvstrata.cli.main import main
from kvstrata.tiers import TierManager


def _run(tmp_path, *extra):
    threads = torch.get_num_threads()
    try:
        return main(["stress", "--dir", str(tmp_path / "disk"), *extra])
    finally:
        torch.set_num_threads(threads)


def test_stress_short_run_passes(tmp_path, capsys):
    assert _run(tmp_path, "--seconds", "8", "--restart-every", "2") == 0
    out = capsys.readouterr().out
    assert "OK:" in out and "peak RSS" in out


def test_stress_detects_wrong_pages(tmp_path, capsys, monkeypatch):
    real = TierManager.load_prefix

    def corrupting(self, namespace, pages, page_ids):
        n = real(self, namespace, pages, page_ids)
        if n:
            self.view.page_major(1)[page_ids[0]].add_(1)   # the draft group changed in transit
        return n
    monkeypatch.setattr(TierManager, "load_prefix", corrupting)
    assert _run(tmp_path, "--seconds", "2", "--codecs", "identity,identity") == 1
    assert "FAILED" in capsys.readouterr().out


@pytest.mark.slow
def test_stress_long_run_write_through(tmp_path, capsys):
    assert _run(tmp_path, "--seconds", "120", "--write-through", "--restart-every", "10") == 0

