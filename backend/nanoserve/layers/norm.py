"""RMSNorm, optionally fused with the residual add that precedes it."""
from __future__ import annotations

import torch
from torch import nn

from nanoserve.kernels.reference import fused_add_rms_norm_ref, rms_norm_ref
from nanoserve.layers.activation import pick


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x -> rms_norm(x); with a residual: (rms_norm(x + residual), x + residual)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # kernels take 2-D rows (q_norm/k_norm pass [T, heads, head_dim])
        if residual is None:
            return pick("rms_norm", rms_norm_ref, x)(x, self.weight, self.eps).view(shape)
        normed, summed = pick("fused_add_rms_norm", fused_add_rms_norm_ref, x)(
            x, residual.reshape(-1, shape[-1]), self.weight, self.eps)
        return normed.view(shape), summed.view(shape)
