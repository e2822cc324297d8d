"""The model runner's persistent batch (docs/architecture.md, "Executor and model runner"), kept up to date from
each SchedulerOutput's diffs. A step's token ids and KV slots are one `take` each from the flat tables (index
slot * width + position)."""
from __future__ import annotations

import math
from collections import Counter
from itertools import chain
from dataclasses import dataclass

import numpy as np
import torch

from nanoserve.engine.scheduler_output import NewSequence, SchedulerOutput
from nanoserve.engine.structured_output import TokenBitmask
from nanoserve.layers.sampler import GREEDY_TEMPERATURE, Penalties, SamplingMetadata
from nanoserve.sampling_params import SamplingParams

_NO_TOP_K = 1 << 30
_NO_ROWS = np.zeros(0, dtype=np.int64)
_MAX_TOKEN_ID = 1 << 31  # larger stop_token_ids cannot be in any vocabulary (and would overflow int64)
# sampling features that cost work only while some row uses them (per-row checks are skipped otherwise)
FEATURES = ("greedy", "top_k", "top_p", "min_p", "seed", "penalties", "min_tokens", "logprobs", "prompt_logprobs",
            "logit_bias")


@dataclass
class PromptPositions:
    """The step's tokens whose logits give prompt logprobs: the prompt positions a row that wants them computes,
    but the prompt's last (its logits sample the first output token)."""
    token_indices: np.ndarray  # [M] int64: among the step's tokens
    target_ids: np.ndarray  # [M] int64: the prompt token each one's logits predict (the next one)
    rows: list[tuple[str, int, int, int]]  # per row, in order: (request id, index in the prompt of its first
    #                                        target, how many, top logprobs wanted)


@dataclass
class StepInputs:
    """One step's model inputs as host arrays, over the B rows that compute tokens (T tokens in all)."""
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64: KV cache slot of each token
    query_start_loc: np.ndarray  # [B+1] int32
    seq_lens: np.ndarray  # [B] int32: context length including this step's tokens
    block_tables: np.ndarray  # [B, W] int32, padded with 0
    logits_indices: np.ndarray  # [N] int64: the tokens whose hidden states are sampled, in row order
    max_query_len: int
    max_seq_len: int
    prompt_positions: PromptPositions | None = None  # the tokens whose logits give prompt logprobs
    lora_slots: np.ndarray | None = None  # [T] int64: each token's LoRA adapter slot (-1: none); None: no adapters
    # async scheduling: input ids the host lacks (the step before samples them), as tensors on the device: (their
    # places among input_ids, the ids), written after the upload
    placeholders: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class PendingTokens:
    """Where a launched step's sampled tokens go in the token table, one entry per sampling row (async
    scheduling: the next step is prepared before they are known). An entry counts only while its slot holds the
    same row: the slot's generation is the one it had."""
    index: np.ndarray  # [N] int64: flat index into token_ids
    slots: np.ndarray  # [N] int64
    generations: np.ndarray  # [N] int64

    def valid(self, slot_generation: np.ndarray) -> np.ndarray:
        return slot_generation[self.slots] == self.generations


def _features(params: SamplingParams) -> list[str]:
    used = {"greedy": params.temperature < GREEDY_TEMPERATURE, "top_k": params.top_k > 0,
            "top_p": params.top_p < 1.0, "min_p": params.min_p > 0.0, "seed": params.seed is not None,
            "min_tokens": params.min_tokens > 0, "logprobs": params.logprobs is not None,
            "prompt_logprobs": params.prompt_logprobs is not None, "logit_bias": bool(params.logit_bias),
            "penalties": (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
                          or params.frequency_penalty != 0.0)}
    return [name for name in FEATURES if used[name]]


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int, eos_token_ids=()):
        self.block_size = block_size
        self.eos_token_ids = sorted(eos_token_ids)  # min_tokens bans them
        self.req_ids: list[str] = []  # per row
        self.slots = np.zeros(0, dtype=np.int64)  # per row
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.slot_generation = np.zeros(max_num_seqs, dtype=np.int64)  # how many rows each slot has held
        # the rows that sample in the step being run, in order: their slots, their lengths (tokens held before
        # the sampled one), and where the sampled tokens go in token_ids (they come with the next diff)
        self.sampling_slots = self.sampling_lengths = self._next_token_index = np.zeros(0, dtype=np.int64)
        self.step_token_index = np.zeros(0, dtype=np.int64)  # the prepared step's tokens' flat indices
        # speculative decoding: per sampling row of the step being run, the proposals it verifies (None: none);
        # its logits rows are the 1 + that many tokens ending the row's tokens in the step
        self.num_draft_tokens: np.ndarray | None = None
        self.draft_token_ids = np.zeros(0, dtype=np.int64)  # the proposals, in row order
        max_blocks = -(-max_model_len // block_size)
        width = max_blocks * block_size  # every position a row's blocks can cover
        self.token_ids = np.zeros((max_num_seqs, width), dtype=np.int32)
        self._flat_token_ids = self.token_ids.ravel()
        # the KV cache slot of every position a row's blocks cover (block_id * block_size + offset)
        self.kv_slots = np.zeros((max_num_seqs, width), dtype=np.int32)
        self._flat_kv_slots = self.kv_slots.ravel()
        self._row_start = np.arange(max_num_seqs, dtype=np.int64) * width  # per slot: its flat index 0
        self._block_offsets = np.arange(block_size, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.block_tables = np.zeros((max_num_seqs, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int64)
        self.params: list[SamplingParams | None] = [None] * max_num_seqs
        self.temperature = np.ones(max_num_seqs, dtype=np.float32)
        self.top_k = np.full(max_num_seqs, _NO_TOP_K, dtype=np.int64)
        self.top_p = np.full(max_num_seqs, math.inf, dtype=np.float32)
        self.log_min_p = np.full(max_num_seqs, -math.inf, dtype=np.float32)
        self.penalties = np.zeros((max_num_seqs, 3), dtype=np.float32)  # repetition, presence, frequency
        self.min_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_logprobs = np.full(max_num_seqs, -1, dtype=np.int64)
        self.num_prompt_logprobs = np.full(max_num_seqs, -1, dtype=np.int64)  # -1: none wanted, or had already
        self.lora_slot = np.full(max_num_seqs, -1, dtype=np.int64)  # the device slot of the row's LoRA adapter
        self.num_lora_rows = 0
        self.num_rows_using = dict.fromkeys(FEATURES, 0)
        # how many rows hold each value of a column: one value for the whole batch is passed as a number
        self.values = {name: Counter() for name in ("temperature", "top_k", "top_p", "log_min_p")}

    def __len__(self) -> int:
        return len(self.req_ids)

    # ---- diffs ----
    def update(self, out: SchedulerOutput) -> None:
        next_index = self._next_token_index
        if len(out.new_token_counts):  # a row verified proposals: its accepted ones and the token after them
            next_index = np.repeat(next_index, out.new_token_counts) + _offsets_in_groups(out.new_token_counts)
        assert len(next_index) == len(out.new_token_ids), "sampled tokens do not match the rows"
        self._flat_token_ids[next_index] = out.new_token_ids
        self._next_token_index = self._next_token_index[:0]
        if out.finished_ids or out.preempted_ids:
            self._remove(out.finished_ids + out.preempted_ids)
        rows, block_ids = [row for row, _ in out.new_block_ids], [ids for _, ids in out.new_block_ids]
        if out.new_seqs:
            rows += range(len(self.slots), len(self.slots) + len(out.new_seqs))
            block_ids += [new.block_ids for new in out.new_seqs]
            self.slots = np.concatenate([self.slots, [self._add(new) for new in out.new_seqs]]).astype(np.int64)
        if rows:
            self._append_blocks(self.slots[rows], block_ids)
        assert len(self.req_ids) == out.num_rows, "the batch's rows do not match the scheduler's"

    def _add(self, new: NewSequence) -> int:
        slot = self._free_slots.pop()
        self.slot_generation[slot] += 1
        self.req_ids.append(new.request_id)
        self.token_ids[slot, :len(new.token_ids)] = new.token_ids
        self.num_prompt_tokens[slot] = new.num_prompt_tokens
        self.num_blocks[slot] = 0
        params = self.params[slot] = new.sampling_params
        self.temperature[slot] = params.temperature
        self.top_k[slot] = params.top_k if params.top_k > 0 else _NO_TOP_K
        self.top_p[slot] = params.top_p if params.top_p < 1.0 else math.inf
        self.log_min_p[slot] = math.log(params.min_p) if params.min_p > 0 else -math.inf
        self.penalties[slot] = (params.repetition_penalty, params.presence_penalty, params.frequency_penalty)
        self.min_tokens[slot] = params.min_tokens
        self.num_logprobs[slot] = -1 if params.logprobs is None else params.logprobs
        resumed = len(new.token_ids) > new.num_prompt_tokens  # preempted after it sampled: the prompt's were sent
        self.num_prompt_logprobs[slot] = -1 if params.prompt_logprobs is None or resumed else params.prompt_logprobs
        self.lora_slot[slot] = new.lora_slot
        self._count(slot, 1)
        return slot

    def _count(self, slot: int, delta: int) -> None:
        """The row in slot joins (delta 1) or leaves (-1) the counts of rows using each feature and value."""
        self.num_lora_rows += delta * int(self.lora_slot[slot] >= 0)
        for name in _features(self.params[slot]):
            self.num_rows_using[name] += delta
        for name, counter in self.values.items():
            value = getattr(self, name)[slot].item()
            counter[value] += delta
            if not counter[value]:
                del counter[value]

    def _append_blocks(self, slots: np.ndarray, block_ids: list[list[int]]) -> None:
        """Append block_ids[i] to the table of slots[i] (distinct slots), with the KV slots of the positions they
        cover, in one numpy pass for all rows (past a block boundary every decoding row grows at once)."""
        counts = np.fromiter(map(len, block_ids), np.int64, len(block_ids))
        ids = np.fromiter(chain.from_iterable(block_ids), np.int64, int(np.add.reduce(counts)))
        first_column = self.num_blocks[slots]
        self.num_blocks[slots] = first_column + counts
        block_slots = np.repeat(slots, counts)
        columns = np.repeat(first_column - (counts.cumsum() - counts), counts) + np.arange(len(ids))
        self.block_tables[block_slots, columns] = ids
        positions = self._row_start[block_slots, None] + columns[:, None] * self.block_size + self._block_offsets
        self._flat_kv_slots[positions] = ids[:, None] * self.block_size + self._block_offsets

    def _remove(self, request_ids: list[str]) -> None:
        rows = [self.req_ids.index(request_id) for request_id in request_ids]
        keep = np.ones(len(self.req_ids), dtype=bool)
        keep[rows] = False
        for slot in self.slots[rows].tolist():
            self.block_tables[slot, :self.num_blocks[slot]] = 0  # columns past a row's table are padding
            self._count(slot, -1)
            self.params[slot] = None
            self._free_slots.append(slot)
        self.req_ids = [request_id for request_id, kept in zip(self.req_ids, keep) if kept]
        self.slots = self.slots[keep]

    # ---- one step ----
    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """The step's inputs: row r computes positions num_computed_tokens[r] .. + num_scheduled_tokens[r]."""
        counts, computed, slots, samples = out.num_scheduled_tokens, out.num_computed_tokens, self.slots, out.samples
        drafts = out.num_draft_tokens
        if len(drafts):
            self._write_drafts(out)
        if np.count_nonzero(counts) < len(counts):  # rows the budget left out are not in the step
            rows = counts.nonzero()[0]
            counts, computed, slots, samples = counts[rows], computed[rows], slots[rows], samples[rows]
            drafts = drafts[rows] if len(drafts) else drafts
        num_rows = len(counts)
        if out.num_batched_tokens == num_rows:  # one token per row: the rows are the tokens
            query_start_loc = np.arange(num_rows + 1, dtype=np.int32)
            logits_indices = np.arange(num_rows)  # each row's one token (int64)
            positions, token_slots, max_query_len = computed, slots, min(num_rows, 1)
        else:
            query_start_loc = np.zeros(num_rows + 1, dtype=np.int32)
            query_start_loc[1:] = ends = counts.cumsum()  # int64, as are the logits indices taken from it
            assert ends[-1] == out.num_batched_tokens, "num_batched_tokens is not the sum of num_scheduled_tokens"
            positions = np.repeat(computed - (ends - counts), counts) + np.arange(out.num_batched_tokens)
            token_slots, max_query_len = np.repeat(slots, counts), int(counts.max())
            logits_indices = ends - 1
        token_index = self.step_token_index = self._row_start[token_slots] + positions
        seq_lens = computed + counts
        max_seq_len = int(np.maximum.reduce(seq_lens, initial=0))
        self.sampling_slots, self.sampling_lengths = slots, seq_lens
        if np.count_nonzero(samples) < num_rows:  # a prompt chunk short of its end samples nothing
            self.sampling_slots, self.sampling_lengths, logits_indices = slots[samples], seq_lens[samples], \
                logits_indices[samples]
            drafts = drafts[samples] if len(drafts) else drafts
        self.num_draft_tokens = None
        if len(drafts):
            logits_indices = self._verifying(logits_indices, drafts, positions)
            self.draft_token_ids = out.draft_token_ids
        self._next_token_index = token_index[logits_indices] + 1
        if self.num_draft_tokens is not None:
            self._next_token_index = self._next_token_index[np.cumsum(drafts + 1) - (drafts + 1)]
        return StepInputs(self._flat_token_ids.take(token_index).astype(np.int64), positions,
                          self._flat_kv_slots.take(token_index).astype(np.int64), query_start_loc,
                          seq_lens.astype(np.int32),
                          self.block_tables[:, :-(-max_seq_len // self.block_size)].take(slots, axis=0),
                          logits_indices, max_query_len, max_seq_len,
                          self._prompt_positions(out) if self.num_rows_using["prompt_logprobs"] else None,
                          self.lora_slot.take(token_slots) if self.num_lora_rows else None)

    # ---- async scheduling ----
    def take_pending(self) -> PendingTokens:
        """Where the prepared step's sampled tokens go; the runner writes them (fill_pending), not the next diff."""
        slots = self.sampling_slots
        pending = PendingTokens(self._next_token_index, slots, self.slot_generation[slots])
        self._next_token_index = self._next_token_index[:0]
        return pending

    def fill_pending(self, pending: PendingTokens, token_ids: np.ndarray) -> None:
        """A launched step's sampled tokens into the token table (rows removed since are passed over)."""
        valid = pending.valid(self.slot_generation)
        self._flat_token_ids[pending.index[valid]] = token_ids[valid]

    def placeholders(self, pending: PendingTokens) -> tuple[np.ndarray, np.ndarray]:
        """The prepared step's tokens that an earlier step samples (not in the token table yet): (that step's
        sampling rows, their places among this step's input ids)."""
        valid = np.flatnonzero(pending.valid(self.slot_generation))
        if not len(valid) or not len(self.step_token_index):
            return _NO_ROWS, _NO_ROWS
        index = pending.index[valid]
        order = np.argsort(index)
        sorted_index = index[order]
        where = np.minimum(np.searchsorted(sorted_index, self.step_token_index), len(index) - 1)
        places = np.flatnonzero(sorted_index[where] == self.step_token_index)
        return valid[order[where[places]]], places

    def _write_drafts(self, out: SchedulerOutput) -> None:
        """The proposed tokens into the rows' token ids, after each row's last token."""
        drafts = out.num_draft_tokens
        rows = np.flatnonzero(drafts)
        counts = drafts[rows]
        first = out.num_computed_tokens[rows] + out.num_scheduled_tokens[rows] - counts
        index = np.repeat(self._row_start[self.slots[rows]] + first, counts) + _offsets_in_groups(counts)
        self._flat_token_ids[index] = out.draft_token_ids

    def _verifying(self, logits_indices: np.ndarray, drafts: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The logits indices of a step whose sampling rows verify proposals: each row's last 1 + drafts tokens.
        The sampling rows become one per logits row, each with its length before the token it samples."""
        groups = drafts + 1
        logits_indices = np.repeat(logits_indices - drafts, groups) + _offsets_in_groups(groups)
        self.sampling_slots = np.repeat(self.sampling_slots, groups)
        self.sampling_lengths = positions[logits_indices] + 1
        self.num_draft_tokens = drafts
        return logits_indices

    def _prompt_positions(self, out: SchedulerOutput) -> PromptPositions | None:
        """The step's prompt positions whose logits the rows wanting prompt logprobs need; None if there are none."""
        counts, computed, slots = out.num_scheduled_tokens, out.num_computed_tokens, self.slots
        num_top = self.num_prompt_logprobs[slots]
        ends = np.minimum(computed + counts, self.num_prompt_tokens[slots] - 1)
        wanted = np.flatnonzero((num_top >= 0) & (ends > computed))
        if not len(wanted):
            return None
        step_starts = counts.cumsum() - counts  # each row's first token among the step's (rows left out have none)
        token_indices, target_ids, rows = [], [], []
        for row in wanted.tolist():
            first, count, slot = int(computed[row]), int(ends[row] - computed[row]), int(slots[row])
            token_indices.append(np.arange(step_starts[row], step_starts[row] + count))
            target_ids.append(self.token_ids[slot, first + 1:first + 1 + count])
            rows.append((self.req_ids[row], first + 1, count, int(num_top[row])))
        return PromptPositions(np.concatenate(token_indices), np.concatenate(target_ids).astype(np.int64), rows)

    def sampling_metadata(self, device: torch.device, bitmask: TokenBitmask | None = None) -> SamplingMetadata:
        """The sampling parameters of the step's sampling rows, in order; bitmask: the tokens allowed to the rows
        with structured outputs (built by the engine, whose matchers follow the grammars)."""
        slots, uses = self.sampling_slots, self.num_rows_using
        greedy = None  # per row, when the batch mixes greedy and sampled rows
        if 0 < uses["greedy"] < len(self):
            greedy = self.temperature[slots] < GREEDY_TEMPERATURE
        all_greedy = not len(slots) or uses["greedy"] == len(self) or (greedy is not None and bool(greedy.all()))
        meta = SamplingMetadata(num_rows=len(slots), all_greedy=all_greedy)
        if not meta.all_greedy:
            self._set_sampling(meta, slots, greedy, device)
        if uses["penalties"]:
            meta.penalties = self._penalties(slots, device)
        if uses["min_tokens"]:
            meta.banned = self._banned(slots, device)
        if uses["logit_bias"]:
            meta.logit_bias = self._logit_bias(slots, device)
        if uses["logprobs"]:
            counts = self.num_logprobs[slots]
            meta.logprob_rows = np.flatnonzero(counts >= 0).tolist()
            meta.max_logprobs = int(counts.max(initial=0))
        if bitmask is not None:
            meta.token_bitmask = self._bitmask(bitmask, device)
        return meta

    @staticmethod
    def _bitmask(bitmask: TokenBitmask, device) -> tuple[torch.Tensor, list[int]]:
        """The bitmask over the step's logits rows, on the device."""
        return _tensor(bitmask.bitmask.numpy(), device), bitmask.rows

    def _set_sampling(self, meta: SamplingMetadata, slots, greedy, device) -> None:
        if greedy is not None and greedy.any():
            meta.greedy = _tensor(greedy, device)
            meta.temperatures = _tensor(np.where(greedy, np.float32(1.0), self.temperature[slots])[:, None], device)
        else:
            greedy = np.zeros(len(slots), dtype=bool)
            meta.temperatures = self._column("temperature", slots, device)
        uses = self.num_rows_using
        if uses["top_k"]:
            sampled_ks = self.top_k[slots][~greedy]  # greedy rows ignore their filters
            if (sampled_ks < _NO_TOP_K).any():
                meta.top_ks = self._column("top_k", slots, device)
                if (sampled_ks < _NO_TOP_K).all():
                    meta.max_top_k = int(sampled_ks.max())
        if uses["top_p"]:
            meta.top_ps = self._column("top_p", slots, device)
        if uses["min_p"]:
            meta.log_min_ps = self._column("log_min_p", slots, device)
        if uses["seed"]:
            num_output = (self.sampling_lengths - self.num_prompt_tokens[slots]).tolist()
            seeded = [(row, self.params[slot].seed) for row, slot in enumerate(slots.tolist())
                      if self.params[slot].seed is not None and not greedy[row]]
            meta.seeds, meta.seed_steps = seeded, [num_output[row] for row, _ in seeded]

    def _column(self, name: str, slots: np.ndarray, device) -> float | int | torch.Tensor:
        """A sampling parameter of the rows in slots: a number when the whole batch agrees, else [N, 1]."""
        if len(self.values[name]) == 1:
            return next(iter(self.values[name]))
        return _tensor(getattr(self, name)[slots][:, None], device)

    def _penalties(self, slots: np.ndarray, device) -> Penalties | None:
        values = self.penalties[slots]
        rows = np.flatnonzero((values != (1.0, 0.0, 0.0)).any(axis=1))
        if not len(rows):
            return None
        values, slots = values[rows], slots[rows]
        num_tokens, num_prompt = self.sampling_lengths[rows, None], self.num_prompt_tokens[slots, None]
        width = int(num_tokens.max())
        ids, positions = self.token_ids[slots, :width].astype(np.int64), np.arange(width)
        all_ids = np.where(positions < num_tokens, ids, -1) if (values[:, 0] != 1.0).any() else None
        output_ids = None
        if values[:, 1:].any():
            output_ids = np.where((positions >= num_prompt) & (positions < num_tokens), ids, -1)
        column = lambda i: _tensor(np.ascontiguousarray(values[:, i:i + 1]), device)  # noqa: E731
        return Penalties(_tensor(rows, device), None if all_ids is None else _tensor(all_ids, device),
                         None if output_ids is None else _tensor(output_ids, device), column(0), column(1), column(2))

    def _banned(self, slots: np.ndarray, device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, token ids): EOS and stop_token_ids for the rows that have not reached min_tokens yet."""
        active = np.flatnonzero(self.sampling_lengths - self.num_prompt_tokens[slots] < self.min_tokens[slots])
        rows, token_ids = [], []
        for row in active.tolist():
            banned = [t for t in self.params[int(slots[row])].stop_token_ids if t < _MAX_TOKEN_ID] + self.eos_token_ids
            rows += [row] * len(banned)
            token_ids += banned
        if not rows:
            return None
        return _tensor(np.array(rows, dtype=np.int64), device), _tensor(np.array(token_ids, dtype=np.int64), device)

    def _logit_bias(self, slots: np.ndarray, device) -> tuple[torch.Tensor, ...] | None:
        """(rows, token ids, biases) of the rows with logit_bias."""
        rows, token_ids, biases = [], [], []
        for row, slot in enumerate(slots.tolist()):
            bias = self.params[slot].logit_bias
            if bias:
                rows += [row] * len(bias)
                token_ids += bias.keys()
                biases += bias.values()
        if not rows:
            return None
        return (_tensor(np.array(rows, dtype=np.int64), device), _tensor(np.array(token_ids, dtype=np.int64), device),
                _tensor(np.array(biases, dtype=np.float32), device))


def _offsets_in_groups(sizes: np.ndarray) -> np.ndarray:
    """0, 1, .., sizes[0] - 1, 0, 1, .., sizes[1] - 1, ...: each entry's place in its group."""
    return np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)


def _tensor(values: np.ndarray, device) -> torch.Tensor:
    """Host array -> tensor on device; on CUDA through pinned memory, so the copy does not block the host."""
    tensor = torch.from_numpy(values)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor
