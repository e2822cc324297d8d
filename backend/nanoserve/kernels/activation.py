"""SiLU-and-mul for gated MLPs: x [..., 2N] -> silu(x[..., :N]) * x[..., N:] (mirrors reference.silu_and_mul_ref)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + N + cols, mask=mask, other=0.0).to(tl.float32)
    # round silu(gate) to the input dtype first, as the reference (two torch ops) does
    act = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], n), device=x.device, dtype=x.dtype)
    if x2.shape[0] and n:
        block = min(BLOCK, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](
            x2, out, x2.stride(0), out.stride(0), N=n, BLOCK=block, num_warps=4)
    return out.view(*x.shape[:-1], n)
