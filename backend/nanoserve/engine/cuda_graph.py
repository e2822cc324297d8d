"""CUDA graphs for decode steps (one query token per sequence).

One graph per batch bucket (1, 2, 4, 8, 16, 32, 48, ... step 16, and max_num_seqs), captured largest first
into one shared memory pool. The graphs read static input buffers; a step copies its tensors into the first
`batch` rows and replays the smallest bucket >= batch. Padded rows get slot -1 (nothing stored) and
seq_len 1 (attend to one harmless cached token); their outputs are dropped. Steps that do not fit (prefill,
a bigger batch, a block table wider than the captured width) run eagerly.
"""
from __future__ import annotations

import bisect

import torch

from nanoserve.layers.attention import AttentionMetadata


def decode_buckets(max_num_seqs: int) -> list[int]:
    sizes = {b for b in (1, 2, 4, 8) if b <= max_num_seqs}
    sizes.update(range(16, max_num_seqs + 1, 16))
    sizes.add(max_num_seqs)
    return sorted(sizes)


def pick_bucket(buckets: list[int], batch_size: int) -> int | None:
    """The smallest bucket >= batch_size, or None when the batch is bigger than every bucket."""
    i = bisect.bisect_left(buckets, batch_size)
    return buckets[i] if i < len(buckets) else None


def fits_graph(buckets: list[int], max_blocks: int, batch_size: int, table_width: int, decode_only: bool) -> bool:
    return decode_only and 0 < batch_size and table_width <= max_blocks and pick_bucket(buckets, batch_size) is not None


class CUDAGraphRunner:
    def __init__(self, model, max_num_seqs: int, max_blocks_per_seq: int, max_seq_len: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device):
        self.model = model
        self.buckets = decode_buckets(max_num_seqs)
        self.max_blocks = max_blocks_per_seq
        self.max_seq_len = max_seq_len
        n = self.buckets[-1]
        with torch.device(device):
            self.input_ids = torch.zeros(n, dtype=torch.int64)
            self.positions = torch.zeros(n, dtype=torch.int64)
            self.slot_mapping = torch.full((n,), -1, dtype=torch.int64)
            self.seq_lens = torch.ones(n, dtype=torch.int32)
            self.query_start_loc = torch.arange(n + 1, dtype=torch.int32)
            self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32)
            self.outputs = torch.zeros(n, hidden_size, dtype=dtype)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def _metadata(self, bucket: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.slot_mapping[:bucket],
                                 query_start_loc=self.query_start_loc[:bucket + 1],
                                 seq_lens=self.seq_lens[:bucket], block_tables=self.block_tables[:bucket],
                                 max_query_len=1, max_seq_len=self.max_seq_len, is_decode_only=True)

    @torch.inference_mode()
    def capture(self) -> "CUDAGraphRunner":
        pool = None
        for bucket in reversed(self.buckets):  # largest first: smaller graphs reuse its pool memory
            meta = self._metadata(bucket)
            args = (self.input_ids[:bucket], self.positions[:bucket], meta)
            self.outputs[:bucket] = self.model(*args)  # warm-up outside the capture (Triton JIT, autotune)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[:bucket] = self.model(*args)
            if pool is None:
                pool = graph.pool()
            torch.cuda.synchronize()
            self.graphs[bucket] = graph
        return self

    def can_run(self, batch_size: int, table_width: int, decode_only: bool) -> bool:
        return fits_graph(self.buckets, self.max_blocks, batch_size, table_width, decode_only)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replay for a decode batch that `can_run`; returns hidden states [batch, hidden] (a view of the
        static output buffer, valid until the next replay)."""
        batch, width = input_ids.shape[0], meta.block_tables.shape[1]
        bucket = pick_bucket(self.buckets, batch)
        self.input_ids[:batch].copy_(input_ids, non_blocking=True)
        self.positions[:batch].copy_(positions, non_blocking=True)
        self.slot_mapping[:batch].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[batch:bucket].fill_(-1)
        self.seq_lens[:batch].copy_(meta.seq_lens, non_blocking=True)
        self.seq_lens[batch:bucket].fill_(1)
        # columns past `width` keep stale block ids: never read, as each row reads ceil(seq_len/block) blocks
        self.block_tables[:batch, :width].copy_(meta.block_tables, non_blocking=True)
        self.graphs[bucket].replay()
        return self.outputs[:batch]
