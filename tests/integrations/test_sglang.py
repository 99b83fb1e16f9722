"""KVStrataHiCacheStorage through SGLang's real storage interface and dynamic backend loader."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from integrations_util import require

require("sglang")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from sglang_host import HostPool  # noqa: E402

HERE = Path(__file__).resolve().parent
LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
P = 16


def storage_config(disk: Path, model: str = "tiny", tp_rank: int = 0, **extra) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name=model,
        extra_config={"backend_name": "kvstrata", "module_path": "kvstrata.integrations.sglang",
                      "class_name": "KVStrataHiCacheStorage", "interface_v1": 1,
                      "disk_path": str(disk), "disk_bytes": 64 << 20, **extra})


def open_backend(disk: Path, pool: HostPool, **kw):
    """As SGLang's cache controller does: the factory loads the class by module path, then the
    host pool is registered."""
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(disk, **kw), pool)
    backend.register_mem_pool_host(pool)
    return backend


@pytest.fixture
def opened(tmp_path):
    made = []

    def make(pool: HostPool, disk: Path | None = None, **kw):
        b = open_backend(disk or tmp_path / "disk", pool, **kw)
        made.append(b)
        return b
    yield make
    for b in made:
        b.close()


def fill(pool: HostPool, pages: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in pages:
        flat = pool.get_data_page(p * P)
        pool.set_from_flat_data_page(p * P, torch.randn(flat.shape, generator=g).to(pool.dtype))


def host_indices(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * P, (p + 1) * P) for p in pages])


def same_page(a: HostPool, ia: int, b: HostPool, ib: int) -> bool:
    ka, va = a.page_kv(ia * P)
    kb, vb = b.page_kv(ib * P)
    return torch.equal(ka, kb) and torch.equal(va, vb)


def test_the_factory_loads_the_backend_by_module_path(opened):
    from kvstrata.integrations.sglang import KVStrataHiCacheStorage
    b = opened(HostPool("layer_first", 4))
    assert isinstance(b, KVStrataHiCacheStorage) and isinstance(b, HiCacheStorage)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_zero_copy_round_trip_is_bit_exact(opened, layout):
    src, dst = HostPool(layout, 6), HostPool(layout, 6)
    fill(src, [1, 2, 4], seed=1)
    b = opened(src)
    keys = ["k1", "k2", "k4"]
    assert b.batch_set_v1(keys, host_indices([1, 2, 4])) == [True] * 3
    b.register_mem_pool_host(dst)     # another host pool of the same format
    assert b.batch_get_v1(keys, host_indices([0, 3, 5])) == [True] * 3
    assert same_page(src, 1, dst, 0) and same_page(src, 2, dst, 3) and same_page(src, 4, dst, 5)
    assert b.stats()["store"]["loaded_pages"] == 3


def test_generic_get_set_and_batch(opened):
    pool = HostPool("page_first", 4)
    fill(pool, [0, 1, 2], seed=2)
    b = opened(pool)
    flat = [pool.get_data_page(p * P).clone() for p in range(3)]
    assert b.set("a", flat[0]) is True
    assert b.batch_set(["b", "c"], flat[1:]) is True
    got = b.get("a")
    assert torch.equal(got, flat[0])
    target = torch.zeros_like(flat[1])
    assert b.get("b", target) is target and torch.equal(target, flat[1])
    out = b.batch_get(["a", "b", "c"], [torch.zeros_like(f) for f in flat])
    assert all(torch.equal(o, f) for o, f in zip(out, flat))


def test_exists_and_missing_keys(opened):
    pool = HostPool("layer_first", 4)
    fill(pool, [0, 1], seed=3)
    b = opened(pool)
    assert b.batch_set_v1(["x0", "x1"], host_indices([0, 1])) == [True, True]
    assert b.exists("x0") and b.exists("x1") and not b.exists("nope")
    assert b.batch_exists(["x0", "x1", "nope"]) == 2
    assert b.batch_exists(["nope", "x0"]) == 0          # longest prefix, as SGLang reads
    assert b.get("nope") is None
    # a missing page in the middle: the prefix before it loads, nothing after it
    assert b.batch_get_v1(["x0", "nope", "x1"], host_indices([2, 3, 0])) == [True, False, False]
    assert b.batch_get(["nope"]) == [None]


def test_a_corrupt_record_is_a_counted_miss_and_is_removed(opened, tmp_path):
    pool = HostPool("layer_first", 4)
    fill(pool, [0, 1], seed=4)
    b = opened(pool)
    assert b.batch_set_v1(["c0", "c1"], host_indices([0, 1])) == [True, True]
    before = pool.kv_buffer.clone()
    seg = sorted((tmp_path / "disk" / "segments").glob("*.seg"))[-1]
    data = bytearray(seg.read_bytes())
    data[-100] ^= 0x01                                  # inside c1's payload (written last)
    seg.write_bytes(bytes(data))
    assert b.batch_get_v1(["c0", "c1"], host_indices([2, 3])) == [True, False]
    assert same_page(pool, 0, pool, 2)
    assert torch.equal(pool.kv_buffer[:, :, 3 * P:4 * P], before[:, :, 3 * P:4 * P])  # untouched
    stats = b.stats()["store"]
    assert stats["corrupt_records"] == 1
    assert not b.exists("c1") and b.exists("c0")         # deleted, never served again


def test_namespaces_keep_models_and_ranks_apart(opened, tmp_path):
    pool = HostPool("layer_first", 2)
    fill(pool, [0], seed=5)
    a = opened(pool)
    assert a.batch_set_v1(["k"], host_indices([0])) == [True]
    a.close()
    other_model = opened(pool, model="other")
    assert other_model.batch_exists(["k"]) == 0
    other_model.close()
    other_rank = opened(pool, tp_rank=1)
    assert other_rank.batch_exists(["k"]) == 0
    other_rank.close()
    same = opened(pool)
    assert same.batch_exists(["k"]) == 1


def test_another_process_reads_the_pages(opened, tmp_path):
    """Process A (this one) backs pages up and keeps the disk tier open for writing; process B
    opens the same disk tier (read-only: one writer per tier) and prefetches them."""
    pool = HostPool("page_first_direct", 4)
    fill(pool, [0, 1, 2], seed=6)
    b = opened(pool)
    keys = ["p0", "p1", "p2"]
    assert b.batch_set_v1(keys, host_indices([0, 1, 2])) == [True] * 3
    out = subprocess.run([sys.executable, str(HERE / "sglang_reader.py"), str(tmp_path / "disk"),
                          json.dumps(keys)], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                             [str(HERE), os.environ.get("PYTHONPATH", "")])))
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["loaded"] == [True] * 3
    # the reader hashed what it got: byte for byte what this process stored
    want = [_digest(pool, p) for p in range(3)]
    assert res["digests"] == want


def _digest(pool: HostPool, page: int) -> str:
    import hashlib
    k, v = pool.page_kv(page * P)
    return hashlib.sha256(k.contiguous().view(torch.uint8).numpy().tobytes() +
                          v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def test_unsupported_paths_raise(opened, tmp_path):
    b = opened(HostPool("layer_first", 2))
    assert b.get_stats() is None          # SGLang's StorageMetrics are SGLang's to measure
    with pytest.raises(NotImplementedError):
        b.clear()
    with pytest.raises(NotImplementedError):
        b.batch_get_v2([])
    pool = HostPool("layer_first", 2)
    pool.layout = "page_unified"
    with pytest.raises(NotImplementedError, match="page_unified"):
        b.register_mem_pool_host(pool)
    with pytest.raises(ValueError, match="unknown option"):
        open_backend(tmp_path / "d2", HostPool("layer_first", 2), disk_byts=1 << 20)
