"""The `attention_backend="torch"` implementation. The step's host work (whether any row decodes, each prefill's
mask) is planned once for all layers. Decode rows (one query token) go through the CPU kernel
paged_decode_attention (cpu_ops.cpp), which reads each row's blocks in place (16-bit, float32 or fp8); where it does
not run (CUDA tensors, no compiler) through reference.decode_attention_ref. Prefill rows go through SDPA,
over their new K/V or, with a cached prefix or an earlier chunk, over their context gathered from the cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .cpu_ops import cpu_op
from .reference import FP8, _gather_context, _sdpa, decode_attention_ref, store_kvcache_ref, to_cache


@dataclass
class PrefillSeq:
    seq: int  # its row in the batch
    start: int
    q_len: int
    ctx: int
    mask: torch.Tensor | None  # [1, 1, q_len, ctx] bool (True: attend), None when q_len == ctx (plain causal)


@dataclass
class AttentionPlan:
    slot_mapping: torch.Tensor
    all_slots_valid: bool
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    has_decode: bool
    prefill: list[PrefillSeq]


def plan_paged_attention(slot_mapping: torch.Tensor, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                         seq_lens: torch.Tensor) -> AttentionPlan:
    starts = query_start_loc.tolist()
    q_lens = [b - a for a, b in zip(starts, starts[1:])]
    all_valid = len(slot_mapping) == 0 or int(slot_mapping.min()) >= 0
    prefill = [_prefill_seq(b, starts[b], q_len, ctx, block_tables.device)
               for b, (q_len, ctx) in enumerate(zip(q_lens, seq_lens.tolist())) if q_len > 1]
    return AttentionPlan(slot_mapping, all_valid, block_tables, query_start_loc, seq_lens, 1 in q_lens, prefill)


def _prefill_seq(seq: int, start: int, q_len: int, ctx: int, device) -> PrefillSeq:
    mask = None
    if q_len < ctx:
        q_pos = torch.arange(ctx - q_len, ctx, device=device)
        mask = (torch.arange(ctx, device=device)[None, :] <= q_pos[:, None])[None, None]
    return PrefillSeq(seq, start, q_len, ctx, mask)


def cpu_reads_cache(x: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether the C++ cache kernels take this cache for activations x: on the CPU, in x's dtype or fp8."""
    return x.is_cpu and cache.dtype in (x.dtype, FP8)


def cpu_cache_op(name: str, x: torch.Tensor, cache: torch.Tensor):
    """cpu_ops.cpp's cache kernel `name` where it takes this cache (cpu_reads_cache), else None."""
    return cpu_op(name) if cpu_reads_cache(x, cache) else None


def store_kvcache_planned(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          plan: AttentionPlan, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """store_kvcache_ref without the boolean-mask copies when no token is padded: on the CPU one C++ kernel
    (cpu_ops.cpp's store_kvcache, an fp8 cache's conversion included)."""
    if not plan.all_slots_valid:
        return store_kvcache_ref(k, v, k_cache, v_cache, plan.slot_mapping, k_scale, v_scale)
    kernel = cpu_cache_op("store_kvcache", k, k_cache)
    if kernel is not None:
        return kernel(k, v, k_cache, v_cache, plan.slot_mapping, k_scale, v_scale)
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        x, cache = to_cache(x, cache.dtype, scale), cache.view(-1, *cache.shape[2:])
        if cache.dtype == FP8:  # index_copy_ has no fp8 kernel: copy the bytes
            x, cache = x.view(torch.uint8), cache.view(torch.uint8)
        cache.index_copy_(0, plan.slot_mapping, x)


def paged_attention_planned(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, plan: AttentionPlan, scale: float, k_scale: float = 1.0,
                            v_scale: float = 1.0) -> torch.Tensor:
    """paged_attention_ref from a precomputed plan. k, v are this step's new K/V (already in the cache):
    a prefill with no cached prefix attends over them directly instead of gathering them back (not from an fp8
    cache: every token must see the K/V that later steps will read)."""
    out = torch.empty_like(q)
    if plan.has_decode:
        decode = cpu_cache_op("paged_decode_attention", q, k_cache) or decode_attention_ref
        decode(out, q, k_cache, v_cache, plan.block_tables, plan.query_start_loc, plan.seq_lens, scale,
               k_scale, v_scale)
    fresh_ok = k.dtype == k_cache.dtype
    for p in plan.prefill:
        rows = slice(p.start, p.start + p.q_len)
        if p.mask is None and fresh_ok:
            kp, vp = k[rows], v[rows]
        else:
            kp, vp = _gather_context(k_cache, v_cache, plan.block_tables[p.seq], p.ctx, q.dtype, k_scale, v_scale)
        out[rows] = _sdpa(q[rows].unsqueeze(0), kp.unsqueeze(0), vp.unsqueeze(0), p.mask, scale,
                          is_causal=p.mask is None)[0]
    return out
