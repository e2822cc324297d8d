"""Batched LoRA over each token's adapter slot, punica's BGMV shape (mirrors reference.add_lora_ref).

Two kernels, one program per (token, block of output columns): shrink computes s = x @ A_slot.T [T, parts * rank]
in float32, expand adds s's part columns @ B_slot.T to the part's output columns, once per part of a fused
linear. A token of slot -1 (the base model) returns at once. The delta is added in float32 and rounded once,
where the reference rounds the shrunk activations and the delta to x's dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, out_ptr, stride_x, stride_a_slot, stride_a_row, stride_o,
                   N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[t, n] = sum_k x[t, k] * a[slot(t), n, k]."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + t * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + slot * stride_a_slot + n[:, None] * stride_a_row + k[None, :],
                    mask=(n[:, None] < N) & (k[None, :] < K), other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], 1)
    tl.store(out_ptr + t * stride_o + n, acc, mask=n < N)


@triton.jit
def _expand_kernel(s_ptr, b_ptr, slots_ptr, y_ptr, stride_s, stride_b_slot, stride_b_row, stride_y,
                   N: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """y[t, n] += sum_r s[t, r] * b[slot(t), n, r]."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    s = tl.load(s_ptr + t * stride_s + r, mask=r < R, other=0.0)
    b = tl.load(b_ptr + slot * stride_b_slot + n[:, None] * stride_b_row + r[None, :],
                mask=(n[:, None] < N) & (r[None, :] < R), other=0.0).to(tl.float32)
    delta = tl.sum(b * s[None, :], 1)
    y = tl.load(y_ptr + t * stride_y + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * stride_y + n, (y + delta).to(y_ptr.dtype.element_ty), mask=n < N)


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             token_slots: torch.Tensor, parts: list[tuple[int, int]]) -> None:
    """y [T, out] += each token's adapter delta of x [T, in], in place (see reference.add_lora_ref)."""
    num_tokens, in_size = x.shape
    if num_tokens == 0:
        return
    assert y.stride(-1) == 1 and lora_a.stride(-1) == 1 and lora_b.stride(-1) == 1
    x = x if x.stride(-1) == 1 else x.contiguous()
    rank = lora_a.shape[1] // len(parts)
    shrunk = torch.empty(num_tokens, lora_a.shape[1], device=x.device, dtype=torch.float32)
    block_n = min(triton.next_power_of_2(lora_a.shape[1]), 64)
    _shrink_kernel[(num_tokens, triton.cdiv(lora_a.shape[1], block_n))](
        x, lora_a, token_slots, shrunk, x.stride(0), lora_a.stride(0), lora_a.stride(1), shrunk.stride(0),
        N=lora_a.shape[1], K=in_size, BLOCK_N=block_n, BLOCK_K=min(triton.next_power_of_2(in_size), 128))
    for i, (start, size) in enumerate(parts):  # views: the part's shrunk columns, rows of B, output columns
        b, y_part = lora_b[:, start:start + size], y[:, start:start + size]
        _expand_kernel[(num_tokens, triton.cdiv(size, 64))](
            shrunk[:, i * rank:], b, token_slots, y_part, shrunk.stride(0), b.stride(0), b.stride(1),
            y_part.stride(0), N=size, R=rank, BLOCK_N=64, BLOCK_R=triton.next_power_of_2(rank))
