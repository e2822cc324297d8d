"""Continuous batching with chunked prefill: running sequences first (decodes and unfinished prefill chunks),
then waiting ones FIFO, within a per-step token budget. When KV blocks run out the newest running sequence
is preempted by recompute (its blocks are freed and it goes back to the front of the waiting queue).

The common step, where every running sequence decodes one token, has a fast path (`_schedule_decode`) that
works on arrays: the running sequences' block tables are kept as rows of one array (`RunningRows`), updated
only when a table grows or a sequence joins or leaves, and the plan carries a `DecodeBatch` instead of one
ScheduledSeq per sequence. It makes exactly the decisions the general path would; whenever it might not
(a prefill, a preemption, the token budget), the general path runs instead."""
from __future__ import annotations

from collections import deque
from operator import attrgetter, itemgetter

import numpy as np

from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.plan import DecodeBatch, ScheduledSeq, StepPlan
from nanoserve.engine.sequence import Sequence, SequenceStatus

_token_ids = attrgetter("token_ids")
_num_computed_tokens = attrgetter("num_computed_tokens")
_last = itemgetter(-1)


class RunningRows:
    """Block tables of the running sequences as rows of one array (row i for scheduler.running[i]), with their
    lengths and the sequences' prompt lengths as arrays, so the decode fast path checks every row in a few
    numpy calls. A running sequence's table only grows (blocks are appended), so a row is written only for
    new blocks."""

    def __init__(self, max_rows: int, max_blocks: int):
        rows = max(max_rows, 1)
        self.block_tables = np.zeros((rows, max(max_blocks, 1)), dtype=np.int32)
        self.num_blocks = np.zeros(rows, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(rows, dtype=np.int64)
        self.size = 0
        # (positions, last token ids) of every row, carried over from a decode step to the next one: then
        # the next step need not read them from the sequences. None after any other change of the rows.
        self.carry: tuple[np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.size

    def append(self, seq: Sequence) -> None:
        row = self.size
        if row == len(self.block_tables):
            self._grow(2 * row, self.block_tables.shape[1])
        self.carry = None
        self.size += 1
        self.num_blocks[row] = 0
        self.num_prompt_tokens[row] = seq.num_prompt_tokens
        self.sync_table(row, seq.block_table)

    def sync_table(self, row: int, table: list[int]) -> None:
        """Write the blocks appended to `table` since the row was last written."""
        old, new = int(self.num_blocks[row]), len(table)
        if new > self.block_tables.shape[1]:
            self._grow(len(self.block_tables), max(new, 2 * self.block_tables.shape[1]))
        self.block_tables[row, old:new] = table[old:]
        self.num_blocks[row] = new

    def remove(self, row: int) -> None:
        """Drop a row; the rows after it move up one, as the sequences after it in `running` do."""
        end = self.size
        for column in (self.block_tables, self.num_blocks, self.num_prompt_tokens):
            column[row:end - 1] = column[row + 1:end]
        self._clear_last()
        if self.carry is not None:  # the carried rows move up too
            self.carry = (np.delete(self.carry[0], row), np.delete(self.carry[1], row))

    def pop(self) -> None:
        self._clear_last()
        self.carry = None

    def _clear_last(self) -> None:
        self.size -= 1
        self.block_tables[self.size] = 0  # columns past a row's length stay 0: they are the padding
        self.num_blocks[self.size] = 0

    def tables(self, num_rows: int) -> np.ndarray:
        """A copy of the first num_rows tables, as wide as the widest of them."""
        width = int(self.num_blocks[:num_rows].max(initial=1))
        return self.block_tables[:num_rows, :width].copy()

    def _grow(self, rows: int, blocks: int) -> None:
        tables = np.zeros((rows, blocks), dtype=np.int32)
        tables[:len(self.block_tables), :self.block_tables.shape[1]] = self.block_tables
        self.block_tables = tables
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros(rows - len(self.num_blocks), np.int64)])
        self.num_prompt_tokens = np.concatenate([self.num_prompt_tokens,
                                                 np.zeros(rows - len(self.num_prompt_tokens), np.int64)])

    def check(self, running: list[Sequence]) -> None:
        """Assert the rows match the running sequences (a testing aid, O(rows x blocks))."""
        assert self.size == len(running), (self.size, len(running))
        for row, seq in enumerate(running):
            n = len(seq.block_table)
            assert self.num_blocks[row] == n and self.num_prompt_tokens[row] == seq.num_prompt_tokens, seq
            assert self.block_tables[row, :n].tolist() == seq.block_table, (seq, self.block_tables[row, :n])
            assert not self.block_tables[row, n:].any(), (seq, self.block_tables[row])  # zero padding
        assert not self.block_tables[self.size:].any() and not self.num_blocks[self.size:].any()
        if self.carry is not None:
            positions, last_tokens = self.carry
            assert positions.tolist() == [seq.num_computed_tokens for seq in running]
            assert last_tokens.tolist() == [seq.token_ids[-1] for seq in running]
            assert all(seq.num_tokens == seq.num_computed_tokens + 1 for seq in running)


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
        self.rows = RunningRows(config.max_num_seqs, -(-config.max_model_len // self.block_size))
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
            self._remove_running(seq)
        else:
            self.waiting.remove(seq)
        self._release(seq, "abort")
        return seq

    def finish(self, seq: Sequence, reason: str) -> None:
        self._remove_running(seq)
        self._release(seq, reason)

    def _remove_running(self, seq: Sequence) -> None:
        row = self.running.index(seq)
        del self.running[row]
        self.rows.remove(row)

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
        plan = self._schedule_decode()
        if plan is None:
            plan = StepPlan()
            budget = self._schedule_running(plan, self.max_num_batched_tokens)
            if not plan.preempted:
                self._schedule_waiting(plan, budget)
        elif self.waiting:  # what the general path does after the running sequences: admit waiting ones
            admitted = StepPlan()
            self._schedule_waiting(admitted, self.max_num_batched_tokens - len(plan.decode))
            if admitted.scheduled:
                plan = StepPlan(plan.scheduled + admitted.scheduled)
        return plan

    def _schedule_decode(self) -> StepPlan | None:
        """Every running sequence decodes its last token; None (nothing changed) when the step is not that:
        a prefill chunk to run, the token budget too small, or too few free blocks to grow the tables (the
        general path then preempts). After a decode step the rows' positions and tokens are carried over;
        otherwise C-level passes over the sequences read them, and numpy calls check them."""
        running, rows, block_manager = self.running, self.rows, self.block_manager
        n = len(running)
        if n == 0 or n > self.max_num_batched_tokens:
            return None
        if rows.carry is not None:
            positions, input_ids = rows.carry
        else:
            token_ids = list(map(_token_ids, running))
            positions = np.fromiter(map(_num_computed_tokens, running), np.int64, n)
            if ((np.fromiter(map(len, token_ids), np.int64, n) - positions != 1).any()  # one token to compute...
                    or (positions < rows.num_prompt_tokens[:n]).any()):  # ...and it is not a prompt token
                return None
            input_ids = np.fromiter(map(_last, token_ids), np.int64, n)
        growing = np.flatnonzero(positions >= rows.num_blocks[:n] * self.block_size)  # need a new block
        if len(growing):
            if not block_manager.can_allocate(len(growing)):
                return None
            for row in growing.tolist():  # in running order, as the general path allocates
                seq = running[row]
                block_manager.allocate(seq, 1)
                rows.sync_table(row, seq.block_table)
        return StepPlan(decode=DecodeBatch(list(running), positions, input_ids, rows.tables(n)))

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
            if start + num_new > len(seq.block_table) * block_size:
                if not self._allocate_or_preempt(seq, num_new, plan):
                    break
                self.rows.sync_table(i, seq.block_table)
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
        self.rows.pop()
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_cached_tokens = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        plan.preempted.append(seq)

    def preempt_all(self) -> None:
        """Preempt every running sequence by recompute, newest first, so the waiting queue keeps their order
        (the engine's recovery from a failed step)."""
        plan = StepPlan()
        while self.running:
            self._preempt(self.running[-1], plan)

    def _schedule_waiting(self, plan: StepPlan, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            num_new = self._admit(seq, budget)
            if num_new == 0:
                return  # FIFO: nothing behind it jumps the queue
            self.waiting.popleft()
            self.running.append(seq)
            self.rows.append(seq)
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

    def postprocess(self, plan: StepPlan, sampled_token_ids: list[int]) -> None:
        """Record the KV computed by the step, append the step's sampled tokens (one per plan.sampling_seqs,
        in order) to their sequences, and register newly full blocks in the prefix cache."""
        if plan.decode is not None:
            self._postprocess_decode(plan.decode, sampled_token_ids)
            return
        self.rows.carry = None
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
        for seq, token_id in zip(plan.sampling_seqs, sampled_token_ids):
            if seq.status is running:
                seq.token_ids.append(token_id)

    def _postprocess_decode(self, decode: DecodeBatch, sampled_token_ids: list[int]) -> None:
        """postprocess for a decode batch: one more computed token and the sampled token per sequence, and
        the sequences whose block just became full get it hashed. The rows' next positions and tokens are
        carried over to the next decode step."""
        seqs, running = decode.seqs, SequenceStatus.RUNNING
        complete = len(self.running) == len(seqs)  # no row was aborted since schedule()
        if not complete:
            seqs = [seq if seq.status is running else None for seq in seqs]
        for seq, token_id in zip(seqs, sampled_token_ids):
            if seq is not None:
                seq.num_computed_tokens += 1
                seq.token_ids.append(token_id)
        if self.block_manager.enable_prefix_caching:
            for row in np.flatnonzero((decode.positions + 1) % self.block_size == 0).tolist():
                if seqs[row] is not None:
                    self.block_manager.cache_full_blocks(seqs[row])
        self.rows.carry = (decode.positions + 1, np.array(sampled_token_ids, np.int64)) if complete else None

    def check_rows(self) -> None:
        """Assert the fast path's block-table rows match the running sequences (testing aid)."""
        self.rows.check(self.running)
