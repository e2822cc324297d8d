"""Consistency checks of the scheduler's and the block manager's bookkeeping, for the tests."""
from __future__ import annotations

from nanoserve.engine.block_manager import NO_HASH, BlockManager, chain_hash, first_prev_hash


def check_block_invariants(bm: BlockManager, live_seqs, num_computed: dict[str, int]) -> None:
    """The bookkeeping agrees with the sequences that hold blocks, whose computed token counts num_computed gives
    by request id."""
    ref_counts = [0] * len(bm.blocks)
    for seq in live_seqs:
        assert len(set(seq.block_table)) == len(seq.block_table), f"block repeated in {seq}"
        for block_id in seq.block_table:
            ref_counts[block_id] += 1
    for block in bm.blocks:
        assert block.ref_count == ref_counts[block.block_id], (block, ref_counts[block.block_id])
        assert (block.ref_count == 0) == (block.block_id in bm.free_block_ids), block
        assert (block.hash == NO_HASH) == (block.token_ids is None), block
    assert bm.num_cached_blocks == sum(b.hash != NO_HASH for b in bm.blocks)
    for block_hash, block_id in bm.hash_to_block_id.items():
        block = bm.blocks[block_id]
        assert block.hash == block_hash and len(block.token_ids) == bm.block_size, block
    for seq in live_seqs:
        check_table_hashes(bm, seq, num_computed.get(seq.request_id, 0))


def check_table_hashes(bm: BlockManager, seq, num_computed_tokens: int) -> None:
    """Hashed blocks form a prefix of the table and each matches the sequence's content and chain."""
    size = bm.block_size
    num_hashed = sum(bm.blocks[b].hash != NO_HASH for b in seq.block_table)
    if bm.enable_prefix_caching:  # every full computed block is registered after a step
        assert num_hashed == num_computed_tokens // size, seq
    prev_hash = first_prev_hash(seq)
    for i, block_id in enumerate(seq.block_table[:num_hashed]):
        block = bm.blocks[block_id]
        assert (i + 1) * size <= num_computed_tokens, (seq, block)
        expected_tokens = seq.token_ids[i * size:(i + 1) * size]
        assert block.token_ids == expected_tokens, (seq, block)
        assert block.hash == chain_hash(prev_hash, expected_tokens), (seq, block)
        prev_hash = block.hash


def check_columns(scheduler) -> None:
    """The scheduler's per-row columns match the running sequences."""
    running, columns = scheduler.running, scheduler.columns
    lengths = [[s.num_tokens, len(s.block_table) * scheduler.block_size, s.num_prompt_tokens, s.max_num_tokens]
               for s in running]
    assert columns[1:, :len(running)].T.tolist() == lengths, (columns, lengths)
    assert not columns[:, len(running):].any()
    assert (columns[0, :len(running)] <= columns[1, :len(running)]).all()


def has_unfinished(scheduler) -> bool:
    return bool(scheduler.waiting or scheduler.running)


def num_sampled(out) -> int:
    return int(out.samples.sum())


def check_stops_inside_a_run(llm, prompt, reference) -> None:
    """A stop token, max_tokens and a stop string that fall inside an accepted run of proposals end the request
    there, as without speculation (reference: the greedy output of prompt), and the run's rest is not counted."""
    from nanoserve import SamplingParams

    stop_token = reference.token_ids[4]
    generated = llm.stats()["generation_tokens"]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_token]),
                       use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == reference.token_ids[:reference.token_ids.index(stop_token) + 1]
    assert llm.stats()["generation_tokens"] - generated == len(out.token_ids)  # the run's rest is not counted
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert out.finish_reason == "length" and out.token_ids == reference.token_ids[:5]
    text = llm.tokenizer.decode(reference.token_ids[:10])
    stop_text = text[len(text) // 2:][:2]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, stop=[stop_text], ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.text == reference.text[:reference.text.index(stop_text)]


def stream_and_abort_the_third(engine, prompts, params, base) -> int:
    """Stream three prompts (s0, s1, s2) with speculation, aborting s2 after 3 steps: one output per request and
    step, each counting the request's tokens so far; s0 and s1 equal base, s2 a prefix of it; every block is free
    at the end. Returns the number of steps."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"s{i}", prompt, params, stream=True)
    tokens = {f"s{i}": [] for i in range(3)}
    steps = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        assert len({out.request_id for out in outputs}) == len(outputs), "one output per request and step"
        for out in outputs:
            tokens[out.request_id] += out.new_token_ids
            assert out.num_output_tokens == len(tokens[out.request_id])
        steps += 1
        if steps == 3:
            assert engine.abort_request("s2")
    assert tokens["s0"] == base[0] and tokens["s1"] == base[1]
    assert tokens["s2"] == base[2][:len(tokens["s2"])] and len(tokens["s2"]) < len(base[2])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    return steps
