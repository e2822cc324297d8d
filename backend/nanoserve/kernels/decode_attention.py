"""Paged attention for one query token per sequence (decode), with GQA and split-K (flash-decoding).

One program owns (sequence, kv head, split): it loads the query rows of every query head that shares the
kv head, so each K/V tile is read once per group instead of once per head. With split-K the context of each
sequence is cut into `num_splits` ranges of whole tiles; each split writes its running max, sum and
unnormalized accumulator, and a reduce kernel merges them. Splits only pay off when sequences x kv heads
leave SMs idle, so the default picks them from the launch shape alone (CUDA-graph friendly: no host sync).
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
TILE_N = 64  # context tokens per inner iteration (may span several pages or part of one)
MAX_SPLITS = 16


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr,
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    scale_log2, v_scale, num_heads,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_cb, stride_cs, stride_ch,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    USE_QSL: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = seq
    if USE_QSL:  # q is the varlen token batch: only rows of sequences with exactly one new token are ours
        row = tl.load(qsl_ptr + seq)
        if tl.load(qsl_ptr + seq + 1) - row != 1:
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    num_tiles = tl.cdiv(seq_len, TILE)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    group = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + group
    dims = tl.arange(0, DIM_PAD)
    qo_mask = (group < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=qo_mask, other=0.0)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        pos = tile * TILE + tl.arange(0, TILE)
        valid = pos < seq_len
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        offs = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        kv_mask = valid[:, None] & (dims < HEAD_DIM)[None, :]
        k = tl.load(k_cache_ptr + offs[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every visited tile has a valid token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + offs[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc * (v_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]  # seq_len 0 (padded row): zeros
        tl.store(out_ptr + row.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=qo_mask)
    else:
        part = (seq.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_m_ptr + part, m_i, mask=group < GROUP)
        tl.store(part_l_ptr + part, l_i, mask=group < GROUP)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=qo_mask)


@triton.jit
def _reduce_kernel(
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, qsl_ptr, v_scale, num_heads, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    USE_QSL: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = seq
    if USE_QSL:
        row = tl.load(qsl_ptr + seq)
        if tl.load(qsl_ptr + seq + 1) - row != 1:
            return
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, DIM_PAD)
    part = (seq.to(tl.int64) * num_heads + head) * NUM_SPLITS + splits
    m = tl.load(part_m_ptr + part, mask=splits < NUM_SPLITS, other=float("-inf"))
    sums = tl.load(part_l_ptr + part, mask=splits < NUM_SPLITS, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :],
                  mask=(splits < NUM_SPLITS)[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # every split empty: seq_len 0
    w = tl.exp2(m - m_max)  # empty splits (m = -inf) weigh 0
    denom = tl.sum(w * sums, 0)
    out = tl.sum(w[:, None] * acc, 0) * (v_scale / tl.where(denom > 0, denom, 1.0))
    tl.store(out_ptr + row.to(tl.int64) * stride_ot + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


@functools.lru_cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the interpreter: any small number


def default_num_splits(batch: int, num_kv_heads: int, device: torch.device, max_seq_len: int | None = None) -> int:
    """Enough splits to give every SM ~2 programs; never more than a split per 2 tiles of the longest context."""
    splits = math.ceil(2 * _num_sms(device) / max(batch * num_kv_heads, 1))
    if max_seq_len is not None:
        splits = min(splits, math.ceil(max_seq_len / (2 * TILE_N)))
    return max(1, min(splits, MAX_SPLITS))


def launch_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, out, num_splits,
                  query_start_loc=None, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Decode attention for `batch = len(seq_lens)` sequences. With query_start_loc, q/out are varlen
    token batches and only sequences with exactly one new token are handled (their row is
    query_start_loc[b]); without it, row b of q/out belongs to sequence b. k_scale joins the softmax scale and
    v_scale the final 1 / sum (an fp8 cache's scales, reference.py)."""
    batch = seq_lens.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    if batch == 0:
        return
    use_qsl = query_start_loc is not None
    qsl = query_start_loc if use_qsl else seq_lens  # dummy pointer when unused
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    if num_splits > 1:
        part_m = torch.empty((batch, num_heads, num_splits), device=q.device, dtype=torch.float32)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((batch, num_heads, num_splits, head_dim), device=q.device, dtype=torch.float32)
    else:
        part_m = part_l = part_acc = out  # unused
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, qsl, out, part_m, part_l, part_acc,
        scale * k_scale * LOG2E, v_scale, num_heads,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, DIM_PAD=dim_pad,
        BLOCK_SIZE=k_cache.shape[1], TILE=TILE_N, NUM_SPLITS=num_splits, USE_QSL=use_qsl,
        PRECISION=dot_precision(q.dtype), num_warps=4, num_stages=2,
    )
    if num_splits > 1:
        _reduce_kernel[(batch, num_heads)](
            out, part_m, part_l, part_acc, qsl, v_scale, num_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, DIM_PAD=dim_pad, NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits), USE_QSL=use_qsl, num_warps=4,
        )


def dot_precision(dtype: torch.dtype) -> str:
    return "tf32x3" if dtype == torch.float32 else "tf32"  # fp32: ~ieee accuracy on tensor cores; 16-bit: unused


def check_paged_args(q, k_cache, v_cache, out) -> None:
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1, "k/v caches need one layout"
    assert q.stride(-1) == 1 and out.stride(-1) == 1, "q and out need a contiguous last dim"
    assert out.shape == q.shape, "out must have q's shape"
    assert q.shape[1] % k_cache.shape[2] == 0, "num_heads must be a multiple of num_kv_heads"


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None, *, out: torch.Tensor | None = None, k_scale: float = 1.0,
                           v_scale: float = 1.0) -> torch.Tensor:
    """One query token per sequence, q [batch, num_heads, head_dim] (mirrors reference.paged_decode_ref).
    Rows with seq_len 0 (CUDA-graph padding) give zeros and read no K/V or block table."""
    if out is None:
        out = torch.empty_like(q)
    check_paged_args(q, k_cache, v_cache, out)
    if num_splits is None:
        num_splits = default_num_splits(q.shape[0], k_cache.shape[2], q.device)
    launch_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, out, num_splits, k_scale=k_scale,
                  v_scale=v_scale)
    return out
