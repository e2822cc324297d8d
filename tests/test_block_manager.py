"""BlockManager unit tests, and a Hypothesis state machine driving Scheduler + BlockManager."""
from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from engine_checks import check_block_invariants, check_columns, has_unfinished, num_sampled

from nanoserve.engine.block_manager import NO_HASH, BlockManager, chain_hash
from nanoserve.engine.input_batch import InputBatch
from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.sequence import Sequence, SequenceStatus
from nanoserve.sampling_params import SamplingParams
from test_scheduler import check_mirror

BS = 4


def make_seq(tokens, request_id="r", max_tokens=4) -> Sequence:
    return Sequence(request_id, list(tokens), SamplingParams(max_tokens=max_tokens), max_tokens)


def compute(bm: BlockManager, seq: Sequence, computed: int, num_tokens: int | None = None) -> int:
    """Stand-in for one engine step: allocate, 'run the model', cache the full blocks; the new computed count."""
    if num_tokens is None:
        num_tokens = seq.num_tokens - computed
    bm.allocate(seq, computed + num_tokens)
    bm.cache_full_blocks(seq, computed + num_tokens)
    return computed + num_tokens


def admit_and_compute(bm: BlockManager, tokens, request_id="r") -> Sequence:
    seq = make_seq(tokens, request_id)
    compute(bm, seq, bm.allocate_cached_prefix(seq))
    return seq


def all_computed(*seqs) -> dict[str, int]:
    return {seq.request_id: seq.num_tokens for seq in seqs}


# ---------------------------------------------------------------- hashing

def test_hash_is_chained_over_the_previous_block():
    block = [5, 6, 7, 8]
    assert chain_hash(NO_HASH, block) == chain_hash(NO_HASH, list(block))
    first_a, first_b = chain_hash(NO_HASH, [1, 2, 3, 4]), chain_hash(NO_HASH, [9, 2, 3, 4])
    assert chain_hash(first_a, block) != chain_hash(first_b, block)
    assert chain_hash(first_a, block) != chain_hash(NO_HASH, block)


def test_same_block_after_a_different_prefix_is_not_a_hit():
    bm = BlockManager(16, BS)
    admit_and_compute(bm, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    other = make_seq([9, 9, 9, 9, 5, 6, 7, 8, 0])
    assert bm.allocate_cached_prefix(other) == 0
    assert other.block_table == []


def test_hit_requires_equal_token_ids_not_just_equal_hash():
    bm = BlockManager(16, BS)
    first = admit_and_compute(bm, [1, 2, 3, 4, 0])
    cached_id = first.block_table[0]
    impostor = [7, 7, 7, 7]
    bm.hash_to_block_id[chain_hash(NO_HASH, impostor)] = cached_id  # simulate a hash collision
    assert bm.allocate_cached_prefix(make_seq(impostor + [0], "x")) == 0
    assert bm.allocate_cached_prefix(make_seq([1, 2, 3, 4, 0], "y")) == BS


def test_block_holding_the_last_token_is_never_taken_from_cache():
    bm = BlockManager(16, BS)
    tokens = list(range(2 * BS))
    admit_and_compute(bm, tokens, "a")
    exact = make_seq(tokens, "b")
    assert bm.allocate_cached_prefix(exact) == BS  # second block holds the last token: computed again
    assert len(exact.block_table) == 1
    assert bm.num_blocks_needed(exact, exact.num_tokens) == 1
    longer = make_seq(tokens + [99], "c")
    assert bm.allocate_cached_prefix(longer) == 2 * BS
    assert bm.prefix_cache_hit_tokens == 3 * BS


def test_prefix_hit_stops_at_first_mismatch():
    bm = BlockManager(16, BS)
    admit_and_compute(bm, list(range(12)) + [0], "a")
    seq = make_seq(list(range(8)) + [50, 51, 52, 53, 0], "b")
    assert bm.allocate_cached_prefix(seq) == 2 * BS


# ---------------------------------------------------------------- allocation, ref counts, free

def test_allocate_covers_computed_plus_new_tokens():
    bm = BlockManager(8, BS)
    seq = make_seq(range(10))
    assert bm.num_blocks_needed(seq, 10) == 3
    assert bm.num_blocks_needed(seq, 4) == 1
    bm.allocate(seq, 5)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6
    assert bm.num_blocks_needed(seq, 5 + 3) == 0  # positions 5..7 fit in block 1
    assert bm.num_blocks_needed(seq, 5 + 4) == 1
    assert bm.can_allocate(6) and not bm.can_allocate(7)


def test_shared_prefix_ref_counts_and_free():
    bm = BlockManager(8, BS)
    a = admit_and_compute(bm, list(range(9)), "a")
    b = make_seq(list(range(9)), "b")
    assert bm.allocate_cached_prefix(b) == 2 * BS
    assert b.block_table == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    free_before = bm.num_free_blocks
    compute(bm, b, 2 * BS)
    assert bm.num_free_blocks == free_before - 1
    check_block_invariants(bm, [a, b], all_computed(a, b))
    bm.free(a)
    assert a.block_table == []
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1, 1]
    check_block_invariants(bm, [b], all_computed(b))
    bm.free(b)
    assert bm.num_free_blocks == bm.num_total_blocks == 8
    check_block_invariants(bm, [], {})


def test_free_blocks_are_reused_least_recently_freed_first():
    bm = BlockManager(3, BS)
    seqs = [make_seq([i], str(i)) for i in range(3)]
    for seq in seqs:
        bm.allocate(seq, 1)
    ids = [seq.block_table[0] for seq in seqs]
    for i in (1, 0, 2):
        bm.free(seqs[i])
    fresh = make_seq(range(3 * BS))
    bm.allocate(fresh, 3 * BS)
    assert fresh.block_table == [ids[1], ids[0], ids[2]]


def test_sequence_is_freed_tail_first_so_its_prefix_is_evicted_last():
    bm = BlockManager(3, BS)
    seq = admit_and_compute(bm, range(3 * BS))
    table = list(seq.block_table)
    bm.free(seq)
    assert list(bm.free_block_ids) == table[::-1]


def test_freed_blocks_stay_cached_until_reused():
    bm = BlockManager(4, BS)
    prompt = list(range(2 * BS + 1))
    first = admit_and_compute(bm, prompt, "a")
    bm.free(first)
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 4
    again = make_seq(prompt, "b")
    assert bm.allocate_cached_prefix(again) == 2 * BS
    assert bm.num_free_blocks == 2  # hits taken out of the free queue
    bm.free(again)
    # Reuse all four blocks for other content: the cached entries disappear.
    filler = make_seq([100 + i for i in range(4 * BS)], "c")
    bm.allocate(filler, 4 * BS)
    assert bm.num_cached_blocks == 0 and bm.hash_to_block_id == {}
    bm.free(filler)
    assert bm.allocate_cached_prefix(make_seq(prompt, "d")) == 0


def test_eviction_drops_oldest_cached_blocks_first():
    bm = BlockManager(4, BS)
    old = admit_and_compute(bm, list(range(BS)) + [0], "old")  # 1 hashed + 1 partial block
    bm.free(old)
    new = admit_and_compute(bm, list(range(50, 50 + BS)) + [0], "new")
    bm.free(new)
    taker = make_seq(range(2 * BS), "taker")
    bm.allocate(taker, 2 * BS)  # takes old's two blocks (freed earliest)
    assert bm.allocate_cached_prefix(make_seq(list(range(BS)) + [0], "x")) == 0
    assert bm.allocate_cached_prefix(make_seq(list(range(50, 50 + BS)) + [0], "y")) == BS


def test_duplicate_content_keeps_the_first_registered_block():
    bm = BlockManager(8, BS)
    a, b = make_seq(range(BS + 1), "a"), make_seq(range(BS + 1), "b")
    for seq in (a, b):  # both admitted before either computed: no hit for b
        assert bm.allocate_cached_prefix(seq) == 0
        bm.allocate(seq, seq.num_tokens)
    for seq in (a, b):
        bm.cache_full_blocks(seq, seq.num_tokens)
    block_hash = bm.blocks[a.block_table[0]].hash
    assert bm.blocks[b.block_table[0]].hash == block_hash
    assert bm.hash_to_block_id[block_hash] == a.block_table[0]
    assert bm.num_cached_blocks == 2
    check_block_invariants(bm, [a, b], all_computed(a, b))


def test_cache_full_blocks_hashes_only_computed_full_blocks_incrementally():
    bm = BlockManager(8, BS)
    seq = make_seq(range(2 * BS + 2))
    computed = compute(bm, seq, bm.allocate_cached_prefix(seq), BS - 1)
    assert bm.num_cached_blocks == 0
    computed = compute(bm, seq, computed, 2)
    assert bm.num_cached_blocks == 1
    computed = compute(bm, seq, computed)
    assert bm.num_cached_blocks == 2
    for token in range(BS):  # decode steps fill the third block
        seq.token_ids.append(1000 + token)
        computed = compute(bm, seq, computed, 1)
    assert bm.num_cached_blocks == 3
    check_block_invariants(bm, [seq], {seq.request_id: computed})


def test_prefix_caching_disabled():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    first = admit_and_compute(bm, range(3 * BS), "a")
    assert bm.num_cached_blocks == 0
    bm.free(first)
    again = make_seq(range(3 * BS), "b")
    assert bm.allocate_cached_prefix(again) == 0 and again.num_cached_tokens == 0


# ---------------------------------------------------------------- Hypothesis: scheduler + block manager

VOCAB = (0, 1, 2)
PREFIXES = ((), (0, 0, 0, 0), (1, 2, 1, 2, 1, 2), (0, 1, 2, 0, 1, 2, 0, 1))
prompts = st.builds(lambda prefix, tail: list(prefix) + tail, st.sampled_from(PREFIXES),
                    st.lists(st.sampled_from(VOCAB), min_size=0, max_size=6))


class SchedulerMachine(RuleBasedStateMachine):
    """Random add / step / abort on small pools, requests with n samples among them (the later ones start from
    the first's prompt blocks); the checks run after every rule. `kv` is the ground truth of the cache: the token
    each step computed into each slot, which every running sequence's computed positions must read back."""

    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(2, 14),
                max_num_seqs=st.integers(1, 4), budget=st.integers(1, 16), prefix_caching=st.booleans(),
                seed=st.integers(0, 2**16))
    def setup(self, block_size, num_blocks, max_num_seqs, budget, prefix_caching, seed):
        config = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=24,
                                 kvcache_block_size=block_size, enable_prefix_caching=prefix_caching)
        self.bm = BlockManager(num_blocks, block_size, prefix_caching)
        self.scheduler = Scheduler(config, self.bm)
        self.batch = InputBatch(max_num_seqs, 24, block_size)  # a runner's batch, kept from the diffs
        self.rng = random.Random(seed)
        self.live: dict[str, Sequence] = {}
        self.finished: list[Sequence] = []
        self.prefix_by_hash: dict[int, tuple[int, ...]] = {}  # ground truth: hash -> the full prefix it names
        self.kv: dict[tuple[int, int], int] = {}  # (block id, offset) -> the token last computed there
        self.requests: dict[str, list[str]] = {}  # request id -> its sequences' ids
        self.next_id = 0

    @rule(requests=st.lists(st.tuples(prompts, st.integers(1, 10), st.integers(1, 3)), min_size=1, max_size=4))
    def add(self, requests):
        for prompt, max_tokens, n in requests:
            self._add(prompt, max_tokens, n)

    def _add(self, prompt, max_tokens, n):
        try:
            self.scheduler.check_admissible(len(prompt), max_tokens)
        except ValueError:
            worst_blocks = -(-(len(prompt) + max_tokens) // self.bm.block_size)
            assert not prompt or len(prompt) + max_tokens > 24 or worst_blocks > self.bm.num_total_blocks
            return
        request_id = f"req{self.next_id}"
        self.next_id += 1
        seqs = [make_seq(prompt, f"{i}_{request_id}" if n > 1 else request_id, max_tokens) for i in range(n)]
        for seq in seqs:
            self.scheduler.add(seq, fork_of=seqs[0] if seq is not seqs[0] else None)
            self.live[seq.request_id] = seq
        self.requests[request_id] = [seq.request_id for seq in seqs]

    @precondition(lambda self: self.live)
    @rule()
    def step(self):
        self._step()

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 1000))
    def abort(self, pick):
        """Abort a request: every sequence of it still live (as the engine does)."""
        live_requests = sorted(r for r, ids in self.requests.items() if any(i in self.live for i in ids))
        for sequence_id in self.requests[live_requests[pick % len(live_requests)]]:
            if sequence_id not in self.live:
                continue
            seq = self.scheduler.abort(sequence_id)
            assert seq is self.live.pop(sequence_id)
            assert seq.status == SequenceStatus.FINISHED and seq.finish_reason == "abort" and not seq.block_table
            assert self.scheduler.abort(sequence_id) is None

    @rule()
    def run_to_completion(self):
        max_steps = 100 + 20 * sum(s.num_prompt_tokens + s.max_tokens for s in self.live.values())
        for _ in range(max_steps):
            if not has_unfinished(self.scheduler):
                break
            self._step()
            self.check_block_bookkeeping()
        assert not has_unfinished(self.scheduler) and not self.live, "requests did not finish: hang"
        assert self.bm.num_free_blocks == self.bm.num_total_blocks
        assert all(seq.num_output_tokens == seq.max_tokens for seq in self.finished if seq.finish_reason == "length")

    def _step(self):
        scheduler = self.scheduler
        out = scheduler.schedule()
        assert out.num_batched_tokens > 0, "unfinished requests but nothing scheduled: no progress"
        assert out.num_batched_tokens <= scheduler.max_num_batched_tokens
        assert out.num_rows == len(scheduler.running) <= scheduler.max_num_seqs
        for seq, start, count in zip(scheduler.running, out.num_computed_tokens, out.num_scheduled_tokens):
            assert seq.status == SequenceStatus.RUNNING and start == scheduler.num_computed_tokens(seq)
            assert start + count <= seq.num_tokens
            assert len(seq.block_table) * self.bm.block_size >= start + count
        for request_id in out.preempted_ids:
            seq = next(s for s in scheduler.waiting if s.request_id == request_id)
            assert seq.status == SequenceStatus.WAITING and not seq.block_table
        for seq in scheduler.running:
            first = scheduler.fork_sources.get(seq.request_id)
            assert first is None, "a later sample is admitted only once its request's first computed the prompt"
        self.batch.update(out)
        check_mirror(self.batch, scheduler)  # the diffs reproduce the running rows, tokens and block tables
        self.batch.prepare(out)
        scheduled_seqs = [seq for seq, count in zip(scheduler.running, out.num_scheduled_tokens) if count]
        for seq, start, count in zip(scheduler.running, out.num_computed_tokens.tolist(),
                                     out.num_scheduled_tokens.tolist()):
            for position in range(start, start + count):  # "run the model": the step writes its tokens' KV
                self.kv[seq.block_table[position // self.bm.block_size], position % self.bm.block_size] = \
                    seq.token_ids[position]
        sampled = np.array([self.rng.choice(VOCAB) for _ in range(num_sampled(out))])
        sampling = scheduler.update(out, sampled).seqs
        self._record_prefixes(scheduled_seqs)
        for seq in sampling:
            if seq.num_output_tokens >= seq.max_tokens:
                scheduler.finish(seq, "length")
                self.finished.append(self.live.pop(seq.request_id))

    def _record_prefixes(self, seqs):
        size = self.bm.block_size
        for seq in seqs:
            prev = NO_HASH
            for i in range(self.scheduler.num_computed_tokens(seq) // size):
                prefix = tuple(seq.token_ids[:(i + 1) * size])
                prev = chain_hash(prev, list(prefix[-size:]))
                assert self.prefix_by_hash.setdefault(prev, prefix) == prefix, "hash collision in the test"

    @invariant()
    def check_block_bookkeeping(self):
        if not hasattr(self, "bm"):
            return
        scheduler = self.scheduler
        holders = list(scheduler.running) + list(scheduler.waiting)
        assert {s.request_id for s in holders} == set(self.live)
        # a later sample's fork source is kept until it is admitted, never after
        assert set(scheduler.fork_sources) <= {seq.request_id for seq in scheduler.waiting}
        for seq in scheduler.running:  # every computed position holds its token's KV, shared blocks included
            for position in range(scheduler.num_computed_tokens(seq)):
                slot = seq.block_table[position // self.bm.block_size], position % self.bm.block_size
                assert self.kv.get(slot) == seq.token_ids[position], (seq, position)
        assert all(not s.block_table for s in scheduler.waiting)
        computed = {seq.request_id: scheduler.num_computed_tokens(seq) for seq in scheduler.running}
        # free xor used, ref counts, hashed prefix of each table
        check_block_invariants(self.bm, holders, computed)
        check_columns(scheduler)  # the rows' numbers match the running sequences'
        used = {b for s in scheduler.running for b in s.block_table}
        assert not used & set(self.bm.free_block_ids)
        for block_hash, block_id in self.bm.hash_to_block_id.items():
            block = self.bm.blocks[block_id]
            prefix = self.prefix_by_hash[block_hash]  # every registered hash names a prefix really computed
            assert list(prefix[-self.bm.block_size:]) == block.token_ids
        if not has_unfinished(scheduler):
            assert self.bm.num_free_blocks == self.bm.num_total_blocks

    def teardown(self):
        if hasattr(self, "bm"):
            self.run_to_completion()


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
