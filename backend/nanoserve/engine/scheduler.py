"""Continuous batching with chunked prefill: running sequences first (decodes and unfinished prefill chunks),
then waiting ones FIFO, within a per-step token budget. When KV blocks run out the newest running sequence
is preempted by recompute (its blocks are freed and it goes back to the front of the waiting queue)."""
from __future__ import annotations

from collections import deque

from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.plan import ScheduledSeq, StepPlan
from nanoserve.engine.sequence import Sequence, SequenceStatus


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
        seq = self._find(request_id)
        if seq is None:
            return None
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._release(seq, "abort")
        return seq

    def finish(self, seq: Sequence, reason: str) -> None:
        self.running.remove(seq)
        self._release(seq, reason)

    def _find(self, request_id: str) -> Sequence | None:
        for seq in self.running:
            if seq.request_id == request_id:
                return seq
        for seq in self.waiting:
            if seq.request_id == request_id:
                return seq
        return None

    def _release(self, seq: Sequence, reason: str) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # ---- one step ----
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self._schedule_running(plan, self.max_num_batched_tokens)
        if not plan.preempted:
            self._schedule_waiting(plan, budget)
        return plan

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        running, scheduled, block_size = self.running, plan.scheduled, self.block_size
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            start = seq.num_computed_tokens
            num_new = min(len(seq.token_ids) - start, budget)
            if num_new <= 0:  # nothing to compute (no token appended yet)
                i += 1
                continue
            # Most decodes stay inside their last block: check that inline, it is the per-step hot path.
            if start + num_new > len(seq.block_table) * block_size and \
                    not self._allocate_or_preempt(seq, num_new, plan):
                break
            scheduled.append(ScheduledSeq(seq, start, num_new))
            budget -= num_new
            i += 1
        return budget

    def _allocate_or_preempt(self, seq: Sequence, num_new: int, plan: StepPlan) -> bool:
        """Allocate blocks for seq, preempting the newest running sequences as needed; False if seq itself
        was preempted."""
        block_manager = self.block_manager
        while not block_manager.can_allocate(block_manager.num_blocks_needed(seq, num_new)):
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is seq:
                return False
        block_manager.allocate(seq, num_new)
        return True

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Preempt by recompute: drop the KV, and recompute prompt + output when it is admitted again."""
        self.running.pop()  # always the newest
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_cached_tokens = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        plan.preempted.append(seq)

    def _schedule_waiting(self, plan: StepPlan, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            num_new = self._admit(seq, budget)
            if num_new == 0:
                return  # FIFO: nothing behind it jumps the queue
            self.waiting.popleft()
            self.running.append(seq)
            plan.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, num_new))
            budget -= num_new

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

    def postprocess(self, plan: StepPlan) -> None:
        """Record the KV computed by the step and register newly full blocks in the prefix cache."""
        block_manager, block_size = self.block_manager, self.block_size
        running = SequenceStatus.RUNNING
        for scheduled in plan.scheduled:
            seq = scheduled.seq
            if seq.status is not running:
                continue  # aborted between schedule() and now: its blocks are gone
            start = scheduled.start_pos
            end = seq.num_computed_tokens = start + scheduled.num_new_tokens
            if start < seq.num_prompt_tokens:
                self.prompt_tokens_computed += min(end, seq.num_prompt_tokens) - start
            if end // block_size != start // block_size:  # a block became full
                block_manager.cache_full_blocks(seq)
