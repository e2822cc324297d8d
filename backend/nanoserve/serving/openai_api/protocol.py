"""The request bodies (pydantic: a wrong type or an unknown parameter is a 400 naming it) and their sampling
parameters, checked with nanoserve's own SamplingParams before anything is sent to Triton."""
from __future__ import annotations

import json
import logging
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from nanoserve.sampling_params import SamplingParams
from nanoserve.serving.openai_api.errors import api_error, bad_request
from nanoserve.serving.openai_api.tools import function_schema, required_schema


logger = logging.getLogger("nanoserve.openai")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RequestBody(BaseModel):
    """A request's body: a parameter OpenAI's API defines that nanoserve does not implement (UNSUPPORTED) is a 400
    naming it; one OpenAI does not define is ignored with a warning in the log, as vLLM does (clients send vendor
    extras)."""
    model_config = ConfigDict(extra="allow")
    UNSUPPORTED: ClassVar[frozenset[str]] = frozenset()

    def check(self) -> None:
        """The checks pydantic does not make: the unknown parameters, then the text's encoding."""
        extras = sorted(self.model_extra or {})
        for name in extras:
            if name in self.UNSUPPORTED:
                raise bad_request(name, "not supported by nanoserve")
        if extras:
            logger.warning("nanoserve: the request's fields %s are not OpenAI API parameters: ignored",
                           ", ".join(extras))
        self.check_utf8()

    def check_utf8(self) -> None:
        """JSON's "\\ud800" escapes make strings UTF-8 cannot carry: a 400 naming the first such field."""
        where = lone_surrogate(self.model_dump(by_alias=True, exclude_none=True))
        if where is not None:
            raise bad_request(where, "a lone surrogate (an unpaired \\ud800-\\udfff escape) is not text")


class StreamOptions(Strict):
    include_usage: bool = False


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: str  # JSON text


class MessageToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a "tool" message: the call it answers

    def template_dict(self) -> dict:
        """The message as chat templates read it: content as one string; a call's arguments as the object they
        encode (templates write them with tojson; one that is not JSON stays text), as vLLM passes them."""
        content = self.content if isinstance(self.content, str) or self.content is None else \
            "".join(part.text for part in self.content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": _json_or_text(call.function.arguments)}}
                for call in self.tool_calls]
        return message


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionDefinition(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema
    strict: bool | None = None  # the arguments always follow the schema with required or a named function


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class JSONSchema(Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None  # the output always follows the schema


class ResponseFormat(Strict):
    """OpenAI's response_format: plain text, any JSON object, or JSON that follows a schema."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchema | None = None

    def structured_outputs(self) -> dict | None:
        """The equivalent structured_outputs sampling parameter (None: no constraint)."""
        if self.type == "json_schema":
            if self.json_schema is None:
                raise bad_request("response_format", "json_schema is required with type json_schema")
            return {"json": self.json_schema.schema_}
        return {"json_object": True} if self.type == "json_object" else None


class SamplingRequest(RequestBody):
    """What /v1/completions and /v1/chat/completions share. The vLLM extensions (top_k, min_p, ...) are
    nanoserve sampling parameters of the same names."""
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None  # accepted and not used
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    structured_outputs: dict | None = None  # vLLM's StructuredOutputsParams
    response_format: ResponseFormat | None = None
    logit_bias: dict[str, float] | None = None  # {token id: bias}

    # the fields that are sampling parameters of the same name
    PASSED: ClassVar[tuple[str, ...]] = (
        "max_tokens", "temperature", "top_p", "seed", "stop", "n", "presence_penalty", "frequency_penalty",
        "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
        "skip_special_tokens", "include_stop_str_in_output", "structured_outputs", "logit_bias")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_values(self) -> tuple[dict, dict[str, str]]:
        """(sampling parameters, sampling name -> this request's name where they differ)."""
        values = {name: getattr(self, name) for name in self.PASSED if getattr(self, name) is not None}
        structured = None if self.response_format is None else self.response_format.structured_outputs()
        if structured is None:
            return values, {}
        if self.structured_outputs is not None:
            raise bad_request("response_format", "give either response_format or structured_outputs, not both")
        return {**values, "structured_outputs": structured}, {"structured_outputs": "response_format"}

    def sampling_parameters(self) -> dict:
        """The sampling_parameters JSON object sent to Triton, validated as the engine will (400 naming the
        request's parameter otherwise)."""
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options", "only with stream: true")
        values, names = self.sampling_values()
        try:
            SamplingParams.from_dict(values)
        except ValueError as e:
            raise api_error(e, names) from None
        return values

    @property
    def top_logprobs_count(self) -> int | None:
        """How many top logprobs per token the response carries; None: no logprobs."""
        return None


class ChatCompletionRequest(SamplingRequest):
    UNSUPPORTED: ClassVar[frozenset[str]] = frozenset({
        "functions", "function_call", "audio", "modalities", "prediction", "web_search_options",
        "reasoning_effort"})
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True  # with "required": more than one call may come
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict | None = None  # extra variables for the chat template (vLLM's extension)

    @property
    def functions(self) -> list[dict]:
        return [tool.function.model_dump(exclude_none=True) for tool in self.tools or []]

    @property
    def tool_choice_value(self) -> str | dict:
        """"none", "auto", "required" or {"type": "function", "function": {"name"}}; OpenAI's default: "auto"
        with tools, else "none"."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice if isinstance(self.tool_choice, str) else self.tool_choice.model_dump()

    def tool_schema(self) -> dict | None:
        """The JSON schema that constrains the output for tool_choice "required" or a named function."""
        choice = self.tool_choice_value
        if isinstance(choice, dict):
            function = next((f for f in self.functions if f["name"] == choice["function"]["name"]), None)
            return None if function is None else function_schema(function)
        return required_schema(self.functions, self.parallel_tool_calls) if choice == "required" else None

    def sampling_values(self) -> tuple[dict, dict[str, str]]:
        values, names = super().sampling_values()
        schema = self.tool_schema()
        if schema is not None:
            if "structured_outputs" in values:
                raise bad_request("tool_choice", f"{self.tool_choice_value!r} constrains the output itself: not "
                                                 f"with {names.get('structured_outputs', 'structured_outputs')}")
            values["structured_outputs"], names["structured_outputs"] = {"json": schema}, "tools"
        if self.max_completion_tokens is not None:
            values["max_tokens"] = self.max_completion_tokens
            names["max_tokens"] = "max_completion_tokens"
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs", "only with logprobs: true")
        if self.logprobs:
            values["logprobs"] = self.top_logprobs or 0
            names["logprobs"] = "top_logprobs"
        return values, names

    @property
    def top_logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


Prompt = str | list[int]  # text, or token ids


class CompletionRequest(SamplingRequest):
    prompt: str | list  # a string, a list of strings, a list of token ids, or a list of lists of token ids
    logprobs: int | None = None
    echo: bool = False
    prompt_logprobs: int | None = None  # vLLM's extension: the prompt's logprobs in vllm_backend's format

    UNSUPPORTED: ClassVar[frozenset[str]] = frozenset({"best_of", "suffix"})

    def sampling_values(self) -> tuple[dict, dict[str, str]]:
        values, names = super().sampling_values()
        if self.logprobs is not None:
            values["logprobs"] = self.logprobs
        if self.prompt_logprobs is not None:
            values["prompt_logprobs"] = self.prompt_logprobs
        if self.echoes_logprobs:  # the prompt's logprobs make the echoed tokens' ones
            values["prompt_logprobs"] = max(self.logprobs, self.prompt_logprobs or 0)
            names.setdefault("prompt_logprobs", "logprobs" if self.prompt_logprobs is None else "prompt_logprobs")
        return values, names

    @property
    def echoes_logprobs(self) -> bool:
        return self.echo and self.logprobs is not None

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.echoes_logprobs or self.prompt_logprobs is not None

    @property
    def top_logprobs_count(self) -> int | None:
        return self.logprobs

    def prompts(self, vocab_size: int) -> list[Prompt]:
        """The request's prompts, each text or token ids in [0, vocab_size); a 400 naming the bad one."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and all(_is_token_id(t) for t in prompt)):
            prompts = [prompt]
        elif prompt and all(isinstance(p, str) or (isinstance(p, list) and all(map(_is_token_id, p))) for p in prompt):
            prompts = prompt
        else:
            raise bad_request("prompt", "expected a string, a list of strings, a list of token ids or a list of "
                                        "lists of token ids")
        for index, one in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 and one is prompt else f"prompt.{index}"
            if not one:
                raise bad_request(where, "empty", "prompt")
            outside = [(position, t) for position, t in enumerate(one) if not isinstance(t, str) and t >= vocab_size]
            if outside:
                position, token_id = outside[0]
                raise bad_request(f"{where}.{position}", f"token id {token_id} is outside the vocabulary "
                                                             f"[0, {vocab_size})", "prompt")
        return prompts


def _is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def lone_surrogate(value) -> str | None:
    """The path ("messages.0.content") of the first string in value that has a lone surrogate (for a dict's key, the
    dict's path), else None. A loop, not recursion: a body nested close to the JSON parser's limit must not
    overflow the stack here."""
    pending = [("", value)]
    while pending:
        path, item = pending.pop()
        if isinstance(item, str):
            try:
                item.encode()
            except UnicodeEncodeError:
                return path
        elif isinstance(item, dict):
            children = [(path, key) for key in item] + [(_join(path, key), child) for key, child in item.items()]
            pending += reversed(children)
        elif isinstance(item, list):
            pending += reversed([(_join(path, index), child) for index, child in enumerate(item)])
    return None


def _join(path: str, key) -> str:
    return f"{path}.{key}" if path else str(key)
