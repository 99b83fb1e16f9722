import pytest
import torch

from kvstrata.pagepool import (KVGroupSpec, PagePool, bytes_per_page, bytes_per_token,
                               pages_for_budget)


def groups():
    return [KVGroupSpec("target", 36, 8, 128, "bf16", "nvfp4"),
            KVGroupSpec("draft", 5, 8, 128, torch.float32, "lossless")]


def test_bytes_per_token_and_page_sum_over_groups():
    g = groups()
    assert bytes_per_token(g) == 36 * 2 * 8 * 128 * 2 + 5 * 2 * 8 * 128 * 4
    assert bytes_per_page(g, 16) == 16 * bytes_per_token(g)


def test_pages_for_budget_floor_and_error_names_minimum():
    g = groups()
    per_page = bytes_per_page(g, 16)
    assert pages_for_budget(g, 16, 10 * per_page + per_page - 1) == 10
    with pytest.raises(ValueError, match=f"takes .*{per_page} bytes"):
        pages_for_budget(g, 16, per_page - 1)


def test_from_budget_builds_mixed_dtype_storage():
    g = [KVGroupSpec("target", 2, 2, 16, "bf16"), KVGroupSpec("draft", 1, 1, 32, "fp32")]
    pool = PagePool.from_budget(g, budget_bytes=5 * bytes_per_page(g, 4) + 7, page_size=4)
    assert pool.num_pages == 5
    assert pool.kv["target"].shape == (5, 2, 2, 2, 4, 16) and pool.kv["target"].dtype == torch.bfloat16
    assert pool.kv["draft"].shape == (5, 1, 2, 1, 4, 32) and pool.kv["draft"].dtype == torch.float32
    assert pool.nbytes == 5 * bytes_per_page(g, 4)


def test_sliding_window_needs_only_the_window():
    full = KVGroupSpec("t", 1, 1, 16)
    win = KVGroupSpec("d", 1, 1, 16, sliding_window=64)
    assert full.pages_needed(1000, 16) == 63
    assert win.pages_needed(1000, 16) == 5        # 4 pages of window + the one it starts in
    assert win.pages_needed(20, 16) == 2


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_layers=0), "num_layers must be a positive integer"),
    (dict(num_kv_heads=-1), "num_kv_heads must be a positive integer"),
    (dict(head_dim=72), "head_dim=72 is not a multiple of 16.*64 or 80"),
    (dict(head_dim=8), "nearest that fit: 16"),
    (dict(dtype=torch.int8), "dtype 'int8' is not supported.*bfloat16"),
    (dict(dtype="fp8"), "dtype 'fp8' is not supported"),
    (dict(name="my group"), "identifier"),
    (dict(sliding_window=0), "sliding_window must be a positive integer"),
])
def test_bad_specs_say_what_fits(kwargs, match):
    base = dict(name="target", num_layers=2, num_kv_heads=2, head_dim=64)
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        KVGroupSpec(**base)


@pytest.mark.parametrize("page_size, match", [(12, "nearest that fit are 8 and 16"),
                                              (0, "positive"), (-4, "positive")])
def test_bad_page_size(page_size, match):
    with pytest.raises(ValueError, match=match):
        PagePool([KVGroupSpec("t", 1, 1, 16)], 4, page_size)


def test_bad_pool_args():
    g = [KVGroupSpec("t", 1, 1, 16)]
    with pytest.raises(ValueError, match="num_pages"):
        PagePool(g, 0, 4)
    with pytest.raises(ValueError, match="unique"):
        PagePool([g[0], g[0]], 4, 4)
    with pytest.raises(ValueError, match="at least one"):
        PagePool([], 4, 4)
