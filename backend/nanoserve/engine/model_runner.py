"""Runs the model on one tensor-parallel rank: applies each SchedulerOutput to its persistent InputBatch, runs
the forward (through a CUDA graph where one fits), and on rank 0 samples. It knows nothing of processes: the
executor builds one runner per rank and calls every rank's runner the same way."""
from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from nanoserve.config import EngineConfig
from nanoserve.distributed import get_tp_rank, get_tp_size
from nanoserve.engine.cuda_graph import CUDAGraphRunner
from nanoserve.engine.draft_model import DraftModel
from nanoserve.engine.input_batch import InputBatch, PendingTokens, PromptPositions, StepInputs
from nanoserve.engine.outputs import PromptLogprobs
from nanoserve.engine.scheduler_output import NewSequence, SchedulerOutput
from nanoserve.engine.simulated_device import SimulatedDevice, SimulatedStep
from nanoserve.engine.structured_output import TokenBitmask
from nanoserve.kernels.cpu_ops import library as cpu_kernels
from nanoserve.layers.attention import Attention, AttentionBatch, make_backend
from nanoserve.layers.decode_layer import fuse_decode_layers
from nanoserve.layers.linear import pack_cpu_weights
from nanoserve.layers.lora import LoRABatch
from nanoserve.layers.sampler import Sampler, SamplerOutput, SamplingMetadata, token_logprobs
from nanoserve.models import get_model_class, load_weights
from nanoserve.models.loader import default_dtype
from nanoserve.models.lora import LoRAStore
from nanoserve.models.quantize import on_device, quantize_weights
from nanoserve.sampling_params import SamplingParams


logger = logging.getLogger(__name__)
BitmaskOf = Callable[[SchedulerOutput], TokenBitmask | None]  # a step's structured-outputs bitmask, once proposed
PROMPT_LOGITS_ROWS = 512  # prompt positions whose logits (a [rows, vocab] float32 tensor) are computed at once


@dataclass
class RunnerOutput:
    """What a step sampled, one entry per sampling row in row order (host data)."""
    token_ids: np.ndarray  # [N] int64
    logprobs: np.ndarray  # [N] float32: log-softmax of the (penalized) logits at the sampled token
    # for the rows whose request asks for logprobs: row -> (the most likely token ids and their logprobs, largest
    # first; the sampled token's rank)
    top_logprobs: dict[int, tuple[list[int], list[float], int]] = field(default_factory=dict)
    # for the rows that want prompt logprobs and computed prompt positions: request id -> (index in the prompt of
    # the first token they are about, their logprobs)
    prompt_logprobs: dict[str, tuple[int, PromptLogprobs]] = field(default_factory=dict)
    # speculative decoding: per sampling row, its tokens among token_ids (its accepted proposals and the token
    # after them); None: one each. logprobs and top_logprobs are then per token too
    num_tokens: np.ndarray | None = None

    def select(self, keep: np.ndarray) -> RunnerOutput:
        """The sampling rows that keep marks (async scheduling drops the rows of sequences that finished)."""
        index = np.cumsum(keep) - 1
        top = {int(index[row]): entry for row, entry in self.top_logprobs.items() if keep[row]}
        return RunnerOutput(self.token_ids[keep], self.logprobs[keep], top, self.prompt_logprobs)


@dataclass
class LaunchedStep:
    """Async scheduling: a step whose forward is launched and whose sampled ids are read later (result())."""
    pending: PendingTokens  # where its sampled tokens go in the token table
    logits: torch.Tensor | None = None  # [sampling rows, vocab] float32, until sampled (None: simulated)
    prompt_logprobs: dict[str, tuple[int, PromptLogprobs]] = field(default_factory=dict)
    simulated: SimulatedStep | None = None
    meta: SamplingMetadata | None = None  # once sampled
    sampled: SamplerOutput | None = None  # once sampled: on the host (CUDA: being copied there)
    token_ids: torch.Tensor | None = None  # once sampled: the sampled ids on the device, for the next step
    copied: torch.cuda.Event | None = None  # CUDA: recorded after the copies to the host were queued


def pick_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank r of tensor parallelism takes the r-th GPU after the configured one (select it before NCCL starts)."""
    if config.device_type == "cpu":
        return torch.device("cpu")
    first = config.gpu_index
    if first is None:
        first = 0 if config.tensor_parallel_size > 1 else torch.cuda.current_device()
    torch.cuda.set_device(first + rank)
    return torch.device("cuda", first + rank)


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device, eos_token_ids=()):
        self.config, self.device, self.dtype = config, device, config.torch_dtype
        self.kv_dtype = config.kv_torch_dtype
        self.block_size = config.kvcache_block_size
        self.max_blocks_per_seq = -(-config.max_model_len // self.block_size)
        self.backend = make_backend(config.attention_backend)
        hf = config.hf_config
        with torch.device(device), default_dtype(self.dtype):
            self.model = get_model_class(hf)(hf, self.backend)
            self.loras = (LoRAStore(self.model, config.max_loras, config.max_lora_rank, config.max_cpu_loras)
                          if config.enable_lora else None)
        load_weights(self.model, config.model)
        self._quantize_weights()
        pack_cpu_weights(self.model)
        fuse_decode_layers(self.model)
        if self.device.type == "cpu":
            cpu_kernels()  # built or loaded now, while the model loads, rather than in the first request's step
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.batch = InputBatch(config.max_num_seqs, config.max_model_len, self.block_size, eos_token_ids)
        self.sampler = Sampler(config.seed)
        self.simulated = SimulatedDevice.from_env(config.seed)  # a benchmark tool: no forward, no sampler math
        if self.simulated is not None:
            logger.warning("nanoserve: %s", self.simulated.describe())
        spec = config.speculative_config
        self.draft = DraftModel(config, device, self.backend, self._upload) \
            if spec is not None and spec.method == "draft_model" else None
        self.kv_cache: torch.Tensor | None = None
        self.graphs: CUDAGraphRunner | None = None
        self.step_prompt_logprobs: dict[str, tuple[int, PromptLogprobs]] = {}  # the last forward's

    # ---- setup ----
    def _quantize_weights(self) -> None:
        """The weights' formats (the quantization engine argument), said once, by rank 0."""
        quantization = on_device(self.config.quantization, self.device)  # CPU: torch's kernels, CUDA: Triton's
        chosen = quantize_weights(self.model, quantization, self.dtype)
        if get_tp_rank() == 0:
            print(f"nanoserve: weights (quantization={quantization}, --quantization none for float): {chosen}",
                  file=sys.stderr, flush=True)

    def init_kv_cache(self) -> int:
        """Allocate the KV cache (and capture CUDA graphs); returns its number of blocks. Every rank calls it
        at once: they agree on the smallest count."""
        block_bytes = int(np.prod(self._kv_shape(1))) * self.kv_dtype.itemsize
        if self.draft is not None:  # the draft's cache has a block for each of the target's
            block_bytes += int(np.prod(self.draft.kv_shape(1, self.block_size))) * self.kv_dtype.itemsize
        num_blocks = self.config.num_kvcache_blocks
        if num_blocks is None:
            if self.device.type == "cpu":
                num_blocks = int(self.config.cpu_kvcache_space_gib * 2 ** 30) // block_bytes
            else:
                num_blocks = self._blocks_from_gpu_memory(block_bytes)
            if get_tp_size() > 1:
                count = torch.tensor([num_blocks], device=self.device)
                torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MIN)
                num_blocks = int(count)
        if num_blocks <= 0:
            raise ValueError(f"no memory left for the KV cache (one block needs {block_bytes} bytes): raise "
                             "gpu_memory_utilization / cpu_kvcache_space_gib, or lower max_num_batched_tokens")
        self._bind_kv_cache(torch.zeros(self._kv_shape(num_blocks), dtype=self.kv_dtype, device=self.device))
        if self.draft is not None:
            self.draft.bind_kv_cache(torch.zeros(self.draft.kv_shape(num_blocks, self.block_size), dtype=self.kv_dtype,
                                                 device=self.device))
        if self.device.type == "cuda" and not self.config.enforce_eager and self.backend.capturable:
            self.graphs = self.graph_runner().capture()
            if self.draft is not None:
                self.draft.graphs = self.draft_graph_runner().capture()
        return num_blocks

    def graph_runner(self) -> CUDAGraphRunner:
        """The CUDA graphs this configuration replays: decode steps up to max_num_seqs sequences and, with
        speculative decoding, verify steps while it proposes (fewer than disable_by_batch_size sequences)."""
        c, spec = self.config, self.config.speculative_config
        verify_len = 1 if spec is None else 1 + spec.num_speculative_tokens
        max_verify_seqs = 0 if spec is None else spec.max_proposing_seqs(c.max_num_seqs)
        return CUDAGraphRunner(self.model, self.backend, c.max_num_seqs, self.max_blocks_per_seq, c.max_model_len,
                               c.hf_config.hidden_size, self.dtype, self.device, verify_len, max_verify_seqs)

    def draft_graph_runner(self) -> CUDAGraphRunner:
        """The draft model's decode graphs: each proposed token is a one-token-per-row forward of the draft."""
        c, draft = self.config, self.draft.model
        return CUDAGraphRunner(draft, self.backend, c.max_num_seqs, self.max_blocks_per_seq, c.max_model_len,
                               draft.config.hidden_size, self.dtype, self.device)

    def _kv_shape(self, num_blocks: int) -> tuple[int, ...]:
        first = self.attention_layers[0]
        return (2, len(self.attention_layers), num_blocks, self.block_size, first.num_kv_heads, first.head_dim)

    def _bind_kv_cache(self, kv: torch.Tensor | None) -> None:
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = (kv[0, i], kv[1, i]) if kv is not None else (torch.empty(0),) * 2
        self.kv_cache = kv

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

    @torch.inference_mode()
    def _warmup(self) -> int:
        """A forward at the largest prefill batch, with a scratch KV cache just big enough, and the logits and
        the sampler's sort at the largest decode batch; returns the scratch cache's size."""
        c = self.config
        seq_len = min(c.max_model_len, c.max_num_batched_tokens)
        num_seqs = max(1, min(c.max_num_seqs, c.max_num_batched_tokens // seq_len))
        blocks = -(-seq_len // self.block_size)
        self._bind_kv_cache(torch.zeros(self._kv_shape(num_seqs * blocks), dtype=self.kv_dtype, device=self.device))
        scratch_bytes = self.kv_cache.numel() * self.kv_cache.element_size()
        batch = InputBatch(num_seqs, seq_len, self.block_size)
        out = SchedulerOutput(new_seqs=[NewSequence(f"warmup-{i}", [0] * seq_len, seq_len, SamplingParams(),
                                                    list(range(i * blocks, (i + 1) * blocks)))
                                        for i in range(num_seqs)],
                              num_computed_tokens=np.zeros(num_seqs, np.int64),
                              num_scheduled_tokens=np.full(num_seqs, seq_len, np.int64),
                              samples=np.ones(num_seqs, bool), num_batched_tokens=num_seqs * seq_len)
        batch.update(out)
        self.forward(batch.prepare(out))
        hidden = torch.zeros(c.max_num_seqs, c.hf_config.hidden_size, dtype=self.dtype, device=self.device)
        logits = self.model.compute_logits(hidden)
        if logits is not None:
            logits.float().sort(dim=-1)
        self._bind_kv_cache(None)
        return scratch_bytes

    # ---- one step ----
    def execute(self, out: SchedulerOutput, bitmask_of: BitmaskOf | None = None,
                while_running: Callable[[], None] | None = None) -> RunnerOutput | None:
        """Apply the step's diffs, run it and sample (within bitmask_of(out), the bitmask of the rows with
        structured outputs, made once a draft model has proposed into out): rank 0's RunnerOutput (None on the
        other ranks). while_running: host work to do once the forward is launched, before its results are read
        (on a GPU it overlaps the device's work, as the bitmask's does; on the CPU it follows)."""
        if self.simulated is not None:
            return self.simulate(out, bitmask_of, while_running)
        logits = self.run_model(out)
        bitmask = None if bitmask_of is None or get_tp_rank() else bitmask_of(out)
        if while_running is not None:
            while_running()
        return None if logits is None else self.sample(logits, bitmask)

    @torch.inference_mode()
    def run_model(self, out: SchedulerOutput) -> torch.Tensor | None:
        """Apply the step's diffs and run the forward: the float32 logits [sampling rows, vocab] in row order on
        rank 0, None on the other ranks."""
        return self.forward(self.prepare(out))

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """Apply the step's diffs (rows, adapters) to the persistent batch: the step's inputs."""
        self.batch.update(out)
        for slot, adapter in out.lora_loads:
            self.loras.load(slot, adapter.id, adapter.path)
        if self.draft is not None and self.simulated is None:
            return self._prepare_with_draft(out)
        return self.batch.prepare(out)

    def _prepare_with_draft(self, out: SchedulerOutput) -> StepInputs:
        """The draft model computes the step's tokens but the proposals (sampled at the last token of each row
        that proposes), proposes into out.draft_token_ids, and then the step's inputs are made with them."""
        drafts = out.num_draft_tokens
        if not np.count_nonzero(drafts):
            inputs = self.batch.prepare(out)
            self.draft.compute(inputs)
            return inputs
        without_proposals = dataclasses.replace(
            out, num_scheduled_tokens=out.num_scheduled_tokens - drafts, samples=drafts > 0,
            num_batched_tokens=out.num_batched_tokens - int(drafts.sum()), num_draft_tokens=drafts[:0])
        speculating = np.flatnonzero(drafts)
        out.draft_token_ids = self.draft.propose(self.batch.prepare(without_proposals), self.batch,
                                                 self.batch.slots[speculating], drafts[speculating])
        return self.batch.prepare(out)

    @torch.inference_mode()
    def simulate(self, out: SchedulerOutput, bitmask_of: BitmaskOf | None = None,
                 while_running: Callable[[], None] | None = None) -> RunnerOutput | None:
        """execute() on the simulated device: the same host work (inputs prepared and uploaded, then the sampling
        metadata while the device runs), random ids for the forward and the sampler's math."""
        if len(out.num_draft_tokens) and not len(out.draft_token_ids):  # a draft model's, but no model runs
            out.draft_token_ids = np.zeros(int(out.num_draft_tokens.sum()), dtype=np.int64)
        inputs = self.prepare(out)
        self._upload(inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.logits_indices,
                     inputs.query_start_loc, inputs.seq_lens, inputs.block_tables)
        step = self.simulated.launch(len(inputs.input_ids), len(inputs.logits_indices),
                                     self.config.hf_config.vocab_size)
        if get_tp_rank():
            return None
        meta = self.batch.sampling_metadata(self.device, None if bitmask_of is None else bitmask_of(out))
        if while_running is not None:
            while_running()
        token_ids = step.token_ids()
        out = RunnerOutput(token_ids, np.zeros(len(token_ids), np.float32),
                           {row: ([], [], 1) for row in meta.logprob_rows})
        if self.batch.num_draft_tokens is not None:  # proposals: verified against the random ids
            out = verify(out, self.batch.num_draft_tokens, self.batch.draft_token_ids)
        return out

    # ---- async scheduling (one rank) ----
    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Apply the step's diffs, prepare it (while `previous`, the step before it, may still run on the device)
        and launch its forward; its input ids that `previous` samples are taken from previous's sampled ids on the
        device (on the CPU: they are known)."""
        inputs = self.prepare(out)
        pending = self.batch.take_pending()
        rows, places = self.batch.placeholders(previous.pending) if previous is not None else (None, None)
        if self.simulated is not None:
            if rows is not None:  # as the device would copy them
                inputs.input_ids[places] = previous.simulated.sampled[rows]
            self._upload(inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.logits_indices,
                         inputs.query_start_loc, inputs.seq_lens, inputs.block_tables)
            return LaunchedStep(pending, simulated=self.simulated.launch(
                len(inputs.input_ids), len(inputs.logits_indices), self.config.hf_config.vocab_size))
        if rows is not None and len(rows):
            sources = previous.token_ids
            inputs.placeholders = (torch.from_numpy(places).to(self.device, non_blocking=True),
                                   sources[torch.from_numpy(rows).to(sources.device, non_blocking=True)])
        logits = self.forward(inputs)
        return LaunchedStep(pending, logits, self.step_prompt_logprobs)

    @torch.inference_mode()
    def sample_launched(self, step: LaunchedStep, bitmask: TokenBitmask | None = None) -> None:
        """Launch the sampling of the last step launched (within bitmask); its ids stay on the device."""
        step.meta = self.batch.sampling_metadata(self.device, bitmask)
        if step.simulated is not None:
            return
        sampled, step.logits = self.sampler(step.logits, step.meta), None
        step.sampled, step.token_ids = sampled, sampled.token_ids
        if self.device.type == "cuda":  # queued now, so that reading them waits for this step, not the next
            tensors = (getattr(sampled, f.name) for f in dataclasses.fields(sampled))
            step.sampled = SamplerOutput(*(None if t is None else t.to("cpu", non_blocking=True) for t in tensors))
            step.copied = torch.cuda.Event()
            step.copied.record()

    def result(self, step: LaunchedStep) -> RunnerOutput:
        """A sampled step's tokens on the host (waiting for the device), written into the token table."""
        if step.simulated is not None:
            token_ids = step.simulated.token_ids()
            out = RunnerOutput(token_ids, np.zeros(len(token_ids), np.float32),
                               {row: ([], [], 1) for row in step.meta.logprob_rows})
        else:
            if step.copied is not None:
                step.copied.synchronize()
            out = self._to_host(step.sampled, step.meta, step.prompt_logprobs)
        self.batch.fill_pending(step.pending, out.token_ids)
        return out

    def forward(self, inputs: StepInputs) -> torch.Tensor | None:
        """The model on one step's inputs: float32 logits [sampling rows, vocab] on rank 0, None on the others.
        The prompt logprobs the step computes wait in self.step_prompt_logprobs for sample()."""
        self.step_prompt_logprobs = {}
        if not len(inputs.input_ids):  # a step that only preempted
            return None if get_tp_rank() else torch.zeros(0, self.config.hf_config.vocab_size, device=self.device)
        hidden, logits_indices = self.hidden_states(inputs)
        if inputs.prompt_positions is not None:
            self.step_prompt_logprobs = self.prompt_logprobs(hidden, inputs.prompt_positions)
        logits = self.model.compute_logits(hidden if logits_indices is None else hidden[logits_indices])
        return None if logits is None else logits.float()

    def hidden_states(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's last hidden states [step tokens, hidden] and the indices of the sampled ones on the device
        (None when every token is sampled, in order)."""
        input_ids, positions, slot_mapping, logits_indices, query_start_loc, seq_lens, block_tables = self._upload(
            inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.logits_indices, inputs.query_start_loc,
            inputs.seq_lens, inputs.block_tables)
        if inputs.placeholders is not None:
            places, token_ids = inputs.placeholders
            input_ids[places] = token_ids
        batch = AttentionBatch(slot_mapping, query_start_loc, seq_lens, block_tables, inputs.max_query_len,
                               inputs.max_seq_len)
        lora = None if inputs.lora_slots is None else LoRABatch.of_tokens(inputs.lora_slots, self.device)
        if lora is None and self.graphs is not None and self.graphs.can_run(len(seq_lens), block_tables.shape[1],
                                                                            batch.max_query_len):
            hidden = self.graphs.run(input_ids, positions, batch)  # the graphs are captured without adapters
        else:
            hidden = self.model(input_ids, positions, self.backend.build(batch), lora)
        every_token = len(inputs.logits_indices) == len(inputs.input_ids)  # every token is sampled, in order
        return hidden, None if every_token else logits_indices

    def prompt_logprobs(self, hidden: torch.Tensor,
                        positions: PromptPositions) -> dict[str, tuple[int, PromptLogprobs]]:
        """The logprobs of the prompt tokens the step's hidden states predict, by request ({} on ranks > 0: every
        rank computes the logits, which tensor parallelism gathers on rank 0). PROMPT_LOGITS_ROWS positions at a
        time, so a long prompt chunk never holds [chunk, vocab] logits."""
        indices = torch.from_numpy(positions.token_indices).to(self.device)
        targets = torch.from_numpy(positions.target_ids).to(self.device)
        num_top = max(row[3] for row in positions.rows)
        parts = []
        for start in range(0, len(indices), PROMPT_LOGITS_ROWS):
            logits = self.model.compute_logits(hidden[indices[start:start + PROMPT_LOGITS_ROWS]])
            if logits is not None:
                parts.append(token_logprobs(logits.float(), targets[start:start + PROMPT_LOGITS_ROWS], num_top))
        if not parts:
            return {}
        chosen, ranks, top_logprobs, top_ids = (torch.cat(part).tolist() for part in zip(*parts))
        target_ids, chunks, offset = positions.target_ids.tolist(), {}, 0
        for request_id, first, count, top_n in positions.rows:
            entries = [{**dict(zip(top_ids[i][:top_n], top_logprobs[i][:top_n])), target_ids[i]: chosen[i]}
                       for i in range(offset, offset + count)]
            chunks[request_id] = (first, PromptLogprobs(target_ids[offset:offset + count], entries,
                                                        ranks[offset:offset + count]))
            offset += count
        return chunks

    def sample(self, logits: torch.Tensor, bitmask: TokenBitmask | None = None) -> RunnerOutput:
        """The next tokens of the rows the last prepared step samples, from their logits (within the bitmask of
        the rows with structured outputs), with the step's prompt logprobs."""
        meta = self.batch.sampling_metadata(self.device, bitmask)
        out = self._to_host(self.sampler(logits, meta), meta, self.step_prompt_logprobs)
        if self.batch.num_draft_tokens is not None:
            out = verify(out, self.batch.num_draft_tokens, self.batch.draft_token_ids)
        return out

    def _to_host(self, sampled: SamplerOutput, meta: SamplingMetadata,
                 prompt_logprobs: dict[str, tuple[int, PromptLogprobs]]) -> RunnerOutput:
        """The sampler's output as host data (waits for the device)."""
        top = {}
        if meta.logprob_rows:
            ranks = sampled.sampled_ranks.tolist()
            if sampled.top_logprobs is None:  # only logprobs=0: no top tokens
                top = {row: ([], [], rank) for row, rank in zip(meta.logprob_rows, ranks)}
            else:
                top = dict(zip(meta.logprob_rows, zip(sampled.top_token_ids.tolist(), sampled.top_logprobs.tolist(),
                                                      ranks)))
        token_ids, logprobs = sampled.token_ids, sampled.sampled_logprobs
        if self.device.type != "cpu":  # (.cpu() costs host time even on a CPU tensor)
            token_ids, logprobs = token_ids.cpu(), logprobs.cpu()
        return RunnerOutput(token_ids.numpy(), logprobs.numpy(), top, prompt_logprobs)

    def _upload(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """Arrays to the device, in one host-to-device copy per dtype (each copy costs ~10 us of host time)."""
        if self.device.type == "cpu":
            return [torch.from_numpy(a) for a in arrays]
        tensors = [None] * len(arrays)
        for dtype in {a.dtype for a in arrays}:
            indices = [i for i, a in enumerate(arrays) if a.dtype == dtype]
            flat = np.concatenate([arrays[i].ravel() for i in indices])
            parts = torch.from_numpy(flat).to(self.device, non_blocking=True).split(
                [arrays[i].size for i in indices])
            for i, part in zip(indices, parts):
                tensors[i] = part.view(arrays[i].shape)
        return tensors

    def reset_batch(self) -> None:
        """Forget every row (after a failed step): the scheduler sends them again as new sequences."""
        c = self.config
        self.batch = InputBatch(c.max_num_seqs, c.max_model_len, self.block_size, self.batch.eos_token_ids)

    def shutdown(self) -> None:
        self.graphs = None
        self._bind_kv_cache(None)
        if self.draft is not None:
            self.draft.graphs = None
            self.draft.bind_kv_cache(None)


def verify(sampled: RunnerOutput, num_draft_tokens: np.ndarray, draft_token_ids: np.ndarray) -> RunnerOutput:
    """Speculative sampling with proposals that are a point mass (n-gram): each sampling row sampled the target
    model at its last token and at each proposed one (token i given proposals 1..i), exactly as decoding one
    token at a time would. A proposal is accepted while it equals the target's token, which happens with
    probability p(proposal); at the first mismatch the target's token stands, drawn from p given that it is not
    the proposal: the standard rule (accept with min(1, p/q), else draw from max(0, p - q) normalized) for q a
    point mass. So every row emits its accepted proposals and the target's token after them."""
    groups = num_draft_tokens + 1
    starts = np.cumsum(groups) - groups
    place = np.arange(len(sampled.token_ids)) - np.repeat(starts, groups)  # 0 at each row's own last token
    is_draft = place < np.repeat(num_draft_tokens, groups)  # the target's tokens at proposed positions
    mismatch = np.ones(len(place), dtype=bool)
    mismatch[is_draft] = sampled.token_ids[is_draft] != draft_token_ids
    num_accepted = np.minimum.reduceat(np.where(mismatch, place, len(place)), starts)
    keep = place <= np.repeat(num_accepted, groups)
    index = np.cumsum(keep) - 1  # a kept logits row's place among the emitted tokens
    top = {int(index[row]): entry for row, entry in sampled.top_logprobs.items() if keep[row]}
    return RunnerOutput(sampled.token_ids[keep], sampled.logprobs[keep], top, sampled.prompt_logprobs,
                        num_accepted + 1)
