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
