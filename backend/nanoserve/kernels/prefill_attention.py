"""Paged causal attention for sequences with more than one new token (prefill, cached prefix, chunks).

One program owns a tile of BLOCK_M query rows of one sequence and one query head, and runs an online
softmax over BLOCK_N-token tiles of that sequence's paged context. Query row i of a sequence with q_len
new tokens and seq_len context sits at position seq_len - q_len + i and sees keys 0..position.

The grid is sized from tensor shapes only (no host sync): sequence b owns programs
[qsl[b] // BLOCK_M + b, qsl[b+1] // BLOCK_M + b + 1), which is at least cdiv(q_len_b, BLOCK_M) of them,
so num_tokens // BLOCK_M + batch tiles (per head) cover every batch; each program finds its sequence by
binary search over query_start_loc and surplus programs exit at once.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .decode_attention import LOG2E, dot_precision

BLOCK_M = 64
BLOCK_N = 64


@triton.jit
def _attend(q, acc, m_i, l_i, q_pos, start_n, k_cache_ptr, v_cache_ptr, table, kv_head, ctx, dims,
            stride_cb, stride_cs, stride_ch, scale_log2,
            HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
            PRECISION: tl.constexpr):
    """One online-softmax step over context tokens start_n .. start_n + BLOCK_N - 1."""
    pos = start_n + tl.arange(0, BLOCK_N)
    block = tl.load(table + pos // BLOCK_SIZE, mask=pos < ctx, other=0).to(tl.int64)
    offs = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    kv_mask = (pos < ctx)[:, None] & (dims < HEAD_DIM)[None, :]
    k = tl.load(k_cache_ptr + offs[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale_log2
    if CAUSAL:  # the diagonal tiles (and the context end)
        s = tl.where(pos[None, :] <= q_pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: key 0 is visible to every row and comes first
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + offs[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _find_sequence(qsl_ptr, tile_id, num_seqs, BLOCK_M: tl.constexpr):
    """The last sequence b whose first tile qsl[b] // BLOCK_M + b is <= tile_id (num_seqs: none)."""
    lo = tl.program_id(0) * 0
    hi = lo + num_seqs
    while lo < hi:
        mid = (lo + hi + 1) // 2
        ok = tl.load(qsl_ptr + mid) // BLOCK_M + mid <= tile_id
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr, out_ptr,
    scale_log2, v_scale, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_cb, stride_cs, stride_ch,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    head = tl.program_id(0)  # fastest-varying: heads sharing a kv head read the same K/V tiles together
    tile_id = tl.num_programs(1) - 1 - tl.program_id(1)  # last (longest causal) tiles start first
    kv_head = head // GROUP
    seq = _find_sequence(qsl_ptr, tile_id, num_seqs, BLOCK_M)
    if seq >= num_seqs:
        return
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    m_start = (tile_id - (q_start // BLOCK_M + seq)) * BLOCK_M
    if (q_len <= 1) | (m_start >= q_len):  # decode rows belong to the decode kernel
        return
    ctx = tl.load(seq_lens_ptr + seq)

    rows = m_start + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, DIM_PAD)
    qo_mask = (rows < q_len)[:, None] & (dims < HEAD_DIM)[None, :]
    tokens = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + dims[None, :], mask=qo_mask, other=0.0)
    q_pos = ctx - q_len + rows

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    first_pos = ctx - q_len + m_start
    last_pos = ctx - q_len + tl.minimum(m_start + BLOCK_M, q_len) - 1
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N  # keys before this are visible to every row: no mask
    for start_n in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend(q, acc, m_i, l_i, q_pos, start_n, k_cache_ptr, v_cache_ptr, table, kv_head,
                                ctx, dims, stride_cb, stride_cs, stride_ch, scale_log2,
                                HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, PRECISION)
    for start_n in range(full_end, last_pos + 1, BLOCK_N):
        acc, m_i, l_i = _attend(q, acc, m_i, l_i, q_pos, start_n, k_cache_ptr, v_cache_ptr, table, kv_head,
                                ctx, dims, stride_cb, stride_cs, stride_ch, scale_log2,
                                HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, PRECISION)

    out = acc * (v_scale / l_i)[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_ot + head * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=qo_mask)


def launch_prefill(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out,
                   k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    num_tokens, num_heads, head_dim = q.shape
    batch = seq_lens.shape[0]
    if batch == 0 or num_tokens == 0:
        return
    grid = (num_heads, num_tokens // BLOCK_M + batch)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        scale * k_scale * LOG2E, v_scale, batch,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=num_heads // k_cache.shape[2], HEAD_DIM=head_dim,
        DIM_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, PRECISION=dot_precision(q.dtype),
        num_warps=8 if head_dim > 128 else 4, num_stages=2,  # 4 warps spill at head_dim 256
    )
