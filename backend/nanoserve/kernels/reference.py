"""Plain-torch references for every kernel: the oracle the Triton kernels, the CPU kernels (cpu_ops.cpp) and the
torch backend (torch_attention.py) are tested against, and the torch backend's path where no kernel runs.

KV cache layout (per layer): k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
A token's slot is block_id * block_size + offset; slot -1 marks a padded token (not stored).
An fp8 cache (float8_e4m3fn, kv_cache_dtype="fp8") holds k / k_scale and v / v_scale, saturated at ±448: each
layer's two scales, as vLLM keeps them (1.0 unless set). Every reader dequantizes as it loads.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x as the cache stores it: x itself in the cache's dtype, or x / scale in fp8 (saturating: a plain cast
    turns what exceeds ±448 into NaN)."""
    if cache_dtype != FP8:
        return x.to(cache_dtype)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def from_cache(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """What the cache's x stands for, in dtype."""
    return (x.float() * scale).to(dtype) if x.dtype == FP8 else x.to(dtype)


def store_kvcache_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write k, v [num_tokens, num_kv_heads, head_dim] into the paged cache at slot_mapping [num_tokens]."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = to_cache(k[valid], k_cache.dtype, k_scale)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = to_cache(v[valid], v_cache.dtype, v_scale)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of q [num_tokens, num_heads, head_dim] over the paged cache (which already holds
    the new tokens' K/V). Sequence b owns q rows query_start_loc[b]:query_start_loc[b+1], the last rows
    of its seq_lens[b] positions. Works for prefill (with a cached prefix), chunked prefill and decode."""
    out = torch.empty_like(q)
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    starts = query_start_loc[:-1].tolist()
    seq_lens_list = seq_lens.tolist()
    decode_attention_ref(out, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, k_scale, v_scale)
    for b, q_len in enumerate(q_lens):
        if q_len <= 1:
            continue
        start, ctx = starts[b], seq_lens_list[b]
        k, v = _gather_context(k_cache, v_cache, block_tables[b], ctx, q.dtype, k_scale, v_scale)
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]  # [q_len, ctx]
        out[start:start + q_len] = _sdpa(q[start:start + q_len].unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                         mask[None, None], scale)[0]
    return out


def decode_attention_ref(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                         scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """out's rows of the sequences with one query token (decodes): what cpu_ops.cpp's paged_decode_attention
    computes. The others are left alone."""
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    decode_rows = [b for b, n in enumerate(q_lens) if n == 1]
    for group in _similar_lengths(decode_rows, seq_lens.tolist()):
        rows = torch.tensor(group, device=q.device)
        token_idx = query_start_loc[:-1][rows].long()
        out[token_idx] = paged_decode_ref(q[token_idx], k_cache, v_cache, block_tables[rows], seq_lens[rows], scale,
                                          k_scale, v_scale)


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
                     seq_lens: torch.Tensor, scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """One query token per sequence, q [batch, num_heads, head_dim], batched over padded contexts."""
    block_size = k_cache.shape[1]
    max_len = int(seq_lens.max())
    num_blocks = -(-max_len // block_size)
    tables = block_tables[:, :num_blocks].long().clamp(min=0).flatten()
    # index_select copies whole blocks: ~2x faster on CPU than advanced indexing with a 2-D index
    k = k_cache.index_select(0, tables).view(len(q), -1, *k_cache.shape[2:])[:, :max_len]
    v = v_cache.index_select(0, tables).view(len(q), -1, *v_cache.shape[2:])[:, :max_len]
    k, v = from_cache(k, q.dtype, k_scale), from_cache(v, q.dtype, v_scale)
    mask = torch.arange(max_len, device=q.device)[None, :] < seq_lens[:, None]  # [batch, max_len]
    return _sdpa(q.unsqueeze(1), k, v, mask[:, None, None, :], scale)[:, 0]


def _gather_context(k_cache, v_cache, block_table, ctx, dtype, k_scale=1.0, v_scale=1.0):
    """The first ctx tokens' K/V of a sequence, in dtype."""
    block_size = k_cache.shape[1]
    blocks = block_table[:-(-ctx // block_size)].long()
    k = k_cache.index_select(0, blocks).flatten(0, 1)[:ctx]
    v = v_cache.index_select(0, blocks).flatten(0, 1)[:ctx]
    return from_cache(k, dtype, k_scale), from_cache(v, dtype, v_scale)


def _sdpa(q, k, v, mask, scale, is_causal=False):
    """q [B, Lq, H, D], k/v [B, Lk, KVH, D], mask (boolean or additive) broadcastable to [B, H, Lq, Lk]
    -> [B, Lq, H, D]."""
    # enable_gqa reads each KV head for its whole query group: ~10x faster on CPU than repeating K/V.
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2).to(q.dtype),
                                         v.transpose(1, 2).to(q.dtype), attn_mask=mask, scale=scale,
                                         is_causal=is_causal, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


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


def add_lora_ref(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 token_slots: torch.Tensor, parts: list[tuple[int, int]]) -> None:
    """y [T, out] += each token's adapter delta of x [T, in], in place. token_slots [T]: the token's adapter slot
    (-1: none); lora_a [slots, len(parts) * rank, in], lora_b [slots, out, rank]; parts: (first output column,
    size) of each sub-projection of a fused linear, whose A rows are i * rank .. (i + 1) * rank. The tokens of a
    slot are one group (punica's SGMV segment): (x @ A.T) @ B.T, part by part."""
    rank = lora_a.shape[1] // len(parts)
    for slot in torch.unique(token_slots).tolist():
        if slot < 0:
            continue
        rows = torch.nonzero(token_slots == slot).flatten()
        shrunk = x.index_select(0, rows) @ lora_a[slot].T  # [n, parts * rank]
        b = lora_b[slot]
        delta = torch.cat([shrunk[:, i * rank:(i + 1) * rank] @ b[start:start + size].T
                           for i, (start, size) in enumerate(parts)], dim=1)
        y.index_add_(0, rows, delta)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N, K] (uint8 in [0, 15], K even) -> [N, K / 2] uint8: code 2j in byte j's low nibble, code
    2j + 1 in its high one (the layout of kernels/quant_matmul.py)."""
    pairs = codes.reshape(codes.shape[0], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """pack_int4's inverse: [N, K / 2] uint8 -> codes [N, K] uint8."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] of codes [N, K]: codes * scale + offset of each code's group (scale, offset
    [N, K / group])."""
    group = codes.shape[1] // scale.shape[1]
    return codes.float() * scale.float().repeat_interleave(group, 1) + offset.float().repeat_interleave(group, 1)


def dequantize_int4_groups(packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] of pack_int4 codes (dequantize_codes)."""
    return dequantize_codes(unpack_int4(packed), scale, offset)


INT4_CHUNK = 64  # pack_int4_chunks' chunk: two groups of 32 codes


def pack_int4_chunks(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N, K] (uint8 in [0, 15], K a multiple of INT4_CHUNK) -> [N, K / 2] uint8, chunk by chunk: byte
    b of chunk c holds code 64 c + b in its low nibble and code 64 c + 32 + b in its high one (the layout of
    cpu_ops.cpp's int4_linear: one 32-byte load holds a chunk's two groups of 32 codes in order)."""
    halves = codes.reshape(codes.shape[0], -1, 2, INT4_CHUNK // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(codes.shape[0], -1)


def unpack_int4_chunks(packed: torch.Tensor) -> torch.Tensor:
    """pack_int4_chunks' inverse: [N, K / 2] uint8 -> codes [N, K] uint8."""
    chunks = packed.reshape(packed.shape[0], -1, INT4_CHUNK // 2)
    return torch.stack([chunks & 0xF, chunks >> 4], dim=2).reshape(packed.shape[0], -1)


def int4_linear_bf16_ref(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                         offset: torch.Tensor) -> torch.Tensor:
    """cpu_ops.cpp's int4_linear for more than 4 rows: x [T, K] @ the 4-bit weight^T (pack_int4_chunks codes,
    w = q * scale + offset per group of K / scale.shape[1] inputs), both rounded to bfloat16 (the weight after
    dequantizing), summed in float64; in x's dtype."""
    weight = dequantize_int4_chunks(packed, scale, offset)
    as_bf16 = lambda t: t.to(torch.bfloat16).double()  # noqa: E731
    return (as_bf16(x) @ as_bf16(weight).T).to(x.dtype)


def int4_linear_int16_ref(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                          offset: torch.Tensor) -> torch.Tensor:
    """cpu_ops.cpp's int4_linear for up to 4 rows: x [T, K] quantized per row to int16 codes (quantize_rows_ref,
    digits=2) @ the exact 4-bit weight^T: per group the integer sum of codes x q times the group's scale, plus its
    offset times the group's code sum, times the row's scale; in float64, then x's dtype."""
    codes, row_scale = quantize_rows_ref(x, 2)
    q = unpack_int4_chunks(packed).double()
    rows, groups = codes.shape[0], scale.shape[1]
    codes = codes.double().reshape(rows, 1, groups, -1)
    per_group = (codes * q.reshape(1, q.shape[0], groups, -1)).sum(-1)  # [T, N, groups], exact
    y = (per_group * scale.double()).sum(-1) + codes.sum(-1)[:, 0] @ offset.double().T
    return (y * row_scale.double()[:, None]).to(x.dtype)


def dequantize_int4_chunks(packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] of pack_int4_chunks codes (dequantize_codes)."""
    return dequantize_codes(unpack_int4_chunks(packed), scale, offset)


def int8_matmul_ref(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ (codes [N, K] int8 * scale [N])^T in x's dtype: the weight dequantized, then F.linear."""
    return F.linear(x, (codes.float() * scale.float()[:, None]).to(x.dtype))


def int4_group_matmul_ref(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                          offset: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ dequantize_int4_groups(packed, scale, offset)^T in x's dtype."""
    return F.linear(x, dequantize_int4_groups(packed, scale, offset).to(x.dtype))


TOP_CODE = {1: 127, 2: 127 * 256 + 127}  # the largest code of activations as 1 or 2 int8 digits


def quantize_rows_ref(x: torch.Tensor, digits: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of x [T, K] as integer codes round(x * top / max |x|) and its scale max |x| / top [T] (float32),
    top = TOP_CODE[digits]: int8 codes (digits=1), or int16 ones that split into two int8 digits (digits=2,
    split_digits). A row's |error| <= its scale / 2; an all-zero row has codes 0 and scale 0."""
    x = x.float()
    top = x.abs().amax(dim=1)
    # top_code divided by top (`127 / top` would be 127 * (1 / top), rounded twice)
    inv = torch.where(top > 0, torch.full_like(top, TOP_CODE[digits]).div(top), torch.zeros_like(top))
    codes = (x * inv[:, None]).round()
    return codes.to(torch.int8 if digits == 1 else torch.int16), top / TOP_CODE[digits]


def split_digits(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int16 codes c as int8 digits (hi, lo), c = 256 hi + lo, lo in [-128, 127]."""
    hi = torch.div(codes.int() + 128, 256, rounding_mode="floor")
    return hi.to(torch.int8), (codes.int() - 256 * hi).to(torch.int8)


def w8a8_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, digits: int = 1) -> torch.Tensor:
    """x [T, K] @ (qweight [N, K] int8 * scales [N])^T with x quantized per row (quantize_rows_ref): the exact
    integer sums of the codes, times the row's scale and the output channel's, in x's dtype."""
    codes, row_scale = quantize_rows_ref(x, digits)
    sums = codes.long() @ qweight.long().T
    return (sums.float() * row_scale[:, None] * scales.float()).to(x.dtype)


BLOCK = 32  # activations per block (as llama.cpp's Q8_0 blocks): cpu_ops.cpp's kBlock
BLOCK_TOP = TOP_CODE[2]  # blocks hold int16 codes: int8 ones lose too much on real models (cpu_ops.cpp)
INTERLEAVE = 8  # pack_int4_interleaved's channels per block: cpu_ops.cpp's kInterleave


def _padded_blocks(t: torch.Tensor) -> torch.Tensor:
    """t [N, ...] with zero rows up to a multiple of INTERLEAVE, as [N / 8, 8, ...]."""
    pad = -t.shape[0] % INTERLEAVE
    t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t
    return t.reshape(-1, INTERLEAVE, *t.shape[1:])


def pack_int4_interleaved(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N, K] (uint8 in [0, 15], K a multiple of 32) -> [ceil(N / 8), K * 4] uint8 (cpu_ops.cpp's
    int4_block_linear): per block of 8 channels (the last padded with zero codes), group by group of 32 inputs, 8
    runs of 16 bytes; byte 2 c + p of run j holds channel c's code 2 j + p in its low nibble and 16 + 2 j + p in its
    high one, so that one run is the int16 pairs of all 8 channels for two pairs of inputs."""
    blocks = _padded_blocks(codes).reshape(-1, INTERLEAVE, codes.shape[1] // BLOCK, 2, 8, 2)  # [B, c, g, half, j, p]
    halves = blocks.permute(0, 2, 3, 4, 1, 5)  # [B, g, half, j, c, p]
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(blocks.shape[0], -1)


def unpack_int4_interleaved(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """pack_int4_interleaved's inverse: -> codes [out_features, K] uint8."""
    runs = packed.reshape(packed.shape[0], -1, 8, INTERLEAVE, 2)  # [B, g, j, c, p]
    halves = torch.stack([runs & 0xF, runs >> 4], dim=2)  # [B, g, half, j, c, p]
    codes = halves.permute(0, 4, 1, 2, 3, 5).reshape(packed.shape[0] * INTERLEAVE, -1)
    return codes[:out_features]


def interleave_groups(t: torch.Tensor) -> torch.Tensor:
    """A group tensor (scale or offset) [N, G] -> [ceil(N / 8), G * 8] in pack_int4_interleaved's blocks: the 8
    channels' values for each group together (zeros for the padding)."""
    return _padded_blocks(t).transpose(1, 2).reshape(-1, t.shape[1] * INTERLEAVE).contiguous()


def deinterleave_groups(t: torch.Tensor, out_features: int) -> torch.Tensor:
    """interleave_groups' inverse: -> [out_features, G]."""
    return t.reshape(t.shape[0], -1, INTERLEAVE).transpose(1, 2).reshape(-1, t.shape[1] // INTERLEAVE)[:out_features]


def dequantize_int4_interleaved(packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                                out_features: int) -> torch.Tensor:
    """The float32 weight [out_features, K] of pack_int4_interleaved codes and interleave_groups scales and offsets
    (dequantize_codes)."""
    return dequantize_codes(unpack_int4_interleaved(packed, out_features), deinterleave_groups(scale, out_features),
                            deinterleave_groups(offset, out_features))


def quantize_blocks_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, K] in blocks: each group of BLOCK inputs of a row quantized as a row of its own (quantize_rows_ref,
    digits=2): int16 codes [T, K / 32, 32], the group's scale d = max |x| / BLOCK_TOP and its sum of x (float64),
    each [T, K / 32]. |error| <= d / 2."""
    groups = x.float().reshape(x.shape[0], -1, BLOCK)
    codes, d = quantize_rows_ref(groups.reshape(-1, BLOCK), 2)
    return codes.reshape(groups.shape), d.reshape(groups.shape[:2]), groups.double().sum(-1)


def _block_products(x: torch.Tensor, weight_codes: torch.Tensor):
    """The exact integer products of x's block codes with weight codes [N, K], per group [T, N, K / 32] (float64),
    with the groups' scales and sums (quantize_blocks_ref)."""
    codes, d, sums = quantize_blocks_ref(x)
    w = weight_codes.double().reshape(weight_codes.shape[0], -1, BLOCK)
    return torch.einsum("tgi,ngi->tng", codes.double(), w), d.double(), sums


def int4_block_linear_ref(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                          out_features: int) -> torch.Tensor:
    """cpu_ops.cpp's int4_block_linear: x [T, K] in blocks @ the 4-bit weight^T (pack_int4_interleaved codes,
    interleave_groups scales and offsets, w = q * scale + offset per group): per group the integer sum of codes x q
    times the group's two scales, plus its offset times the group's exact sum of x; in float64, then x's dtype."""
    per_group, d, sums = _block_products(x, unpack_int4_interleaved(packed, out_features))
    scale, offset = (deinterleave_groups(t, out_features).double() for t in (scale, offset))
    y = (per_group * scale[None] * d[:, None]).sum(-1) + sums @ offset.T
    return y.to(x.dtype)


def int8_block_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """cpu_ops.cpp's int8_block_linear: x [T, K] in blocks @ (qweight [N, K] int8 * scales [N])^T: per group the
    integer sum of codes x qweight times the group's scale, summed, times the channel's scale; in float64, then
    x's dtype."""
    per_group, d, _ = _block_products(x, qweight)
    return ((per_group * d[:, None]).sum(-1) * scales.double()).to(x.dtype)
