"""Scheduler: chunked prefill, token budget, preemption by recompute, prefix caching, admission checks."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.sequence import Sequence, SequenceStatus
from nanoserve.sampling_params import SamplingParams


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=64, max_model_len=256,
                   prefix_caching=True) -> Scheduler:
    config = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             max_model_len=max_model_len, kvcache_block_size=block_size,
                             enable_prefix_caching=prefix_caching)
    return Scheduler(config, BlockManager(num_blocks, block_size, prefix_caching))


def add(scheduler: Scheduler, request_id: str, prompt, max_tokens=4) -> Sequence:
    prompt = list(prompt)
    scheduler.check_admissible(len(prompt), max_tokens)
    seq = Sequence(request_id, prompt, SamplingParams(max_tokens=max_tokens), max_tokens)
    scheduler.add(seq)
    return seq


def step(scheduler: Scheduler, next_token=7):
    """schedule -> fake model (samples next_token on sampling rows) -> postprocess -> finish at max_tokens."""
    plan = scheduler.schedule()
    assert plan.num_batched_tokens <= scheduler.max_num_batched_tokens
    assert len(plan.scheduled) <= scheduler.max_num_seqs
    scheduler.check_rows()
    sampling = plan.sampling_seqs  # before tokens are appended
    plan.sampled = [seq.request_id for seq in sampling]
    scheduler.postprocess(plan, [next_token] * len(sampling))  # appends the tokens
    for seq in sampling:
        if seq.num_output_tokens >= seq.max_tokens:
            scheduler.finish(seq, "length")
    return plan


def run_to_completion(scheduler: Scheduler, max_steps=10_000) -> int:
    steps = 0
    while scheduler.has_unfinished():
        step(scheduler)
        steps += 1
        assert steps < max_steps, "scheduler hangs"
    bm = scheduler.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks
    return steps


def rows(plan):
    return [(s.seq.request_id, s.start_pos, s.num_new_tokens) for s in plan.scheduled]


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
    assert not plans[0].is_decode_only
    assert plans[1].sampled == ["short"]  # a mid-prompt chunk samples nothing
    assert plans[2].sampled == ["short", "long"]
    assert long.num_computed_tokens == 20 and long.num_output_tokens == 1
    assert rows(step(scheduler)) == [("short", 6, 1), ("long", 20, 1)]
    assert long.is_finished and long.finish_reason == "length"
    assert scheduler.prompt_tokens_computed == 23
    run_to_completion(scheduler)
    assert short.num_output_tokens == 10


def test_budget_and_max_num_seqs_are_respected():
    scheduler = make_scheduler(num_blocks=200, budget=16, max_num_seqs=3)
    seqs = [add(scheduler, f"r{i}", range(i, i + 5 + 3 * i), max_tokens=6) for i in range(8)]
    while scheduler.has_unfinished():
        plan = step(scheduler)
        assert plan.num_batched_tokens <= 16 and len(plan.scheduled) <= 3
        assert scheduler.num_running <= 3
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
    scheduler.block_manager.check_invariants(scheduler.running)  # the undone prefix taking leaked nothing
    run_to_completion(scheduler)


# ---------------------------------------------------------------- preemption

def test_newest_sequence_is_preempted_and_finishes_after_recompute():
    scheduler = make_scheduler(num_blocks=6, block_size=2, budget=64, prefix_caching=False)
    old = add(scheduler, "old", [1, 2, 3, 4], max_tokens=6)  # needs up to 5 blocks
    new = add(scheduler, "new", [5, 6, 7, 8], max_tokens=6)
    assert rows(step(scheduler)) == [("old", 0, 4), ("new", 0, 4)]  # 4 of 6 blocks used
    plan = step(scheduler)  # both cross into a third block: all 6 used
    assert rows(plan) == [("old", 4, 1), ("new", 4, 1)] and not plan.preempted
    step(scheduler)
    plan = step(scheduler)  # old needs a 4th block, none free: the newest goes
    assert plan.preempted == [new] and rows(plan) == [("old", 6, 1)]
    assert new.status == SequenceStatus.WAITING and new.block_table == [] and new.num_computed_tokens == 0
    assert list(scheduler.waiting) == [new] and scheduler.num_preemptions == 1
    generated_before = new.output_token_ids
    recompute_rows = []
    while scheduler.has_unfinished():
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
        assert second.num_cached_tokens == 32 and scheduler.prefix_cache_hit_tokens == 32
        assert scheduler.prompt_tokens_computed == 34
    else:
        assert rows(plan) == [("second", 0, 33)]
        assert second.num_cached_tokens == 0 and scheduler.prefix_cache_hit_tokens == 0
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
    scheduler.block_manager.check_invariants(scheduler.running)
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
    restart = next(s for s in plan.scheduled if s.seq is new)
    assert restart.start_pos == new.num_cached_tokens > 0  # resumed from its own cached prefix
    run_to_completion(scheduler)
    assert new.num_output_tokens == 4


# ---------------------------------------------------------------- abort / finish

def test_abort_waiting_and_running_frees_blocks():
    scheduler = make_scheduler(max_num_seqs=1)
    running = add(scheduler, "run", range(10))
    waiting = add(scheduler, "wait", range(5))
    step(scheduler)
    assert scheduler.num_running == 1 and scheduler.num_waiting == 1
    assert scheduler.abort("wait") is waiting and waiting.finish_reason == "abort" and waiting.is_finished
    assert scheduler.abort("run") is running and running.block_table == []
    assert scheduler.abort("run") is None and scheduler.abort("nope") is None
    assert not scheduler.has_unfinished()
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_total_blocks


def test_aborted_between_schedule_and_postprocess_is_skipped():
    scheduler = make_scheduler()
    add(scheduler, "a", range(10))
    plan = scheduler.schedule()
    scheduler.abort("a")
    scheduler.postprocess(plan, [7])
    assert scheduler.prompt_tokens_computed == 0
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


# ---------------------------------------------------------------- decode fast path

class GeneralPathScheduler(Scheduler):
    """The scheduler with its decode fast path turned off: the reference the fast path must agree with."""

    def _schedule_decode(self):
        return None


def test_decode_steps_use_the_fast_path_and_describe_the_same_work():
    scheduler = make_scheduler(block_size=4)
    seqs = [add(scheduler, f"r{i}", range(i, i + 3 + i), max_tokens=10) for i in range(3)]
    assert step(scheduler).decode is None  # prefill
    plan = step(scheduler)
    assert plan.decode is not None and plan.is_decode_only and plan.num_prefill_tokens == 0
    assert plan.num_batched_tokens == plan.num_seqs == 3 and bool(plan)
    assert plan.sampling_seqs == seqs == [s.seq for s in plan.scheduled]
    assert rows(plan) == [(s.request_id, s.num_tokens - 2, 1) for s in seqs]  # tokens were appended since
    assert plan.decode.input_ids.tolist() == [s.token_ids[-2] for s in seqs]
    assert plan.decode.block_tables.tolist() == [s.block_table + [0] * (2 - len(s.block_table)) for s in seqs]


def test_the_last_prompt_token_left_by_a_chunk_is_not_a_decode():
    scheduler = make_scheduler(budget=5)
    seq = add(scheduler, "p", range(6), max_tokens=3)
    assert rows(step(scheduler)) == [("p", 0, 5)]
    plan = step(scheduler)  # one prompt token left: a one-token step, but a prefill
    assert plan.decode is None and rows(plan) == [("p", 5, 1)] and plan.sampled == ["p"]
    assert plan.num_prefill_tokens == 1 and scheduler.prompt_tokens_computed == 6
    assert step(scheduler).decode is not None and seq.num_output_tokens == 2


def test_admission_next_to_decodes_leaves_the_fast_path():
    scheduler = make_scheduler(budget=8)
    add(scheduler, "a", range(3), max_tokens=10)
    step(scheduler)
    add(scheduler, "b", range(10, 14), max_tokens=3)
    plan = step(scheduler)
    assert plan.decode is None and rows(plan) == [("a", 3, 1), ("b", 0, 4)]


def lockstep_workload(seed: int, num_blocks: int, block_size: int, max_num_seqs: int, budget: int,
                      prefix_caching: bool, steps: int = 120):
    """Drive a fast-path scheduler and a general-path one with the same random requests, aborts and tokens;
    every plan, preemption, block table and counter must be the same."""
    import random

    rng = random.Random(seed)
    config = dict(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs, budget=budget,
                  max_model_len=64, prefix_caching=prefix_caching)
    fast = make_scheduler(**config)
    slow = make_scheduler(**config)
    slow.__class__ = GeneralPathScheduler
    used_fast_path = carried = 0
    for i in range(steps):
        if rng.random() < 0.25:
            prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
            max_tokens = rng.randrange(1, 20)
            try:
                fast.check_admissible(len(prompt), max_tokens)
            except ValueError:
                continue
            for scheduler in (fast, slow):
                add(scheduler, f"r{i}", prompt, max_tokens)
        if rng.random() < 0.05 and fast.running:
            victim = rng.choice(fast.running).request_id
            assert fast.abort(victim).request_id == slow.abort(victim).request_id
        if not fast.has_unfinished():
            continue
        next_token = rng.randrange(3)
        carried += fast.rows.carry is not None
        plan_fast, plan_slow = step(fast, next_token), step(slow, next_token)
        used_fast_path += plan_fast.decode is not None
        assert plan_slow.decode is None
        assert rows(plan_fast) == rows(plan_slow) and plan_fast.sampled == plan_slow.sampled
        assert [s.request_id for s in plan_fast.preempted] == [s.request_id for s in plan_slow.preempted]
        assert plan_fast.num_prefill_tokens == plan_slow.num_prefill_tokens
        assert [s.block_table for s in fast.running] == [s.block_table for s in slow.running]
        assert [s.request_id for s in fast.waiting] == [s.request_id for s in slow.waiting]
        assert list(fast.block_manager.free_block_ids) == list(slow.block_manager.free_block_ids)
        assert (fast.num_preemptions, fast.prompt_tokens_computed, fast.prefix_cache_hit_tokens) == \
            (slow.num_preemptions, slow.prompt_tokens_computed, slow.prefix_cache_hit_tokens)
        fast.check_rows()
        fast.block_manager.check_invariants(fast.running)
    assert carried > 0
    return used_fast_path


@pytest.mark.parametrize("seed", range(12))
def test_decode_fast_path_agrees_with_the_general_path(seed):
    # small pools preempt, small budgets chunk prefills and limit decodes, big ones decode many at once
    num_blocks, block_size, max_num_seqs, budget = [(12, 2, 4, 6), (40, 4, 8, 64), (20, 1, 6, 5),
                                                    (64, 8, 16, 32)][seed % 4]
    used = lockstep_workload(seed, num_blocks, block_size, max_num_seqs, budget, prefix_caching=seed % 3 != 0)
    assert used > 0


def test_aborted_between_schedule_and_postprocess_of_a_decode_step_is_skipped():
    scheduler = make_scheduler(block_size=2)
    a, b = add(scheduler, "a", range(3), max_tokens=8), add(scheduler, "b", range(4), max_tokens=8)
    step(scheduler)
    plan = scheduler.schedule()
    assert plan.decode is not None
    scheduler.abort("a")
    scheduler.postprocess(plan, [7, 8])
    assert a.num_computed_tokens == 0 and a.block_table == [] and b.num_computed_tokens == 5
    assert a.num_tokens == 4 and b.token_ids[-1] == 8  # the aborted row gets no token
    scheduler.check_rows()
    scheduler.block_manager.check_invariants(scheduler.running)


def test_decode_positions_and_tokens_carry_over_to_the_next_decode_step():
    scheduler = make_scheduler(block_size=2)
    a, b, c = (add(scheduler, name, range(3), max_tokens=8) for name in "abc")
    step(scheduler)
    assert scheduler.rows.carry is None  # a prefill step: nothing to carry
    step(scheduler, next_token=5)
    assert scheduler.rows.carry is not None  # a decode step with its sampled tokens
    scheduler.check_rows()  # carried positions and tokens equal the sequences'
    plan = scheduler.schedule()
    assert plan.decode.positions.tolist() == [4, 4, 4] and plan.decode.input_ids.tolist() == [5, 5, 5]
    scheduler.abort("a")  # between schedule and postprocess: b and c get their tokens, nothing is carried
    scheduler.postprocess(plan, [6, 7, 8])
    assert a.token_ids[-1] == 5 and (b.token_ids[-1], c.token_ids[-1]) == (7, 8) and scheduler.rows.carry is None
    scheduler.check_rows()
    step(scheduler)
    scheduler.abort("b")  # after postprocess: its row leaves the carried arrays too
    assert scheduler.rows.carry is not None
    scheduler.check_rows()
    assert scheduler.schedule().decode.input_ids.tolist() == [7]
