"""Continuous batching with chunked prefill, in vLLM v1's manner: there is no prefill or decode phase. Each
sequence has num_computed_tokens (KV in the cache) and num_tokens (prompt + output so far); each step gives
the running sequences, oldest first, the tokens they lack within the token budget (one for a decode, a chunk
of a prompt, a whole prompt again after preemption), then admits waiting ones FIFO with what is left. When
KV blocks run out the newest running sequence is preempted by recompute: its blocks are freed and it goes
back to the front of the waiting queue.

The running sequences are the rows of the batch. A step's decisions are numpy over the rows; only the rows
that need a new block, and admissions, cost Python."""
from __future__ import annotations

from collections import deque
from itertools import compress
from operator import attrgetter

import numpy as np

from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.scheduler_output import NewSequence, SchedulerOutput
from nanoserve.engine.sequence import Sequence, SequenceStatus

_token_ids = attrgetter("token_ids")
_block_table = attrgetter("block_table")
_num_computed_tokens = attrgetter("num_computed_tokens")
_num_prompt_tokens = attrgetter("num_prompt_tokens")


class Scheduler:
    def __init__(self, config, block_manager: BlockManager):
        # Reads only max_num_seqs, max_num_batched_tokens, max_model_len, kvcache_block_size.
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        assert self.block_size == config.kvcache_block_size, "block manager and config disagree on block size"
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last one is preempted first
        self.num_preemptions = 0
        self.prompt_tokens_computed = 0  # prompt positions computed, i.e. not taken from the prefix cache
        self._finished_ids: list[str] = []  # running sequences that finished or were aborted since schedule()
        self._new_token_ids = np.zeros(0, dtype=np.int64)  # what update() appended, for the runners

    # ---- queues ----
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def prefix_cache_hit_tokens(self) -> int:
        return self.block_manager.prefix_cache_hit_tokens

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def check_admissible(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """Raise ValueError (naming the field) for a request that could never be served."""
        if num_prompt_tokens == 0:
            raise ValueError("prompt: empty (at least one token is needed)")
        if num_prompt_tokens >= self.max_model_len:
            raise ValueError(f"prompt: {num_prompt_tokens} tokens leaves no room to generate within "
                             f"max_model_len ({self.max_model_len})")
        if max_tokens is None:
            max_tokens = self.max_model_len - num_prompt_tokens
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens: prompt length ({num_prompt_tokens}) + max_tokens ({max_tokens}) = "
                             f"{num_prompt_tokens + max_tokens} exceeds max_model_len ({self.max_model_len})")
        total = self.block_manager.num_total_blocks
        worst_case = -(-(num_prompt_tokens + max_tokens) // self.block_size)
        if worst_case > total:
            field = "prompt" if -(-num_prompt_tokens // self.block_size) > total else "max_tokens"
            raise ValueError(f"{field}: prompt length ({num_prompt_tokens}) + max_tokens ({max_tokens}) needs up to "
                             f"{worst_case} KV cache blocks of {self.block_size} tokens, but the pool has only "
                             f"{total}; it could never fit")

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """Drop a request wherever it is and free its blocks at once."""
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
        """Between steps: a running sequence is done; its blocks are freed and its row leaves the batch."""
        self.running.remove(seq)
        self._finished_ids.append(seq.request_id)
        self._release(seq, reason)

    def _release(self, seq: Sequence, reason: str) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # ---- one step ----
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(new_token_ids=self._new_token_ids, finished_ids=self._finished_ids)
        self._new_token_ids, self._finished_ids = np.zeros(0, dtype=np.int64), []
        rows = [self._schedule_running(out)]
        if not out.preempted_ids:
            rows += self._schedule_waiting(out, self.max_num_batched_tokens - int(rows[0][1].sum()))
        computed, counts, num_tokens = (np.concatenate(column) for column in zip(*rows))
        ends = computed + counts
        num_prompt = np.fromiter(map(_num_prompt_tokens, self.running), np.int64, len(self.running))
        out.num_computed_tokens, out.num_scheduled_tokens = computed, counts
        out.samples = (ends == num_tokens) & (counts > 0)
        out.num_prefill_tokens = int((np.minimum(ends, num_prompt) - computed).clip(0).sum())
        return out

    def _schedule_running(self, out: SchedulerOutput) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(num_computed_tokens, tokens scheduled, num_tokens) of the running rows, oldest first within the
        budget; rows that need blocks get them, preempting the newest rows while the pool is short."""
        running = self.running
        n = len(running)
        computed = np.fromiter(map(_num_computed_tokens, running), np.int64, n)
        num_tokens = np.fromiter(map(len, map(_token_ids, running)), np.int64, n)
        wanted = num_tokens - computed
        counts = np.clip(self.max_num_batched_tokens - (np.cumsum(wanted) - wanted), 0, wanted)
        capacity = np.fromiter(map(len, map(_block_table, running)), np.int64, n) * self.block_size
        for row in np.flatnonzero(computed + counts > capacity).tolist():
            if row >= len(running) or not self._grow(row, int(counts[row]), out):
                break  # the row was preempted, and every row after it
        n = len(running)
        return computed[:n], counts[:n], num_tokens[:n]

    def _grow(self, row: int, num_new_tokens: int, out: SchedulerOutput) -> bool:
        """Blocks for running[row]'s next num_new_tokens, preempting the newest rows as needed; False when it had
        to preempt the row itself."""
        seq, block_manager = self.running[row], self.block_manager
        while not block_manager.can_allocate(block_manager.num_blocks_needed(seq, num_new_tokens)):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        out.new_block_ids.append((row, block_manager.allocate(seq, num_new_tokens)))
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Preempt by recompute: drop the KV, and recompute prompt + output when it is admitted again."""
        self.running.pop()  # always the newest
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_cached_tokens = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted_ids.append(seq.request_id)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> list[tuple[np.ndarray, ...]]:
        """Admit waiting sequences FIFO while the budget, max_num_seqs and the pool allow; their rows' arrays."""
        rows = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            num_new = self._admit(seq, budget)
            if num_new == 0:
                break  # FIFO: nothing behind it jumps the queue
            self.waiting.popleft()
            self.running.append(seq)
            out.new_seqs.append(NewSequence(seq.request_id, list(seq.token_ids), seq.num_prompt_tokens,
                                            seq.sampling_params, list(seq.block_table)))
            rows.append((np.array([seq.num_computed_tokens]), np.array([num_new]), np.array([seq.num_tokens])))
            budget -= num_new
        return rows

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Take the cached prefix and blocks for the first chunk; returns the chunk size, 0 if it does not fit."""
        block_manager = self.block_manager
        block_manager.allocate_cached_prefix(seq)
        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if not block_manager.can_allocate(block_manager.num_blocks_needed(seq, num_new)):
            block_manager.undo_cached_prefix(seq)
            return 0
        block_manager.allocate(seq, num_new)
        seq.status = SequenceStatus.RUNNING
        return num_new

    def update(self, out: SchedulerOutput, sampled_token_ids: np.ndarray) -> list[Sequence]:
        """After the step `out` described ran (no sequence finished in between): record the computed KV, append
        the sampled tokens (one per sampling row, in row order) and register newly full blocks in the prefix
        cache. Returns the sequences that got a token, in row order."""
        running, samples = self.running, out.samples
        assert len(running) == out.num_rows, "the running sequences changed between schedule() and update()"
        ends = out.num_computed_tokens + out.num_scheduled_tokens
        for row in np.flatnonzero(~samples & (out.num_scheduled_tokens > 0)).tolist():  # prompt chunks
            running[row].num_computed_tokens = int(ends[row])
        seqs = list(compress(running, samples))
        for seq, token_id in zip(seqs, sampled_token_ids.tolist()):
            token_ids = seq.token_ids
            seq.num_computed_tokens = len(token_ids)  # a sampling row computed all tokens it had
            token_ids.append(token_id)
        if self.block_manager.enable_prefix_caching:
            for row in np.flatnonzero(ends // self.block_size > out.num_computed_tokens // self.block_size).tolist():
                self.block_manager.cache_full_blocks(running[row])
        self.prompt_tokens_computed += out.num_prefill_tokens
        self._new_token_ids = sampled_token_ids
        return seqs
