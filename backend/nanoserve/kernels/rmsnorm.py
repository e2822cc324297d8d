"""RMSNorm and fused residual-add + RMSNorm over rows (mirrors reference.rms_norm_ref).

Rounding follows the reference: the normalized row is rounded to x's dtype before the weight multiply,
and in the fused version the sum is rounded to the residual-stream dtype before it is normalized.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, eps, num_rows,
                     stride_x, stride_r, stride_o, stride_s,
                     N: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, ADD_RESIDUAL: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (rows < num_rows) & (cols < N)
    x = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        x += tl.load(res_ptr + rows * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + rows * stride_s + cols, x, mask=mask)
        x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 1) / N + eps)[:, None]
    normed = (x * rstd).to(sum_ptr.dtype.element_ty).to(tl.float32)  # round like the reference
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(x2, res2, weight, out, summed, eps, add_residual):
    num_rows, n = x2.shape
    block = triton.next_power_of_2(n)
    rows = max(1, min(2048 // block, 16))  # short rows (per-head q/k norm): several rows per program
    _rms_norm_kernel[(triton.cdiv(num_rows, rows),)](
        x2, res2, weight, out, summed, eps, num_rows,
        x2.stride(0), res2.stride(0), out.stride(0), summed.stride(0),
        N=n, BLOCK=block, ROWS=rows, ADD_RESIDUAL=add_residual, num_warps=min(max(rows * block // 256, 1), 16),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., N]; the result has dtype promote(x, weight) like the reference."""
    x2 = _rows(x)
    out = torch.empty(x2.shape, device=x.device, dtype=torch.promote_types(x.dtype, weight.dtype))
    if x2.shape[0]:
        # `summed` only carries x's dtype (for the rounding step) when there is no residual
        _launch(x2, x2, weight, out, x2, eps, add_residual=False)
    return out.view(x.shape)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual), both new tensors."""
    x2, r2 = _rows(x), _rows(residual)
    sum_dtype = torch.promote_types(x.dtype, residual.dtype)
    summed = torch.empty(x2.shape, device=x.device, dtype=sum_dtype)
    out = torch.empty(x2.shape, device=x.device, dtype=torch.promote_types(sum_dtype, weight.dtype))
    if x2.shape[0]:
        _launch(x2, r2, weight, out, summed, eps, add_residual=True)
    return out.view(x.shape), summed.view(x.shape)
