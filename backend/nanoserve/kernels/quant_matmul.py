"""Weight-only quantized matmuls, y [M, N] = x [M, K] @ W^T, W dequantized tile by tile inside the kernel (mirrors
reference.int8_matmul_ref and reference.int4_group_matmul_ref):

- int8: codes [N, K] int8, one scale per output row: W = codes * scale. The tile multiplies x by the codes (exact
  in any float dtype) and the row's scale is applied once to the float32 sum.
- 4-bit groups: two codes a byte (reference.pack_int4: code 2j in byte j's low nibble, 2j + 1 in its high one),
  packed [N, K / 2] uint8, scale and offset [N, K / group] float32: W = codes * scale + offset, q in [0, 15].

One program per (block of rows of x, block of output columns), accumulating in float32 over K, one group (4-bit)
or BLOCK_K inputs (int8) a step. A decode step's few rows take the 16-row block (tl.dot's smallest), a prefill's
many rows the 64-row one (32 in float32). float32 activations are multiplied in full float32 precision (no TF32),
16-bit ones on the tensor cores in their own dtype. Groups are a power of two of at least 16 inputs.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK_N = 64
# int8's K tile; a float32 dot's tiles are smaller (ptxas spills registers at 64 x 64 x 64). A 4-bit tile is a group.
BLOCK_K, BLOCK_K_FP32 = 64, 32
# The interpreter's tl.dot multiplies bfloat16 tiles as the integers it stores them in: there the 16-bit tiles are
# widened to float32 first (exactly), and the product is the same as a GPU's up to the order of the sum.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _quant_matmul_kernel(x_ptr, w_ptr, scale_ptr, offset_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_s,
                         stride_y, FOUR_BIT: tl.constexpr, DOT_FP32: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_x + k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = n_ok[:, None] & k_ok[None, :]
        if FOUR_BIT:  # BLOCK_K is the group: one scale and offset per row of the tile
            byte = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_w + k[None, :] // 2, mask=w_mask, other=0)
            codes = (byte.to(tl.int32) >> ((k[None, :] % 2) * 4)) & 0xF
            group = n.to(tl.int64) * stride_s + k0 // BLOCK_K
            scale = tl.load(scale_ptr + group, mask=n_ok, other=0.0).to(tl.float32)
            offset = tl.load(offset_ptr + group, mask=n_ok, other=0.0).to(tl.float32)
            w = codes.to(tl.float32) * scale[:, None] + offset[:, None]
        else:
            w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_w + k[None, :], mask=w_mask, other=0).to(tl.float32)
        w = w.to(x.dtype)  # what a 16-bit dot multiplies: the weight rounded to x's dtype
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    if not FOUR_BIT:
        acc *= tl.load(scale_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None].to(tl.int64) * stride_y + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, out_features: int,
            group: int) -> torch.Tensor:
    """y [..., N] in x's dtype for x [..., K]."""
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    rows, in_features = x2.shape
    y = torch.empty(rows, out_features, device=x.device, dtype=x.dtype)
    if rows == 0:
        return y.reshape(*x.shape[:-1], out_features)
    assert weight.stride(-1) == 1 and scale.is_contiguous()
    four_bit, dot_fp32 = offset is not None, x.dtype == torch.float32 or INTERPRETED
    block_m = 16 if rows <= 16 else 32 if dot_fp32 else 64
    _quant_matmul_kernel[(triton.cdiv(rows, block_m), triton.cdiv(out_features, BLOCK_N))](
        x2, weight, scale, offset if four_bit else scale, y, rows, out_features, in_features, x2.stride(0),
        weight.stride(0), scale.stride(0) if four_bit else 0, y.stride(0), FOUR_BIT=four_bit,
        DOT_FP32=dot_fp32, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        BLOCK_K=group if four_bit else BLOCK_K_FP32 if dot_fp32 else BLOCK_K)
    return y.reshape(*x.shape[:-1], out_features)


def int8_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ (codes [N, K] int8 * scale [N])^T, in x's dtype (see reference.int8_matmul_ref)."""
    if codes.shape[1] != x.shape[-1]:
        raise ValueError(f"int8_matmul: x has {x.shape[-1]} inputs, the weight {codes.shape[1]}")
    return _launch(x, codes, scale, None, codes.shape[0], 1)


def int4_group_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ W^T, W = unpacked codes * scale + offset per group (see reference.int4_group_matmul_ref)."""
    in_features = packed.shape[1] * 2
    if in_features != x.shape[-1] or in_features % scale.shape[1] or scale.shape != offset.shape:
        raise ValueError(f"int4_group_matmul: x has {x.shape[-1]} inputs, the packed weight {in_features} in "
                         f"groups of scale {tuple(scale.shape)} and offset {tuple(offset.shape)}")
    group = in_features // scale.shape[1]
    if group < 16 or group & (group - 1):
        raise ValueError(f"int4_group_matmul: groups must be a power of two of at least 16 inputs, got {group}")
    return _launch(x, packed, scale, offset.contiguous(), packed.shape[0], group)
