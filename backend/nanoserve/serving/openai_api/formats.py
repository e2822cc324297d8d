"""Triton Chunks -> OpenAI response bodies: one whole response, or the events of a stream. Each choice is a
sequence index of the Triton response (n of them), so n > 1 needs no change here."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from nanoserve.serving.openai_api.logprobs import chat_logprobs, completion_logprobs, top_prompt_logprobs
from nanoserve.serving.openai_api.protocol import ChatCompletionRequest, CompletionRequest, Prompt, SamplingRequest
from nanoserve.serving.openai_api.tools import Parser, ToolCall, constrained_calls
from nanoserve.serving.openai_api.triton import Chunk


@dataclass
class Choice:
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[dict] = field(default_factory=list)  # vllm_backend's entries, one per token
    num_output_tokens: int = 0


@dataclass
class ChunkDelta:
    """What one Chunk adds to one choice (its index among all the request's choices)."""
    index: int
    text: str
    finish_reason: str | None
    logprobs: list[dict] | None
    prompt_index: int = 0


@dataclass
class Result:
    """The choices so far: prompt p's sample s is choice p * n + s."""
    n: int = 1
    choices: dict[int, Choice] = field(default_factory=dict)
    prompt_tokens: dict[int, int] = field(default_factory=dict)  # by prompt
    prompt_logprobs: dict[int, list] = field(default_factory=dict)  # by prompt, once they came

    def add(self, chunk: Chunk) -> list[ChunkDelta]:
        prompt = chunk.prompt_index
        if chunk.num_input_tokens is not None:
            self.prompt_tokens[prompt] = chunk.num_input_tokens
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs[prompt] = chunk.prompt_logprobs
        deltas = []
        for sample, text in enumerate(chunk.texts):
            index = prompt * self.n + sample
            choice = self.choices.setdefault(index, Choice())
            delta = ChunkDelta(index, text, _at(chunk.finish_reasons, sample), _at(chunk.logprobs, sample), prompt)
            choice.text += text
            choice.finish_reason = delta.finish_reason or choice.finish_reason
            choice.logprobs += delta.logprobs or []
            choice.num_output_tokens += _at(chunk.num_output_tokens, sample) or 0
            deltas.append(delta)
        return deltas

    def usage(self) -> dict:
        completion = sum(choice.num_output_tokens for choice in self.choices.values())
        prompt = sum(self.prompt_tokens.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _at(values: list, index: int):
    return values[index] if index < len(values) else None


class Format:
    """One request's responses; subclasses give the endpoint's shapes."""
    id_prefix = ""
    object_name = ""
    chunk_object_name = ""

    def __init__(self, request: SamplingRequest, prompts: list[Prompt]):
        self.request = request
        self.prompts = prompts  # what is sent to the engine, one Triton request each
        self.id = f"{self.id_prefix}{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.result = Result(request.n or 1)

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
    """Chat's shapes. With tools, a choice's text may be tool calls: constrained ones (tool_choice "required" or a
    named function) never stream as content; with "auto" the content streams up to where a call may begin (the
    parser says), and the calls come, parsed, with the choice's last event (finish_reason "tool_calls")."""
    id_prefix = "chatcmpl-"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    request: ChatCompletionRequest

    def __init__(self, request: ChatCompletionRequest, prompts: list[Prompt], tool_choice: str | dict = "none",
                 parser: Parser | None = None):
        super().__init__(request, prompts)
        self.tool_choice = tool_choice
        self.parser = parser if tool_choice == "auto" else None
        self.sent: dict[int, int] = {}  # per choice: how much of its text went out as content (with tools)

    def _logprobs(self, entries: list[dict] | None) -> dict | None:
        top_n = self.request.top_logprobs_count
        return None if top_n is None or entries is None else {"content": chat_logprobs(entries, top_n)}

    def _tool_calls(self, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished choice."""
        choice = self.tool_choice
        if choice in ("none", None) or finish_reason != "stop":
            return text, []
        if self.parser is not None:
            return self.parser.parse(text)
        try:
            return None, constrained_calls(text, choice["function"]["name"] if isinstance(choice, dict) else None)
        except (ValueError, KeyError, TypeError):
            return text, []

    def full_choice(self, index: int, choice: Choice) -> dict:
        content, calls = self._tool_calls(choice.text, choice.finish_reason)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.message_dict() for call in calls]
        return {"index": index, "message": message, "logprobs": self._logprobs(choice.logprobs),
                "finish_reason": "tool_calls" if calls else choice.finish_reason}

    def start(self) -> list[dict]:
        """The assistant role comes first, for each choice, as OpenAI streams it."""
        choices = [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None} for index in range(self.request.n or 1)]
        return [self._stream_event(choices)]

    def delta_choice(self, delta: ChunkDelta) -> dict:
        event = {"index": delta.index, "delta": {"content": delta.text} if delta.text else {},
                 "logprobs": self._logprobs(delta.logprobs), "finish_reason": delta.finish_reason}
        if self.tool_choice in ("none", None):
            return event
        text, sent = self.result.choices[delta.index].text, self.sent.get(delta.index, 0)
        calls = []
        if delta.finish_reason is None:
            end = self.parser.content_end(text) if self.parser is not None else 0
        else:
            _, calls = self._tool_calls(text, delta.finish_reason)
            end = (self.parser.content_end(text) if self.parser is not None else 0) if calls else len(text)
        piece = text[sent:end] if end > sent else ""
        self.sent[delta.index] = max(sent, end)
        event["delta"] = {"content": piece} if piece else {}
        if calls:
            event["delta"]["tool_calls"] = [call.message_dict(i) for i, call in enumerate(calls)]
            event["finish_reason"] = "tool_calls"
        return event


class CompletionFormat(Format):
    """The legacy completions shapes. With echo, each choice's text starts with its prompt; with echo and logprobs,
    its logprobs start with the prompt's tokens (the first has no logprob, null), as vLLM gives them."""
    id_prefix = "cmpl-"
    object_name = "text_completion"
    chunk_object_name = "text_completion"
    request: CompletionRequest

    def __init__(self, request: CompletionRequest, prompts: list[Prompt], echoes: list[str], first_tokens: list[str]):
        """echoes: each prompt's text as echoed; first_tokens: the text of each prompt's first token (with echo and
        logprobs: the prompts are token ids then)."""
        super().__init__(request, prompts)
        self.echoes, self.first_tokens = echoes, first_tokens
        self.offsets: dict[int, int] = {}  # per choice: where the next token's text starts
        self.opened: set[int] = set()  # the choices whose first delta went out (with the echo)
        self.sent_prompt_logprobs: set[int] = set()

    def _opening(self, index: int, prompt: int) -> tuple[str, dict | None]:
        """What a choice starts with: the echoed prompt and its logprobs (None when not asked)."""
        if not self.request.echo:
            return "", None
        if not self.request.echoes_logprobs:
            return self.echoes[prompt], None
        entries = self.result.prompt_logprobs.get(prompt) or [None]
        first = {"tokens": [self.first_tokens[prompt]], "token_logprobs": [None], "top_logprobs": [None],
                 "text_offset": [0]}
        rest = completion_logprobs(entries[1:], len(self.first_tokens[prompt]), self.request.logprobs)
        self.offsets[index] = rest.pop("end")
        return self.echoes[prompt], {name: first[name] + rest[name] for name in first}

    def _logprobs(self, index: int, entries: list[dict] | None) -> dict | None:
        if self.request.top_logprobs_count is None or entries is None:
            return None
        logprobs = completion_logprobs(entries, self.offsets.get(index, 0), self.request.logprobs)
        self.offsets[index] = logprobs.pop("end")
        return logprobs

    def _choice(self, index: int, prompt: int, text: str, entries: list[dict] | None, finish_reason) -> dict:
        echoed, logprobs = ("", None) if index in self.opened else self._opening(index, prompt)
        self.opened.add(index)
        generated = self._logprobs(index, entries)
        if logprobs is None or generated is None:
            logprobs = logprobs or generated
        else:
            logprobs = {name: logprobs[name] + generated[name] for name in logprobs}
        choice = {"index": index, "text": echoed + text, "logprobs": logprobs, "finish_reason": finish_reason}
        return {**choice, **self._prompt_logprobs(index, prompt)}

    def _prompt_logprobs(self, index: int, prompt: int) -> dict:
        """vLLM's prompt_logprobs extension, on each choice (a stream: on its first event)."""
        if self.request.prompt_logprobs is None or index in self.sent_prompt_logprobs:
            return {}
        self.sent_prompt_logprobs.add(index)
        return {"prompt_logprobs": top_prompt_logprobs(self.result.prompt_logprobs.get(prompt),
                                                       self.request.prompt_logprobs)}

    def full_choice(self, index: int, choice: Choice) -> dict:
        return self._choice(index, index // self.result.n, choice.text, choice.logprobs, choice.finish_reason)

    def events(self, chunk: Chunk) -> list[dict]:
        """A stream's choice opens with its first delta, which may carry nothing else."""
        choices = [self.delta_choice(delta) for delta in self.result.add(chunk)
                   if delta.text or delta.finish_reason or delta.logprobs or self._opens(delta.index)]
        return [self._stream_event(choices)] if choices else []

    def _opens(self, index: int) -> bool:
        """The choice's first delta carries the echo or the prompt logprobs."""
        return (self.request.echo or self.request.prompt_logprobs is not None) and index not in self.opened

    def delta_choice(self, delta: ChunkDelta) -> dict:
        return self._choice(delta.index, delta.prompt_index, delta.text, delta.logprobs, delta.finish_reason)
