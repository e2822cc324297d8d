"""Continuous batching with chunked prefill, in vLLM v1's manner (docs/architecture.md, "Scheduler"). A request's
later samples (n > 1) wait until its first has computed the prompt, then share its full prompt blocks. With LoRA, a
waiting sequence is admitted only while its adapter holds or can take a device slot; else it is passed over."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import compress

import numpy as np

from nanoserve.errors import RequestError
from nanoserve.config import SpeculativeConfig
from nanoserve.engine.block_manager import BlockManager, block_offset
from nanoserve.engine.lora import LoRASlots
from nanoserve.engine.scheduler_output import NewSequence, SchedulerOutput
from nanoserve.engine.sequence import Sequence, SequenceStatus
from nanoserve.engine.speculative import NgramProposer, SpecDecodeStats

_NO_TOKENS = np.zeros(0, dtype=np.int64)
_NO_SAMPLES = np.zeros(0, dtype=bool)


@dataclass
class SampledSeqs:
    """The sequences that got a token in a step, in row order, with their lengths after it and length limits."""
    seqs: list[Sequence]
    num_tokens: np.ndarray
    max_num_tokens: np.ndarray
    scored: list[Sequence] = field(default_factory=list)  # max_tokens 0: the prompt is computed, nothing sampled


@dataclass
class ScheduledStep:
    """Async scheduling: a step scheduled (its effect on the columns applied, its sampled tokens placeholders)
    whose tokens are not known yet: its rows' sequences, their computed tokens after it, and their lengths (with
    the step's tokens) and length limits, as update() takes them from the columns."""
    out: SchedulerOutput
    seqs: list[Sequence]
    computed: np.ndarray
    num_tokens: np.ndarray
    max_num_tokens: np.ndarray
    registered: bool = False  # the blocks it fills are in the prefix cache


class Scheduler:
    def __init__(self, config, block_manager: BlockManager, lora_slots: LoRASlots | None = None,
                 speculative: SpeculativeConfig | None = None, async_scheduling: bool = False):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.block_manager = block_manager
        self.lora_slots = lora_slots
        self.block_size = block_manager.block_size
        assert self.block_size == config.kvcache_block_size, "block manager and config disagree on block size"
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last one is preempted first
        # per running row: num_computed_tokens, num_tokens, KV slots held (blocks x block_size), num_prompt_tokens,
        # max_num_tokens
        self.columns = np.zeros((5, max(config.max_num_seqs, 1)), dtype=np.int64)
        self.num_preemptions = 0
        self.prompt_tokens_computed = 0  # prompt positions computed, i.e. not taken from the prefix cache
        self._finished_ids: list[str] = []  # running sequences that finished or were aborted since schedule()
        self.fork_sources: dict[str, Sequence] = {}  # a later sample's id -> its request's first, until admitted
        self._new_token_ids = _NO_TOKENS  # what update() appended, for the runners
        self._new_token_counts = _NO_TOKENS  # how many of them per row (empty: one each)
        self.speculative = spec = speculative  # None: no speculative decoding
        # n-gram proposals are made here; a draft model's in the model runner, at the start of the step, into the
        # slots scheduled for them (proposer None)
        self.proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max) \
            if spec is not None and spec.method == "ngram" else None
        self.spec_stats = None if spec is None else SpecDecodeStats(spec.num_speculative_tokens)
        # async scheduling: schedule() counts each sampling row's token at once (a placeholder) and keeps the step
        # here until update_scheduled() gets its tokens; the next step may be scheduled in between
        self.async_scheduling = async_scheduling
        self.scheduled: list[ScheduledStep] = []

    # ---- queues ----
    def check_admissible(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise a RequestError (a ValueError naming the field) for a request that could never be served."""
        if num_prompt_tokens == 0:
            raise RequestError("prompt", "empty (at least one token is needed)")
        if num_prompt_tokens >= self.max_model_len:
            raise RequestError("prompt", f"{num_prompt_tokens} tokens leaves no room to generate within "
                                         f"max_model_len ({self.max_model_len})")
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise RequestError("max_tokens", f"prompt length ({num_prompt_tokens}) + max_tokens ({max_tokens}) = "
                                             f"{num_prompt_tokens + max_tokens} exceeds max_model_len "
                                             f"({self.max_model_len})")
        total = self.block_manager.num_total_blocks
        worst_case = -(-(num_prompt_tokens + max_tokens) // self.block_size)
        if worst_case > total:
            field = "prompt" if -(-num_prompt_tokens // self.block_size) > total else "max_tokens"
            raise RequestError(field, f"prompt length ({num_prompt_tokens}) + max_tokens ({max_tokens}) needs up to "
                                      f"{worst_case} KV cache blocks of {self.block_size} tokens, but the pool has "
                                      f"only {total}; it could never fit")

    def add(self, seq: Sequence, fork_of: Sequence | None = None) -> None:
        """Queue a sequence; fork_of: the first sample of its request (added just before it), whose prompt blocks
        it shares once that one has computed them."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        if fork_of is not None:
            self.fork_sources[seq.request_id] = fork_of

    def abort(self, request_id: str) -> Sequence | None:
        """Drop a request wherever it is and free its blocks at once."""
        self.fork_sources.pop(request_id, None)
        for seq in self.running:
            if seq.request_id == request_id:
                self.finish(seq, "abort")
                return seq
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                self._release(seq, "abort")
                return seq
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        """Between steps: a running sequence is done; its blocks are freed and its row leaves the batch. (Async
        scheduling: a sequence preempted after its last step was scheduled finishes from the waiting queue.)"""
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self._release(seq, reason)
            return
        row, last = self.running.index(seq), len(self.running) - 1
        del self.running[row]
        self.columns[:, row:last] = self.columns[:, row + 1:last + 1]
        self.columns[:, last] = 0
        self._finished_ids.append(seq.request_id)
        self._release_lora_slot(seq)
        self._release(seq, reason)

    def _release(self, seq: Sequence, reason: str) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # ---- one step ----
    def schedule(self) -> SchedulerOutput:
        if self.scheduled:
            self._register_step(self.scheduled[0])
        out = SchedulerOutput(self._new_token_ids, self._new_token_counts, self._finished_ids, [], [], [],
                              _NO_TOKENS, _NO_TOKENS, _NO_SAMPLES)
        self._new_token_ids, self._new_token_counts, self._finished_ids = _NO_TOKENS, _NO_TOKENS, []
        counts, num_batched = self._schedule_running(out)
        if self.speculative is not None and not out.preempted_ids and self._speculates():
            counts, num_batched = self._schedule_drafts(out, counts, num_batched)
        if self.waiting and not out.preempted_ids:
            counts, num_batched = self._schedule_waiting(out, counts, num_batched)
        columns = self.columns[:, :len(self.running)]  # (indexing rows: unpacking the array costs more)
        computed, num_tokens, num_prompt = columns[0], columns[1], columns[3]
        out.num_computed_tokens, out.num_scheduled_tokens = computed.copy(), counts
        # the step reaches the last token (every row lacks one; a row verifying proposals goes past it), and the
        # row may grow (max_tokens 0 may not)
        out.samples = (counts >= num_tokens - computed) & (num_tokens < columns[4])
        if len(out.num_draft_tokens) and len(out.num_draft_tokens) < len(counts):  # admitted rows propose nothing
            out.num_draft_tokens = np.pad(out.num_draft_tokens, (0, len(counts) - len(out.num_draft_tokens)))
        out.num_batched_tokens = num_batched
        in_prompt = num_prompt > computed
        if np.count_nonzero(in_prompt):
            out.num_prefill_tokens = int(np.add.reduce(np.minimum(num_prompt - computed, counts)[in_prompt]))
        if self.async_scheduling:
            computed += counts
            num_tokens += out.samples  # placeholders for the tokens the step samples
            self.scheduled.append(ScheduledStep(out, list(self.running), computed.copy(), num_tokens.copy(),
                                                columns[4].copy()))
        return out

    def _schedule_running(self, out: SchedulerOutput) -> tuple[np.ndarray, int]:
        """Tokens for the running rows, oldest first within the budget (and their total); rows that need
        blocks get them, preempting the newest rows while the pool is short."""
        columns = self.columns[:, :len(self.running)]
        computed, num_tokens, capacity = columns[0], columns[1], columns[2]
        counts = num_tokens - computed  # what each row lacks
        if self.async_scheduling:  # a row whose placeholder reached its length limit finishes: nothing to compute
            counts[(num_tokens >= columns[4]) & (num_tokens > columns[3])] = 0
        num_batched = int(np.add.reduce(counts))
        if num_batched > self.max_num_batched_tokens:  # the budget runs out: the oldest rows first
            counts = np.clip(self.max_num_batched_tokens - (counts.cumsum() - counts), 0, counts)
            num_batched = self.max_num_batched_tokens
        short = computed + counts > capacity
        for row in (short.nonzero()[0].tolist() if np.count_nonzero(short) else ()):
            if row >= len(self.running) or not self._grow(row, int(computed[row] + counts[row]), out):
                break  # the row was preempted, and every row after it
        if len(self.running) < len(counts):
            counts = counts[:len(self.running)]
            num_batched = int(np.add.reduce(counts))
        return counts, num_batched

    def _speculates(self) -> bool:
        return 0 < len(self.running) <= self.speculative.max_proposing_seqs(self.max_num_seqs)

    def _schedule_drafts(self, out: SchedulerOutput, counts: np.ndarray, num_batched: int) -> tuple[np.ndarray, int]:
        """Proposed tokens for the decoding rows, within the budget, the length limits and the free blocks (a
        proposal never preempts): they are computed after the row's last token, which verifies them."""
        columns = self.columns[:, :len(counts)]
        computed, num_tokens, max_num_tokens = columns[0], columns[1], columns[4]
        budget = self.max_num_batched_tokens - num_batched
        drafts, draft_ids = np.zeros(len(counts), dtype=np.int64), []
        for row in np.flatnonzero((counts == 1) & (num_tokens - computed == 1)).tolist():
            if budget <= 0:
                break
            seq = self.running[row]
            limit = min(self.speculative.num_speculative_tokens, budget, int(max_num_tokens[row] - num_tokens[row]) - 1)
            if limit <= 0:
                continue
            draft = self.proposer.propose(seq.token_ids, limit) if self.proposer is not None else None
            # structured outputs: the proposals the grammar allows (a draft model's are checked by the bitmask)
            if seq.grammar is not None and draft is not None:
                draft = draft[:seq.grammar.valid_prefix(draft)]
            drafts[row] = self._room_for(row, limit if draft is None else len(draft), out)
            draft_ids += draft[:drafts[row]] if draft is not None else []
            budget -= drafts[row]
        num_drafted = int(drafts.sum())
        if not num_drafted:
            return counts, num_batched
        out.num_draft_tokens = drafts
        if self.proposer is not None:  # (a draft model fills them in at the start of the step)
            out.draft_token_ids = np.array(draft_ids, dtype=np.int64)
        return counts + drafts, num_batched + num_drafted

    def _room_for(self, row: int, num_draft: int, out: SchedulerOutput) -> int:
        """How many of num_draft proposed tokens running[row] can hold KV for, taking free blocks if needed."""
        seq, block_manager = self.running[row], self.block_manager
        num_tokens, capacity = int(self.columns[1, row]), int(self.columns[2, row])
        needed = block_manager.num_blocks_needed(seq, num_tokens + num_draft)
        if not needed:
            return num_draft
        if not block_manager.can_allocate(needed):
            return capacity - num_tokens
        new_ids = block_manager.allocate(seq, num_tokens + num_draft)
        self.columns[2, row] = len(seq.block_table) * self.block_size
        for grown_row, ids in out.new_block_ids:  # the row may have grown for its last token already
            if grown_row == row:
                ids.extend(new_ids)
                break
        else:
            out.new_block_ids.append((row, new_ids))
        return num_draft

    def _grow(self, row: int, num_tokens: int, out: SchedulerOutput) -> bool:
        """Blocks for running[row] to hold num_tokens, preempting the newest rows as needed; False when it had to
        preempt the row itself."""
        seq, block_manager = self.running[row], self.block_manager
        while not block_manager.can_allocate(block_manager.num_blocks_needed(seq, num_tokens)):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        out.new_block_ids.append((row, block_manager.allocate(seq, num_tokens)))
        self.columns[2, row] = len(seq.block_table) * self.block_size
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Preempt by recompute: drop the KV, and recompute prompt + output when it is admitted again."""
        self.running.pop()  # always the newest
        self.columns[:, len(self.running)] = 0
        self._release_lora_slot(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_cached_tokens = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted_ids.append(seq.request_id)

    def _schedule_waiting(self, out: SchedulerOutput, counts: np.ndarray, num_batched: int) -> tuple[np.ndarray, int]:
        """Admit waiting sequences FIFO while the budget, max_num_seqs and the pool allow; the counts of all rows
        and their total."""
        new_counts, passed_over = [], []
        while self.waiting and num_batched < self.max_num_batched_tokens and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.lora is not None and not self.lora_slots.can_acquire(seq.lora):
                passed_over.append(self.waiting.popleft())  # every slot holds an adapter in use
                continue
            num_cached, num_new = self._admit(seq, self.max_num_batched_tokens - num_batched)
            if num_new == 0:
                break  # FIFO: nothing behind it jumps the queue
            self.waiting.popleft()
            self.columns[:, len(self.running)] = (num_cached, seq.num_tokens, len(seq.block_table) * self.block_size,
                                                  seq.num_prompt_tokens, seq.max_num_tokens)
            self.running.append(seq)
            out.new_seqs.append(NewSequence(seq.request_id, list(seq.token_ids), seq.num_prompt_tokens,
                                            seq.sampling_params, list(seq.block_table), self._lora_slot(seq, out)))
            new_counts.append(num_new)
            num_batched += num_new
        self.waiting.extendleft(reversed(passed_over))
        return (np.concatenate([counts, new_counts]).astype(np.int64) if new_counts else counts), num_batched

    def _lora_slot(self, seq: Sequence, out: SchedulerOutput) -> int:
        """The device slot of an admitted sequence's adapter (-1: none); loading it there goes with out."""
        if seq.lora is None:
            return -1
        slot, load = self.lora_slots.acquire(seq.lora)
        if load:
            out.lora_loads.append((slot, seq.lora))
        return slot

    def _release_lora_slot(self, seq: Sequence) -> None:
        if seq.lora is not None:
            self.lora_slots.release(seq.lora)

    def _admit(self, seq: Sequence, budget: int) -> tuple[int, int]:
        """Take the computed prefix and blocks for the first chunk: (tokens cached, chunk size); the chunk is 0 when
        it does not fit, or the sequence must wait."""
        first = self.fork_sources.get(seq.request_id)
        if first is not None and not first.num_output_tokens and not first.is_finished:
            return 0, 0  # its request's first sample has not computed the prompt yet
        block_manager = self.block_manager
        num_cached = self._take_prefix(seq, first)
        num_new = min(seq.num_tokens - num_cached, budget)
        if not block_manager.can_allocate(block_manager.num_blocks_needed(seq, num_cached + num_new)):
            block_manager.undo_cached_prefix(seq, num_cached)
            return 0, 0
        block_manager.allocate(seq, num_cached + num_new)
        self.fork_sources.pop(seq.request_id, None)
        seq.status = SequenceStatus.RUNNING
        seq.num_cached_tokens = num_cached
        return num_cached, num_new

    def _take_prefix(self, seq: Sequence, first: Sequence | None) -> int:
        """The computed KV an admitted sequence starts from (in tokens): its request's first sample's full prompt
        blocks while that one runs, else the cached prefix. A sequence that wants prompt logprobs and has none yet
        takes no cached prefix: every prompt position's logits are needed (vLLM does the same)."""
        if first is not None and first.status is SequenceStatus.RUNNING:
            computed = min(seq.num_prompt_tokens - 1, self.num_computed_tokens(first))
            return self.block_manager.fork(first, seq, computed // self.block_size)
        if seq.sampling_params.prompt_logprobs is not None and not seq.num_output_tokens:
            return 0
        return self.block_manager.allocate_cached_prefix(seq)

    def update(self, out: SchedulerOutput, sampled_token_ids: np.ndarray,
               num_new_tokens: np.ndarray | None = None) -> SampledSeqs:
        """After the step `out` described ran (no sequence finished in between): record the computed KV, append
        the sampled tokens (one per sampling row in row order; with proposals, num_new_tokens[i] for sampling row
        i: its accepted proposals and the token after them) and register newly full blocks in the prefix cache.
        Returns the sequences that got tokens, one entry per token, and those whose prompt is all computed that
        sample nothing (max_tokens 0)."""
        running, samples, counts = self.running, out.samples, out.num_scheduled_tokens
        assert len(running) == out.num_rows, "the running sequences changed between schedule() and update()"
        columns = self.columns[:, :len(running)]
        computed, num_tokens, max_num_tokens = columns[0], columns[1], columns[4]
        computed += counts
        scored = self._scored(samples, computed, num_tokens)
        if len(out.num_draft_tokens):
            return self._update_verified(out, sampled_token_ids, num_new_tokens, scored)
        num_tokens += samples
        seqs = list(compress(running, samples)) if np.count_nonzero(samples) < len(running) else list(running)
        for seq, token_id in zip(seqs, sampled_token_ids.tolist()):
            seq.token_ids.append(token_id)
        self._register_filled(out, running, computed, counts)
        self._new_token_ids = sampled_token_ids
        if len(seqs) < len(running):
            num_tokens, max_num_tokens = num_tokens[samples], max_num_tokens[samples]
        return SampledSeqs(seqs, num_tokens, max_num_tokens, scored)

    def update_scheduled(self, sampled_token_ids: np.ndarray) -> tuple[SampledSeqs, np.ndarray]:
        """Async scheduling: update() for the earliest scheduled step, whose placeholders become sampled_token_ids
        (one per sampling row in row order). Its rows may have finished or been preempted since it was scheduled;
        a finished one's token is dropped. Returns the sequences that got tokens and which sampling rows they are
        (a mask over sampled_token_ids)."""
        step = self.scheduled.pop(0)
        self._register_step(step)
        samples = step.out.samples
        sampled = list(compress(step.seqs, samples)) if np.count_nonzero(samples) < len(samples) else step.seqs
        keep = np.ones(len(sampled), bool)
        keep[[row for row, seq in enumerate(sampled) if seq.status is SequenceStatus.FINISHED]] = False
        seqs = sampled if keep.all() else list(compress(sampled, keep))
        for seq, token_id in zip(seqs, sampled_token_ids[keep].tolist()):
            seq.token_ids.append(token_id)
        num_tokens, max_num_tokens = step.num_tokens[samples][keep], step.max_num_tokens[samples][keep]
        scored = [] if np.count_nonzero(samples) == len(samples) else [
            seq for seq, computed, sampling in zip(step.seqs, step.computed.tolist(), samples.tolist())
            if not sampling and seq.status is SequenceStatus.RUNNING and computed == len(seq.token_ids)]
        return SampledSeqs(seqs, num_tokens, max_num_tokens, scored), keep

    def _register_step(self, step: ScheduledStep) -> None:
        """Async scheduling: the blocks a scheduled step fills go into the prefix cache once, before the next step
        is scheduled or when its tokens come, whichever is first (the tokens of the steps before it are known)."""
        if not step.registered:
            step.registered = True
            self._register_filled(step.out, step.seqs, step.computed, step.out.num_scheduled_tokens)

    def _scored(self, samples: np.ndarray, computed: np.ndarray, num_tokens: np.ndarray) -> list[Sequence]:
        """The rows that have computed every token and sample none: max_tokens 0, its prompt scored."""
        if np.count_nonzero(samples) == len(samples):
            return []
        return [self.running[row] for row in np.flatnonzero(~samples & (computed == num_tokens)).tolist()]

    def _update_verified(self, out: SchedulerOutput, sampled_token_ids: np.ndarray,
                         num_new_tokens: np.ndarray, scored: list[Sequence]) -> SampledSeqs:
        """update() for a step that verified proposals: the rejected ones' KV is not computed (their slots are
        written again by the next step, and their blocks enter the prefix cache only once full of accepted
        tokens' KV)."""
        running, samples = self.running, out.samples
        columns = self.columns[:, :len(running)]
        computed, num_tokens, max_num_tokens = columns[0], columns[1], columns[4]
        rows = np.flatnonzero(samples)
        drafts = out.num_draft_tokens[rows]
        rejected = drafts - (num_new_tokens - 1)
        computed[rows] -= rejected
        tokens_before = num_tokens[rows]
        num_tokens[rows] += num_new_tokens
        seqs = [running[row] for row in rows.tolist()]
        ends = np.cumsum(num_new_tokens).tolist()
        token_ids = sampled_token_ids.tolist()
        for seq, start, end in zip(seqs, [0, *ends[:-1]], ends):
            seq.token_ids += token_ids[start:end]
        progress = out.num_scheduled_tokens.copy()
        progress[rows] -= rejected
        self._register_filled(out, running, computed, progress)
        self._new_token_ids, self._new_token_counts = sampled_token_ids, num_new_tokens
        proposed = drafts > 0
        self.spec_stats.record(drafts[proposed], (num_new_tokens - 1)[proposed])
        # one entry per new token: its sequence, the sequence's length with it, the length limit
        first = np.repeat(np.cumsum(num_new_tokens) - num_new_tokens, num_new_tokens)
        lengths = np.repeat(tokens_before, num_new_tokens) + np.arange(len(token_ids)) - first + 1
        return SampledSeqs([seq for seq, n in zip(seqs, num_new_tokens.tolist()) for _ in range(n)], lengths,
                           np.repeat(max_num_tokens[rows], num_new_tokens), scored)

    def _register_filled(self, out: SchedulerOutput, seqs: list[Sequence], computed: np.ndarray,
                         progress: np.ndarray) -> None:
        """Register the blocks the step filled with computed KV (computed: each row's computed tokens after it,
        progress: its new ones), of the rows still running (with async scheduling a row may have finished or been
        preempted since its step was scheduled)."""
        if self.block_manager.enable_prefix_caching:
            filled = block_offset(computed, self.block_size) < progress  # the rows that filled a block
            for row in (filled.nonzero()[0].tolist() if np.count_nonzero(filled) else ()):
                seq = seqs[row]
                if seq.status is SequenceStatus.RUNNING:
                    self.block_manager.cache_full_blocks(seq, int(computed[row]))
        self.prompt_tokens_computed += out.num_prefill_tokens

    def preempt_all(self) -> None:
        """Preempt every running sequence by recompute, newest first, so the waiting queue keeps their order, and
        drop the diffs not sent yet: the runners start again from an empty batch (after a failed step)."""
        out = SchedulerOutput()
        while self.running:
            self._preempt(self.running[-1], out)
        self._new_token_ids, self._new_token_counts, self._finished_ids = _NO_TOKENS, _NO_TOKENS, []
        self.scheduled.clear()  # their placeholders are dropped: the preempted sequences hold their real tokens
        if self.lora_slots is not None:  # the step may have failed half-way through loading an adapter
            self.lora_slots.forget()

    def num_computed_tokens(self, seq: Sequence) -> int:
        """Tokens of seq whose KV is in the cache (0 unless it is running)."""
        return int(self.columns[0, self.running.index(seq)]) if seq.status is SequenceStatus.RUNNING else 0
