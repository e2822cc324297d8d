"""The `attention_backend="torch"` implementation: reference.py's paged attention with its per-step host work
(row groups, gather indices, masks) planned once for all layers, and decode K/V gathers kept between steps.

Plain-torch decode attention gathers each row's context out of the paged cache into a contiguous buffer and
runs SDPA on it. The gather is memory-bound and costs about as much as the attention itself. From one decode
step to the next a row's context grows by one token, so on the CPU each layer keeps its gathered buffers
(AttentionWorkspace) and a step re-copies only the blocks written in it or that moved: one or two blocks per
row instead of its whole context. Which blocks those are is worked out once per step, in the plan.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from nanoserve.kernels.reference import _sdpa, _similar_lengths, store_kvcache_ref

# Padding a group's shorter rows costs SDPA work on the gathered copy; below ~1.25x, extra SDPA calls cost more.
DECODE_MAX_PAD = 1.25
# A kept group's gathered rows are this many tokens wider than needed (rounded up), so that its buffer keeps
# its layout, and stays valid, while the rows grow. Without kept buffers the slack would only be copied.
WIDTH_SLACK_TOKENS = 64


@dataclass
class DecodeGroup:
    token_idx: torch.Tensor  # [g] long, the group's q rows
    blocks: torch.Tensor  # [g * width] long, the rows' cache blocks back to back, each row padded to width
    width: int  # blocks per row in the gathered buffer
    max_len: int
    mask: torch.Tensor | None  # [g, 1, 1, max_len] additive float, None when every row has max_len
    stale: torch.Tensor | None  # positions in `blocks` a buffer kept from the previous step must re-copy
    # (written this step, or a different block than before); None: that buffer cannot be reused


@dataclass
class PrefillSeq:
    start: int
    q_len: int
    ctx: int
    blocks: torch.Tensor  # [ceil(ctx / block_size)] long
    mask: torch.Tensor | None  # [1, 1, q_len, ctx] additive float, None when q_len == ctx (plain causal)


@dataclass
class AttentionWorkspace:
    """The torch backend's buffers, owned by the model runner and reused every step: a fresh multi-MB tensor
    per layer costs page faults that take ~3x as long as the copy into it.

    `kept` holds each layer's gathered decode context per group, valid for the step it was copied at; it may
    use up to keep_bytes (0: every step gathers every context again, into the one scratch buffer)."""
    keep_bytes: int = 0
    step: int = 0  # the number of plans made
    scratch: dict = field(default_factory=dict)  # (dtype, device) -> flat buffer
    kept: dict = field(default_factory=dict)  # (layer's cache address, group index) -> [flat buffer, step]
    kept_bytes: int = 0
    last_blocks: list = field(default_factory=list)  # the previous plan's DecodeGroup.blocks

    def scratch_buffer(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        key = (like.dtype, like.device)
        buf = self.scratch.get(key)
        if buf is None or buf.numel() < numel:
            buf = self.scratch[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf[:numel]

    def kept_buffer(self, key: tuple, numel: int, like: torch.Tensor) -> list | None:
        """[buffer, step] for key with room for numel elements (step -1 when new), or None over the budget."""
        entry = self.kept.get(key)
        if entry is not None and entry[0].numel() >= numel:
            return entry
        old = 0 if entry is None else entry[0].numel() * entry[0].element_size()
        new = numel * like.element_size()
        if self.kept_bytes - old + new > self.keep_bytes:
            return None
        self.kept_bytes += new - old
        entry = self.kept[key] = [torch.empty(numel, dtype=like.dtype, device=like.device), -1]
        return entry


@dataclass
class AttentionPlan:
    """The host work of store_kvcache_ref + paged_attention_ref, done once per step and shared by every layer."""
    slot_mapping: torch.Tensor
    all_slots_valid: bool
    decode: list[DecodeGroup]
    prefill: list[PrefillSeq]
    workspace: AttentionWorkspace
    step: int


def plan_paged_attention(slot_mapping: torch.Tensor, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                         seq_lens: torch.Tensor, block_size: int, dtype: torch.dtype,
                         workspace: AttentionWorkspace | None = None) -> AttentionPlan:
    workspace = AttentionWorkspace() if workspace is None else workspace
    starts = query_start_loc.tolist()
    seq_lens_list = seq_lens.tolist()
    q_lens = [b - a for a, b in zip(starts, starts[1:])]
    decode_rows = [b for b, n in enumerate(q_lens) if n == 1]
    all_valid = len(slot_mapping) == 0 or int(slot_mapping.min()) >= 0
    written = None  # the cache blocks this step writes, computed when a kept buffer could be reused
    slack_tokens = WIDTH_SLACK_TOKENS if workspace.keep_bytes else 0
    decode = []
    for index, group in enumerate(_similar_lengths(decode_rows, seq_lens_list, DECODE_MAX_PAD)):
        decode.append(_decode_group(group, starts, seq_lens_list, block_tables, block_size, slack_tokens, dtype))
        last = workspace.last_blocks[index] if index < len(workspace.last_blocks) else None
        if workspace.keep_bytes and last is not None and last.shape == decode[-1].blocks.shape:
            if written is None:
                written = (slot_mapping if all_valid else slot_mapping[slot_mapping >= 0]) // block_size
            blocks = decode[-1].blocks
            decode[-1].stale = ((blocks != last) | torch.isin(blocks, written)).nonzero().flatten()
    workspace.last_blocks = [g.blocks for g in decode]
    workspace.step += 1
    prefill = [_prefill_seq(starts[b], q_len, seq_lens_list[b], block_tables[b], block_size, dtype)
               for b, q_len in enumerate(q_lens) if q_len > 1]
    return AttentionPlan(slot_mapping, all_valid, decode, prefill, workspace, workspace.step)


def store_kvcache_planned(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          plan: AttentionPlan) -> None:
    """store_kvcache_ref without the boolean-mask copies when no token is padded."""
    if not plan.all_slots_valid:
        return store_kvcache_ref(k, v, k_cache, v_cache, plan.slot_mapping)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, plan.slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, plan.slot_mapping, v.to(v_cache.dtype))


def _decode_group(rows, starts, seq_lens, block_tables, block_size, slack_tokens, dtype) -> DecodeGroup:
    lens = [seq_lens[b] for b in rows]
    max_len = max(lens)
    device = block_tables.device
    slack = max(1, -(-slack_tokens // block_size))  # width is a multiple of this many blocks
    width = -(-max_len // (slack * block_size)) * slack
    rows_t = torch.tensor(rows, device=device)
    table = block_tables[rows_t, :width].long().clamp(min=0)
    if table.shape[1] < width:  # the batch's tables are only as wide as its longest row needs
        table = F.pad(table, (0, width - table.shape[1]))
    mask = None
    if min(lens) < max_len:
        keep = torch.arange(max_len, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
        mask = _additive(keep, dtype)[:, None, None, :]
    return DecodeGroup(torch.tensor([starts[b] for b in rows], device=device), table.flatten(), width, max_len,
                       mask, None)


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
    for index, g in enumerate(plan.decode):
        kv = _decode_context(plan, index, g, k_cache, v_cache)
        kg, vg = kv.view(2, len(g.token_idx), g.width * k_cache.shape[1], *k_cache.shape[2:])[:, :, :g.max_len]
        out.index_copy_(0, g.token_idx, _decode_sdpa(q[g.token_idx], kg, vg, g.mask, scale))
    fresh_ok = k.dtype == k_cache.dtype
    for p in plan.prefill:
        rows = slice(p.start, p.start + p.q_len)
        if p.mask is None and fresh_ok:
            kp, vp = k[rows].unsqueeze(0), v[rows].unsqueeze(0)
        else:
            kv = _gather(plan.workspace.scratch_buffer(2 * len(p.blocks) * k_cache[0].numel(), k_cache),
                         k_cache, v_cache, p.blocks)
            kp, vp = kv.view(2, 1, len(p.blocks) * k_cache.shape[1], *k_cache.shape[2:])[:, :, :p.ctx]
        out[rows] = _sdpa(q[rows].unsqueeze(0), kp, vp, p.mask, scale, is_causal=p.mask is None)[0]
    return out


def _decode_sdpa(q, k, v, mask, scale) -> torch.Tensor:
    """One query token per row: q [g, heads, head_dim], k/v [g, len, kv_heads, head_dim] -> like q. The query
    heads that share a KV head go in as that head's query positions (the mask holds for each of them), so SDPA
    reads each KV head once per row, where enable_gqa reads it once per query head."""
    g, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    out = F.scaled_dot_product_attention(q.view(g, kv_heads, heads // kv_heads, head_dim),
                                         k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype),
                                         attn_mask=mask, scale=scale)
    return out.view(g, heads, head_dim)


def _decode_context(plan: AttentionPlan, index: int, g: DecodeGroup, k_cache, v_cache) -> torch.Tensor:
    """[2, len(g.blocks), block numel]: the group's K and V blocks, from this layer's buffer kept since the
    previous step (re-copying only g.stale) or gathered anew."""
    workspace, numel = plan.workspace, 2 * len(g.blocks) * k_cache[0].numel()
    entry = workspace.kept_buffer((k_cache.data_ptr(), index), numel, k_cache) if workspace.keep_bytes else None
    if entry is None:
        return _gather(workspace.scratch_buffer(numel, k_cache), k_cache, v_cache, g.blocks)
    buf, held_step = entry[0][:numel], entry[1]
    entry[1] = plan.step
    if held_step != plan.step - 1 or g.stale is None or 2 * len(g.stale) > len(g.blocks):
        return _gather(buf, k_cache, v_cache, g.blocks)
    kv = buf.view(2, len(g.blocks), k_cache[0].numel())
    if len(g.stale):
        src = g.blocks[g.stale]
        kv[0].index_copy_(0, g.stale, k_cache.flatten(1).index_select(0, src))
        kv[1].index_copy_(0, g.stale, v_cache.flatten(1).index_select(0, src))
    return kv


def _gather(buf: torch.Tensor, k_cache, v_cache, blocks) -> torch.Tensor:
    kv = buf.view(2, len(blocks), k_cache[0].numel())
    torch.index_select(k_cache.flatten(1), 0, blocks, out=kv[0])
    torch.index_select(v_cache.flatten(1), 0, blocks, out=kv[1])
    return kv
