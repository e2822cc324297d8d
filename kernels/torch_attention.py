"""The `attention_backend="torch"` implementation: reference.py's paged attention with its per-step host work
(row order, copy positions, masks) planned once for all layers, and decode K/V kept between steps.

Decode attention is one query token per row: per KV head, a [context, head_dim] x [head_dim, query heads]
product, a softmax and a [query heads, context] x [context, head_dim] product. torch's SDPA runs that on the
CPU at a fraction of the memory bandwidth (small gemm calls per row and head), so every decode row of a step
goes through one padded batched computation per layer instead: two bmm calls over the rows' contexts laid out
head-major ([kv_heads, rows, context, head_dim]), masked past each row's length. The scores are float32 (K is
kept in float32); the probabilities meet V in the cache's dtype, as in SDPA's CPU kernel.

Those head-major buffers are copies of the paged cache. From one step to the next a row's context grows by one
token, so each layer keeps its buffers (AttentionWorkspace) and a step re-copies only the blocks written in it
or not held at their place: about one block per row instead of its whole context. A buffer row keeps holding
the same sequence while it runs (matched by its first block), whatever the batch's row order does.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from nanoserve.kernels.reference import _sdpa, store_kvcache_ref

# The kept buffers' rows are this many tokens wider than needed (rounded up), so that their layout, and their
# contents, stay valid while the rows grow.
WIDTH_SLACK_TOKENS = 64
ROWS_STEP = 16  # and room for a multiple of this many rows


@dataclass
class DecodeRows:
    """The step's decode rows in the order of the buffers' rows."""
    token_idx: torch.Tensor  # [n] long, each buffer row's q row
    blocks: torch.Tensor  # [n, width] long, its cache blocks; -1 past its context (nothing to copy)
    capacity: int  # rows the buffers' layout has room for (>= n)
    max_len: int
    mask: torch.Tensor | None  # [n, 1, max_len] additive float32, None when every row has max_len
    copy: torch.Tensor  # positions in blocks.flatten() that a buffer kept from the previous step must copy
    every: torch.Tensor  # positions in blocks.flatten() of every block (what a new buffer copies)


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

    `kept` holds each layer's decode K/V buffers, valid for the step they were updated at; they may use up to
    keep_bytes (0: every step copies every context again, into the one scratch buffer)."""
    keep_bytes: int = 0
    step: int = 0  # the number of plans made
    scratch: dict = field(default_factory=dict)  # (name, dtype, device) -> flat buffer
    kept: dict = field(default_factory=dict)  # layer's cache address -> [flat K buffer, flat V buffer, step]
    kept_bytes: int = 0
    keys: list = field(default_factory=list)  # the previous plan's buffer rows' first blocks
    held: torch.Tensor | None = None  # [rows, width]: the blocks the buffers held after the previous step
    capacity: int = 0  # the rows the buffers' layout had room for at the previous step

    def scratch_buffer(self, name: str, numel: int, like: torch.Tensor, dtype=None) -> torch.Tensor:
        key = (name, dtype or like.dtype, like.device)
        buf = self.scratch.get(key)
        if buf is None or buf.numel() < numel:
            buf = self.scratch[key] = torch.zeros(numel, dtype=key[1], device=like.device)
        return buf[:numel]

    def kept_buffers(self, key, numel: int, like: torch.Tensor) -> list | None:
        """[K buffer (float32), V buffer (like's dtype), step] for key with room for numel elements each (step -1
        when new), or None over the budget."""
        entry = self.kept.get(key)
        if entry is not None and entry[0].numel() >= numel:
            return entry
        element_bytes = 4 + like.element_size()
        old = 0 if entry is None else entry[0].numel() * element_bytes
        if self.kept_bytes - old + numel * element_bytes > self.keep_bytes:
            return None
        self.kept_bytes += numel * element_bytes - old
        entry = self.kept[key] = [torch.zeros(numel, device=like.device),
                                  torch.zeros(numel, dtype=like.dtype, device=like.device), -1]
        return entry


@dataclass
class AttentionPlan:
    """The host work of store_kvcache_ref + paged_attention_ref, done once per step and shared by every layer."""
    slot_mapping: torch.Tensor
    all_slots_valid: bool
    decode: DecodeRows | None
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
    all_valid = len(slot_mapping) == 0 or int(slot_mapping.min()) >= 0
    decode_rows = [b for b, n in enumerate(q_lens) if n == 1]
    decode = None
    if decode_rows:
        written = (slot_mapping if all_valid else slot_mapping[slot_mapping >= 0]) // block_size
        decode = _plan_decode(decode_rows, starts, seq_lens_list, block_tables, block_size, written, workspace)
    else:
        workspace.keys, workspace.held = [], None
    workspace.step += 1
    prefill = [_prefill_seq(starts[b], q_len, seq_lens_list[b], block_tables[b], block_size, dtype)
               for b, q_len in enumerate(q_lens) if q_len > 1]
    return AttentionPlan(slot_mapping, all_valid, decode, prefill, workspace, workspace.step)


def _buffer_order(rows: list[int], keys: list[int], last_keys: list[int]) -> list[int]:
    """rows, reordered so that a row whose key (its first block) held buffer row i at the previous step holds it
    again where it can; the others take the places left, in order."""
    count = {}
    for key in keys:
        count[key] = count.get(key, 0) + 1
    at = {key: row for row, key in zip(rows, keys) if count[key] == 1}  # a shared first block matches nothing
    order = [at.pop(key, None) for key in last_keys[:len(rows)]]
    order += [None] * (len(rows) - len(order))
    placed = set(order)
    rest = iter(row for row in rows if row not in placed)
    return [row if row is not None else next(rest) for row in order]


def _plan_decode(rows, starts, seq_lens, block_tables, block_size, written, workspace) -> DecodeRows:
    device = block_tables.device
    keys = block_tables[rows, 0].tolist()
    order = _buffer_order(rows, keys, workspace.keys)
    lens = [seq_lens[b] for b in order]
    max_len = max(lens)
    slack = max(1, -(-WIDTH_SLACK_TOKENS // block_size))
    width = -(-max_len // (slack * block_size)) * slack
    held, capacity = workspace.held, -(-len(rows) // ROWS_STEP) * ROWS_STEP
    if held is not None:  # a buffer's layout stays while its rows shrink
        width, capacity = max(width, held.shape[1]), max(capacity, workspace.capacity)
    order_t = torch.tensor(order, device=device)
    table = block_tables[order_t, :width].long()
    if table.shape[1] < width:  # the batch's tables are only as wide as its longest row needs
        table = F.pad(table, (0, width - table.shape[1]))
    num_blocks = torch.tensor([-(-n // block_size) for n in lens], device=device)
    table = table.masked_fill(torch.arange(width, device=device)[None, :] >= num_blocks[:, None], -1)
    every = (table.flatten() >= 0).nonzero().flatten()
    copy = every
    if workspace.keep_bytes and held is not None and (held.shape[1], workspace.capacity) == (width, capacity):
        had = torch.full_like(table, -1)
        had[:min(len(held), len(table))] = held[:len(table)]
        flat = table.flatten()
        copy = ((flat >= 0) & ((flat != had.flatten()) | torch.isin(flat, written))).nonzero().flatten()
    key_of = dict(zip(rows, keys))
    workspace.keys, workspace.held, workspace.capacity = [key_of[b] for b in order], table, capacity
    mask = None
    if min(lens) < max_len:
        keep = torch.arange(max_len, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
        mask = torch.zeros(keep.shape, device=device).masked_fill_(~keep, float("-inf"))[:, None, :]
    return DecodeRows(torch.tensor([starts[b] for b in order], device=device), table, capacity, max_len, mask, copy,
                      every)


def _prefill_seq(start, q_len, ctx, block_table, block_size, dtype) -> PrefillSeq:
    blocks = block_table[:-(-ctx // block_size)].long()
    mask = None
    if q_len < ctx:
        q_pos = torch.arange(ctx - q_len, ctx, device=blocks.device)
        keep = torch.arange(ctx, device=blocks.device)[None, :] <= q_pos[:, None]
        mask = torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf"))[None, None]
    return PrefillSeq(start, q_len, ctx, blocks, mask)


def store_kvcache_planned(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          plan: AttentionPlan) -> None:
    """store_kvcache_ref without the boolean-mask copies when no token is padded."""
    if not plan.all_slots_valid:
        return store_kvcache_ref(k, v, k_cache, v_cache, plan.slot_mapping)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, plan.slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, plan.slot_mapping, v.to(v_cache.dtype))


def paged_attention_planned(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, plan: AttentionPlan, scale: float) -> torch.Tensor:
    """paged_attention_ref from a precomputed plan. k, v are this step's new K/V (already in the cache):
    a prefill with no cached prefix attends over them directly instead of gathering them back."""
    out = torch.empty_like(q)
    if plan.decode is not None:
        out.index_copy_(0, plan.decode.token_idx, _decode_attention(q, k_cache, v_cache, plan, scale))
    fresh_ok = k.dtype == k_cache.dtype
    for p in plan.prefill:
        rows = slice(p.start, p.start + p.q_len)
        if p.mask is None and fresh_ok:
            kp, vp = k[rows].unsqueeze(0), v[rows].unsqueeze(0)
        else:
            kv = plan.workspace.scratch_buffer("prefill", 2 * len(p.blocks) * k_cache[0].numel(), k_cache)
            kv = kv.view(2, len(p.blocks), k_cache[0].numel())
            torch.index_select(k_cache.flatten(1), 0, p.blocks, out=kv[0])
            torch.index_select(v_cache.flatten(1), 0, p.blocks, out=kv[1])
            kp, vp = kv.view(2, 1, len(p.blocks) * k_cache.shape[1], *k_cache.shape[2:])[:, :, :p.ctx]
        out[rows] = _sdpa(q[rows].unsqueeze(0), kp, vp, p.mask, scale, is_causal=p.mask is None)[0]
    return out


def _decode_attention(q, k_cache, v_cache, plan: AttentionPlan, scale: float) -> torch.Tensor:
    """The decode rows' attention, [n, heads, head_dim] in buffer order: per KV head and row, the query heads
    that share it against its K [context, head_dim] in float32, then their probabilities against V in the
    cache's dtype (as SDPA's CPU kernel does: the scores in float32, the probabilities rounded for P @ V)."""
    d = plan.decode
    n, heads, head_dim = len(d.token_idx), q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    k, v = _decode_context(plan, k_cache, v_cache)  # [kv_heads, capacity, width * block_size, head_dim]
    qh = (q.index_select(0, d.token_idx).float() * scale).view(n, kv_heads, heads // kv_heads, head_dim)
    scores = q.new_empty(kv_heads, n, heads // kv_heads, d.max_len, dtype=torch.float32)
    for h in range(kv_heads):
        torch.bmm(qh[:, h], k[h, :n, :d.max_len].transpose(1, 2), out=scores[h])
    if d.mask is not None:
        scores.add_(d.mask.view(1, n, 1, d.max_len))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.stack([torch.bmm(probs[h], v[h, :n, :d.max_len]) for h in range(kv_heads)], dim=1)
    return out.view(n, heads, head_dim).to(q.dtype)


def _decode_context(plan: AttentionPlan, k_cache, v_cache) -> tuple[torch.Tensor, torch.Tensor]:
    """K (float32) and V (the cache's dtype) [kv_heads, d.capacity, width * block_size, head_dim] of the decode
    rows: this layer's buffers kept since the previous step with d.copy re-copied, or every block copied anew."""
    d, workspace = plan.decode, plan.workspace
    width = d.blocks.shape[1]
    kv_heads, head_dim = k_cache.shape[2:]
    numel = d.capacity * width * k_cache[0].numel()
    entry = workspace.kept_buffers(k_cache.data_ptr(), numel, k_cache) if workspace.keep_bytes else None
    if entry is None:
        entry = [workspace.scratch_buffer("decode_k", numel, k_cache, torch.float32),
                 workspace.scratch_buffer("decode_v", numel, k_cache), -1]
    positions = d.copy if entry[2] == plan.step - 1 else d.every
    entry[2] = plan.step
    bufs = [buf[:numel].view(kv_heads, d.capacity * width, -1) for buf in entry[:2]]
    if len(positions):
        src = d.blocks.flatten()[positions]
        for buf, cache in zip(bufs, (k_cache, v_cache)):  # blocks [m, block_size, kv_heads, head_dim]
            blocks = cache.index_select(0, src).permute(2, 0, 1, 3).to(buf.dtype)
            buf.index_copy_(1, positions, blocks.reshape(kv_heads, len(src), -1))
    return tuple(buf.view(kv_heads, d.capacity, -1, head_dim) for buf in bufs)
