"""``kvstrata.devices.resolve_device``: a device name checked against the machine, errors that
say what there is (the CLI and the server print them as one line)."""

from __future__ import annotations

import pytest
import torch

from kvstrata.cli.main import main
from kvstrata.devices import resolve_device
from kvstrata.runtime import LLM


def test_names_this_machine_has():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    want = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("auto") == resolve_device(None) == want


def test_a_malformed_name_is_a_value_error():
    with pytest.raises(ValueError, match="'tpu' is not a device name"):
        resolve_device("tpu")


def test_cuda_past_what_the_machine_has(monkeypatch):
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match=f"cuda:{n}"):
        resolve_device(f"cuda:{n}")
    # a CUDA build on a machine without a GPU, and one with two
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    with pytest.raises(ValueError, match="torch sees no CUDA device"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ValueError, match=r"has 2 CUDA devices \(cuda:0..cuda:1\)"):
        resolve_device("cuda:2")


def test_the_engine_and_the_cli_refuse_a_missing_device_before_loading(tmp_path, capsys):
    missing = f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}"
    with pytest.raises(ValueError, match=missing):
        LLM("kvstrata-tiny-py", "kvstrata-tiny-py", device=missing)
    assert main(["demo", "--device", missing]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvstrata demo: --device: "), err
    from kvstrata.training.__main__ import main as train
    assert train([str(tmp_path / "run"), "--device", missing]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device: device" in err and not (tmp_path / "run").exists()
