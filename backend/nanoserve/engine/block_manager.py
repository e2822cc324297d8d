"""Paged KV-cache bookkeeping (docs/architecture.md, "KV cache"): reference-counted blocks and a prefix cache.
Freed blocks stay findable until reused, least recently freed first."""
from __future__ import annotations

from array import array
from collections import OrderedDict

import numpy as np
import xxhash

from nanoserve.engine.sequence import Sequence

NO_HASH = -1


def block_offset(positions: np.ndarray, block_size: int) -> np.ndarray:
    """positions % block_size, by a mask when block_size is a power of two (the usual case): numpy's integer
    division is several times slower."""
    if block_size & (block_size - 1):
        return positions % block_size
    return positions & (block_size - 1)


def first_prev_hash(seq: Sequence) -> int:
    """What the hash of a sequence's first block chains from: its LoRA adapter's key, NO_HASH for the base model."""
    return NO_HASH if seq.lora is None else seq.lora.cache_key


def chain_hash(prev_hash: int, token_ids: list[int]) -> int:
    """Hash of one full block; prev_hash is NO_HASH for the first block of a sequence."""
    data = array("i", token_ids).tobytes()
    if prev_hash != NO_HASH:
        data = prev_hash.to_bytes(8, "little") + data
    return xxhash.xxh64_intdigest(data)  # unsigned, so never NO_HASH


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = NO_HASH
        self.token_ids: list[int] | None = None  # kept with the hash to verify cache hits

    def __repr__(self) -> str:  # in the tests' assertion messages
        return f"Block({self.block_id}, ref={self.ref_count}, hash={self.hash})"


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.num_total_blocks = num_blocks
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # oldest first
        self.hash_to_block_id: dict[int, int] = {}
        self.num_cached_blocks = 0  # blocks holding a valid hash, in use or free
        self.prefix_cache_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    # ---- admission ----
    def allocate_cached_prefix(self, seq: Sequence) -> int:
        """Give a newly admitted sequence the longest run of cached blocks matching its tokens; returns the
        number of tokens hit. The block holding the last token is never taken, so at least one token is
        computed (its logits are needed to sample)."""
        assert not seq.block_table, seq
        hit_blocks = self._find_cached_prefix(seq) if self.enable_prefix_caching else []
        for block in hit_blocks:
            if block.ref_count == 0:
                del self.free_block_ids[block.block_id]
            block.ref_count += 1
        seq.block_table = [block.block_id for block in hit_blocks]
        hit_tokens = len(hit_blocks) * self.block_size
        self.prefix_cache_hit_tokens += hit_tokens
        return hit_tokens

    def fork(self, parent: Sequence, child: Sequence, num_blocks: int) -> int:
        """Give a newly admitted child the first num_blocks blocks of parent (full, their KV computed), shared by
        reference count; returns the tokens they hold. They count as prefix-cache hits: the child computes none
        of them. undo_cached_prefix gives them back."""
        assert not child.block_table, child
        child.block_table = parent.block_table[:num_blocks]
        for block_id in child.block_table:
            self.blocks[block_id].ref_count += 1  # the parent holds them: never 0 here, so never in the free list
        hit_tokens = num_blocks * self.block_size
        self.prefix_cache_hit_tokens += hit_tokens
        return hit_tokens

    def undo_cached_prefix(self, seq: Sequence, hit_tokens: int) -> None:
        """Give back what allocate_cached_prefix took when the sequence cannot be admitted after all."""
        self.prefix_cache_hit_tokens -= hit_tokens
        self.free(seq)

    def _find_cached_prefix(self, seq: Sequence) -> list[Block]:
        size, token_ids = self.block_size, seq.token_ids
        hits: list[Block] = []
        prev_hash = first_prev_hash(seq)
        for i in range((len(token_ids) - 1) // size):
            block_tokens = token_ids[i * size:(i + 1) * size]
            prev_hash = chain_hash(prev_hash, block_tokens)
            block_id = self.hash_to_block_id.get(prev_hash)
            if block_id is None or self.blocks[block_id].token_ids != block_tokens:
                break
            hits.append(self.blocks[block_id])
        return hits

    # ---- growth ----
    def num_blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks to add so the table covers positions 0 .. num_tokens - 1."""
        return max(0, (num_tokens + self.block_size - 1) // self.block_size - len(seq.block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_block_ids)

    def allocate(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Append the blocks num_blocks_needed asks for; returns their ids."""
        new_ids = [self._take_free_block() for _ in range(self.num_blocks_needed(seq, num_tokens))]
        seq.block_table += new_ids
        return new_ids

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash != NO_HASH:  # its cached content is overwritten now
            if self.hash_to_block_id.get(block.hash) == block_id:
                del self.hash_to_block_id[block.hash]
            block.hash = NO_HASH
            block.token_ids = None
            self.num_cached_blocks -= 1
        block.ref_count = 1
        return block_id

    # ---- after a step ----
    def cache_full_blocks(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Hash and register the blocks that became full and computed since the last call. Hashed blocks form a
        prefix of the table, so walking back from the last full block finds the first unhashed one."""
        if not self.enable_prefix_caching:
            return
        num_full = num_computed_tokens // self.block_size
        table, blocks = seq.block_table, self.blocks
        first_unhashed = num_full
        while first_unhashed > 0 and blocks[table[first_unhashed - 1]].hash == NO_HASH:
            first_unhashed -= 1
        for i in range(first_unhashed, num_full):
            prev_hash = blocks[table[i - 1]].hash if i else first_prev_hash(seq)
            self._register(blocks[table[i]], prev_hash, seq.token_ids, i)

    def _register(self, block: Block, prev_hash: int, token_ids: list[int], index: int) -> None:
        block.token_ids = token_ids[index * self.block_size:(index + 1) * self.block_size]
        block.hash = chain_hash(prev_hash, block.token_ids)
        self.num_cached_blocks += 1
        # Another block with the same content may already be registered (two sequences prefilled the same
        # prefix at once); keep that one, this block still carries the hash for chaining.
        self.hash_to_block_id.setdefault(block.hash, block.block_id)

    # ---- release ----
    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks tail-first, so its prefix blocks are the last to be evicted."""
        blocks = self.blocks
        for block_id in reversed(seq.block_table):
            block = blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table = []
