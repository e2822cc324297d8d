"""InputBatch: the model runner's persistent rows, kept from SchedulerOutput diffs; the step's arrays against
hand-computed ones (the engine-level references are the scheduler tests' mirror and the runner tests' HF logits)."""
import numpy as np
import torch

from nanoserve.engine.input_batch import InputBatch
from nanoserve.engine.scheduler_output import NewSequence, SchedulerOutput
from nanoserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def step(computed, counts, samples, **diffs) -> SchedulerOutput:
    counts = np.array(counts, dtype=np.int64)
    return SchedulerOutput(num_computed_tokens=np.array(computed, dtype=np.int64), num_scheduled_tokens=counts,
                           samples=np.array(samples, dtype=bool), num_batched_tokens=int(counts.sum()), **diffs)


def new(request_id, token_ids, block_ids, params=GREEDY) -> NewSequence:
    return NewSequence(request_id, token_ids, len(token_ids), params, block_ids)


def test_a_mixed_step_from_the_rows():
    batch = InputBatch(max_num_seqs=4, max_model_len=16, block_size=4)
    out = step([0, 4, 2], [6, 1, 5], [True, True, False], new_seqs=[
        new("x", [5, 6, 7, 8, 9, 10], [3, 9]), new("y", [1, 2, 3, 4, 50], [1, 5, 8]),  # y's table is wider
        new("z", list(range(20, 30)), [2, 4, 6])])
    batch.update(out)
    inputs = batch.prepare(out)
    assert inputs.input_ids.tolist() == [5, 6, 7, 8, 9, 10, 50, 22, 23, 24, 25, 26]
    assert inputs.positions.tolist() == [0, 1, 2, 3, 4, 5, 4, 2, 3, 4, 5, 6]
    assert inputs.slot_mapping.tolist() == [12, 13, 14, 15, 36, 37, 20, 10, 11, 16, 17, 18]
    assert inputs.query_start_loc.tolist() == [0, 6, 7, 12] and inputs.seq_lens.tolist() == [6, 5, 7]
    assert inputs.block_tables.tolist() == [[3, 9], [1, 5], [2, 4]]  # as wide as the longest context needs
    assert inputs.logits_indices.tolist() == [5, 6]  # z's chunk stops before its last token
    assert (inputs.max_query_len, inputs.max_seq_len) == (6, 7)
    for name, dtype in (("input_ids", np.int64), ("positions", np.int64), ("slot_mapping", np.int64),
                        ("query_start_loc", np.int32), ("seq_lens", np.int32), ("block_tables", np.int32),
                        ("logits_indices", np.int64)):
        assert getattr(inputs, name).dtype == dtype, name
    # the next step: x and y get their sampled tokens from the diff; z's next chunk; y's table is full
    out = step([6, 5, 7], [1, 1, 3], [True, True, True], new_token_ids=np.array([77, 88]))
    batch.update(out)
    inputs = batch.prepare(out)
    assert inputs.input_ids.tolist() == [77, 88, 27, 28, 29]
    assert inputs.slot_mapping.tolist() == [38, 21, 19, 24, 25] and inputs.max_query_len == 3


def test_rows_leave_in_order_and_their_slots_are_reused():
    batch = InputBatch(max_num_seqs=3, max_model_len=8, block_size=2)
    rows = [new(name, [i + 1] * 3, [2 * i, 2 * i + 1]) for i, name in enumerate("abc")]
    batch.update(step([0, 0, 0], [3, 3, 3], [True] * 3, new_seqs=rows))
    batch.prepare(step([0, 0, 0], [3, 3, 3], [True] * 3))
    out = step([3, 3, 0], [1, 1, 2], [True] * 3, new_token_ids=np.array([10, 11, 12]), finished_ids=["b"],
               new_seqs=[new("d", [9, 9], [7])])
    batch.update(out)
    assert batch.req_ids == ["a", "c", "d"] and batch.slots.tolist()[2] == 1  # d takes b's slot
    inputs = batch.prepare(out)
    assert inputs.input_ids.tolist() == [10, 12, 9, 9]  # a's and c's sampled tokens; nothing of b's remains
    assert inputs.block_tables.tolist() == [[0, 1], [4, 5], [7, 0]]  # d's row has no stale block of b's


def test_rows_without_tokens_this_step_are_left_out():
    batch = InputBatch(max_num_seqs=2, max_model_len=8, block_size=4)
    out = step([0, 0], [3, 0], [True, False], new_seqs=[new("a", [1, 2, 3], [0]), new("b", [4, 5], [1])])
    batch.update(out)
    inputs = batch.prepare(out)
    assert inputs.input_ids.tolist() == [1, 2, 3] and inputs.seq_lens.tolist() == [3]
    assert batch.sampling_slots.tolist() == [batch.slots[0]]


def test_a_parameter_the_whole_batch_shares_is_a_number():
    batch = InputBatch(max_num_seqs=3, max_model_len=8, block_size=4)
    params = [SamplingParams(temperature=0.5, top_k=4), SamplingParams(temperature=0.5, top_k=4),
              SamplingParams(temperature=0.9, top_k=4)]
    batch.update(step([0, 0, 0], [1, 1, 1], [True] * 3,
                      new_seqs=[new(str(i), [i], [i], p) for i, p in enumerate(params)]))
    batch.prepare(step([0, 0, 0], [1, 1, 1], [True] * 3))
    meta = batch.sampling_metadata(torch.device("cpu"))
    assert meta.temperatures.view(-1).tolist() == [0.5, 0.5, 0.8999999761581421] and meta.top_ks == 4
    assert meta.max_top_k == 4 and not meta.all_greedy
    out = step([1, 1], [1, 1], [True, True], new_token_ids=np.array([5, 6, 7]), finished_ids=["2"])
    batch.update(out)
    batch.prepare(out)
    assert batch.sampling_metadata(torch.device("cpu")).temperatures == 0.5  # the odd one left


def test_blocks_appended_to_several_rows_at_once_map_every_position():
    """Rows that grow in one step (several blocks each, the last one past max_model_len) get the KV slots a
    per-position reference computes from their block tables."""
    batch = InputBatch(max_num_seqs=3, max_model_len=10, block_size=4)  # 3 blocks cover 12 positions
    tables = {"a": [7], "b": [2, 5], "c": []}
    first = step([0, 0, 0], [3, 6, 0], [False] * 3, new_seqs=[new(name, list(range(1, 11)), tables[name])
                                                              for name in "abc"])
    batch.update(first)
    batch.prepare(first)
    grown = {"a": [0, 9], "c": [4, 1, 3]}  # a: blocks 2 and 3; c: its first three
    out = step([3, 6, 0], [7, 1, 10], [True] * 3, new_block_ids=[(0, grown["a"]), (2, grown["c"])])
    batch.update(out)
    for name, ids in grown.items():
        tables[name] += ids
    inputs = batch.prepare(out)
    positions = [range(3, 10), range(6, 7), range(0, 10)]
    expected = [tables[name][p // 4] * 4 + p % 4 for name, rows in zip("abc", positions) for p in rows]
    assert inputs.slot_mapping.tolist() == expected
    assert inputs.block_tables.tolist() == [tables["a"], tables["b"] + [0], tables["c"]]


def test_a_launched_steps_tokens_reach_only_the_rows_that_still_hold_their_slots():
    """Async scheduling: step 2 is prepared before step 1's tokens are known. b leaves and d takes its slot in
    step 2's diff: step 1's token for b lands nowhere (not in d's row), a's and c's are step 2's inputs."""
    batch = InputBatch(max_num_seqs=3, max_model_len=8, block_size=2)
    rows = [new(name, [i + 1] * 3, [2 * i, 2 * i + 1]) for i, name in enumerate("abc")]
    first = step([0, 0, 0], [3, 3, 3], [True] * 3, new_seqs=rows)
    batch.update(first)
    batch.prepare(first)
    pending = batch.take_pending()
    second = step([3, 3, 0], [1, 1, 4], [True] * 3, finished_ids=["b"], new_seqs=[new("d", [9, 8, 7, 6], [2, 3])])
    batch.update(second)  # no new_token_ids: the runner fills them in
    inputs = batch.prepare(second)
    assert batch.req_ids == ["a", "c", "d"] and batch.slots.tolist()[2] == 1  # d takes b's slot
    rows_of_first, places = batch.placeholders(pending)
    assert rows_of_first.tolist() == [0, 2] and places.tolist() == [0, 1]  # a's and c's tokens, not b's
    sampled = np.array([10, 11, 12])
    inputs.input_ids[places] = sampled[rows_of_first]
    assert inputs.input_ids.tolist() == [10, 12, 9, 8, 7, 6]
    batch.fill_pending(pending, sampled)
    assert batch.token_ids[batch.slots, :4].tolist() == [[1, 1, 1, 10], [3, 3, 3, 12], [9, 8, 7, 6]]
