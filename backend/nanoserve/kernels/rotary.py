"""Neox-style (rotate-half) rotary embedding for q and k (mirrors reference.rotary_ref).

One program per token rotates every head of q and of k, so cos/sin are loaded once per token.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, o_ptr, token, stride_xt, stride_xh, stride_ot, stride_oh, cos, sin,
                  NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    heads = tl.arange(0, HEADS_PAD)[:, None]
    cols = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < NUM_HEADS) & (cols < HALF)
    src = x_ptr + token * stride_xt + heads * stride_xh + cols
    dst = o_ptr + token * stride_ot + heads * stride_oh + cols
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst, (x1 * cos - x2 * sin).to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
                   stride_ct, stride_st,
                   Q_HEADS: tl.constexpr, K_HEADS: tl.constexpr, Q_HEADS_PAD: tl.constexpr,
                   K_HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, HALF_PAD)[None, :]
    cos = tl.load(cos_ptr + token * stride_ct + cols, mask=cols < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_st + cols, mask=cols < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, qo_ptr, token, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin,
                  Q_HEADS, Q_HEADS_PAD, HALF, HALF_PAD)
    _rotate_heads(k_ptr, ko_ptr, token, stride_kt, stride_kh, stride_kot, stride_koh, cos, sin,
                  K_HEADS, K_HEADS_PAD, HALF, HALF_PAD)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [T, H, D], k [T, KVH, D] (views of a fused qkv are fine), cos/sin [T, D//2] -> new (q, k)."""
    q, k = _last_dim_contiguous(q), _last_dim_contiguous(k)
    cos, sin = _last_dim_contiguous(cos), _last_dim_contiguous(sin)
    num_tokens, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    q_out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    k_out = torch.empty(k.shape, device=k.device, dtype=k.dtype)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        q, k, q_out, k_out, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos.stride(0), sin.stride(0),
        Q_HEADS=q_heads, K_HEADS=k_heads, Q_HEADS_PAD=triton.next_power_of_2(q_heads),
        K_HEADS_PAD=triton.next_power_of_2(k_heads), HALF=half, HALF_PAD=triton.next_power_of_2(half),
        num_warps=4,
    )
    return q_out, k_out
