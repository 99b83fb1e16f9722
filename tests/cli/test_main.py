"""The `kvstrata` command itself: help, version, `python -m kvstrata`, usage errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvstrata
from kvstrata.cli.main import main


def test_version_and_module_entry_point():
    res = subprocess.run([sys.executable, "-m", "kvstrata", "--version"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == f"kvstrata {kvstrata.__version__}"


def test_top_level_help_is_for_users(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "Exit codes" in out and "kvstrata stress --seconds 30" in out
    assert "imported only when" not in out and "Each subcommand lives" not in out


def test_subcommand_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["stress", "--help"])
    out = capsys.readouterr().out
    assert "(default: 10.0)" in out and "(default: nvfp4,lossless)" in out
    assert "device of the page pool" in out


@pytest.mark.parametrize("args,msg", [
    (["--seconds", "0"], "--seconds must be positive, got 0"),
    (["--codecs", "foo"], "--codecs takes two names"),
    (["--codecs", "foo,identity"], "--codecs: unknown codec 'foo'; known: identity, lossless"),
    (["--pages", "0"], "--pages must be at least 1"),
    (["--device", "tpu"], "'tpu' is not a device name"),
    (["--device", "cuda:64"], "device 'cuda:64'"),            # no machine here has 65 GPUs
    (["--dir", "{tmp}/afile"], "is not a directory"),
    (["--dir", "{tmp}/afile/sub"], "cannot create it"),
])
def test_usage_errors_exit_2_with_one_line(tmp_path, capsys, args, msg):
    """Bad values, a device this machine lacks, a --dir that cannot be a directory: one line,
    exit 2, before anything runs."""
    (tmp_path / "afile").write_text("x")
    args = [a.format(tmp=tmp_path) for a in args]
    assert main(["stress", "--dir", str(tmp_path), *args]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    err = cap.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvstrata stress: error: ") and msg in err[0]


@pytest.mark.parametrize("out,msg", [("{tmp}/afile/x.md", "cannot create"),
                                     ("{tmp}", "is a folder")])
def test_bench_out_is_checked_before_the_run(tmp_path, capsys, out, msg):
    (tmp_path / "afile").write_text("x")
    assert main(["bench", "acceptance", "--out", out.format(tmp=tmp_path)]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err.count("\n") == 1 and msg in cap.err, cap.err
