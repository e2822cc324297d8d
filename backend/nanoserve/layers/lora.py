"""Batched LoRA for the tensor-parallel linear layers (docs/architecture.md, "Multi-LoRA"): tokens of different
adapters, and of none, share a step; a token of slot s adds (x @ A_s.T) @ B_s.T to its row of the output."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.kernels.reference import add_lora_ref
from nanoserve.layers.activation import pick
from nanoserve.layers.linear import LinearBase, RowParallelLinear, copy_checked


@dataclass
class LoRABatch:
    """One step's adapter slot of each token: token_slots [T] int64 on the device (-1: the base model)."""
    token_slots: torch.Tensor

    @classmethod
    def of_tokens(cls, token_slots: np.ndarray, device: torch.device) -> LoRABatch | None:
        """From each token's adapter slot ([T], -1: the base model); None when no token has an adapter."""
        if not (token_slots >= 0).any():
            return None
        return cls(torch.from_numpy(token_slots).to(device))


class StackedLoRA(nn.Module):
    """The LoRA weights of one linear layer for every adapter slot, sharded like its weight: A [slots, parts *
    max_rank, in], B [slots, out, max_rank] (ranks zero-padded, the scaling in B; created zero, on the default
    device and dtype)."""

    def __init__(self, linear: LinearBase, num_slots: int, max_rank: int):
        super().__init__()
        self.max_rank = max_rank
        self.row_parallel = isinstance(linear, RowParallelLinear)
        self.shard_ids = tuple(linear.shards)
        self.parts = [(offset, size) for offset, size, _, _ in linear.shards.values()]  # (first output column, size)
        self.load_shard = linear.weight_loader  # copies this rank's part of a full tensor, as for the weight
        out_size, in_size = linear.weight.shape
        self.register_buffer("a", torch.zeros(num_slots, len(self.parts) * max_rank, in_size), persistent=False)
        self.register_buffer("b", torch.zeros(num_slots, out_size, max_rank), persistent=False)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def load(self, slot: int, shard_id, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        """One part's full (unsharded) A [r, in] and B [out, r], the scaling already in B, into slot."""
        rank, part = lora_a.shape[0], self.shard_ids.index(shard_id)
        lora_a = F.pad(lora_a, (0, 0, 0, self.max_rank - rank))
        lora_b = F.pad(lora_b, (0, self.max_rank - rank))
        a_rows = self.a[slot, part * self.max_rank:(part + 1) * self.max_rank]
        if self.row_parallel:  # the input dim is sharded
            self.load_shard(a_rows, lora_a)
            copy_checked(self.b[slot], lora_b)
        else:
            copy_checked(a_rows, lora_a)
            self.load_shard(self.b[slot], lora_b, shard_id)

    def add_to(self, y: torch.Tensor, x: torch.Tensor, batch: LoRABatch) -> None:
        """y [T, out] += each token's adapter delta of x [T, in] (in place): the Triton kernel on CUDA."""
        add_lora = pick("add_lora", add_lora_ref, x)
        add_lora(y, x, self.a, self.b, batch.token_slots, self.parts)
