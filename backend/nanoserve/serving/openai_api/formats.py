"""Triton Chunks -> OpenAI response bodies: one whole response, or the events of a stream. Each choice is a
sequence index of the Triton response (n of them), so n > 1 needs no change here."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from nanoserve.serving.openai_api.logprobs import chat_logprobs, completion_logprobs
from nanoserve.serving.openai_api.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from nanoserve.serving.openai_api.triton import Chunk


@dataclass
class Choice:
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[dict] = field(default_factory=list)  # vllm_backend's entries, one per token
    num_output_tokens: int = 0


@dataclass
class ChunkDelta:
    """What one Chunk adds to one choice."""
    index: int
    text: str
    finish_reason: str | None
    logprobs: list[dict] | None


@dataclass
class Result:
    choices: dict[int, Choice] = field(default_factory=dict)
    prompt_tokens: int = 0

    def add(self, chunk: Chunk) -> list[ChunkDelta]:
        if chunk.num_input_tokens is not None:
            self.prompt_tokens = chunk.num_input_tokens
        deltas = []
        for index, text in enumerate(chunk.texts):
            choice = self.choices.setdefault(index, Choice())
            delta = ChunkDelta(index, text, _at(chunk.finish_reasons, index), _at(chunk.logprobs, index))
            choice.text += text
            choice.finish_reason = delta.finish_reason or choice.finish_reason
            choice.logprobs += delta.logprobs or []
            choice.num_output_tokens += _at(chunk.num_output_tokens, index) or 0
            deltas.append(delta)
        return deltas

    def usage(self) -> dict:
        completion = sum(choice.num_output_tokens for choice in self.choices.values())
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}


def _at(values: list, index: int):
    return values[index] if index < len(values) else None


class Format:
    """One request's responses; subclasses give the endpoint's shapes."""
    id_prefix = ""
    object_name = ""
    chunk_object_name = ""

    def __init__(self, request: SamplingRequest, prompt: str):
        self.request = request
        self.prompt = prompt
        self.id = f"{self.id_prefix}{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.result = Result()

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.request.model,
                "choices": choices}

    def full(self, chunks: list[Chunk]) -> dict:
        for chunk in chunks:
            self.result.add(chunk)
        choices = [self.full_choice(index, choice) for index, choice in sorted(self.result.choices.items())]
        return {**self._envelope(self.object_name, choices), "usage": self.result.usage()}

    def events(self, chunk: Chunk) -> list[dict]:
        choices = [self.delta_choice(delta) for delta in self.result.add(chunk)
                   if delta.text or delta.finish_reason or delta.logprobs]
        return [self._stream_event(choices)] if choices else []

    def _stream_event(self, choices: list[dict]) -> dict:
        event = self._envelope(self.chunk_object_name, choices)
        return {**event, "usage": None} if self.request.include_usage else event

    def start(self) -> list[dict]:
        return []

    def end(self) -> list[dict]:
        """After the last chunk: the usage event, when stream_options.include_usage asks for it."""
        if not self.request.include_usage:
            return []
        return [{**self._envelope(self.chunk_object_name, []), "usage": self.result.usage()}]

    def full_choice(self, index: int, choice: Choice) -> dict:
        raise NotImplementedError

    def delta_choice(self, delta: ChunkDelta) -> dict:
        raise NotImplementedError


class ChatFormat(Format):
    id_prefix = "chatcmpl-"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    request: ChatCompletionRequest

    def _logprobs(self, entries: list[dict] | None) -> dict | None:
        top_n = self.request.top_logprobs_count
        return None if top_n is None or entries is None else {"content": chat_logprobs(entries, top_n)}

    def full_choice(self, index: int, choice: Choice) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": choice.text},
                "logprobs": self._logprobs(choice.logprobs), "finish_reason": choice.finish_reason}

    def start(self) -> list[dict]:
        """The assistant role comes first, as OpenAI streams it."""
        choices = [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None}]
        return [self._stream_event(choices)]

    def delta_choice(self, delta: ChunkDelta) -> dict:
        return {"index": delta.index, "delta": {"content": delta.text} if delta.text else {},
                "logprobs": self._logprobs(delta.logprobs), "finish_reason": delta.finish_reason}


class CompletionFormat(Format):
    id_prefix = "cmpl-"
    object_name = "text_completion"
    chunk_object_name = "text_completion"
    request: CompletionRequest

    def __init__(self, request: CompletionRequest, prompt: str):
        super().__init__(request, prompt)
        self.echoed = prompt if request.echo else ""
        self.offsets: dict[int, int] = {}  # per choice: where the next token's text starts

    def _logprobs(self, index: int, entries: list[dict] | None) -> dict | None:
        if self.request.top_logprobs_count is None or entries is None:
            return None
        logprobs = completion_logprobs(entries, self.offsets.get(index, len(self.echoed)))
        self.offsets[index] = self.offsets.get(index, len(self.echoed)) + sum(map(len, logprobs["tokens"]))
        return logprobs

    def full_choice(self, index: int, choice: Choice) -> dict:
        return {"index": index, "text": self.echoed + choice.text, "logprobs": self._logprobs(index, choice.logprobs),
                "finish_reason": choice.finish_reason}

    def start(self) -> list[dict]:
        if not self.echoed:
            return []
        return [self._stream_event([{"index": 0, "text": self.echoed, "logprobs": None, "finish_reason": None}])]

    def delta_choice(self, delta: ChunkDelta) -> dict:
        return {"index": delta.index, "text": delta.text, "logprobs": self._logprobs(delta.index, delta.logprobs),
                "finish_reason": delta.finish_reason}
