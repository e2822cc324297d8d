"""CUDA graphs for decode steps (one query token per sequence; docs/architecture.md, "CUDA graphs"). A replay
copies the step's tensors into the first rows of static buffers and replays the smallest bucket that holds them."""
from __future__ import annotations

import bisect

import torch

from nanoserve.layers.attention import AttentionBackend, AttentionBatch

PAD_SLOT = -1
PAD_SEQ_LEN = 0


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
    def __init__(self, model, backend: AttentionBackend, max_num_seqs: int, max_blocks_per_seq: int,
                 max_seq_len: int, hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.model, self.backend = model, backend
        self.buckets = decode_buckets(max_num_seqs)
        self.max_blocks = max_blocks_per_seq
        self.max_seq_len = max_seq_len  # max_model_len: a bound on every seq_len a replay will see
        n = self.buckets[-1]
        with torch.device(device):
            self.input_ids = torch.zeros(n, dtype=torch.int64)
            self.positions = torch.zeros(n, dtype=torch.int64)
            self.slot_mapping = torch.full((n,), PAD_SLOT, dtype=torch.int64)
            self.seq_lens = torch.full((n,), PAD_SEQ_LEN, dtype=torch.int32)
            self.query_start_loc = torch.arange(n + 1, dtype=torch.int32)
            self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32)
            self.outputs = torch.zeros(n, hidden_size, dtype=dtype)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._used_rows = 0  # rows [0, _used_rows) hold the last replay's inputs; the rest hold padding

    def _forward(self, bucket: int) -> None:
        """The captured work: the backend's metadata and the model on the first `bucket` rows of the buffers.
        max_seq_len is the static bound, never the batch's own maximum: the decode split count it caps is frozen
        into the graph and must suit every later replay."""
        meta = self.backend.build(AttentionBatch(self.slot_mapping[:bucket], self.query_start_loc[:bucket + 1],
                                                 self.seq_lens[:bucket], self.block_tables[:bucket], max_query_len=1,
                                                 max_seq_len=self.max_seq_len))
        self.outputs[:bucket] = self.model(self.input_ids[:bucket], self.positions[:bucket], meta)

    @torch.inference_mode()
    def capture(self) -> "CUDAGraphRunner":
        if not self.backend.capturable:
            raise ValueError(f"attention_backend={self.backend.name!r} synchronizes with the host here (the torch "
                             "reference attention / KV store) and cannot run in a CUDA graph: use "
                             "attention_backend='triton', or enforce_eager=True")
        pool = None
        for bucket in reversed(self.buckets):  # largest first: the smaller graphs fit in its pool
            self._forward(bucket)  # warm-up at this shape: Triton compiles, cuBLAS picks its kernels
            torch.cuda.synchronize()
            graph = self.graphs[bucket] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(bucket)
            torch.cuda.synchronize()
            if pool is None:
                pool = graph.pool()
        return self

    def can_run(self, batch_size: int, table_width: int, decode_only: bool) -> bool:
        return fits_graph(self.buckets, self.max_blocks, batch_size, table_width, decode_only)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """Replay for a decode batch that `can_run`; returns hidden states [batch, hidden]: a view of the
        static output buffer, valid until the next replay (the caller computes logits from it first)."""
        num_rows = input_ids.shape[0]
        if batch.seq_lens.shape[0] != num_rows:
            raise ValueError(f"a graphed decode step needs one token per sequence: {num_rows} tokens for "
                             f"{batch.seq_lens.shape[0]} sequences")
        self.input_ids[:num_rows].copy_(input_ids, non_blocking=True)
        self.positions[:num_rows].copy_(positions, non_blocking=True)
        self.slot_mapping[:num_rows].copy_(batch.slot_mapping, non_blocking=True)
        self.seq_lens[:num_rows].copy_(batch.seq_lens, non_blocking=True)
        # columns past the step's table keep stale block ids: a row reads only its first ceil(seq_len / block)
        self.block_tables[:num_rows, :batch.block_tables.shape[1]].copy_(batch.block_tables, non_blocking=True)
        if self._used_rows > num_rows:  # rows of an earlier, bigger batch become padding again
            self.slot_mapping[num_rows:self._used_rows].fill_(PAD_SLOT)
            self.seq_lens[num_rows:self._used_rows].fill_(PAD_SEQ_LEN)
        self._used_rows = num_rows
        self.graphs[pick_bucket(self.buckets, num_rows)].replay()
        return self.outputs[:num_rows]
