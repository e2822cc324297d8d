"""Paged attention: store the step's new K/V into the cache by slot, then attend over the cache.

The backend is chosen by name once, at construction:
  "torch"      nanoserve.kernels.torch_attention (the CPU path; host-synchronizing, so never CUDA-graphed)
  "triton"     nanoserve.kernels.ops (same signatures as the reference)
  "flash_attn" flash_attn_varlen_func / flash_attn_with_kvcache (paged KV needs block_size % 256 == 0)
Padded rows of CUDA-graph batches (engine/cuda_graph.py) have slot -1 and seq_len 0: nothing is stored or
read, and the triton and flash_attn backends write zeros for them (dropped afterwards). The torch backend
is never graphed: it synchronizes with the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.kernels.reference import store_kvcache_ref
from nanoserve.kernels.torch_attention import (AttentionPlan, AttentionWorkspace, paged_attention_planned,
                                               plan_paged_attention, store_kvcache_planned)
from nanoserve.layers.activation import cuda_op


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, -1 = padded token
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32, context length including this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    is_decode_only: bool  # every row has exactly one query token
    cu_seqlens_k: torch.Tensor | None = None  # [B+1] int32, built on first use by flash_attn
    torch_plan: AttentionPlan | None = None  # built by the first layer of the torch backend, used by all
    workspace: AttentionWorkspace | None = None  # the torch backend's buffers, kept by the model runner


def _torch_backend():
    def attend(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        if meta.torch_plan is None:
            meta.torch_plan = plan_paged_attention(meta.slot_mapping, meta.block_tables, meta.query_start_loc,
                                                   meta.seq_lens, k_cache.shape[1], q.dtype, meta.workspace)
        store_kvcache_planned(k, v, k_cache, v_cache, meta.torch_plan)
        return paged_attention_planned(q, k, v, k_cache, v_cache, meta.torch_plan, scale)
    return attend


def _triton_backend():
    try:
        from nanoserve.kernels import ops
    except ImportError as e:
        raise RuntimeError(f"attention_backend='triton' needs nanoserve.kernels.ops ({e}); "
                           "use attention_backend='torch'") from e

    def attend(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        ops.store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
        # the hints let a decode-only step skip the prefill launch and cap the decode split-K; under a CUDA
        # graph max_seq_len is max_model_len (a bound for every replay), not the capture batch's maximum
        return ops.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                   meta.seq_lens, scale, max_query_len=meta.max_query_len,
                                   max_seq_len=meta.max_seq_len)
    return attend


def _flash_attn_backend():
    try:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
    except ImportError as e:
        raise RuntimeError(f"attention_backend='flash_attn' needs the flash-attn package ({e}); "
                           "use attention_backend='triton' or 'torch'") from e
    store = cuda_op("store_kvcache") or store_kvcache_ref  # the reference is not CUDA-graph safe

    def attend(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        store(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_decode_only:
            out = flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.seq_lens,
                                          block_table=meta.block_tables, softmax_scale=scale, causal=True)
            return out.squeeze(1)
        if meta.cu_seqlens_k is None:
            meta.cu_seqlens_k = F.pad(meta.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        return flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=meta.query_start_loc,
                                      cu_seqlens_k=meta.cu_seqlens_k, max_seqlen_q=meta.max_query_len,
                                      max_seqlen_k=meta.max_seq_len, softmax_scale=scale, causal=True,
                                      block_table=meta.block_tables)
    return attend


BACKENDS = {"torch": _torch_backend, "triton": _triton_backend, "flash_attn": _flash_attn_backend}


class Attention(nn.Module):
    """q [T, heads, head_dim], k/v [T, kv_heads, head_dim] -> [T, heads * head_dim]. The model runner
    binds `k_cache`/`v_cache` ([num_blocks, block_size, kv_heads, head_dim]) before the first forward."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, backend: str = "torch"):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"attention backend must be one of {sorted(BACKENDS)}, got {backend!r}")
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.backend = backend
        self._attend = BACKENDS[backend]()
        self.k_cache = self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_metadata: AttentionMetadata):
        out = self._attend(q, k, v, self.k_cache, self.v_cache, attn_metadata, self.scale)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
