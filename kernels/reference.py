"""Plain-torch references for every kernel. Also the `attention_backend="torch"` implementation, through
the same code with its per-step host work planned once for all layers (plan_paged_attention).

KV cache layout (per layer): k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
A token's slot is block_id * block_size + offset; slot -1 marks a padded token (not stored).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def store_kvcache_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write k, v [num_tokens, num_kv_heads, head_dim] into the paged cache at slot_mapping [num_tokens]."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[valid].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[valid].to(v_cache.dtype)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """Causal attention of q [num_tokens, num_heads, head_dim] over the paged cache (which already holds
    the new tokens' K/V). Sequence b owns q rows query_start_loc[b]:query_start_loc[b+1], the last rows
    of its seq_lens[b] positions. Works for prefill (with a cached prefix), chunked prefill and decode."""
    out = torch.empty_like(q)
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    starts = query_start_loc[:-1].tolist()
    seq_lens_list = seq_lens.tolist()
    decode_rows = [b for b, n in enumerate(q_lens) if n == 1]
    for group in _similar_lengths(decode_rows, seq_lens_list):
        rows = torch.tensor(group, device=q.device)
        token_idx = query_start_loc[:-1][rows].long()
        out[token_idx] = paged_decode_ref(q[token_idx], k_cache, v_cache, block_tables[rows], seq_lens[rows], scale)
    for b, q_len in enumerate(q_lens):
        if q_len <= 1:
            continue
        start, ctx = starts[b], seq_lens_list[b]
        k, v = _gather_context(k_cache, v_cache, block_tables[b], ctx)
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]  # [q_len, ctx]
        out[start:start + q_len] = _sdpa(q[start:start + q_len].unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                         mask[None, None], scale)[0]
    return out


def _similar_lengths(rows: list[int], seq_lens: list[int], max_pad: float = 1.5) -> list[list[int]]:
    """Decode rows grouped so that no context is padded to more than max_pad x its length: a batched decode
    pads every row to the group's longest context, which for mixed lengths would otherwise double the work."""
    groups: list[list[int]] = []
    shortest = 0
    for row in sorted(rows, key=seq_lens.__getitem__):
        if not groups or seq_lens[row] > max_pad * shortest:
            groups.append([])
            shortest = seq_lens[row]
        groups[-1].append(row)
    return groups


def paged_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per sequence, q [batch, num_heads, head_dim], batched over padded contexts."""
    block_size = k_cache.shape[1]
    max_len = int(seq_lens.max())
    num_blocks = -(-max_len // block_size)
    tables = block_tables[:, :num_blocks].long().clamp(min=0).flatten()
    # index_select copies whole blocks: ~2x faster on CPU than advanced indexing with a 2-D index
    k = k_cache.index_select(0, tables).view(len(q), -1, *k_cache.shape[2:])[:, :max_len]
    v = v_cache.index_select(0, tables).view(len(q), -1, *v_cache.shape[2:])[:, :max_len]
    mask = torch.arange(max_len, device=q.device)[None, :] < seq_lens[:, None]  # [batch, max_len]
    return _sdpa(q.unsqueeze(1), k, v, mask[:, None, None, :], scale)[:, 0]


def _gather_context(k_cache, v_cache, block_table, ctx):
    block_size = k_cache.shape[1]
    blocks = block_table[:-(-ctx // block_size)].long()
    k = k_cache.index_select(0, blocks).flatten(0, 1)[:ctx]
    v = v_cache.index_select(0, blocks).flatten(0, 1)[:ctx]
    return k, v


def _sdpa(q, k, v, mask, scale, is_causal=False):
    """q [B, Lq, H, D], k/v [B, Lk, KVH, D], mask (boolean or additive) broadcastable to [B, H, Lq, Lk]
    -> [B, Lq, H, D]."""
    # enable_gqa reads each KV head for its whole query group: ~10x faster on CPU than repeating K/V.
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2).to(q.dtype),
                                         v.transpose(1, 2).to(q.dtype), attn_mask=mask, scale=scale,
                                         is_causal=is_causal, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


@dataclass
class DecodeGroup:
    token_idx: torch.Tensor  # [g] long, the group's q rows
    blocks: torch.Tensor  # [g * num_blocks] long, the rows' cache blocks back to back
    max_len: int
    mask: torch.Tensor | None  # [g, 1, 1, max_len] additive float, None when every row has max_len


@dataclass
class PrefillSeq:
    start: int
    q_len: int
    ctx: int
    blocks: torch.Tensor  # [ceil(ctx / block_size)] long
    mask: torch.Tensor | None  # [1, 1, q_len, ctx] additive float, None when q_len == ctx (plain causal)


@dataclass
class AttentionPlan:
    """The host work of store_kvcache_ref + paged_attention_ref (rows, groups, gather indices, masks) done
    once per step and shared by every layer: the torch backend's fast path."""
    slot_mapping: torch.Tensor
    all_slots_valid: bool
    decode: list[DecodeGroup]
    prefill: list[PrefillSeq]
    workspace: dict  # (dtype, device) -> the buffer K/V are gathered into, reused by every layer (and step)


# Padding a group's shorter rows costs SDPA work on the gathered copy; below ~1.25x, extra SDPA calls cost more.
DECODE_MAX_PAD = 1.25


def plan_paged_attention(slot_mapping: torch.Tensor, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                         seq_lens: torch.Tensor, block_size: int, dtype: torch.dtype,
                         workspace: dict | None = None) -> AttentionPlan:
    starts = query_start_loc.tolist()
    seq_lens_list = seq_lens.tolist()
    q_lens = [b - a for a, b in zip(starts, starts[1:])]
    decode_rows = [b for b, n in enumerate(q_lens) if n == 1]
    decode = [_decode_group(group, starts, seq_lens_list, block_tables, block_size, dtype)
              for group in _similar_lengths(decode_rows, seq_lens_list, DECODE_MAX_PAD)]
    prefill = [_prefill_seq(starts[b], q_len, seq_lens_list[b], block_tables[b], block_size, dtype)
               for b, q_len in enumerate(q_lens) if q_len > 1]
    all_valid = len(slot_mapping) == 0 or int(slot_mapping.min()) >= 0
    return AttentionPlan(slot_mapping, all_valid, decode, prefill, {} if workspace is None else workspace)


def store_kvcache_planned(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          plan: AttentionPlan) -> None:
    """store_kvcache_ref without the boolean-mask copies when no token is padded."""
    if not plan.all_slots_valid:
        return store_kvcache_ref(k, v, k_cache, v_cache, plan.slot_mapping)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, plan.slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, plan.slot_mapping, v.to(v_cache.dtype))


def _decode_group(rows, starts, seq_lens, block_tables, block_size, dtype) -> DecodeGroup:
    lens = [seq_lens[b] for b in rows]
    max_len = max(lens)
    device = block_tables.device
    rows_t = torch.tensor(rows, device=device)
    blocks = block_tables[rows_t, :-(-max_len // block_size)].long().clamp(min=0).flatten()
    mask = None
    if min(lens) < max_len:
        keep = torch.arange(max_len, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
        mask = _additive(keep, dtype)[:, None, None, :]
    return DecodeGroup(torch.tensor([starts[b] for b in rows], device=device), blocks, max_len, mask)


def _prefill_seq(start, q_len, ctx, block_table, block_size, dtype) -> PrefillSeq:
    blocks = block_table[:-(-ctx // block_size)].long()
    mask = None
    if q_len < ctx:
        q_pos = torch.arange(ctx - q_len, ctx, device=blocks.device)
        mask = _additive(torch.arange(ctx, device=blocks.device)[None, :] <= q_pos[:, None], dtype)[None, None]
    return PrefillSeq(start, q_len, ctx, blocks, mask)


def _additive(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as the additive float mask SDPA would convert it to (once per step, not per layer)."""
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf"))


def paged_attention_planned(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, plan: AttentionPlan, scale: float) -> torch.Tensor:
    """paged_attention_ref from a precomputed plan. k, v are this step's new K/V (already in the cache):
    a prefill with no cached prefix attends over them directly instead of gathering them back."""
    out = torch.empty_like(q)
    for g in plan.decode:
        kg, vg = _gather_context_into_workspace(plan.workspace, k_cache, v_cache, g.blocks, len(g.token_idx),
                                                g.max_len)
        out.index_copy_(0, g.token_idx, _sdpa(q[g.token_idx].unsqueeze(1), kg, vg, g.mask, scale)[:, 0])
    fresh_ok = k.dtype == k_cache.dtype
    for p in plan.prefill:
        rows = slice(p.start, p.start + p.q_len)
        if p.mask is None and fresh_ok:
            kp, vp = k[rows].unsqueeze(0), v[rows].unsqueeze(0)
        else:
            kp, vp = _gather_context_into_workspace(plan.workspace, k_cache, v_cache, p.blocks, 1, p.ctx)
        out[rows] = _sdpa(q[rows].unsqueeze(0), kp, vp, p.mask, scale, is_causal=p.mask is None)[0]
    return out


def _gather_context_into_workspace(workspace: dict, k_cache, v_cache, blocks, batch, length):
    """The blocks' K and V as [batch, length, kv_heads, head_dim] views of one reused buffer (valid until the
    next call): a fresh multi-MB tensor per layer costs page faults that take ~3x as long as the copy."""
    n, row = len(blocks), k_cache[0].numel()
    key = (k_cache.dtype, k_cache.device)
    buf = workspace.get(key)
    if buf is None or buf.numel() < 2 * n * row:
        buf = workspace[key] = torch.empty(2 * n * row, dtype=k_cache.dtype, device=k_cache.device)
    kv = buf[:2 * n * row].view(2, n, row)
    torch.index_select(k_cache.flatten(1), 0, blocks, out=kv[0])
    torch.index_select(v_cache.flatten(1), 0, blocks, out=kv[1])
    k, v = kv.view(2, batch, -1, *k_cache.shape[2:])[:, :, :length]
    return k, v


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return x32.to(x.dtype) * weight


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual), as HF computes it in the residual stream dtype."""
    summed = x + residual
    return rms_norm_ref(summed, weight, eps), summed


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Neox-style (rotate-half) RoPE as HF Llama/Qwen apply it. q [T, H, D], k [T, KVH, D], cos/sin [T, D//2]."""
    def rotate(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        c, s = cos[:, None, :].float(), sin[:, None, :].float()
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
    return rotate(q), rotate(k)
