"""Varlen causal attention over the paged KV cache (mirrors reference.paged_attention_ref).

Sequences with one new token go to the decode kernel (GQA-grouped, optional split-K); the others to the
prefill kernel. Both launches are sized from tensor shapes, so the call never syncs with the host and can
be captured in a CUDA graph. Token rows past query_start_loc[-1] are not written.
"""
from __future__ import annotations

import torch

from .decode_attention import check_paged_args, default_num_splits, launch_decode
from .decode_attention import paged_decode_attention  # noqa: F401  (re-exported)
from .prefill_attention import launch_prefill


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                    max_query_len: int | None = None, max_seq_len: int | None = None,
                    num_splits: int | None = None, out: torch.Tensor | None = None, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> torch.Tensor:
    """q [num_tokens, num_heads, head_dim] -> out of the same shape; the cache already holds the new K/V (an fp8
    cache: K / k_scale and V / v_scale, reference.py).

    Optional hints (from the attention metadata, never required): max_query_len == 1 skips the prefill
    launch; max_seq_len caps the number of decode splits. num_splits forces the decode split count.
    Under CUDA-graph capture the split count is frozen into the graph, so max_seq_len must then bound every
    replay (max_model_len) or be None, never the capture batch's own maximum. Rows with seq_len 0 (graph
    padding) give zeros and read nothing.
    """
    if out is None:
        out = torch.empty_like(q)
    check_paged_args(q, k_cache, v_cache, out)
    batch = seq_lens.shape[0]
    if num_splits is None:
        num_splits = default_num_splits(batch, k_cache.shape[2], q.device, max_seq_len)
    launch_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, out, num_splits,
                  query_start_loc=query_start_loc, k_scale=k_scale, v_scale=v_scale)
    if max_query_len is None or max_query_len > 1:
        launch_prefill(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out, k_scale, v_scale)
    return out
