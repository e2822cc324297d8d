"""What the scheduler sends the model runners each step: diffs against the batch each runner keeps (a
tensor-parallel worker receives only what changed), and the step's work as arrays over the batch's rows (the running
sequences in the scheduler's order, once the diffs are applied in the order of the fields below)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from nanoserve.engine.lora import LoRAAdapter
from nanoserve.sampling_params import SamplingParams


def _empty(dtype=np.int64):
    return field(default_factory=lambda: np.zeros(0, dtype=dtype))


@dataclass
class NewSequence:
    """A sequence joining the batch: admitted, or resumed after preemption (then with its output so far)."""
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    lora_slot: int = -1  # the device slot holding its LoRA adapter (-1: the base model)


@dataclass
class SchedulerOutput:
    # ---- diffs, applied in this order ----
    new_token_ids: np.ndarray = _empty()  # the last step's sampled tokens, one per row that sampled then
    # with speculative decoding: per row that sampled then, how many of new_token_ids are its (empty: one each)
    new_token_counts: np.ndarray = _empty()
    finished_ids: list[str] = field(default_factory=list)  # finished or aborted since the last step
    preempted_ids: list[str] = field(default_factory=list)  # preempted by this step (back to waiting)
    new_seqs: list[NewSequence] = field(default_factory=list)  # appended as rows, in order
    new_block_ids: list[tuple[int, list[int]]] = field(default_factory=list)  # (row, ids appended to its table)
    # ---- the step, one entry per row ----
    num_computed_tokens: np.ndarray = _empty()  # [rows] int64, before this step
    num_scheduled_tokens: np.ndarray = _empty()  # [rows] int64, tokens computed this step (0: none)
    samples: np.ndarray = _empty(bool)  # [rows]: the step reaches the row's last token, so it samples
    num_batched_tokens: int = 0  # num_scheduled_tokens.sum()
    num_prefill_tokens: int = 0  # of those, the tokens at prompt positions
    # speculative decoding: [rows] proposed tokens each row verifies, the last of its scheduled tokens (empty:
    # none this step), and the proposed tokens themselves, in row order (n-gram proposals; a draft model's are
    # written here by the model runner at the start of the step)
    num_draft_tokens: np.ndarray = _empty()
    draft_token_ids: np.ndarray = _empty()
    # ---- before the forward ----
    lora_loads: list[tuple[int, LoRAAdapter]] = field(default_factory=list)  # (device slot, adapter to load there)

    @property
    def num_rows(self) -> int:
        return len(self.num_scheduled_tokens)
