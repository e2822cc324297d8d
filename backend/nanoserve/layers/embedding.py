"""Vocab-parallel token embedding and LM head: each rank owns a contiguous slice of the vocabulary
(ceil(vocab / tp) rows, the last slice zero-padded)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.distributed import all_reduce, gather_last_dim, get_tp_rank, get_tp_size
from nanoserve.layers.linear import copy_checked, linear


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_embeddings = num_embeddings
        self.rows_per_rank = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.quantized = None  # an Int8Weight (layers/quantization.py) in the weight's place, when quantized

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[0] != self.num_embeddings:
            raise ValueError(f"shape mismatch: expected {self.num_embeddings} vocab rows, checkpoint gives "
                             f"{tuple(loaded.shape)}")
        rows = self.vocab_end - self.vocab_start
        copy_checked(param.data[:rows], loaded[self.vocab_start:self.vocab_end])
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.lookup(input_ids)
        local = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        out = self.lookup((input_ids - self.vocab_start) * local)
        return all_reduce(out * local.unsqueeze(-1).to(out.dtype))

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized.embedding(rows, self.weight.dtype)
        return F.embedding(rows, self.weight)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden [N, dim] -> logits [N, vocab], complete on rank 0 (None on the other ranks)."""
    packed_weight = None  # set by layers.linear.pack_cpu_weights, or a quantized weight (models/quantize.py)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = gather_last_dim(linear(hidden, self.weight, None, self.packed_weight))
        if logits is None:
            return None
        return logits[:, :self.num_embeddings] if self.tp_size > 1 else logits
