"""`kvstrata serve` argument handling (no model is loaded: every case fails before that)."""

from __future__ import annotations

import argparse
import gc
import socket
import warnings

import pytest

from kvstrata.cli.main import main
from kvstrata.cli.serve import parse_bytes, parse_port


@pytest.mark.parametrize("text,value", [("1048576", 1 << 20), ("512M", 512 << 20),
                                        ("4GiB", 4 << 30), ("1.5k", 1536), ("64 MB", 64 << 20)])
def test_sizes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "lots", "-1", "4X", "1e9"])
def test_bad_sizes(text):
    with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
        parse_bytes(text)


@pytest.mark.parametrize("args,msg", [
    (["--disk-tier", "x"], "--disk-tier needs --host-tier-bytes"),
    (["--max-body-bytes", "100"], "max_body_bytes must be an integer >= 1024"),
    (["--max-prompt-chars", "0"], "max_prompt_chars must be a positive integer"),
    (["--max-batch-size", "0"], "max_batch_size must be a positive integer"),
])
def test_usage_errors_exit_2_with_one_line(capsys, args, msg):
    assert main(["serve", "kvstrata-tiny-py", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvstrata serve: error: ") and msg in err[0]


@pytest.mark.parametrize("text,value", [("0", 0), ("8000", 8000), ("65535", 65535)])
def test_ports(text, value):
    assert parse_port(text) == value


@pytest.mark.parametrize("text", ["", "-1", "65536", "99999", "http", "80.5"])
def test_bad_ports(text):
    with pytest.raises(argparse.ArgumentTypeError, match="not a port"):
        parse_port(text)


def test_an_address_in_use_fails_before_the_model_loads(capsys, monkeypatch):
    """The port is bound before the model loads (minutes for a large one): a port in use or a
    host that does not resolve is one line and exit 2 at once, and nothing is loaded."""
    import kvstrata.runtime as rt

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(rt, "LLM", no_load)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "kvstrata-tiny-py", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"kvstrata serve: error: cannot listen on 127.0.0.1:{port}: "
                   f"Address already in use"], err
    assert main(["serve", "kvstrata-tiny-py", "--host", "no-such-host.invalid"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot listen on no-such-host.invalid:8000" in err[0], err


def test_a_model_that_fails_to_load_releases_the_port(capsys):
    """The port is bound before the model loads; a load that fails closes it again."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", ResourceWarning)
        assert main(["serve", "/no/such/model", "--port", str(port)]) == 2
        gc.collect()
    assert "unknown model '/no/such/model'" in capsys.readouterr().err
    assert not [w for w in seen if issubclass(w.category, ResourceWarning)], \
        [str(w.message) for w in seen]          # closed, not left to the collector
    with socket.socket() as again:
        again.bind(("127.0.0.1", port))


def test_api_key_is_not_shown_as_a_default(capsys, monkeypatch):
    monkeypatch.setenv("KVSTRATA_API_KEY", "s3cret-value")
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "s3cret-value" not in out and "KVSTRATA_API_KEY" in out and "127.0.0.1" in out
