"""Triton paged attention (decode, chunked prefill, verify, DFlash block mode) with split-KV.

Grid ``(num_seqs * num_q_blocks, num_kv_heads, num_splits)``. A program owns one KV head of one
sequence and serves *all* its GQA query heads and (up to ``BLOCK_Q``) query tokens at once: its
``BLOCK_M = BLOCK_Q * GROUP_PAD`` rows are (token, head) pairs, so each KV tile is read once and
multiplied against every query row that needs it. Decode and verify (<= 16 tokens with GQA 4) fit
one query block, which reads each KV page once per KV head (long prefill chunks take several).

Split-KV (flash-decoding): when few programs would run (few sequences, long contexts), the plan
cuts the KV range into ``num_splits`` pieces of ``tokens_per_split`` tokens; each piece writes a
normalised partial output and its log-sum-exp, merged either by a second launch
(:func:`_reduce_splits_kernel`) or, with ``FUSED_REDUCE``, in the same launch: each split program
bumps a per-(sequence, q block, KV head) arrival counter after storing its partial, and the last
to arrive merges them all and resets the counter (so CUDA-graph replays start from zero);
:func:`~.attention_plan.kernel_config` turns it on for decode (one query per sequence). The
split factor comes from host ints at plan time, never from a device->host sync.

Batch-1 verify launches (``kernel_config``'s ``TMA_STAGES``) take whole pages instead of
tiles: :func:`_paged_attention_tma_kernel` copies one page of K and one of V per step with
Hopper bulk tensor copies into a ring of stages, where the pool allows (:func:`_tma_ok`).

Addresses are int64: ``page * stride0`` overflows int32 for pools beyond 2**31 elements (the
page-copy kernel's descriptor rows are int32: :func:`_tma_ok` keeps it below 2**31 rows).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

try:   # host-side tensor descriptors (bulk tensor copies): Triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:   # pragma: no cover - older Triton keeps the tiled kernel everywhere
    TensorDescriptor = None

from ._device import gdc_launch_dependents, gdc_wait, num_sms, pdl_launch  # noqa: F401
from .attention_plan import REDUCE_TILE, AttentionMetadata, block_q_for, kernel_config

_LOG2E = 1.4426950408889634


@triton.jit
def _online_softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale, IEEE: tl.constexpr,
                         UPCAST: tl.constexpr, MASKED: tl.constexpr = True):
    """One flash-attention update: q [M, D], k [D, N], v [N, D], visible [M, N] bool (ignored
    when not ``MASKED``: every key of the tile is visible to every row)."""
    if UPCAST:
        q = q.to(tl.float32)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    if IEEE:
        s = tl.dot(q, k, input_precision="ieee")
    else:
        s = tl.dot(q, k)
    if MASKED:
        s = tl.where(visible, s * qk_scale, float("-inf"))
    else:
        s = s * qk_scale
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:
        # Rows with nothing visible yet keep m = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_safe = m_new
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["num_splits"])
def _paged_attention_kernel(
        q_ptr, kv_ptr, bk_ptr, bv_ptr, out_ptr, part_o_ptr, part_lse_ptr, counters_ptr,
        bt_ptr, seq_lens_ptr, qsl_ptr, tps_ptr, qlens_ptr,
        layer_off, qk_scale, window, tokens_per_split, num_q_blocks, num_splits,
        s_qt, s_qh, s_page, s_layer, s_kv, s_head, s_tok,
        s_bkt, s_bkh, s_bvt, s_bvh, s_ot, s_oh, s_bt,
        s_pos, s_pot, s_poh, s_pls, s_plt,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        PAGE_SIZE: tl.constexpr, CAUSAL: tl.constexpr, HAS_BLOCK: tl.constexpr,
        HAS_WINDOW: tl.constexpr, SPLIT: tl.constexpr, FUSED_REDUCE: tl.constexpr,
        RED_CHUNK: tl.constexpr, SPLIT_LOOP: tl.constexpr, IEEE: tl.constexpr,
        UPCAST: tl.constexpr, TPS_DEV: tl.constexpr, QLENS: tl.constexpr, PDL: tl.constexpr):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    pid = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq = pid // num_q_blocks
    qblk = pid % num_q_blocks
    # The plan (query offsets, lengths, split length) is read before the PDL wait: no kernel
    # writes it (host copies and plan-time tensors do, before the step's first kernel).
    q_start = tl.load(qsl_ptr + seq)
    if QLENS:
        # A captured plan's per-row query lengths (rows packed at a fixed stride).
        q_len = tl.load(qlens_ptr + seq)
    else:
        q_len = tl.load(qsl_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    if TPS_DEV:
        # A CUDA graph's plan: the split length is written per step into device memory (the
        # grid, num_splits, is fixed at capture).
        tokens_per_split = tl.load(tps_ptr)
    if PDL:   # every program waits, the idle ones too (kernels/_device.pdl_ok)
        gdc_wait()
        gdc_launch_dependents()
    if qblk * BLOCK_Q >= q_len:
        return

    offs_m = tl.arange(0, BLOCK_M)
    t = qblk * BLOCK_Q + offs_m // GROUP_PAD
    g = offs_m % GROUP_PAD
    row_ok = (t < q_len) & (g < GROUP)
    head = kvh * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_rows = (q_start + t).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * s_qt + head[:, None] * s_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if CAUSAL:
        pos = seq_len - q_len + t
        first_pos = seq_len - q_len + qblk * BLOCK_Q
    else:
        pos = seq_len + t
        first_pos = seq_len + qblk * BLOCK_Q

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    lo = split * tokens_per_split
    hi = tl.minimum(lo + tokens_per_split, seq_len)
    if CAUSAL:
        last_t = tl.minimum(q_len, (qblk + 1) * BLOCK_Q) - 1
        hi = tl.minimum(hi, seq_len - q_len + last_t + 1)
    if HAS_WINDOW:
        # BLOCK_N divides tokens_per_split, so the aligned start never crosses into the previous
        # split (which would count those keys twice).
        lo = tl.maximum(lo, (first_pos - window + 1) // BLOCK_N * BLOCK_N)
    # layer_off = layer * s_layer comes from the host: Triton specializes an int argument equal to
    # 1 into a constexpr, so `layer.to(...)` would not compile for layer 1.
    kv_base = kv_ptr + layer_off + kvh * s_head
    bt_row = bt_ptr + seq.to(tl.int64) * s_bt
    mid = lo
    if SPLIT_LOOP and not HAS_WINDOW:
        # Tiles whose every key every row sees (below the first query's position) run without
        # masks; only the tail tiles pay for them.
        if CAUSAL:
            full_end = tl.minimum(hi, first_pos + 1)
        else:
            full_end = hi
        mid = lo + tl.maximum(full_end - lo, 0) // BLOCK_N * BLOCK_N
        for start in range(lo, mid, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            page = tl.load(bt_row + offs_n // PAGE_SIZE).to(tl.int64)
            tok_off = page * s_page + (offs_n % PAGE_SIZE).to(tl.int64) * s_tok
            if BLOCK_D == HEAD_DIM:
                k = tl.load(kv_base + tok_off[None, :] + d[:, None])
                v = tl.load(kv_base + s_kv + tok_off[:, None] + d[None, :])
            else:
                k = tl.load(kv_base + tok_off[None, :] + d[:, None], mask=d_ok[:, None],
                            other=0.0)
                v = tl.load(kv_base + s_kv + tok_off[:, None] + d[None, :],
                            mask=d_ok[None, :], other=0.0)
            m_i, l_i, acc = _online_softmax_step(q, k, v, row_ok[:, None], m_i, l_i, acc,
                                                 qk_scale, IEEE, UPCAST, False)
    for start in range(mid, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = (offs_n < hi) & (offs_n >= 0)
        page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
        tok_off = page * s_page + (offs_n % PAGE_SIZE).to(tl.int64) * s_tok
        k = tl.load(kv_base + tok_off[None, :] + d[:, None],
                    mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(kv_base + s_kv + tok_off[:, None] + d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        visible = n_ok[None, :] & row_ok[:, None]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= pos[:, None])
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] > pos[:, None] - window)
        m_i, l_i, acc = _online_softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale, IEEE,
                                             UPCAST)

    if HAS_BLOCK:
        if split == 0:
            # The draft block's own K/V (scratch, packed like q): visible to every block query.
            for bstart in range(0, q_len, BLOCK_N):
                offs_b = bstart + tl.arange(0, BLOCK_N)
                b_ok = offs_b < q_len
                b_rows = (q_start + offs_b).to(tl.int64)
                k = tl.load(bk_ptr + b_rows[None, :] * s_bkt + kvh * s_bkh + d[:, None],
                            mask=b_ok[None, :] & d_ok[:, None], other=0.0)
                v = tl.load(bv_ptr + b_rows[:, None] * s_bvt + kvh * s_bvh + d[None, :],
                            mask=b_ok[:, None] & d_ok[None, :], other=0.0)
                visible = b_ok[None, :] & row_ok[:, None]
                m_i, l_i, acc = _online_softmax_step(q, k, v, visible, m_i, l_i, acc,
                                                     qk_scale, IEEE, UPCAST)

    _write_rows(acc, l_i, m_i, row_ok, q_rows, head, d, d_ok, split, pid, kvh, seq_len,
                tokens_per_split, num_splits, q_start, tl.minimum(q_len - qblk * BLOCK_Q, BLOCK_Q),
                qblk, out_ptr, part_o_ptr, part_lse_ptr, counters_ptr, s_pos, s_pot, s_poh,
                s_pls, s_plt, s_ot, s_oh, SPLIT, FUSED_REDUCE, GROUP, GROUP_PAD, BLOCK_Q,
                HEAD_DIM, BLOCK_D, RED_CHUNK)


@triton.jit(do_not_specialize=["num_splits"])
def _paged_attention_tma_kernel(
        q_ptr, kv_desc, out_ptr, part_o_ptr, part_lse_ptr, counters_ptr,
        bt_ptr, seq_lens_ptr, qsl_ptr, tps_ptr, qlens_ptr,
        layer, qk_scale, window, tokens_per_split, num_q_blocks, num_splits,
        s_qt, s_qh, s_ot, s_oh, s_bt, s_pos, s_pot, s_poh, s_pls, s_plt,
        NUM_LAYERS: tl.constexpr, HKV: tl.constexpr,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
        HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr,
        SPLIT: tl.constexpr, FUSED_REDUCE: tl.constexpr, RED_CHUNK: tl.constexpr,
        IEEE: tl.constexpr, UPCAST: tl.constexpr, TPS_DEV: tl.constexpr, QLENS: tl.constexpr,
        PDL: tl.constexpr, STAGES: tl.constexpr):
    """:func:`_paged_attention_kernel` (causal, no draft block) with each step one page of K
    and one of V, brought into a ring of ``STAGES`` shared-memory stages by Hopper bulk tensor
    copies (``kv_desc``: a ``[PAGE_SIZE, HEAD_DIM]``-box descriptor over the pool as rows of
    ``HEAD_DIM``). The copies need no address arithmetic or per-thread issue, and more of
    them stay in flight than the general kernel's two 64-token tiles: H200, batch-1
    verify-16 over 8k tokens, 36 layers in one graph, the split launch 15.2 against 19.8 us
    per layer (docs/benchmarks.md, thirteenth runner session). The split bounds are
    multiples of ``PAGE_SIZE`` (the wrapper checks), so every step is one whole page.
    (Its prologue repeats the tiled kernel's, plan and query rows, as it was measured; a
    shared helper is GPU code to re-measure.)"""
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = pid // num_q_blocks
    qblk = pid % num_q_blocks
    q_start = tl.load(qsl_ptr + seq)
    if QLENS:
        q_len = tl.load(qlens_ptr + seq)
    else:
        q_len = tl.load(qsl_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    if TPS_DEV:
        tokens_per_split = tl.load(tps_ptr)
    if PDL:   # every program waits, the idle ones too (kernels/_device.pdl_ok)
        gdc_wait()
        gdc_launch_dependents()
    if qblk * BLOCK_Q >= q_len:
        return

    offs_m = tl.arange(0, BLOCK_M)
    t = qblk * BLOCK_Q + offs_m // GROUP_PAD
    g = offs_m % GROUP_PAD
    row_ok = (t < q_len) & (g < GROUP)
    head = kvh.to(tl.int64) * GROUP + g
    d = tl.arange(0, HEAD_DIM)
    d_ok = d < HEAD_DIM
    q_rows = (q_start + t).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * s_qt + head[:, None] * s_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    pos = seq_len - q_len + t
    first_pos = seq_len - q_len + qblk * BLOCK_Q
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    lo = split * tokens_per_split
    last_t = tl.minimum(q_len, (qblk + 1) * BLOCK_Q) - 1
    hi = tl.minimum(tl.minimum(lo + tokens_per_split, seq_len), seq_len - q_len + last_t + 1)
    if HAS_WINDOW:
        lo = tl.maximum(lo, (first_pos - window + 1) // PAGE_SIZE * PAGE_SIZE)
    bt_row = bt_ptr + seq.to(tl.int64) * s_bt
    # Pool row of (page, layer, K, head, token 0); V is HKV * PAGE_SIZE rows further.
    row0 = (layer * 2 * HKV + kvh) * PAGE_SIZE
    page_rows = NUM_LAYERS * 2 * HKV * PAGE_SIZE
    v_rows = HKV * PAGE_SIZE
    mid = lo
    if not HAS_WINDOW:
        # Pages every row sees whole run without masks; only the tail pays for them.
        mid = lo + tl.maximum(tl.minimum(hi, first_pos + 1) - lo, 0) // PAGE_SIZE * PAGE_SIZE
        for start in tl.range(lo, mid, PAGE_SIZE, num_stages=STAGES):
            base = tl.load(bt_row + start // PAGE_SIZE) * page_rows + row0
            k = kv_desc.load([base, 0])
            v = kv_desc.load([base + v_rows, 0])
            m_i, l_i, acc = _online_softmax_step(q, tl.trans(k), v, row_ok[:, None], m_i, l_i,
                                                 acc, qk_scale, IEEE, UPCAST, False)
    for start in tl.range(mid, hi, PAGE_SIZE, num_stages=STAGES):
        base = tl.load(bt_row + start // PAGE_SIZE) * page_rows + row0
        offs_n = start + tl.arange(0, PAGE_SIZE)
        n_ok = offs_n < hi
        k = kv_desc.load([base, 0])
        # A page's tokens past the sequence may hold anything (NaN too): their V rows must be
        # zero, not just their probabilities.
        v = kv_desc.load([base + v_rows, 0])
        v = tl.where(n_ok[:, None], v, tl.zeros_like(v))
        visible = n_ok[None, :] & row_ok[:, None] & (offs_n[None, :] <= pos[:, None])
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] > pos[:, None] - window)
        m_i, l_i, acc = _online_softmax_step(q, tl.trans(k), v, visible, m_i, l_i, acc,
                                             qk_scale, IEEE, UPCAST)
    _write_rows(acc, l_i, m_i, row_ok, q_rows, head, d, d_ok, split, pid, kvh.to(tl.int64),
                seq_len, tokens_per_split, num_splits, q_start,
                tl.minimum(q_len - qblk * BLOCK_Q, BLOCK_Q), qblk, out_ptr, part_o_ptr,
                part_lse_ptr, counters_ptr, s_pos, s_pot, s_poh, s_pls, s_plt, s_ot, s_oh,
                SPLIT, FUSED_REDUCE, GROUP, GROUP_PAD, BLOCK_Q, HEAD_DIM, HEAD_DIM, RED_CHUNK)


@triton.jit
def _write_rows(acc, l_i, m_i, row_ok, q_rows, head, d, d_ok, split, pid, kvh, seq_len,
                tokens_per_split, num_splits, q_start, n_tok, qblk, out_ptr, part_o_ptr,
                part_lse_ptr, counters_ptr, s_pos, s_pot, s_poh, s_pls, s_plt, s_ot, s_oh,
                SPLIT: tl.constexpr, FUSED_REDUCE: tl.constexpr, GROUP: tl.constexpr,
                GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_D: tl.constexpr, RED_CHUNK: tl.constexpr):
    """A program's epilogue (both kernels): normalise its rows (``acc / l``) and store them,
    or with split-KV store the partial and its log-sum-exp, and with ``FUSED_REDUCE`` have the
    last split program of the group merge them all (:func:`_merge_splits`)."""
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if SPLIT:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        sp = split.to(tl.int64)
        # Splits that start inside the sequence (split 0 always: it holds a draft block's own
        # K/V); with the fused reduce the others store nothing and are not merged.
        live = tl.minimum(num_splits, tl.maximum(tl.cdiv(seq_len, tokens_per_split), 1))
        if FUSED_REDUCE:
            row_st = row_ok & (q_rows * 0 + split < live)   # (a row tensor: the interpreter
        else:                                                # takes no scalar-bool masks)
            row_st = row_ok
        tl.store(part_o_ptr + sp * s_pos + q_rows[:, None] * s_pot + head[:, None] * s_poh
                 + d[None, :], o, mask=row_st[:, None] & d_ok[None, :])
        tl.store(part_lse_ptr + sp * s_pls + q_rows * s_plt + head, lse, mask=row_st)
        if FUSED_REDUCE:
            # Single-launch split-KV: the last of this (sequence, q block, KV head)'s split
            # programs to arrive merges every partial. The barrier orders all threads' partial
            # stores before the one thread's gpu-scope release (acq_rel) increment; the acquire
            # side is that increment's result, broadcast through shared memory with a barrier,
            # and the partials are then read through L2 (.cg), never a stale L1 line.
            tl.debug_barrier()
            cnt_ptr = counters_ptr + pid * tl.num_programs(1) + kvh
            arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:
                tl.debug_barrier()
                _merge_splits(part_o_ptr, part_lse_ptr, out_ptr, cnt_ptr, q_start, n_tok,
                              qblk, kvh, live, s_pos, s_pot, s_poh, s_pls, s_plt, s_ot, s_oh,
                              GROUP, GROUP_PAD, BLOCK_Q, HEAD_DIM, BLOCK_D, RED_CHUNK)
    else:
        tl.store(out_ptr + q_rows[:, None] * s_ot + head[:, None] * s_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_splits(part_o_ptr, part_lse_ptr, out_ptr, cnt_ptr, q_start, n_tok, qblk, kvh,
                  live, s_pos, s_pot, s_poh, s_pls, s_plt, s_ot, s_oh,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, RED_CHUNK: tl.constexpr):
    """The fused reduce: merge the ``live`` splits' partials (the splits that start inside the
    sequence; the others stored nothing) of one program's ``n_tok`` query tokens, all ``GROUP``
    heads of a token at once as ``[GROUP_PAD, RED_CHUNK, BLOCK_D]`` tiles (an online
    log-sum-exp merge, ``RED_CHUNK`` splits per step: one step at batch 1 in the runner's
    grids), write the output and reset the arrival counter for the next launch (or graph
    replay)."""
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    g = tl.arange(0, GROUP_PAD)
    g_ok = g < GROUP
    h = (kvh * GROUP + g).to(tl.int64)
    sp = tl.arange(0, RED_CHUNK)
    for t in range(0, n_tok):
        row = (q_start + qblk * BLOCK_Q + t).to(tl.int64)
        m_run = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        den = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
        for c in range(0, live, RED_CHUNK):
            s_idx = (c + sp).to(tl.int64)
            s_ok = g_ok[:, None] & (s_idx < live)[None, :]
            # Both loads at once: a live split's partial is finite (0 where it saw nothing).
            lse = tl.load(part_lse_ptr + s_idx[None, :] * s_pls + row * s_plt + h[:, None],
                          mask=s_ok, other=float("-inf"), cache_modifier=".cg")
            o = tl.load(part_o_ptr + s_idx[None, :, None] * s_pos + row * s_pot
                        + h[:, None, None] * s_poh + d[None, None, :],
                        mask=s_ok[:, :, None] & d_ok[None, None, :], other=0.0,
                        cache_modifier=".cg")
            m_new = tl.maximum(m_run, tl.max(lse, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_run - m_safe)
            w = tl.exp2(lse - m_safe[:, None])           # [GROUP_PAD, RED_CHUNK]
            acc = acc * alpha[:, None] + tl.sum(o * w[:, :, None], 1)
            den = den * alpha + tl.sum(w, 1)
            m_run = m_new
        res = acc / tl.where(den > 0, den, 1.0)[:, None]
        tl.store(out_ptr + row * s_ot + h[:, None] * s_oh + d[None, :],
                 res.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    tl.store(cnt_ptr, 0)


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_splits_kernel(part_o_ptr, part_lse_ptr, out_ptr, num_splits, num_heads,
                          s_pos, s_pot, s_poh, s_pls, s_plt, s_ot, s_oh,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                          SPLITS_PAD: tl.constexpr, HEADS: tl.constexpr, PDL: tl.constexpr):
    """Merge split partials of ``HEADS`` query heads of one token:
    out = sum_s 2^(lse_s - max) o_s / sum_s 2^(lse_s - max). Several heads per program keep
    the grid small: with one (token, head) per program, verify's 4096-program merge (8 x 1k,
    16 tokens, 4 splits) spent 12.9 us launching programs."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    h_ok = h < num_heads
    h = h.to(tl.int64)
    sp = tl.arange(0, SPLITS_PAD)
    sp_ok = sp < num_splits
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lse = tl.load(part_lse_ptr + sp.to(tl.int64)[None, :] * s_pls + t * s_plt + h[:, None],
                  mask=h_ok[:, None] & sp_ok[None, :], other=float("-inf"))
    m = tl.max(lse, 1)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m[:, None])  # [HEADS, SPLITS_PAD]
    o = tl.load(part_o_ptr + sp.to(tl.int64)[None, :, None] * s_pos + t * s_pot
                + h[:, None, None] * s_poh + d[None, None, :],
                mask=(h_ok[:, None] & sp_ok[None, :] & (w > 0))[:, :, None] & d_ok[None, None, :],
                other=0.0)
    den = tl.sum(w, 1)
    res = tl.sum(o * w[:, :, None], 1) / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(out_ptr + t * s_ot + h[:, None] * s_oh + d[None, :],
             res.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & d_ok[None, :])


#: A process-wide cache (written only by :func:`split_counters`): per-device int32 arrival
#: counters of the fused split reduce (all zero between launches: the last program of each group
#: resets its counter). Grown, never shrunk; a grown-out buffer is kept in ``_RETIRED`` because a
#: queued launch may still use it. Allocate before a CUDA graph capture by running the kernel
#: once (any warm-up does).
_COUNTERS: dict[torch.device, Tensor] = {}
_RETIRED: list[Tensor] = []


def split_counters(device: torch.device, n: int) -> Tensor:
    """At least ``n`` zeroed int32 counters on ``device`` (cached; launches on one stream share
    them, which is safe because each launch leaves them zero; concurrent launches on two
    streams must pass their own ``counters`` to :func:`paged_attention_triton`)."""
    device = torch.device(device)
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _RETIRED.append(buf)   # a queued launch may still use it: never hand it back
        buf = torch.zeros(max(4096, triton.next_power_of_2(n)), dtype=torch.int32,
                          device=device)
        _COUNTERS[device] = buf
    return buf


def _tma_ok(cfg: dict, kv_cache: Tensor, block_kv, tokens_per_split: int, d: int) -> bool:
    """Whether :func:`_paged_attention_tma_kernel` serves this launch: ``TMA_STAGES`` in the
    config (:func:`~.attention_plan.kernel_config`), causal (no draft block), a contiguous
    pool whose pages (``[page_size, d]`` boxes) a tensor descriptor can copy (``d`` and the
    page size powers of two within 16..256 elements, rows of >= 16 bytes), splits of whole
    pages, Triton's host-side descriptors (>= 3.4), and a GPU with bulk tensor copies
    (compute capability 9) or the interpreter."""
    if (TensorDescriptor is None or not cfg.get("TMA_STAGES") or block_kv is not None
            or not kv_cache.is_contiguous()):
        return False
    P = kv_cache.shape[4]
    if (P < 16 or P > 256 or P & (P - 1) or d < 16 or d > 256 or d & (d - 1)
            or d * kv_cache.element_size() < 16 or tokens_per_split % P
            or kv_cache.numel() // d >= 2 ** 31):
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return kv_cache.is_cuda and torch.cuda.get_device_capability(kv_cache.device)[0] >= 9


def paged_attention_triton(q: Tensor, kv_cache: Tensor, layer: int, meta: AttentionMetadata, *,
                           sm_scale: float, sliding_window: int | None = None,
                           block_kv: tuple[Tensor, Tensor] | None = None,
                           out: Tensor | None = None, config: dict | None = None,
                           counters: Tensor | None = None) -> Tensor:
    """Triton path of :func:`kvstrata.kernels.attention.paged_attention` (validated there).

    q: ``[T, Hq, D]``; kv_cache: ``[num_pages, num_layers, 2, Hkv, page_size, D]`` (contiguous
    in ``D``); returns ``[T, Hq, D]`` in ``q.dtype``. ``config`` overrides
    :func:`kernel_config`'s knobs; ``counters`` (int32, zeroed, >= ``num_seqs * q_blocks *
    Hkv`` entries) replaces the cached per-device workspace of the fused split reduce.
    """
    if kv_cache.stride(5) != 1 or q.stride(2) != 1:
        raise ValueError("paged attention needs q and kv_cache contiguous in head_dim")
    T, hq, d = q.shape
    hkv = kv_cache.shape[3]
    group = hq // hkv
    if out is None:
        out = torch.empty_like(q)
    if T == 0 or meta.num_seqs == 0:
        return out
    blk_q = (config or {}).get("BLOCK_Q", block_q_for(group, meta.max_query_len))
    num_q_blocks = math.ceil(max(meta.max_query_len, 1) / blk_q)
    n_groups = meta.num_seqs * num_q_blocks * hkv
    cfg = kernel_config(group, d, meta.max_query_len, meta.tokens_per_split,
                        programs=n_groups * meta.num_splits, num_sms=num_sms(q.device, 132),
                        groups=n_groups)
    if config:
        cfg.update(config)   # tuning sweeps (benchmarks/attention_bench.py --sweep-cases)
    splits = meta.num_splits
    per = meta.tokens_per_split
    tps_dev = meta.split_tokens
    if per % 16:
        raise ValueError(f"tokens_per_split={per} must be a multiple of 16; build the "
                         f"metadata with plan_attention")
    block_n = cfg["BLOCK_N"]
    while per % block_n:     # BLOCK_N must divide tokens_per_split (a power of two >= 16 does)
        block_n //= 2
    fused = splits > 1 and bool(cfg.get("FUSED_REDUCE", False))
    if splits > 1:
        part_o = torch.empty((splits, T, hq, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((splits, T, hq), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused (SPLIT=False)
    if fused:
        if counters is None:
            counters = split_counters(q.device, n_groups)
        elif counters.dtype != torch.int32 or counters.numel() < n_groups:
            raise ValueError(f"counters must be int32 with >= {n_groups} zeroed entries")
    else:
        counters = meta.seq_lens  # unused (FUSED_REDUCE=False)
    if block_kv is not None:
        bk, bv = block_kv
        if bk.stride(2) != 1 or bv.stride(2) != 1:
            raise ValueError("block_kv tensors must be contiguous in head_dim")
    else:
        bk = bv = q  # unused (HAS_BLOCK=False)
    grid = (meta.num_seqs * num_q_blocks, hkv, splits)
    # Triton 3.9's interpreter computes bf16 tl.dot wrongly (numpy has no bf16): on the CPU
    # interpreter only, bf16 tiles are multiplied in fp32.
    upcast = q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
    if _tma_ok(cfg, kv_cache, block_kv, per, d):
        P = kv_cache.shape[4]
        desc = TensorDescriptor(kv_cache.view(-1, d), [kv_cache.numel() // d, d], [d, 1],
                                [P, d])
        _paged_attention_tma_kernel[grid](
            q, desc, out, part_o, part_lse, counters,
            meta.block_tables, meta.seq_lens, meta.query_start_loc,
            tps_dev if tps_dev is not None else meta.seq_lens,
            meta.query_lens if meta.query_lens is not None else meta.seq_lens,
            layer, sm_scale * _LOG2E, sliding_window or 0, max(per, 1), num_q_blocks, splits,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), meta.block_tables.stride(0),
            part_o.stride(0), part_o.stride(1), part_o.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            NUM_LAYERS=kv_cache.shape[1], HKV=hkv, GROUP=group, GROUP_PAD=cfg["GROUP_PAD"],
            BLOCK_Q=cfg["BLOCK_Q"], HEAD_DIM=d, PAGE_SIZE=P,
            HAS_WINDOW=sliding_window is not None, SPLIT=splits > 1, FUSED_REDUCE=fused,
            RED_CHUNK=cfg.get("RED_CHUNK", 16), IEEE=q.dtype == torch.float32 or upcast,
            UPCAST=upcast, TPS_DEV=tps_dev is not None, QLENS=meta.query_lens is not None,
            **pdl_launch(q.device, "attn"), STAGES=cfg["TMA_STAGES"],
            num_warps=cfg["num_warps"], num_stages=cfg["TMA_STAGES"])
    else:
        _paged_attention_kernel[grid](
            q, kv_cache, bk, bv, out, part_o, part_lse, counters,
            meta.block_tables, meta.seq_lens, meta.query_start_loc,
            tps_dev if tps_dev is not None else meta.seq_lens,
            meta.query_lens if meta.query_lens is not None else meta.seq_lens,
            layer * kv_cache.stride(1), sm_scale * _LOG2E, sliding_window or 0,
            max(per, 1), num_q_blocks, splits,
            q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
            kv_cache.stride(3), kv_cache.stride(4),
            bk.stride(0), bk.stride(1), bv.stride(0), bv.stride(1), out.stride(0), out.stride(1),
            meta.block_tables.stride(0),
            part_o.stride(0), part_o.stride(1), part_o.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            GROUP=group, GROUP_PAD=cfg["GROUP_PAD"], BLOCK_Q=cfg["BLOCK_Q"], HEAD_DIM=d,
            BLOCK_D=cfg["BLOCK_D"], BLOCK_N=block_n, PAGE_SIZE=kv_cache.shape[4],
            CAUSAL=block_kv is None, HAS_BLOCK=block_kv is not None,
            HAS_WINDOW=sliding_window is not None, SPLIT=splits > 1, FUSED_REDUCE=fused,
            RED_CHUNK=cfg.get("RED_CHUNK", 16), SPLIT_LOOP=bool(cfg.get("SPLIT_LOOP", False)),
            IEEE=q.dtype == torch.float32 or upcast, UPCAST=upcast, TPS_DEV=tps_dev is not None,
            QLENS=meta.query_lens is not None, **pdl_launch(q.device, "attn"),
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
            **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}))
    if splits > 1 and not fused:
        splits_pad = max(2, triton.next_power_of_2(splits))
        # powers of two all: so is heads
        heads = max(1, min(triton.next_power_of_2(hq),
                           REDUCE_TILE // (splits_pad * cfg["BLOCK_D"])))
        _reduce_splits_kernel[(T, triton.cdiv(hq, heads))](
            part_o, part_lse, out, splits, hq,
            part_o.stride(0), part_o.stride(1), part_o.stride(2),
            part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
            HEAD_DIM=d, BLOCK_D=cfg["BLOCK_D"], SPLITS_PAD=splits_pad, HEADS=heads,
            num_warps=4, **pdl_launch(q.device, "reduce"))
    return out


__all__ = ["paged_attention_triton", "split_counters"]
