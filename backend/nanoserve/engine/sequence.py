"""One request inside the engine: its tokens, KV blocks and progress."""
from __future__ import annotations

import time
from enum import Enum, auto

from nanoserve.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    __slots__ = ("request_id", "token_ids", "num_prompt_tokens", "sampling_params", "max_tokens", "status",
                 "block_table", "num_computed_tokens", "num_cached_tokens", "finish_reason", "arrival_time",
                 "logprobs", "logprob_ranks", "cumulative_logprob")  # slots: every step reads and writes these for every sequence

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 max_tokens: int, arrival_time: float | None = None):
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt + generated
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens  # resolved: never None inside the engine
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # of those, taken from the prefix cache at the last admission
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.logprobs: list[dict[int, float]] = []  # per generated token: {token_id: logprob}
        self.logprob_ranks: list[int] = []  # per generated token: its rank in the vocabulary (with logprobs)
        self.cumulative_logprob = 0.0

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")
