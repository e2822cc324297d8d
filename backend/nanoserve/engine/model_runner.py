"""Runs the model for one StepPlan: batch tensors, paged KV cache, CUDA graphs, tensor-parallel workers."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from nanoserve.config import EngineConfig
from nanoserve.distributed import destroy_tp, free_port, get_tp_size, init_tp
from nanoserve.engine.plan import DecodeBatch, ScheduledSeq, StepPlan
from nanoserve.kernels.torch_attention import AttentionWorkspace
from nanoserve.layers.attention import Attention, AttentionMetadata
from nanoserve.models import get_model_class, load_weights


@dataclass
class StepBatch:
    """One step's inputs as host arrays: built once on rank 0, pickled to tensor-parallel workers."""
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [B+1] int32
    seq_lens: np.ndarray  # [B] int32
    block_tables: np.ndarray  # [B, max_blocks] int32, padded with 0
    sample_rows: np.ndarray  # [N] int64: rows whose last token is sampled
    max_query_len: int
    max_seq_len: int


class BlockTableCache:
    """Host copies of the sequences' block tables kept between steps, so that a decode step converts only
    the tables that changed: converting every table every step costs ~30 ns per Python int, which at
    256 sequences x 64 blocks is most of a step's host budget. Correctness does not depend on the cache
    key: a row is reused only when its saved table equals the sequence's current one."""

    def __init__(self, num_rows: int, width: int):
        self.rows = np.zeros((num_rows, max(width, 1)), dtype=np.int32)
        self.saved: dict[int, tuple[int, list[int]]] = {}  # id(seq) -> (row, table it holds)
        self.free = list(range(num_rows))

    def gather(self, tables: list[list[int]], keys: list[int], width: int) -> np.ndarray:
        if len(self.free) < len(tables):  # rows of finished sequences are only reclaimed here
            self.saved.clear()
            self.free = list(range(len(self.rows)))
        if width > self.rows.shape[1]:
            self.rows = np.pad(self.rows, ((0, 0), (0, width - self.rows.shape[1])))
        index = []
        for key, table in zip(keys, tables):
            entry = self.saved.get(key)
            if entry is None or entry[1] != table:
                row = entry[0] if entry is not None else self.free.pop()
                self.rows[row, :len(table)] = table
                self.rows[row, len(table):] = 0
                entry = self.saved[key] = (row, list(table))
            index.append(entry[0])
        return self.rows[index, :width]

    @property
    def capacity(self) -> int:
        return len(self.rows)


def build_step_batch(plan: StepPlan, block_size: int, tables: BlockTableCache | None = None) -> StepBatch:
    """The batch for `plan`, from the plan alone: each ScheduledSeq contributes tokens start_pos..end_pos-1.
    Written as list comprehensions over the sequences: this runs every step, for up to max_num_seqs rows."""
    if plan.decode is not None:
        return build_decode_batch(plan.decode, block_size)
    scheduled = plan.scheduled
    seqs = [s.seq for s in scheduled]
    starts = [s.start_pos for s in scheduled]
    counts = [s.num_new_tokens for s in scheduled]
    ends = [start + n for start, n in zip(starts, counts)]
    block_tables = [seq.block_table for seq in seqs]
    max_query_len = max(counts, default=0)
    if max_query_len == 1:  # decode (the hot path): one token per sequence
        query_start = np.arange(len(seqs) + 1, dtype=np.int32)
        input_ids = [seq.token_ids[p] for seq, p in zip(seqs, starts)]
        positions = starts
        slots = [t[p // block_size] * block_size + p % block_size for t, p in zip(block_tables, starts)]
    else:
        query_start = np.zeros(len(seqs) + 1, dtype=np.int32)
        np.cumsum(counts, out=query_start[1:])
        input_ids, positions, slots = [], [], []
        for seq, table, start, end in zip(seqs, block_tables, starts, ends):
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += _slot_range(table, start, end, block_size)
    sampled = np.array([end == len(seq.token_ids) for seq, end in zip(seqs, ends)], dtype=bool)
    width = max(map(len, block_tables), default=0)
    if tables is not None and len(block_tables) <= tables.capacity:
        table_array = tables.gather(block_tables, list(map(id, seqs)), width)
    else:
        table_array = _pad_tables(block_tables, width)
    return StepBatch(np.array(input_ids, np.int64), np.array(positions, np.int64), np.array(slots, np.int64),
                     query_start, np.array(ends, np.int32), table_array,
                     (query_start[1:][sampled] - 1).astype(np.int64), max_query_len, max(ends, default=0))


def build_decode_batch(decode: DecodeBatch, block_size: int) -> StepBatch:
    """The batch of a decode-only plan, from its arrays: one token per row, every row sampled."""
    positions = decode.positions
    rows = np.arange(len(positions))
    block_ids = decode.block_tables[rows, positions // block_size].astype(np.int64)
    seq_lens = (positions + 1).astype(np.int32)
    return StepBatch(decode.input_ids, positions, block_ids * block_size + positions % block_size,
                     np.arange(len(positions) + 1, dtype=np.int32), seq_lens, decode.block_tables, rows,
                     1, int(seq_lens.max(initial=0)))


def _slot_range(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    slots, pos = [], start
    while pos < end:
        offset = pos % block_size
        base = table[pos // block_size] * block_size
        take = min(block_size - offset, end - pos)
        slots += range(base + offset, base + offset + take)
        pos += take
    return slots


def _pad_tables(tables: list[list[int]], width: int) -> np.ndarray:
    out = np.zeros((len(tables), width), dtype=np.int32)
    for row, table in enumerate(tables):
        out[row, :len(table)] = table
    return out


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class ModelRunner:
    """Rank 0 is the runner the engine owns; with tensor_parallel_size > 1 it spawns ranks 1.. (each a
    ModelRunner built by engine/tp_worker.py) and drives them step by step."""

    def __init__(self, config: EngineConfig, rank: int = 0, dist_port: int | None = None):
        self.config, self.rank = config, rank
        self.block_size = config.kvcache_block_size
        self.workers = None
        self.graphs = None
        self.sampler = None
        self.attention_workspace = AttentionWorkspace()  # the torch attention backend's buffers (see _bind_kv_cache)
        self._sampling = None  # (seqs, eos_token_id, SamplingMetadata) of the last step, reused when the
        # next step samples the same sequences
        self._closed = False
        if config.attention_backend == "flash_attn" and self.block_size % 256:
            raise ValueError(f"kvcache_block_size: attention_backend='flash_attn' needs a multiple of 256 "
                             f"(flash-attn's paged KV), got {self.block_size}")
        hf = config.hf_config
        eos = getattr(hf, "eos_token_id", None)
        self.eos_token_id = eos[0] if isinstance(eos, (list, tuple)) and eos else eos  # the engine may set it
        try:
            self.device = self._pick_device()  # before the process group: NCCL binds the current GPU
            self._init_distributed(dist_port)
            self.dtype = config.torch_dtype
            with torch.device(self.device), _default_dtype(self.dtype):
                self.model = get_model_class(hf)(hf, config.attention_backend)
            load_weights(self.model, config.model)
            self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
            self.max_blocks_per_seq = -(-config.max_model_len // self.block_size)
            self.table_cache = BlockTableCache(2 * config.max_num_seqs, min(self.max_blocks_per_seq, 64))
            self.kv_cache = self._allocate_kv_cache()
            if self._use_cuda_graphs():
                self.graphs = self._capture_cuda_graphs()
        except BaseException:
            self.shutdown()
            raise

    # ---- setup ----
    def _init_distributed(self, dist_port):
        tp = self.config.tensor_parallel_size
        if tp == 1:
            return
        if self.rank == 0:
            from nanoserve.engine.tp_worker import TPWorkers

            dist_port = free_port()
            self.workers = TPWorkers(self.config, dist_port)
            self.workers.wait_ready()
        init_tp(self.rank, tp, dist_port, self.config.device_type)

    def _pick_device(self) -> torch.device:
        if self.config.device_type == "cpu":
            return torch.device("cpu")
        first = self.config.gpu_index
        if first is None:
            first = 0 if self.config.tensor_parallel_size > 1 else torch.cuda.current_device()
        index = first + self.rank
        torch.cuda.set_device(index)
        return torch.device("cuda", index)

    def _kv_shape(self, num_blocks: int) -> tuple[int, ...]:
        first = self.attention_layers[0]
        return (2, len(self.attention_layers), num_blocks, self.block_size, first.num_kv_heads, first.head_dim)

    def _bind_kv_cache(self, kv: torch.Tensor | None) -> None:
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = (kv[0, i], kv[1, i]) if kv is not None else (torch.empty(0),) * 2
        # buffers gathered from the previous cache are void. On the CPU the torch backend keeps each layer's
        # gathered decode context between steps (kernels/torch_attention.py): at most the cache's size again.
        keep = kv is not None and self.device.type == "cpu" and self.config.attention_backend == "torch"
        self.attention_workspace = AttentionWorkspace(keep_bytes=kv.numel() * kv.element_size() if keep else 0)

    def _allocate_kv_cache(self) -> torch.Tensor:
        block_bytes = int(np.prod(self._kv_shape(1))) * self.dtype.itemsize
        num_blocks = self.config.num_kvcache_blocks
        if num_blocks is None:
            if self.device.type == "cpu":
                num_blocks = int(self.config.cpu_kvcache_space_gib * 2 ** 30) // block_bytes
            else:
                num_blocks = self._blocks_from_gpu_memory(block_bytes)
            if get_tp_size() > 1:  # every rank must agree on the block count
                count = torch.tensor([num_blocks], device=self.device)
                torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MIN)
                num_blocks = int(count)
        if num_blocks <= 0:
            raise ValueError(f"no memory left for the KV cache (one block needs {block_bytes} bytes): raise "
                             "gpu_memory_utilization / cpu_kvcache_space_gib, or lower max_num_batched_tokens")
        self.config.num_kvcache_blocks = num_blocks
        kv = torch.zeros(self._kv_shape(num_blocks), dtype=self.dtype, device=self.device)
        self._bind_kv_cache(kv)
        return kv

    def _blocks_from_gpu_memory(self, block_bytes: int) -> int:
        """Blocks that fit in gpu_memory_utilization of the GPU once weights and the activation peak of a
        warm-up forward at the largest batch are accounted for."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        scratch_bytes = self._warmup()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        stats = torch.cuda.memory_stats()
        peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
        # the warm-up's scratch KV cache was live at the peak but is not activation memory
        activations = peak - scratch_bytes - current
        available = total * self.config.gpu_memory_utilization - (total - free) - activations
        return int(available) // block_bytes

    def _warmup(self) -> int:
        """A forward at the largest prefill batch, with a scratch KV cache just big enough; returns its size."""
        from nanoserve.engine.sequence import Sequence
        from nanoserve.sampling_params import SamplingParams

        c = self.config
        seq_len = min(c.max_model_len, c.max_num_batched_tokens)
        num_seqs = max(1, min(c.max_num_seqs, c.max_num_batched_tokens // seq_len))
        blocks_per_seq = -(-seq_len // self.block_size)
        scratch = torch.zeros(self._kv_shape(num_seqs * blocks_per_seq), dtype=self.dtype, device=self.device)
        self._bind_kv_cache(scratch)
        plan = StepPlan()
        for i in range(num_seqs):
            seq = Sequence(f"warmup-{i}", [0] * seq_len, SamplingParams(), max_tokens=1)
            seq.block_table = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
            plan.scheduled.append(ScheduledSeq(seq, 0, seq_len))
        self.run_batch(build_step_batch(plan, self.block_size))
        with torch.inference_mode():  # logits at the largest decode batch, and the sampler's top-p/top-k sort
            hidden = torch.zeros(c.max_num_seqs, c.hf_config.hidden_size, dtype=self.dtype, device=self.device)
            logits = self.model.compute_logits(hidden)
            if logits is not None:
                logits.float().sort(dim=-1)
        self._bind_kv_cache(None)
        size = scratch.numel() * scratch.element_size()
        del scratch
        return size

    def _use_cuda_graphs(self) -> bool:
        from nanoserve.engine.cuda_graph import backend_is_capturable

        return (self.device.type == "cuda" and not self.config.enforce_eager
                and backend_is_capturable(self.config.attention_backend))

    def _capture_cuda_graphs(self):
        from nanoserve.engine.cuda_graph import CUDAGraphRunner

        c = self.config
        return CUDAGraphRunner(self.model, c.max_num_seqs, self.max_blocks_per_seq, c.max_model_len,
                               c.hf_config.hidden_size, self.dtype, self.device).capture()

    # ---- one step ----
    def build_batch(self, plan: StepPlan) -> StepBatch:
        return build_step_batch(plan, self.block_size, self.table_cache)

    def to_device(self, batch: StepBatch):
        """-> (input_ids, positions, attn_metadata, sample_rows) tensors on the runner's device."""
        input_ids, positions, slots, sample_rows = self._upload(
            batch.input_ids, batch.positions, batch.slot_mapping, batch.sample_rows)
        query_start_loc, seq_lens, block_tables = self._upload(
            batch.query_start_loc, batch.seq_lens, batch.block_tables)
        meta = AttentionMetadata(slot_mapping=slots, query_start_loc=query_start_loc, seq_lens=seq_lens,
                                 block_tables=block_tables, max_query_len=batch.max_query_len,
                                 max_seq_len=batch.max_seq_len, is_decode_only=batch.max_query_len == 1,
                                 workspace=self.attention_workspace)
        return input_ids, positions, meta, sample_rows

    def _upload(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """Same-dtype arrays to the device in one host-to-device copy (each copy costs ~10 us of host time)."""
        if self.device.type == "cpu":
            return [torch.from_numpy(a) for a in arrays]
        flat = torch.from_numpy(np.concatenate([a.ravel() for a in arrays])).to(self.device, non_blocking=True)
        parts = flat.split([a.size for a in arrays])
        return [part.view(a.shape) for part, a in zip(parts, arrays)]

    def prepare(self, plan: StepPlan):
        """-> (input_ids [T], positions [T], attn_metadata, sample_rows [N]) for `plan`."""
        return self.to_device(self.build_batch(plan))

    @torch.inference_mode()
    def run_batch(self, batch: StepBatch) -> torch.Tensor | None:
        """Forward on this rank; float32 logits [N, vocab] on rank 0, None on the other ranks."""
        input_ids, positions, meta, sample_rows = self.to_device(batch)
        num_tokens = len(batch.input_ids)
        if self.graphs is not None and self.graphs.can_run(num_tokens, batch.block_tables.shape[1],
                                                           meta.is_decode_only):
            hidden = self.graphs.run(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, meta)
        if len(batch.sample_rows) != num_tokens:  # otherwise every row is sampled, in order
            hidden = hidden[sample_rows]
        logits = self.model.compute_logits(hidden)
        return None if logits is None else logits.float()

    def run_model(self, plan: StepPlan) -> torch.Tensor:
        """float32 logits [number of sampling rows, vocab], rows in plan order."""
        batch = self.build_batch(plan)
        if self.workers is not None:
            self.workers.call("run_batch", batch)
        return self.run_batch(batch)

    def execute(self, plan: StepPlan):
        """run_model + sampling -> SamplerOutput for plan.sampling_seqs, in order."""
        from nanoserve.layers.sampler import Sampler

        logits = self.run_model(plan)
        if self.sampler is None:
            self.sampler = Sampler(self.config.seed)
        return self.sampler(logits, self.sampling_metadata(plan.sampling_seqs))

    def sampling_metadata(self, seqs: list):
        """SamplingMetadata for seqs. A decode step usually samples the same sequences as the step before:
        then only the parts that follow their tokens (seeds, penalties, min_tokens) are rebuilt."""
        from nanoserve.layers.sampler import SamplingMetadata

        last = self._sampling
        if last is not None and last[0] == seqs and last[1] == self.eos_token_id:
            meta = last[2].refresh(seqs)
        else:
            meta = SamplingMetadata.from_seqs(seqs, self.eos_token_id, self.device)
        self._sampling = (list(seqs), self.eos_token_id, meta)
        return meta

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.workers is not None:
            self.workers.shutdown()
            self.workers = None
        self.graphs = None
        if getattr(self, "attention_layers", None):
            self._bind_kv_cache(None)
        self.kv_cache = None
        destroy_tp()
