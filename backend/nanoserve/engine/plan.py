"""The scheduler's output for one engine step: everything the model runner needs, nothing global."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nanoserve.engine.sequence import Sequence


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start_pos: int  # first position computed this step (== seq.num_computed_tokens at schedule time)
    num_new_tokens: int  # tokens computed this step: a prefill chunk, or 1 for decode

    @property
    def end_pos(self) -> int:
        return self.start_pos + self.num_new_tokens

    @property
    def samples(self) -> bool:
        """True when this step reaches the sequence's last token, so a new token is sampled."""
        return self.end_pos == self.seq.num_tokens

    @property
    def is_prefill(self) -> bool:
        return self.start_pos < self.seq.num_prompt_tokens or self.num_new_tokens > 1


@dataclass
class DecodeBatch:
    """A decode-only step as arrays, the hot path's form of a plan: row i computes position positions[i]
    (its last token, input_ids[i]) of seqs[i] and samples the next token. Built by the scheduler from its
    persistent block-table rows, so it costs no per-sequence objects; the arrays belong to the plan."""
    seqs: list[Sequence]
    positions: np.ndarray  # [B] int64: num_computed_tokens == num_tokens - 1 at schedule time
    input_ids: np.ndarray  # [B] int64
    block_tables: np.ndarray  # [B, max_blocks] int32, padded with 0

    def __len__(self) -> int:
        return len(self.seqs)


class StepPlan:
    """`scheduled` lists the work in runner row order. A decode-only plan from the scheduler's fast path
    carries `decode` instead and builds `scheduled` from it only when asked (tests, slow paths); such a plan
    is read-only."""

    def __init__(self, scheduled: list[ScheduledSeq] | None = None, preempted: list[Sequence] | None = None,
                 decode: DecodeBatch | None = None):
        assert decode is None or not scheduled, "a plan is either a decode batch or a list of ScheduledSeq"
        self._scheduled = scheduled if scheduled is not None or decode is not None else []
        self.preempted: list[Sequence] = preempted if preempted is not None else []  # moved back to waiting
        self.decode = decode

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        if self._scheduled is None:
            decode = self.decode
            self._scheduled = [ScheduledSeq(seq, pos, 1) for seq, pos in zip(decode.seqs, decode.positions.tolist())]
        return self._scheduled

    @property
    def num_seqs(self) -> int:
        return len(self.decode) if self.decode is not None else len(self._scheduled)

    @property
    def num_batched_tokens(self) -> int:
        if self.decode is not None:
            return len(self.decode)
        return sum(s.num_new_tokens for s in self._scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        if self.decode is not None:
            return 0
        return sum(s.num_new_tokens for s in self._scheduled if s.is_prefill)

    @property
    def is_decode_only(self) -> bool:
        if self.decode is not None:
            return True
        return all(s.num_new_tokens == 1 and not s.is_prefill for s in self._scheduled)

    @property
    def sampling_seqs(self) -> list[Sequence]:
        """The sequences that sample a token this step, in row order (every row of a decode batch)."""
        if self.decode is not None:
            return self.decode.seqs
        return [s.seq for s in self._scheduled if s.samples]

    def __bool__(self) -> bool:
        return self.num_seqs > 0

    def __repr__(self) -> str:
        kind = "decode" if self.decode is not None else "scheduled"
        return f"StepPlan({kind}: {self.num_seqs} seqs, {self.num_batched_tokens} tokens, " \
               f"preempted={[s.request_id for s in self.preempted]})"
