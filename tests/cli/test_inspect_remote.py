"""`kvstrata inspect redis://...`: summary, list, page, verify (exit 1 naming bad records)."""

from __future__ import annotations

import json

import redis

from kvstrata.cli.main import main
from kvstrata.testing.redis import RedisServer, free_port
from kvstrata.testing.tiers import make_records
from kvstrata.tiers.remote import RemoteTier


def _json(capsys, *args):
    rc = main(["inspect", *args, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_inspect_lists_and_verifies_remote_records(capsys):
    with RedisServer() as srv:
        ns, infos, recs = make_records(5)
        tier = RemoteTier(srv.url, ns.digest)
        assert tier.put([(i.hash, r) for i, r in zip(infos, recs)]) == [True] * 5
        rc, doc = _json(capsys, srv.url)
        assert rc == 0 and doc["pages"] == 5 and doc["namespaces"] == {ns.digest.hex(): 5}
        assert doc["groups"]["target"]["codecs"] == {"identity v1": 5}
        assert doc["maxmemory_policy"] == ["allkeys-lru"] and not doc["cluster"]
        rc, rows = _json(capsys, srv.url, "--list")
        assert rc == 0 and sorted(r["hash"] for r in rows) == sorted(i.hash.hex() for i in infos)
        rc, rows = _json(capsys, srv.url, "--list", "2")
        assert rc == 0 and len(rows) == 2
        # Usage errors: one line on stderr, exit 2 (as the disk tier's inspect).
        for args, msg in [(["--repair"], "a remote tier has none"),
                          (["--page", "xyz"], "--page takes a hex page hash"),
                          (["--page", "f" * 32], f"no page '{'f' * 32}' in {srv.url}"),
                          (["--list", "-1"], "--list takes a number of rows >= 1")]:
            assert main(["inspect", srv.url, *args]) == 2
            out, err = capsys.readouterr()
            assert out == "" and err.count("\n") == 1 and msg in err, (args, err)
            assert err.startswith("kvstrata inspect: ")
        rc, page = _json(capsys, srv.url, "--page", infos[2].hash.hex()[:10])
        assert rc == 0 and page["token_ids"] == list(infos[2].token_ids)
        rc, v = _json(capsys, srv.url, "--verify")
        assert rc == 0 and v == {"pages": 5, "bad": []}
        # Damage: a flipped payload byte, and page 4's record stored under page 3's key.
        r = redis.Redis.from_url(srv.url)
        val = bytearray(r.get(tier.key(infos[1].hash)))
        val[-1] ^= 0x10
        r.set(tier.key(infos[1].hash), bytes(val))
        r.set(tier.key(infos[3].hash), r.get(tier.key(infos[4].hash)))
        rc, v = _json(capsys, srv.url, "--verify")
        assert rc == 1 and sorted(b["hash"] for b in v["bad"]) == sorted(
            [infos[1].hash.hex(), infos[3].hash.hex()])
        assert main(["inspect", srv.url + "?prefix=other", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["pages"] == 0
        r.close()
        tier.close()


def test_inspect_unreachable_server_is_a_clear_error(capsys):
    """One line on stderr (the client's own message has a line break), exit 2."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    assert main(["inspect", url]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith(f"kvstrata inspect: remote tier {url} cannot be reached: "), err
