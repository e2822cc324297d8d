"""CUDA graphs for decode steps (one query token per sequence) and for speculative verify steps (up to
1 + num_speculative_tokens query tokens per sequence; docs/architecture.md, "CUDA graphs"). A replay copies the
step's tensors into the first rows of static buffers and replays the smallest bucket that holds its sequences.

A decode graph's padded sequences have one query token each and seq_len 0. A verify graph of bucket b holds
b * verify_len token rows: the step's tokens come first and its padded sequences have empty queries, so the token
rows after the step's are in no sequence (the attention kernels write nothing there; whatever the layers then
compute in those rows is never read)."""
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


def fits_graph(buckets: list[int], max_blocks: int, batch_size: int, table_width: int) -> bool:
    return 0 < batch_size and table_width <= max_blocks and pick_bucket(buckets, batch_size) is not None


def verify_buckets(verify_len: int, max_verify_seqs: int) -> list[int]:
    """The verify graphs' buckets: none without speculation (verify_len 1)."""
    return decode_buckets(max_verify_seqs) if verify_len > 1 and max_verify_seqs > 0 else []


class CUDAGraphRunner:
    def __init__(self, model, backend: AttentionBackend, max_num_seqs: int, max_blocks_per_seq: int,
                 max_seq_len: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 verify_len: int = 1, max_verify_seqs: int = 0):
        self.model, self.backend = model, backend
        self.buckets = decode_buckets(max_num_seqs)
        # speculative decoding: a verify step's sequences have up to verify_len query tokens (1 + the proposals);
        # proposals stop at disable_by_batch_size, so its graphs need buckets up to max_verify_seqs only
        self.verify_len = verify_len
        self.verify_buckets = verify_buckets(verify_len, min(max_verify_seqs, max_num_seqs))
        self.max_blocks = max_blocks_per_seq
        self.max_seq_len = max_seq_len  # max_model_len: a bound on every seq_len a replay will see
        n = self.buckets[-1]
        num_tokens = max(n, self.verify_buckets[-1] * verify_len if self.verify_buckets else 0)
        with torch.device(device):
            self.input_ids = torch.zeros(num_tokens, dtype=torch.int64)
            self.positions = torch.zeros(num_tokens, dtype=torch.int64)
            self.slot_mapping = torch.full((num_tokens,), PAD_SLOT, dtype=torch.int64)
            self.seq_lens = torch.full((n,), PAD_SEQ_LEN, dtype=torch.int32)
            self.query_start_loc = torch.arange(n + 1, dtype=torch.int32)
            self.verify_query_start_loc = torch.zeros(n + 1, dtype=torch.int32)  # every sequence empty until a replay
            self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32)
            self.outputs = torch.zeros(num_tokens, hidden_size, dtype=dtype)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # decode graphs, by bucket
        self.verify_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._used_rows = 0  # rows [0, _used_rows) hold the last replay's sequences; the rest hold padding
        self._used_tokens = 0  # and token rows [0, _used_tokens) its tokens

    def _forward(self, bucket: int, query_len: int = 1) -> None:
        """The captured work: the backend's metadata and the model on the first `bucket` sequences (and
        bucket * query_len token rows) of the buffers. max_seq_len is the static bound, never the batch's own
        maximum: the decode split count it caps is frozen into the graph and must suit every later replay."""
        tokens = bucket * query_len
        query_start_loc = self.query_start_loc if query_len == 1 else self.verify_query_start_loc
        meta = self.backend.build(AttentionBatch(self.slot_mapping[:tokens], query_start_loc[:bucket + 1],
                                                 self.seq_lens[:bucket], self.block_tables[:bucket],
                                                 max_query_len=query_len, max_seq_len=self.max_seq_len))
        self.outputs[:tokens] = self.model(self.input_ids[:tokens], self.positions[:tokens], meta)

    def _shapes(self) -> list[tuple[int, int]]:
        """(bucket, query_len) of every graph, the most token rows first: the smaller graphs fit in its pool."""
        shapes = [(b, 1) for b in self.buckets] + [(b, self.verify_len) for b in self.verify_buckets]
        return sorted(shapes, key=lambda shape: shape[0] * shape[1], reverse=True)

    @torch.inference_mode()
    def capture(self) -> "CUDAGraphRunner":
        if not self.backend.capturable:
            raise ValueError(f"attention_backend={self.backend.name!r} synchronizes with the host here (the torch "
                             "reference attention / KV store) and cannot run in a CUDA graph: use "
                             "attention_backend='triton', or enforce_eager=True")
        pool = None
        for bucket, query_len in self._shapes():
            self._forward(bucket, query_len)  # warm-up at this shape: Triton compiles, cuBLAS picks its kernels
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            (self.graphs if query_len == 1 else self.verify_graphs)[bucket] = graph
            with torch.cuda.graph(graph, pool=pool):
                self._forward(bucket, query_len)
            torch.cuda.synchronize()
            if pool is None:
                pool = graph.pool()
        return self

    def can_run(self, batch_size: int, table_width: int, max_query_len: int) -> bool:
        """Whether a step of batch_size sequences with up to max_query_len query tokens each fits a graph."""
        if max_query_len == 1:
            return fits_graph(self.buckets, self.max_blocks, batch_size, table_width)
        return max_query_len <= self.verify_len and fits_graph(self.verify_buckets, self.max_blocks, batch_size,
                                                               table_width)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """Replay for a step that `can_run`; returns hidden states [step tokens, hidden]: a view of the
        static output buffer, valid until the next replay (the caller computes logits from it first)."""
        num_tokens, num_rows = input_ids.shape[0], batch.seq_lens.shape[0]
        if batch.max_query_len == 1 and num_tokens != num_rows:
            raise ValueError(f"a graphed decode step needs one token per sequence: {num_tokens} tokens for "
                             f"{num_rows} sequences")
        self.input_ids[:num_tokens].copy_(input_ids, non_blocking=True)
        self.positions[:num_tokens].copy_(positions, non_blocking=True)
        self.slot_mapping[:num_tokens].copy_(batch.slot_mapping, non_blocking=True)
        self.seq_lens[:num_rows].copy_(batch.seq_lens, non_blocking=True)
        # columns past the step's table keep stale block ids: a row reads only its first ceil(seq_len / block)
        self.block_tables[:num_rows, :batch.block_tables.shape[1]].copy_(batch.block_tables, non_blocking=True)
        self._repad(num_tokens, num_rows)
        if batch.max_query_len == 1:
            graph = self.graphs[pick_bucket(self.buckets, num_rows)]
        else:
            self.verify_query_start_loc[:num_rows + 1].copy_(batch.query_start_loc, non_blocking=True)
            self.verify_query_start_loc[num_rows + 1:].fill_(num_tokens)  # padded sequences: empty queries
            graph = self.verify_graphs[pick_bucket(self.verify_buckets, num_rows)]
        graph.replay()
        return self.outputs[:num_tokens]

    def _repad(self, num_tokens: int, num_rows: int) -> None:
        """Rows of an earlier, bigger step become padding again: their tokens write no KV, their sequences
        read none."""
        if self._used_tokens > num_tokens:
            self.slot_mapping[num_tokens:self._used_tokens].fill_(PAD_SLOT)
        if self._used_rows > num_rows:
            self.seq_lens[num_rows:self._used_rows].fill_(PAD_SEQ_LEN)
        self._used_tokens, self._used_rows = num_tokens, num_rows
