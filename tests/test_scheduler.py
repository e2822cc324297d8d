"""Scheduler: chunked prefill, token budget, preemption by recompute, prefix caching, admission checks, and the
diffs it sends the runners (applied to a real InputBatch, they must reproduce its rows)."""
from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
from engine_checks import check_block_invariants, check_columns, has_unfinished, num_sampled

from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.input_batch import InputBatch
from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.sequence import Sequence, SequenceStatus
from nanoserve.sampling_params import SamplingParams


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=64, max_model_len=256,
                   prefix_caching=True) -> Scheduler:
    config = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             max_model_len=max_model_len, kvcache_block_size=block_size,
                             enable_prefix_caching=prefix_caching)
    scheduler = Scheduler(config, BlockManager(num_blocks, block_size, prefix_caching))
    scheduler.mirror = InputBatch(max_num_seqs, max_model_len, block_size)  # what a runner keeps from the diffs
    return scheduler


def add(scheduler: Scheduler, request_id: str, prompt, max_tokens=4) -> Sequence:
    prompt = list(prompt)
    scheduler.check_admissible(len(prompt), max_tokens)
    seq = Sequence(request_id, prompt, SamplingParams(max_tokens=max_tokens), max_tokens)
    scheduler.add(seq)
    return seq


def check_mirror(batch: InputBatch, scheduler: Scheduler) -> None:
    """After a SchedulerOutput is applied, the batch holds the running sequences, in order, with their tokens
    and block tables."""
    assert batch.req_ids == [seq.request_id for seq in scheduler.running]
    for slot, seq in zip(batch.slots.tolist(), scheduler.running):
        assert batch.num_prompt_tokens[slot] == seq.num_prompt_tokens
        assert batch.token_ids[slot, :seq.num_tokens].tolist() == seq.token_ids
        assert batch.block_tables[slot].tolist() == seq.block_table + [0] * (batch.block_tables.shape[1] -
                                                                           len(seq.block_table))


def check_blocks(scheduler: Scheduler) -> None:
    computed = {seq.request_id: scheduler.num_computed_tokens(seq) for seq in scheduler.running}
    check_block_invariants(scheduler.block_manager, scheduler.running, computed)


def step(scheduler: Scheduler, next_token=7, tokens=None):
    """schedule -> the mirror applies the diffs and builds the step's inputs -> fake model (samples next_token,
    or the next of `tokens`, on sampling rows) -> update -> finish at max_tokens."""
    out = scheduler.schedule()
    assert out.num_batched_tokens <= scheduler.max_num_batched_tokens
    assert out.num_rows == len(scheduler.running) <= scheduler.max_num_seqs
    out.rows = [(seq.request_id, int(start), int(n)) for seq, start, n in
                zip(scheduler.running, out.num_computed_tokens, out.num_scheduled_tokens) if n]
    scheduler.mirror.update(out)
    check_mirror(scheduler.mirror, scheduler)
    inputs = scheduler.mirror.prepare(out)
    running = {seq.request_id: seq for seq in scheduler.running}
    expected = [running[rid].token_ids[p] for rid, start, n in out.rows for p in range(start, start + n)]
    assert inputs.input_ids.tolist() == expected
    sampled = np.array([next_token if tokens is None else tokens.pop(0) for _ in range(num_sampled(out))])
    seqs = scheduler.update(out, sampled).seqs
    check_columns(scheduler)
    out.sampled = [seq.request_id for seq in seqs]
    for seq in seqs:
        if seq.num_output_tokens >= seq.max_tokens:
            scheduler.finish(seq, "length")
    return out


def run_to_completion(scheduler: Scheduler, max_steps=10_000) -> int:
    steps = 0
    while has_unfinished(scheduler):
        step(scheduler)
        steps += 1
        assert steps < max_steps, "scheduler hangs"
    bm = scheduler.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks
    return steps


def rows(out):
    return out.rows


# ---------------------------------------------------------------- chunked prefill and budget

def test_chunked_prefill_splits_a_long_prompt_and_shares_steps_with_decodes():
    scheduler = make_scheduler(budget=8)
    short = add(scheduler, "short", range(3), max_tokens=10)
    plan = step(scheduler)
    assert rows(plan) == [("short", 0, 3)] and plan.sampled == ["short"]
    long = add(scheduler, "long", range(100, 120), max_tokens=2)
    plans = [step(scheduler) for _ in range(3)]
    assert [rows(p) for p in plans] == [
        [("short", 3, 1), ("long", 0, 7)],
        [("short", 4, 1), ("long", 7, 7)],
        [("short", 5, 1), ("long", 14, 6)],
    ]
    assert plans[0].num_prefill_tokens == 7
    assert plans[1].sampled == ["short"]  # a mid-prompt chunk samples nothing
    assert plans[2].sampled == ["short", "long"]
    assert scheduler.num_computed_tokens(long) == 20 and long.num_output_tokens == 1
    assert rows(step(scheduler)) == [("short", 6, 1), ("long", 20, 1)]
    assert long.is_finished and long.finish_reason == "length"
    assert scheduler.prompt_tokens_computed == 23
    run_to_completion(scheduler)
    assert short.num_output_tokens == 10


def test_budget_and_max_num_seqs_are_respected():
    scheduler = make_scheduler(num_blocks=200, budget=16, max_num_seqs=3)
    seqs = [add(scheduler, f"r{i}", range(i, i + 5 + 3 * i), max_tokens=6) for i in range(8)]
    while has_unfinished(scheduler):
        out = step(scheduler)
        assert out.num_batched_tokens <= 16 and len(out.rows) <= 3
        assert len(scheduler.running) <= 3
    assert all(s.finish_reason == "length" and s.num_output_tokens == 6 for s in seqs)
    assert scheduler.num_preemptions == 0


def test_waiting_queue_is_fifo_and_does_not_skip_ahead():
    scheduler = make_scheduler(num_blocks=8, block_size=4, budget=64)
    add(scheduler, "big", range(24), max_tokens=4)  # 6 blocks + growth
    step(scheduler)
    add(scheduler, "blocked", range(100, 116), max_tokens=4)  # 4 blocks: does not fit next to "big"
    add(scheduler, "small", [1], max_tokens=1)  # would fit, but must not jump the queue
    plan = step(scheduler)
    assert rows(plan) == [("big", 24, 1)]
    assert [s.request_id for s in scheduler.waiting] == ["blocked", "small"]
    check_blocks(scheduler)  # the undone prefix taking leaked nothing
    run_to_completion(scheduler)


# ---------------------------------------------------------------- preemption

def test_newest_sequence_is_preempted_and_finishes_after_recompute():
    scheduler = make_scheduler(num_blocks=6, block_size=2, budget=64, prefix_caching=False)
    old = add(scheduler, "old", [1, 2, 3, 4], max_tokens=6)  # needs up to 5 blocks
    new = add(scheduler, "new", [5, 6, 7, 8], max_tokens=6)
    assert rows(step(scheduler)) == [("old", 0, 4), ("new", 0, 4)]  # 4 of 6 blocks used
    plan = step(scheduler)  # both cross into a third block: all 6 used
    assert rows(plan) == [("old", 4, 1), ("new", 4, 1)] and not plan.preempted_ids
    step(scheduler)
    plan = step(scheduler)  # old needs a 4th block, none free: the newest goes
    assert plan.preempted_ids == ["new"] and rows(plan) == [("old", 6, 1)]
    assert new.status == SequenceStatus.WAITING and new.block_table == [] and scheduler.num_computed_tokens(new) == 0
    assert list(scheduler.waiting) == [new] and scheduler.num_preemptions == 1
    generated_before = new.output_token_ids
    recompute_rows = []
    while has_unfinished(scheduler):
        plan = step(scheduler)
        recompute_rows += [r for r in rows(plan) if r[0] == "new" and r[1] == 0]
    assert recompute_rows == [("new", 0, 4 + len(generated_before))]  # prompt + output computed again
    assert new.output_token_ids[:len(generated_before)] == generated_before
    assert old.finish_reason == new.finish_reason == "length"
    assert old.num_output_tokens == new.num_output_tokens == 6
    assert scheduler.block_manager.num_free_blocks == 6


def test_many_sequences_in_a_small_pool_all_finish():
    scheduler = make_scheduler(num_blocks=10, block_size=2, max_num_seqs=6, budget=12)
    seqs = [add(scheduler, f"r{i}", [i % 3] * (1 + i % 5), max_tokens=1 + (7 * i) % 9) for i in range(30)]
    run_to_completion(scheduler)
    assert scheduler.num_preemptions > 0
    assert all(s.num_output_tokens == s.max_tokens for s in seqs)


# ---------------------------------------------------------------- prefix caching

@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prefix_cache_cuts_prompt_tokens_computed_for_a_repeated_prompt(prefix_caching):
    scheduler = make_scheduler(block_size=4, prefix_caching=prefix_caching)
    prompt = list(range(33))
    first = add(scheduler, "first", prompt)
    run_to_completion(scheduler)
    assert scheduler.prompt_tokens_computed == 33 and first.num_cached_tokens == 0
    second = add(scheduler, "second", prompt)
    plan = step(scheduler)
    if prefix_caching:
        assert rows(plan) == [("second", 32, 1)]
        assert second.num_cached_tokens == 32 and scheduler.block_manager.prefix_cache_hit_tokens == 32
        assert scheduler.prompt_tokens_computed == 34
    else:
        assert rows(plan) == [("second", 0, 33)]
        assert second.num_cached_tokens == 0 and scheduler.block_manager.prefix_cache_hit_tokens == 0
        assert scheduler.prompt_tokens_computed == 66
    run_to_completion(scheduler)


def test_running_sequences_share_a_prefix_while_both_are_live():
    scheduler = make_scheduler(block_size=4)
    system = list(range(40, 56))
    a = add(scheduler, "a", system + [1, 2], max_tokens=8)
    step(scheduler)
    b = add(scheduler, "b", system + [3], max_tokens=8)
    step(scheduler)
    assert b.num_cached_tokens == 16 and b.block_table[:4] == a.block_table[:4]
    assert scheduler.prompt_tokens_computed == 18 + 1
    check_blocks(scheduler)
    run_to_completion(scheduler)


def test_preempted_sequence_reuses_its_own_cached_blocks():
    scheduler = make_scheduler(num_blocks=8, block_size=2, budget=64)
    add(scheduler, "old", [1, 2, 3, 4], max_tokens=8)
    new = add(scheduler, "new", [5, 6, 7, 8, 9, 10], max_tokens=4)
    step(scheduler)  # 2 + 3 blocks
    for _ in range(3):  # pool exhausted at new's position 8: it is the newest and preempts itself
        step(scheduler)
    assert scheduler.num_preemptions == 1 and list(scheduler.waiting) == [new]
    assert scheduler.block_manager.num_cached_blocks >= 4  # its 4 full blocks stay cached while free
    while new.status == SequenceStatus.WAITING:
        plan = step(scheduler)
    (restart,) = [start for request_id, start, _ in rows(plan) if request_id == "new"]
    assert restart == new.num_cached_tokens > 0  # resumed from its own cached prefix
    run_to_completion(scheduler)
    assert new.num_output_tokens == 4


# ---------------------------------------------------------------- abort / finish

def test_abort_waiting_and_running_frees_blocks():
    scheduler = make_scheduler(max_num_seqs=1)
    running = add(scheduler, "run", range(10))
    waiting = add(scheduler, "wait", range(5))
    step(scheduler)
    assert len(scheduler.running) == 1 and len(scheduler.waiting) == 1
    assert scheduler.abort("wait") is waiting and waiting.finish_reason == "abort" and waiting.is_finished
    assert scheduler.abort("run") is running and running.block_table == []
    assert scheduler.abort("run") is None and scheduler.abort("nope") is None
    assert not has_unfinished(scheduler)
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_total_blocks


# ---------------------------------------------------------------- admission

def test_admission_errors_name_the_field():
    scheduler = make_scheduler(num_blocks=8, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match=r"^prompt: empty"):
        scheduler.check_admissible(0, 4)
    with pytest.raises(ValueError, match=r"^max_tokens: .*\(10\).*\(60\).*max_model_len \(64\)"):
        scheduler.check_admissible(10, 60)
    with pytest.raises(ValueError, match=r"^prompt: 64 tokens .*max_model_len \(64\)"):
        scheduler.check_admissible(64, 1)
    with pytest.raises(ValueError, match=r"^max_tokens: .*9 KV cache blocks.*only 8"):
        scheduler.check_admissible(20, 13)  # 33 tokens -> 9 blocks of 4
    with pytest.raises(ValueError, match=r"^prompt: .*only 8"):
        scheduler.check_admissible(40, 1)
    scheduler.check_admissible(20, 12)  # exactly 8 blocks: fits
    scheduler.check_admissible(1, 1)


# ---------------------------------------------------------------- the diffs of a step

def test_a_decode_step_sends_no_new_sequences_and_only_the_blocks_that_grow():
    scheduler = make_scheduler(block_size=4)
    seqs = [add(scheduler, f"r{i}", range(i, i + 3 + i), max_tokens=10) for i in range(3)]
    first = step(scheduler)
    assert [new.request_id for new in first.new_seqs] == ["r0", "r1", "r2"]
    assert [new.block_ids for new in first.new_seqs] == [s.block_table for s in seqs]
    out = step(scheduler, next_token=5)  # positions 3, 4, 5: r1 (5 tokens) crosses into its second block
    assert not out.new_seqs and not out.finished_ids and out.num_prefill_tokens == 0
    assert out.new_token_ids.tolist() == [7, 7, 7]  # the first step's tokens, for the runners
    assert out.num_computed_tokens.tolist() == [3, 4, 5] and out.num_scheduled_tokens.tolist() == [1, 1, 1]
    assert out.samples.all() and out.new_block_ids == [(1, seqs[1].block_table[1:])]
    assert step(scheduler).new_token_ids.tolist() == [5, 5, 5]


def test_the_last_prompt_token_left_by_a_chunk_is_a_prefill_token():
    scheduler = make_scheduler(budget=5)
    seq = add(scheduler, "p", range(6), max_tokens=3)
    assert rows(step(scheduler)) == [("p", 0, 5)]
    out = step(scheduler)  # one prompt token left: a one-token step, but a prefill
    assert rows(out) == [("p", 5, 1)] and out.sampled == ["p"]
    assert out.num_prefill_tokens == 1 and scheduler.prompt_tokens_computed == 6
    assert step(scheduler).num_prefill_tokens == 0 and seq.num_output_tokens == 2


def test_finished_and_aborted_rows_leave_with_the_next_step():
    scheduler = make_scheduler(block_size=2, max_num_seqs=3)
    for name in "abc":
        add(scheduler, name, range(3), max_tokens=8)
    waiting = add(scheduler, "waiting", range(3), max_tokens=8)
    step(scheduler)
    scheduler.abort("b")
    assert scheduler.abort("waiting") is waiting  # never ran: no row to remove
    scheduler.finish(scheduler.running[0], "stop")
    out = step(scheduler)
    assert out.finished_ids == ["b", "a"] and rows(out) == [("c", 3, 1)] and not out.new_seqs


def test_update_after_the_running_sequences_changed_is_refused():
    scheduler = make_scheduler()
    add(scheduler, "a", range(10))
    out = scheduler.schedule()
    scheduler.abort("a")
    with pytest.raises(AssertionError):
        scheduler.update(out, np.array([7]))


def random_workload(seed: int, num_blocks: int, block_size: int, max_num_seqs: int, budget: int,
                    prefix_caching: bool, steps: int = 120) -> Scheduler:
    """Random requests, aborts and tokens; every step the mirror batch follows the diffs (checked in step)."""
    rng = random.Random(seed)
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                               budget=budget, max_model_len=64, prefix_caching=prefix_caching)
    for i in range(steps):
        if rng.random() < 0.25:
            prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
            try:
                add(scheduler, f"r{i}", prompt, rng.randrange(1, 20))
            except ValueError:
                continue
        if rng.random() < 0.05 and scheduler.running:
            scheduler.abort(rng.choice(scheduler.running).request_id)
        if has_unfinished(scheduler):
            step(scheduler, rng.randrange(3))
            check_blocks(scheduler)
    return scheduler


@pytest.mark.parametrize("seed", range(8))
def test_diffs_reproduce_the_running_rows(seed):
    # small pools preempt, small budgets chunk prefills and limit decodes, big ones decode many at once
    num_blocks, block_size, max_num_seqs, budget = [(12, 2, 4, 6), (40, 4, 8, 64), (20, 1, 6, 5),
                                                    (64, 8, 16, 32)][seed % 4]
    scheduler = random_workload(seed, num_blocks, block_size, max_num_seqs, budget, prefix_caching=seed % 3 != 0)
    run_to_completion(scheduler)
