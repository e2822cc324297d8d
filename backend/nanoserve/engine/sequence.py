"""One request inside the engine: its tokens, KV blocks and progress."""
from __future__ import annotations

from enum import Enum, auto
from typing import TYPE_CHECKING

from nanoserve.engine.lora import LoRAAdapter
from nanoserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanoserve.engine.structured_output import Grammar


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    __slots__ = ("request_id", "token_ids", "num_prompt_tokens", "sampling_params", "max_tokens", "status",
                 "block_table", "num_cached_tokens", "finish_reason", "grammar", "lora")

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 max_tokens: int, grammar: Grammar | None = None, lora: LoRAAdapter | None = None):
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt + generated
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens  # resolved: never None inside the engine
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []  # KV blocks; how many tokens they hold is the scheduler's business
        self.num_cached_tokens = 0  # tokens taken from the prefix cache at the last admission
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.grammar = grammar  # structured outputs: the matcher of the request's grammar
        self.lora = lora  # the adapter sampling_params.lora_name names (None: the base model)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def max_num_tokens(self) -> int:
        """The length limit: the sequence finishes with "length" when it holds this many tokens."""
        return self.num_prompt_tokens + self.max_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return f"Sequence({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, " \
               f"blocks={self.block_table})"
