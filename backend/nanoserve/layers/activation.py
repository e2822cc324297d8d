"""SiluAndMul, and `pick`: the kernel to use for a tensor's device (`cuda_op`: the Triton kernel, when
nanoserve.kernels.ops has it; `cpu_op`: the C++ one), else the plain-torch reference."""
from __future__ import annotations

import functools

import torch
from torch import nn

from nanoserve.kernels.cpu_ops import cpu_op
from nanoserve.kernels.reference import silu_and_mul_ref


@functools.cache
def cuda_op(name: str):
    """nanoserve.kernels.ops.<name>, or None when the Triton kernels are not importable (no triton)."""
    try:
        from nanoserve.kernels import ops
    except ImportError:
        return None
    return getattr(ops, name, None)


def pick(name: str, reference, x: torch.Tensor):
    """The kernel for x's device (a Triton kernel on CUDA, a cpu_ops.cpp one on the CPU), else the reference."""
    kernel = cuda_op(name) if x.is_cuda else cpu_op(name) if x.is_cpu else None
    return kernel or reference


class SiluAndMul(nn.Module):
    """[..., 2n] (gate | up) -> silu(gate) * up  [..., n]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return pick("silu_and_mul", silu_and_mul_ref, x)(x)
