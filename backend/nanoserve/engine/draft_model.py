"""The draft model of speculative decoding (speculative_config {"model": ...}): a smaller model with the target's
tokenizer, on the target's device, whose KV cache is a second tensor indexed by the target's block ids (the same
block tables, so the scheduler allocates for both at once).

Each step it computes the tokens the target computes, but for the proposals (so its cache holds KV wherever the
target's does, prefix-cached blocks included), then proposes each speculating row's tokens greedily, one forward
per proposed token; the forward of the last proposal writes only its KV. A proposal is the draft's argmax, a
point mass, so the runner's verify() keeps the target's distribution exactly; rejected proposals' KV is written
again when those positions are computed. Where the target replays CUDA graphs, the draft replays its own decode
graphs (`graphs`, set by the runner): its one-token-per-row forwards are decode steps."""
from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np
import torch
from transformers import AutoConfig

from nanoserve.config import EngineConfig
from nanoserve.engine.cuda_graph import CUDAGraphRunner
from nanoserve.engine.input_batch import InputBatch, StepInputs
from nanoserve.layers.attention import Attention, AttentionBackend, AttentionBatch
from nanoserve.layers.decode_layer import fuse_decode_layers
from nanoserve.layers.linear import pack_cpu_weights
from nanoserve.models import get_model_class, load_weights
from nanoserve.models.loader import default_dtype
from nanoserve.models.quantize import on_device, quantize_weights


class DraftModel:
    def __init__(self, config: EngineConfig, device: torch.device, backend: AttentionBackend,
                 upload: Callable[..., list[torch.Tensor]]):
        self.path = config.speculative_config.model
        self.device, self.backend, self.upload = device, backend, upload
        self.kv_dtype = config.kv_torch_dtype
        hf = AutoConfig.from_pretrained(self.path)
        with torch.device(device), default_dtype(config.torch_dtype):
            self.model = get_model_class(hf)(hf, backend)
        load_weights(self.model, self.path)
        quantization = on_device(config.quantization, device)
        chosen = quantize_weights(self.model, quantization, config.torch_dtype)
        print(f"nanoserve: draft model weights (quantization={quantization}): {chosen}", file=sys.stderr, flush=True)
        pack_cpu_weights(self.model)
        fuse_decode_layers(self.model)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.kv_cache: torch.Tensor | None = None
        self.graphs: CUDAGraphRunner | None = None

    def kv_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        first = self.attention_layers[0]
        return (2, len(self.attention_layers), num_blocks, block_size, first.num_kv_heads, first.head_dim)

    def bind_kv_cache(self, kv: torch.Tensor | None) -> None:
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = (kv[0, i], kv[1, i]) if kv is not None else (torch.empty(0),) * 2
        self.kv_cache = kv

    # ---- one step ----
    @torch.inference_mode()
    def compute(self, inputs: StepInputs) -> None:
        """The KV of a step's tokens (a step without proposals)."""
        if len(inputs.input_ids):
            self._forward(inputs, None)

    @torch.inference_mode()
    def propose(self, inputs: StepInputs, batch: InputBatch, slots: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
        """The KV of the step's tokens but the proposals (inputs: sampled at each speculating row's last token),
        then num_drafts[i] greedy proposals for the row in slots[i]: the proposed ids, in row order."""
        last_positions = inputs.positions[inputs.logits_indices]
        num_steps = int(num_drafts.max())
        proposals = np.zeros((len(slots), num_steps), dtype=np.int64)
        proposals[:, 0] = self._forward(inputs, inputs.logits_indices)
        for step in range(1, num_steps + 1):
            rows = np.flatnonzero(num_drafts >= step)  # they hold proposal `step` and compute its KV
            wants_next = np.flatnonzero(num_drafts[rows] > step)
            decode = _decode_inputs(batch, slots[rows], last_positions[rows] + step, proposals[rows, step - 1])
            next_ids = self._forward(decode, wants_next if len(wants_next) else None)
            if len(wants_next):
                proposals[rows[wants_next], step] = next_ids
        return proposals[np.arange(num_steps) < num_drafts[:, None]]

    def _forward(self, inputs: StepInputs, sampled: np.ndarray | None) -> np.ndarray | None:
        """Run the draft on inputs: the argmax token of each token index in sampled (None: KV only)."""
        input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables = self.upload(
            inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.query_start_loc, inputs.seq_lens,
            inputs.block_tables)
        batch = AttentionBatch(slot_mapping, query_start_loc, seq_lens, block_tables, inputs.max_query_len,
                               inputs.max_seq_len)
        if self.graphs is not None and self.graphs.can_run(len(seq_lens), block_tables.shape[1], batch.max_query_len):
            hidden = self.graphs.run(input_ids, positions, batch)
        else:
            hidden = self.model(input_ids, positions, self.backend.build(batch), None)
        if sampled is None:
            return None
        index = torch.from_numpy(np.asarray(sampled, dtype=np.int64)).to(self.device)
        return self.model.compute_logits(hidden[index]).argmax(dim=-1).cpu().numpy()


def _decode_inputs(batch: InputBatch, slots: np.ndarray, positions: np.ndarray, token_ids: np.ndarray) -> StepInputs:
    """One token per row: token_ids[i] at positions[i] of the row in slots[i]."""
    seq_lens = positions + 1
    max_seq_len = int(seq_lens.max())
    return StepInputs(token_ids.astype(np.int64), positions.astype(np.int64),
                      batch.kv_slots[slots, positions].astype(np.int64),
                      np.arange(len(slots) + 1, dtype=np.int32), seq_lens.astype(np.int32),
                      batch.block_tables[slots, :-(-max_seq_len // batch.block_size)],
                      np.arange(len(slots)), 1, max_seq_len)
