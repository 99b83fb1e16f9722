"""Triton paged attention (under TRITON_INTERPRET=1 on the CPU) against the torch reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from kvstrata.kernels.attention import paged_attention, paged_attention_ref
from kvstrata.kernels.attention_plan import SplitPolicy, choose_num_splits, plan_attention
from kvstrata.kernels.attention_triton import paged_attention_triton, split_counters
from kvstrata.kernels.kv_write import write_kv
from attention_cases import FINE_SPLITS, make_case, tol


def _check(case, sm_scale=0.3, window=None, config=None, counters=None):
    if config is None and counters is None:
        got = paged_attention(case.q, case.kv_cache, case.layer, case.meta, sm_scale=sm_scale,
                              sliding_window=window, block_kv=case.block_kv, impl="triton")
    else:
        got = paged_attention_triton(case.q, case.kv_cache, case.layer, case.meta,
                                     sm_scale=sm_scale, sliding_window=window,
                                     block_kv=case.block_kv, config=config, counters=counters)
    want = paged_attention_ref(case.q, case.kv_cache, case.layer, case.meta, sm_scale=sm_scale,
                               sliding_window=window, block_kv=case.block_kv)
    assert got.dtype == case.q.dtype and got.shape == case.q.shape
    torch.testing.assert_close(got.float(), want.float(), **tol(case.q.dtype))
    return got


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("window", [None, 7])
def test_causal_decode_prefill_verify_mix(group, window):
    # decode (1), verify (16), prefill chunk spanning pages (5), a full prompt (37), no query (0)
    case = make_case([37, 1, 50, 16, 21], [37, 1, 1, 16, 0], group=group, seed=group)
    _check(case, window=window)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes_head_dim_128(dtype):
    case = make_case([45, 3, 70], [1, 3, 9], hkv=2, group=4, head_dim=128, dtype=dtype, seed=7)
    _check(case, sm_scale=128 ** -0.5)


def test_non_power_of_two_group_and_head_dim():
    case = make_case([29, 40], [6, 1], hkv=1, group=3, head_dim=80, page_size=8, seed=11)
    _check(case)


@pytest.mark.parametrize("window", [None, 100])
def test_split_kv_matches_unsplit(window):
    case = make_case([300, 70, 129], [1, 3, 2], group=4, num_splits=3, seed=2)
    assert case.meta.num_splits == 3 and case.meta.tokens_per_split == 128
    split = _check(case, window=window)
    one = make_case([300, 70, 129], [1, 3, 2], group=4, num_splits=1, seed=2)
    unsplit = paged_attention(one.q, one.kv_cache, one.layer, one.meta, sm_scale=0.3,
                              sliding_window=window, impl="triton")
    torch.testing.assert_close(split, unsplit, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("splits", [1, 2])
def test_block_mode(window, splits):
    case = make_case([0, 233, 17], [4, 4, 3], group=4, block=True, num_splits=splits, seed=3)
    _check(case, sm_scale=0.125, window=window)


@pytest.mark.parametrize("mode,group", [("decode", 1), ("decode", 4), ("decode", 8),
                                        ("verify", 1), ("verify", 4), ("block", 1),
                                        ("block", 4), ("block", 8)])
def test_fused_split_reduce_matches_reference_and_two_kernel(mode, group):
    """Single-launch split-KV (the last split program merges) against the oracle and the
    two-launch reduce; odd lengths, a window, several split counts, run twice (the arrival
    counters must be back at zero after each launch)."""
    seq_lens, q_lens = {"decode": ([200, 1, 97], [1, 1, 1]),
                        "verify": ([130, 37, 16], [16, 5, 7]),
                        "block": ([150, 0, 53], [4, 3, 4])}[mode]
    for splits, window in ((2, None), (5, 70) if mode != "block" else (3, 9)):
        case = make_case(seq_lens, q_lens, group=group, head_dim=32, page_size=8,
                         block=mode == "block", num_splits=splits, split_policy=FINE_SPLITS,
                         seed=splits * 10 + group)
        assert case.meta.num_splits == splits and case.meta.tokens_per_split % 16 == 0
        assert (splits - 1) * case.meta.tokens_per_split < max(seq_lens)  # no empty last split
        counters = torch.zeros(64, dtype=torch.int32)
        fused = _check(case, window=window, config=dict(FUSED_REDUCE=True, SPLIT_LOOP=True),
                       counters=counters)
        assert counters.abs().sum() == 0
        if splits == 2:
            again = _check(case, window=window, config=dict(FUSED_REDUCE=True),
                           counters=counters)
            assert counters.abs().sum() == 0 and torch.equal(fused, again)
        two = paged_attention_triton(case.q, case.kv_cache, case.layer, case.meta, sm_scale=0.3,
                                     sliding_window=window, block_kv=case.block_kv,
                                     config=dict(FUSED_REDUCE=False))
        torch.testing.assert_close(fused, two, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [16, 64])
def test_fused_reduce_chunks_and_cached_workspace(chunk):
    """More splits than the reduce chunk (several merge steps), bf16, the cached per-device
    counters (zero after the launch), verify-sized query blocks split in two (BLOCK_Q=8); the
    unmasked-interior loop over several full tiles per split."""
    case = make_case([300, 111], [16, 3], group=4, head_dim=32, page_size=16,
                     dtype=torch.bfloat16, num_splits=18, split_policy=FINE_SPLITS, seed=4)
    assert case.meta.num_splits == 18
    _check(case, config=dict(FUSED_REDUCE=True, RED_CHUNK=chunk, BLOCK_Q=8))
    _check(case, config=dict(SPLIT_LOOP=True, BLOCK_N=16))
    assert split_counters(case.q.device, 1).abs().sum() == 0
    bad = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="counters"):
        _check(case, config=dict(FUSED_REDUCE=True), counters=bad)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("splits,window", [(1, None), (2, None), (5, 70), (3, 9)])
def test_tma_pages_match_reference_and_tiles(group, splits, window, monkeypatch):
    """The bulk-copy path (one page of K and V per step; verify-sized queries, odd lengths,
    windows, split-KV with the merge fused or launched, an empty row) against the oracle and
    the tiled kernel; the tiled kernel must not run."""
    import kvstrata.kernels.attention_triton as at
    case = make_case([130, 37, 16, 0], [16, 5, 7, 0], group=group, head_dim=32, page_size=16,
                     num_splits=splits, split_policy=FINE_SPLITS, seed=splits * 10 + group)
    tiled = {f: paged_attention_triton(case.q, case.kv_cache, case.layer, case.meta,
                                       sm_scale=0.3, sliding_window=window,
                                       config=dict(FUSED_REDUCE=f, TMA_STAGES=0))
             for f in (True, False)}

    class _Unused:
        def __getitem__(self, grid):
            raise AssertionError("the tiled kernel ran")
    monkeypatch.setattr(at, "_paged_attention_kernel", _Unused())
    for fused in (True, False):
        got = _check(case, window=window, config=dict(TMA_STAGES=4, FUSED_REDUCE=fused))
        torch.testing.assert_close(got, tiled[fused], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("splits,window", [(1, None), (5, 40)])
def test_tma_pages_serve_one_query_token_too(splits, window):
    """Decode rows (one query token, the fused merge) through the page copies, which
    kernel_config does not choose for them yet (not measured in the step)."""
    case = make_case([200, 1, 97], [1, 1, 1], group=4, head_dim=32, page_size=16,
                     num_splits=splits, split_policy=FINE_SPLITS, seed=splits)
    for fused in (True, False):
        _check(case, window=window, config=dict(TMA_STAGES=4, FUSED_REDUCE=fused))


def test_tma_pages_ignore_whatever_lies_past_the_sequence():
    """A partial last page is copied whole: the tokens past the sequence (NaN here) must
    not reach the output, through K or through V; bf16 at head_dim 128 equals the tiles."""
    case = make_case([37, 21], [5, 3], group=4, head_dim=64, page_size=16, num_splits=1, seed=5)
    for s, n in enumerate([37, 21]):
        case.kv_cache[case.meta.block_tables[s, (n - 1) // 16], :, :, :, n % 16:] = float("nan")
    for window in (None, 7):
        assert torch.isfinite(_check(case, window=window, config=dict(TMA_STAGES=2))).all()
    case = make_case([300, 111], [16, 3], hkv=2, group=4, head_dim=128, page_size=16,
                     dtype=torch.bfloat16, num_splits=3, split_policy=FINE_SPLITS, seed=4)
    a = _check(case, config=dict(TMA_STAGES=8))
    b = _check(case, config=dict(TMA_STAGES=0))
    torch.testing.assert_close(a, b, atol=2e-2, rtol=0)


def test_tma_only_where_a_descriptor_can_copy_the_pages():
    from kvstrata.kernels.attention_triton import _tma_ok
    kv = torch.zeros(4, 2, 2, 2, 16, 64)
    on = dict(TMA_STAGES=8)
    assert _tma_ok(on, kv, None, 32, 64)
    assert not _tma_ok(dict(TMA_STAGES=0), kv, None, 32, 64)
    assert not _tma_ok(on, kv, (kv, kv), 32, 64)                      # the draft block
    assert not _tma_ok(on, kv, None, 24, 64)                          # splits not whole pages
    assert not _tma_ok(on, torch.zeros(4, 2, 2, 2, 8, 64), None, 32, 64)   # pages of 8
    assert not _tma_ok(on, kv.transpose(0, 1), None, 32, 64)           # not contiguous
    assert not _tma_ok(on, torch.zeros(4, 2, 2, 2, 16, 80), None, 32, 80)  # d not 2^k


def test_split_choice_is_host_only_and_sane():
    # Decode of <= 16 (sequence, KV head) groups merges in the same launch over ~2 programs
    # per SM: 33 programs per head (the plan drops the one whose 128-token-aligned split
    # would start past the sequence: 32, below).
    assert choose_num_splits(1, 32768, num_kv_heads=8, num_sms=132) == 33
    assert choose_num_splits(1, 8192, num_kv_heads=8, num_sms=132) == 33
    # A few short sequences: 512-token splits would leave SMs idle, so splits go down to 128.
    assert choose_num_splits(1, 1024, num_kv_heads=8, num_sms=132) == 8
    assert choose_num_splits(2, 8192, num_kv_heads=8, num_sms=132) == 16    # 512-token splits fill it
    assert choose_num_splits(128, 32768, num_kv_heads=8, num_sms=132) == 1
    # Decode: at most 4 programs per SM (3 splits = 768 programs ran 35% slower on an H200).
    assert choose_num_splits(32, 8192, num_kv_heads=8, num_sms=132) == 2
    assert choose_num_splits(8, 32768, num_kv_heads=8, num_sms=132) == 8
    # Short contexts that fill the SMs are not split.
    assert choose_num_splits(32, 1024, num_kv_heads=8, num_sms=132) == 1
    assert choose_num_splits(8, 1024, num_kv_heads=8, num_sms=132) == 8
    # Multi-token queries (verify): >= 2 splits over long contexts, 256-token fine splits, and
    # 128-token ones only where 256-token splits would still leave SMs idle.
    v = dict(num_kv_heads=8, num_sms=132, max_query_len=16)
    assert choose_num_splits(128, 8192, **v) == 2
    assert choose_num_splits(64, 8192, **v) == 1     # one wave of 512 programs: whole
    assert choose_num_splits(32, 8192, **v) == 2
    assert choose_num_splits(8, 32768, **v) == 8
    assert choose_num_splits(1, 8192, **v) == 32
    assert choose_num_splits(8, 1024, **v) == 4
    assert choose_num_splits(1, 1024, **v) == 8
    assert choose_num_splits(1, 2048, **v) == 16
    assert choose_num_splits(128, 1024, **v) == 1
    # The policy's knobs (what the GPU sweep varies).
    pol = SplitPolicy(min_tokens=1024, fine_min_tokens=256, waves=2.0, max_splits=16)
    assert choose_num_splits(1, 8192, num_kv_heads=8, num_sms=132, policy=pol) == 16
    assert choose_num_splits(32, 8192, num_kv_heads=8, num_sms=132, policy=pol) == 1
    assert choose_num_splits(16, 8192, num_kv_heads=8, num_sms=132, policy=pol) == 2
    assert choose_num_splits(1, 100, num_kv_heads=8, num_sms=132) == 1
    with pytest.raises(ValueError):
        SplitPolicy(align=48)
    with pytest.raises(ValueError):
        SplitPolicy(min_tokens=64, fine_min_tokens=128)
    bt = torch.zeros(1, 2048, dtype=torch.int32)
    meta = plan_attention(bt, [32768], [1], page_size=16, num_sms=132, num_kv_heads=8)
    assert meta.num_splits == 32 and meta.tokens_per_split == 1024
    meta = plan_attention(bt, [8192], [1], page_size=16, num_sms=132, num_kv_heads=8)
    assert meta.num_splits == 32 and meta.tokens_per_split == 256
    # 8 sequences (64 groups) keep the 4-wave plan and the merge launch.
    assert choose_num_splits(8, 8192, num_kv_heads=8, num_sms=132) == 8
    meta = plan_attention(bt, [8192], [1], page_size=16, num_sms=132, num_kv_heads=8,
                          split_policy=SplitPolicy(align=64, max_splits=128, fused_waves=4.0))
    assert meta.num_splits == 64 and meta.tokens_per_split == 128
    meta = plan_attention(bt, torch.tensor([100], dtype=torch.int32), [1], page_size=16)
    assert meta.max_seq_len == 100 and meta.seq_lens_host == [100] and meta.num_splits == 1


def test_plan_never_reads_device_values():
    """Plan from tensors whose values cannot be read (the meta device): any device->host sync
    (``.tolist()``, ``.item()``, ``int(t)``) would raise."""
    bt = torch.zeros(3, 512, dtype=torch.int32, device="meta")
    sl = torch.zeros(3, dtype=torch.int32, device="meta")
    meta = plan_attention(bt, sl, [1, 1, 1], page_size=16, num_sms=132, num_kv_heads=8)
    assert meta.max_seq_len == 512 * 16 and meta.num_splits == choose_num_splits(
        3, 8192, num_kv_heads=8, num_sms=132)
    meta = plan_attention(bt, sl, [16, 16, 16], page_size=16, num_sms=132, num_kv_heads=8,
                          seq_lens_host=[4000, 17, 300])
    assert meta.max_seq_len == 4000 and meta.seq_lens.device.type == "meta"


def test_int64_addressing_past_2_31_elements():
    """A real pool of > 2**31 elements (bf16, ~4.3 GB virtual; only touched pages are resident):
    pages at the top of the pool sit past the int32 range of element offsets."""
    P, D = 16, 16
    num_pages = 2 ** 31 // (2 * P * D) + 64
    kv = torch.empty(num_pages, 1, 2, 1, P, D, dtype=torch.bfloat16)
    assert kv.numel() > 2 ** 31 and (num_pages - 1) * kv.stride(0) > 2 ** 31
    pages = [num_pages - 1, num_pages - 7, 5, num_pages - 3]
    g = torch.Generator().manual_seed(0)
    kv[:8] = torch.randn(8, 1, 2, 1, P, D, generator=g).bfloat16()  # decoys a wrap would hit
    seq_len = 4 * P - 3
    slots = torch.tensor([pages[i // P] * P + i % P for i in range(seq_len)], dtype=torch.int64)
    k = torch.randn(seq_len, 1, D, generator=g).bfloat16()
    v = torch.randn(seq_len, 1, D, generator=g).bfloat16()
    write_kv(kv, 0, k, v, slots, impl="triton")
    assert torch.equal(kv[num_pages - 3, 0, 1, 0, :seq_len - 3 * P], v[3 * P:, 0])
    q = torch.randn(3, 4, D, generator=g).bfloat16()
    meta = plan_attention(torch.tensor([pages], dtype=torch.int32), [seq_len], [3], page_size=P)
    got = paged_attention(q, kv, 0, meta, sm_scale=0.25, impl="triton")
    # Oracle from the dense K/V (independent of any pool indexing).
    pos = torch.arange(seq_len - 3, seq_len)
    mask = torch.arange(seq_len)[None] <= pos[:, None]
    s = torch.einsum("qhd,kd->hqk", q.float(), k[:, 0].float()) * 0.25
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
    want = torch.einsum("hqk,kd->qhd", p, v[:, 0].float())
    torch.testing.assert_close(got.float(), want, **tol(torch.bfloat16))


@given(lens=st.lists(st.tuples(st.integers(0, 70), st.integers(0, 9)), min_size=1, max_size=4),
       group=st.sampled_from([1, 2, 4, 8]), window=st.one_of(st.none(), st.integers(1, 40)),
       block=st.booleans(), splits=st.integers(1, 3), fused=st.booleans(),
       split_loop=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_property_triton_equals_reference(lens, group, window, block, splits, fused, split_loop,
                                          seed):
    seq_lens = [s if block else max(s, q) for s, q in lens]
    q_lens = [q for _, q in lens]
    if sum(q_lens) == 0:
        q_lens[0] = 1
        seq_lens[0] = max(seq_lens[0], 1)
    case = make_case(seq_lens, q_lens, hkv=2, group=group, head_dim=32, page_size=8,
                     block=block, num_splits=splits, split_policy=FINE_SPLITS, seed=seed)
    _check(case, window=window, config=dict(FUSED_REDUCE=fused, SPLIT_LOOP=split_loop))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block", [False, True])
def test_cuda_compiled_kernel_matches_reference(dtype, block):
    """The compiled kernel on a GPU (run by benchmarks/gpu_run.sh): unsplit, split with the
    two-launch reduce and with the fused (atomic arrival counter) reduce; tiles and (for the
    causal cases) bulk page copies."""
    for splits, fused in ((1, False), (4, False), (4, True), (7, True)):
        c = make_case([300, 1, 77], [1, 1, 16] if not block else [4, 4, 16], hkv=8, group=4,
                      head_dim=128, dtype=dtype, block=block, num_splits=splits, seed=splits,
                      split_policy=FINE_SPLITS)
        q, kv = c.q.cuda(), c.kv_cache.cuda()
        sl, ql = c.meta.host_lens()
        meta = plan_attention(c.meta.block_tables, sl, ql, page_size=16, causal=not block,
                              num_splits=splits, device="cuda", split_policy=FINE_SPLITS)
        bkv = None if c.block_kv is None else (c.block_kv[0].cuda(), c.block_kv[1].cuda())
        for window, tma in ((None, 0), (None, 8), (50, 0), (50, 8)):
            got = paged_attention_triton(q, kv, c.layer, meta, sm_scale=0.1,
                                         sliding_window=window, block_kv=bkv,
                                         config=dict(FUSED_REDUCE=fused, TMA_STAGES=tma))
            want = paged_attention_ref(c.q, c.kv_cache, c.layer, c.meta, sm_scale=0.1,
                                       sliding_window=window, block_kv=c.block_kv)
            torch.testing.assert_close(got.cpu().float(), want.float(),
                                       **(tol(dtype) if dtype != torch.float32
                                          else dict(atol=1e-4, rtol=1e-4)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fused_reduce_repeated_launches_and_graph_replay():
    """Many split programs racing for the arrival counters, launched again and again (eagerly and
    from a CUDA graph): every result equals the two-launch reduce's."""
    c = make_case([4096, 1500, 77, 4000], [1, 1, 1, 16], hkv=8, group=4, head_dim=128,
                  dtype=torch.bfloat16, num_splits=48, split_policy=FINE_SPLITS, seed=9)
    q, kv = c.q.cuda(), c.kv_cache.cuda()
    sl, ql = c.meta.host_lens()
    meta = plan_attention(c.meta.block_tables, sl, ql, page_size=16, num_splits=48,
                          device="cuda", split_policy=FINE_SPLITS)
    run = lambda fused: paged_attention_triton(q, kv, c.layer, meta, sm_scale=0.1,  # noqa: E731
                                               config=dict(FUSED_REDUCE=fused, BLOCK_N=32))
    want = run(False)
    for _ in range(20):
        torch.testing.assert_close(run(True), want, atol=2e-3, rtol=0)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run(True)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        out = run(True)
    for _ in range(20):
        out.zero_()
        g.replay()
        torch.testing.assert_close(out, want, atol=2e-3, rtol=0)
    assert split_counters(q.device, 1).abs().sum().item() == 0


def test_kernel_config_tiles_follow_the_grid():
    # 64 query rows: 64-token tiles while the launch fits one wave (<= 2 programs per SM),
    # 32-token tiles capped at 128 registers beyond; decode unchanged; 4-8 query tokens
    # capped beyond one wave as well.
    from kvstrata.kernels.attention_plan import kernel_config
    one_wave = kernel_config(4, 128, 16, 0, programs=256, num_sms=132)
    assert one_wave["BLOCK_Q"] * one_wave["GROUP_PAD"] == 64
    assert one_wave["BLOCK_N"] == 64 and one_wave["maxnreg"] is None
    many = kernel_config(4, 128, 16, 0, programs=512, num_sms=132)
    assert many["BLOCK_N"] == 32 and many["maxnreg"] == 128
    dec = kernel_config(4, 128, 1, 128, programs=512, num_sms=132)
    assert dec["BLOCK_N"] == 32 and dec["maxnreg"] is None
    # 4 or 8 query tokens (narrower verify widths): capped beyond two programs per SM too
    for q in (4, 8):
        narrow = kernel_config(4, 128, q, 2048, programs=512, num_sms=132)
        assert narrow["BLOCK_Q"] * narrow["GROUP_PAD"] == 4 * q and narrow["maxnreg"] == 128
        assert kernel_config(4, 128, q, 2048, programs=256, num_sms=132)["maxnreg"] is None
    assert kernel_config(4, 128, 1, 1024, programs=64)["BLOCK_N"] == 64
    # Decode merges its splits in the same launch, 32 splits per merge tile at GQA 4, d 128;
    # verify keeps the merge launch.
    assert dec["FUSED_REDUCE"] and dec["RED_CHUNK"] == 32
    # ... only decode of few groups (batch 1-2 at 8 KV heads): more merge in a second launch.
    assert kernel_config(4, 128, 1, 128, programs=256, groups=16)["FUSED_REDUCE"]
    assert not kernel_config(4, 128, 1, 1024, programs=512, groups=64)["FUSED_REDUCE"]
    assert not one_wave["FUSED_REDUCE"] and not many["FUSED_REDUCE"]
    # Bulk page copies: verify-sized queries over <= 3 programs per SM (batch 1) only.
    assert kernel_config(4, 128, 16, 256, programs=272, num_sms=132)["TMA_STAGES"] == 8
    assert kernel_config(4, 128, 2, 256, programs=272, num_sms=132)["TMA_STAGES"] == 8
    assert kernel_config(4, 128, 16, 256, programs=512, num_sms=132)["TMA_STAGES"] == 0
    assert kernel_config(4, 128, 1, 256, programs=272, num_sms=132)["TMA_STAGES"] == 0
    assert kernel_config(4, 128, 64, 256, programs=64, num_sms=132)["TMA_STAGES"] == 0


@pytest.mark.parametrize("q_len,fused", [(1, True), (1, False), (4, False)])
def test_device_split_length_and_padding_rows(q_len, fused):
    """A CUDA graph's plan: the grid is sized once (8 splits), the split length is read from
    device memory each step; a padding row (length 0, causal) outputs zeros, as the reference."""
    import dataclasses
    c = make_case([300, 70, 5], [q_len] * 3, hkv=2, group=4, head_dim=32, seed=3)
    seq_lens = c.meta.seq_lens.clone()
    seq_lens[2] = 0                       # the padding row
    # Two steps' split lengths over the same grid; the runner's device lengths are multiples of
    # 32 that the plan's KV tile (from its host length) need not divide: 48 and 80 over tiles
    # of 64 run a masked last tile.
    for per, host, block_n in ((48, 16, 16), (64, 16, 16), (48, 64, 64), (80, 64, 64)):
        meta = dataclasses.replace(c.meta, seq_lens=seq_lens, num_splits=8,
                                   tokens_per_split=host, seq_lens_host=None,
                                   split_tokens=torch.tensor([per], dtype=torch.int32))
        got = paged_attention_triton(c.q, c.kv_cache, c.layer, meta, sm_scale=0.3,
                                     config=dict(FUSED_REDUCE=fused, BLOCK_N=block_n))
        want = paged_attention_ref(c.q, c.kv_cache, c.layer, meta, sm_scale=0.3)
        torch.testing.assert_close(got.float(), want.float(), **tol(c.q.dtype))
        assert torch.count_nonzero(want[2 * q_len:]) == 0


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("splits", [1, 3])
def test_per_row_query_lengths_at_a_fixed_stride(causal, splits):
    """A captured plan's layout: every sequence owns Q rows, ``query_lens`` says how many of
    them are queries. Those rows equal a plan packing only the real queries (kernel and
    reference); the rest are not written by the kernel and are never read (block mode's own
    K/V included)."""
    import dataclasses
    Q, P, hkv, group, d = 4, 4, 2, 2, 32
    seq_ctx, qlens = [9, 14, 5], [4, 1, 3]
    g = torch.Generator().manual_seed(11)
    pages = 16
    kv = torch.randn(pages, 1, 2, hkv, P, d, generator=g)
    bt = torch.randperm(pages, generator=g)[:12].view(3, 4).to(torch.int32)
    q = torch.randn(3 * Q, hkv * group, d, generator=g)
    bk, bv = torch.randn(3 * Q, hkv, d, generator=g), torch.randn(3 * Q, hkv, d, generator=g)
    rows = [s * Q + i for s, n in enumerate(qlens) for i in range(n)]
    sl = [c + (n if causal else 0) for c, n in zip(seq_ctx, qlens)]
    dense = plan_attention(bt, sl, qlens, page_size=P, causal=causal, num_splits=splits,
                           num_kv_heads=hkv)
    strided = plan_attention(bt, sl, [Q] * 3, page_size=P, causal=causal, num_splits=splits,
                             num_kv_heads=hkv)
    strided = dataclasses.replace(strided, tokens_per_split=dense.tokens_per_split,
                                  query_lens=torch.tensor(qlens, dtype=torch.int32))
    blk = (bk, bv) if not causal else None
    blk_dense = (bk[rows], bv[rows]) if not causal else None
    want = paged_attention_ref(q[rows], kv, 0, dense, sm_scale=0.3, block_kv=blk_dense)
    ref = paged_attention_ref(q, kv, 0, strided, sm_scale=0.3, block_kv=blk)
    got = paged_attention_triton(q, kv, 0, strided, sm_scale=0.3, block_kv=blk)
    torch.testing.assert_close(ref[rows], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[rows], want, atol=1e-4, rtol=1e-4)
    # poisoning the rows past each block changes none of the real rows
    junk = [r for r in range(3 * Q) if r not in rows]
    q2 = q.clone()
    q2[junk] = float("nan")
    if blk is not None:
        blk = (bk.clone().index_fill_(0, torch.tensor(junk), float("nan")),
               bv.clone().index_fill_(0, torch.tensor(junk), float("nan")))
    got2 = paged_attention_triton(q2, kv, 0, strided, sm_scale=0.3, block_kv=blk)
    assert torch.equal(got2[rows], got[rows])
