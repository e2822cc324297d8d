"""Batched LoRA for the tensor-parallel linear layers: requests with different adapters, and requests without one,
share a step (punica's idea, SGMV's segments).

Every adapter-capable linear keeps the weights of `num_slots` adapters stacked, one slot per adapter the device
holds: A [slots, parts * max_rank, in] and B [slots, out, max_rank], a smaller rank zero-padded to max_rank and
the adapter's scaling folded into B. A fused linear (q/k/v, gate/up) has one A and B per part: part i's A rows are
i * max_rank .. (i + 1) * max_rank, its B rows are the part's output columns. A step's `LoRABatch` groups its
tokens by slot; each group adds (x @ A.T) @ B.T to its rows of the linear's output, and tokens of the base model
are in no group. Under tensor parallelism A and B are sharded like the weight: a column-parallel layer keeps all
of A and its rows of B; a row-parallel one its columns of A and all of B, its partial delta summed by the layer's
all-reduce with the partial output.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.layers.linear import (LinearBase, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear,
                                     copy_checked)


@dataclass
class LoRABatch:
    """One step's tokens grouped by adapter slot: (slot, token indices [n] int64, or None for every token)."""
    groups: list[tuple[int, torch.Tensor | None]]

    @classmethod
    def of_tokens(cls, token_slots: np.ndarray, device: torch.device) -> LoRABatch | None:
        """From each token's adapter slot ([T], -1: the base model); None when no token has an adapter."""
        groups = []
        for slot in np.unique(token_slots).tolist():
            if slot < 0:
                continue
            rows = np.flatnonzero(token_slots == slot)
            groups.append((slot, None if len(rows) == len(token_slots) else torch.from_numpy(rows).to(device)))
        return cls(groups) if groups else None


def output_parts(linear: LinearBase) -> list[int]:
    """The sizes of the sub-projections a linear's output (this rank's part) concatenates."""
    if isinstance(linear, QKVParallelLinear):
        return [linear.q_size, linear.kv_size, linear.kv_size]
    if isinstance(linear, MergedColumnParallelLinear):
        return [size // linear.tp_size for size in linear.output_sizes]
    return [linear.weight.shape[0]]


class StackedLoRA(nn.Module):
    """The LoRA weights of one linear layer for every adapter slot (buffers: created zero, on the default device
    and dtype)."""

    def __init__(self, linear: LinearBase, num_slots: int, max_rank: int):
        super().__init__()
        self.max_rank = max_rank
        self.row_parallel = isinstance(linear, RowParallelLinear)
        self.shard_ids = getattr(linear, "shard_ids", (None,))
        sizes = output_parts(linear)
        self.parts = [(sum(sizes[:i]), size) for i, size in enumerate(sizes)]  # (first output column, size)
        self.load_shard = linear.weight_loader  # copies this rank's part of a full tensor, as for the weight
        out_size, in_size = linear.weight.shape
        self.register_buffer("a", torch.zeros(num_slots, len(sizes) * max_rank, in_size), persistent=False)
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
        """y [T, out] += each token's adapter delta of x [T, in] (in place)."""
        rank = self.max_rank
        for slot, rows in batch.groups:
            xs = x if rows is None else x.index_select(0, rows)
            shrunk = xs @ self.a[slot].T  # [n, parts * rank]
            b = self.b[slot]
            delta = torch.cat([shrunk[:, i * rank:(i + 1) * rank] @ b[start:start + size].T
                               for i, (start, size) in enumerate(self.parts)], dim=1)
            if rows is None:
                y += delta
            else:
                y.index_add_(0, rows, delta)
