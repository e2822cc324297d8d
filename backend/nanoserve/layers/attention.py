"""Paged attention behind one interface (docs/architecture.md, "Attention backends"): the runner describes each
step once as an AttentionBatch, the backend turns it into its own metadata (`backend.build(batch)`), and each layer
stores the step's new K/V into the paged cache by slot, then attends over the cache. Padded rows of CUDA-graph
batches (engine/cuda_graph.py) have slot -1 and seq_len 0: nothing is stored or read, and the triton and flash_attn
backends write zeros for them (dropped afterwards)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.kernels.reference import store_kvcache_ref
from nanoserve.kernels.torch_attention import (AttentionPlan, paged_attention_planned, plan_paged_attention,
                                               store_kvcache_planned)
from nanoserve.layers.activation import cuda_op


@dataclass
class AttentionBatch:
    """One step's attention work, the same for every backend."""
    slot_mapping: torch.Tensor  # [T] int64, -1 = padded token
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32, context length including this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int  # under a CUDA graph: a bound for every replay (max_model_len), not this batch's maximum

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class TorchBackend:
    """Plans the step's host work (decode rows, prefill masks) once for all layers."""
    name, capturable = "torch", False

    def build(self, batch: AttentionBatch) -> AttentionPlan:
        return plan_paged_attention(batch.slot_mapping, batch.block_tables, batch.query_start_loc, batch.seq_lens)

    def forward(self, q, k, v, k_cache, v_cache, plan: AttentionPlan, scale: float, kv_scales=(1.0, 1.0)):
        store_kvcache_planned(k, v, k_cache, v_cache, plan, *kv_scales)
        return paged_attention_planned(q, k, v, k_cache, v_cache, plan, scale, *kv_scales)


class TritonBackend:
    name, capturable = "triton", True

    def __init__(self):
        try:
            from nanoserve.kernels import ops
        except ImportError as e:
            raise RuntimeError(f"attention_backend='triton' needs nanoserve.kernels.ops ({e}); "
                               "use attention_backend='torch'") from e
        self.ops = ops

    def build(self, batch: AttentionBatch) -> AttentionBatch:
        return batch

    def forward(self, q, k, v, k_cache, v_cache, batch: AttentionBatch, scale: float, kv_scales=(1.0, 1.0)):
        self.ops.store_kvcache(k, v, k_cache, v_cache, batch.slot_mapping, *kv_scales)
        # the hints let a decode-only step skip the prefill launch and cap the decode split-K
        return self.ops.paged_attention(q, k_cache, v_cache, batch.block_tables, batch.query_start_loc,
                                        batch.seq_lens, scale, max_query_len=batch.max_query_len,
                                        max_seq_len=batch.max_seq_len, k_scale=kv_scales[0], v_scale=kv_scales[1])


@dataclass
class FlashAttnMetadata:
    batch: AttentionBatch
    cu_seqlens_k: torch.Tensor | None  # [B+1] int32; None for a decode-only step


class FlashAttnBackend:
    name = "flash_attn"

    def __init__(self):
        try:
            from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        except ImportError as e:
            raise RuntimeError(f"attention_backend='flash_attn' needs the flash-attn package ({e}); "
                               "use attention_backend='triton' or 'torch'") from e
        self.varlen, self.with_kvcache = flash_attn_varlen_func, flash_attn_with_kvcache
        self.store = cuda_op("store_kvcache") or store_kvcache_ref
        self.capturable = self.store is not store_kvcache_ref  # the reference store synchronizes with the host

    def build(self, batch: AttentionBatch) -> FlashAttnMetadata:
        cu_seqlens_k = None if batch.is_decode_only else F.pad(batch.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        return FlashAttnMetadata(batch, cu_seqlens_k)

    def forward(self, q, k, v, k_cache, v_cache, meta: FlashAttnMetadata, scale: float, kv_scales=(1.0, 1.0)):
        """(kv_scales: always 1.0, the config allows no fp8 cache with flash_attn)"""
        batch = meta.batch
        self.store(k, v, k_cache, v_cache, batch.slot_mapping)
        if meta.cu_seqlens_k is None:
            return self.with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=batch.seq_lens,
                                     block_table=batch.block_tables, softmax_scale=scale, causal=True).squeeze(1)
        return self.varlen(q, k_cache, v_cache, cu_seqlens_q=batch.query_start_loc, cu_seqlens_k=meta.cu_seqlens_k,
                           max_seqlen_q=batch.max_query_len, max_seqlen_k=batch.max_seq_len, softmax_scale=scale,
                           causal=True, block_table=batch.block_tables)


BACKENDS = {"torch": TorchBackend, "triton": TritonBackend, "flash_attn": FlashAttnBackend}
AttentionBackend = TorchBackend | TritonBackend | FlashAttnBackend


def make_backend(name: str) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {sorted(BACKENDS)}, got {name!r}")
    return BACKENDS[name]()


class Attention(nn.Module):
    """q [T, heads, head_dim], k/v [T, kv_heads, head_dim] -> [T, heads * head_dim]. The model runner
    binds `k_cache`/`v_cache` ([num_blocks, block_size, kv_heads, head_dim]) before the first forward.
    kv_scales: the layer's K and V scales of an fp8 cache (kernels/reference.py), 1.0 as vLLM's default."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, backend: AttentionBackend):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.backend = backend
        self.k_cache = self.v_cache = torch.empty(0)
        self.kv_scales = (1.0, 1.0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_metadata) -> torch.Tensor:
        out = self.backend.forward(q, k, v, self.k_cache, self.v_cache, attn_metadata, self.scale, self.kv_scales)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
