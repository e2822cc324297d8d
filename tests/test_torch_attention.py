"""The torch backend (kernels/torch_attention.py) against the reference, step after step, while rows grow,
finish, join, move in the batch and blocks are freed and reused."""
from __future__ import annotations

import random

import pytest
import torch

from nanoserve.kernels import reference as ref
from nanoserve.kernels import torch_attention as ta

BLOCK, KV_HEADS, HEADS, HEAD_DIM = 4, 2, 4, 8


class Decoder:
    """Sequences decoding over a shared block pool (freed blocks reused first) in two layers' caches."""

    def __init__(self, seed: int, num_blocks: int = 400):
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
        self.caches = [(torch.randn(shape, generator=self.gen), torch.randn(shape, generator=self.gen))
                       for _ in range(2)]
        self.free = list(range(num_blocks))
        self.rows: list[dict] = []  # {"table": [...], "len": context length incl. this step's tokens}

    def step(self, joins: int, finishes: int):
        """One plan's rows: `finishes` rows leave, `joins` rows arrive with a prompt (prefill rows), the others
        decode a token. Returns (slot_mapping, block_tables, query_start_loc, seq_lens, q_lens)."""
        for _ in range(min(finishes, len(self.rows))):
            row = self.rows.pop(self.rng.randrange(len(self.rows)))
            self.free = row["table"] + self.free  # reused first: stale copies of them would show
        q_lens = []
        for row in self.rows:
            row["len"] += 1
            q_lens.append(1)
        for _ in range(joins):
            self.rows.append({"table": [], "len": self.rng.randint(1, 30)})
            q_lens.append(self.rows[-1]["len"])
        slots = []
        for row, q_len in zip(self.rows, q_lens):
            while len(row["table"]) * BLOCK < row["len"]:
                row["table"].append(self.free.pop(0))
            for pos in range(row["len"] - q_len, row["len"]):
                slots.append(row["table"][pos // BLOCK] * BLOCK + pos % BLOCK)
        width = max(len(r["table"]) for r in self.rows)
        tables = torch.tensor([r["table"] + [0] * (width - len(r["table"])) for r in self.rows], dtype=torch.int32)
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        return (torch.tensor(slots), tables, torch.tensor(starts, dtype=torch.int32),
                torch.tensor([r["len"] for r in self.rows], dtype=torch.int32), starts[-1])

    def new_kv(self, num_tokens: int):
        return [torch.randn(2, num_tokens, KV_HEADS, HEAD_DIM, generator=self.gen) for _ in self.caches]


def attend_one_layer(decoder: Decoder, layer: int, plan, batch, q, kv_new) -> None:
    """Store this step's K/V in the layer's cache, attend through the plan, compare with the reference."""
    _, tables, starts, seq_lens, _ = batch
    (k_cache, v_cache), (k, v) = decoder.caches[layer], kv_new
    ta.store_kvcache_planned(k, v, k_cache, v_cache, plan)
    out = ta.paged_attention_planned(q, k, v, k_cache, v_cache, plan, 0.3)
    torch.testing.assert_close(out, ref.paged_attention_ref(q, k_cache, v_cache, tables, starts, seq_lens, 0.3),
                               atol=1e-5, rtol=1e-5)


def plan_step(decoder: Decoder, batch):
    """(plan, q, new K/V per layer) for a step made by decoder.step."""
    slots, tables, starts, seq_lens, num_tokens = batch
    plan = ta.plan_paged_attention(slots, tables, starts, seq_lens)
    return plan, torch.randn(num_tokens, HEADS, HEAD_DIM, generator=decoder.gen), decoder.new_kv(num_tokens)


@pytest.mark.parametrize("seed", range(6))
def test_the_backend_matches_the_reference_step_after_step(seed):
    decoder = Decoder(seed)
    for step in range(60):
        joins = 3 if step == 0 else int(decoder.rng.random() < 0.15)
        finishes = int(step > 0 and decoder.rng.random() < 0.12)
        if len(decoder.rows) - finishes + joins == 0:
            joins = 1
        batch = decoder.step(joins, finishes)
        plan, q, kv_new = plan_step(decoder, batch)
        for layer in range(2):  # one plan serves every layer
            attend_one_layer(decoder, layer, plan, batch, q, kv_new[layer])


def test_decode_rows_of_very_different_lengths():
    decoder = Decoder(3)
    decoder.rows = [{"table": [], "len": n} for n in (1, 2, 90, 5)]
    for _ in range(3):
        batch = decoder.step(0, 0)
        plan, q, kv_new = plan_step(decoder, batch)
        attend_one_layer(decoder, 0, plan, batch, q, kv_new[0])
