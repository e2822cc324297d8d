"""The scheduler's output for one engine step: everything the model runner needs, nothing global."""
from __future__ import annotations

from dataclasses import dataclass, field

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
class StepPlan:
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # runner row order
    preempted: list[Sequence] = field(default_factory=list)  # moved back to waiting this step

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_decode_only(self) -> bool:
        return all(s.num_new_tokens == 1 and not s.is_prefill for s in self.scheduled)

    @property
    def sampling_seqs(self) -> list[Sequence]:
        return [s.seq for s in self.scheduled if s.samples]

    def __bool__(self) -> bool:
        return bool(self.scheduled)
