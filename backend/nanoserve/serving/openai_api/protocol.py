"""The request bodies (pydantic: a wrong type or an unknown parameter is a 400 naming it) and their sampling
parameters, checked with nanoserve's own SamplingParams before anything is sent to Triton."""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from nanoserve.sampling_params import SamplingParams
from nanoserve.serving.openai_api.errors import bad_request, from_field_error


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: bool = False


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def template_dict(self) -> dict:
        """The message as chat templates read it: content as one string."""
        content = self.content if isinstance(self.content, str) or self.content is None else \
            "".join(part.text for part in self.content)
        message = {"role": self.role, "content": content or ""}
        return {**message, "name": self.name} if self.name is not None else message


class SamplingRequest(Strict):
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

    # the fields that are sampling parameters of the same name
    PASSED: ClassVar[tuple[str, ...]] = ("max_tokens", "temperature", "top_p", "seed", "stop", "n", "presence_penalty", "frequency_penalty",
              "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
              "skip_special_tokens", "include_stop_str_in_output")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_values(self) -> tuple[dict, dict[str, str]]:
        """(sampling parameters, sampling name -> this request's name where they differ)."""
        return {name: getattr(self, name) for name in self.PASSED if getattr(self, name) is not None}, {}

    def sampling_parameters(self) -> dict:
        """The sampling_parameters JSON object sent to Triton, validated as the engine will (400 naming the
        request's parameter otherwise)."""
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options: only with stream: true", "stream_options")
        values, names = self.sampling_values()
        try:
            SamplingParams.from_dict(values)
        except ValueError as e:
            raise from_field_error(str(e), names) from None
        return values

    @property
    def top_logprobs_count(self) -> int | None:
        """How many top logprobs per token the response carries; None: no logprobs."""
        return None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict | None = None  # extra variables for the chat template (vLLM's extension)

    def sampling_values(self) -> tuple[dict, dict[str, str]]:
        values, names = super().sampling_values()
        if self.max_completion_tokens is not None:
            values["max_tokens"] = self.max_completion_tokens
            names["max_tokens"] = "max_completion_tokens"
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs: only with logprobs: true", "top_logprobs")
        if self.logprobs:
            values["logprobs"] = self.top_logprobs or 0
            names["logprobs"] = "top_logprobs"
        return values, names

    @property
    def top_logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str]
    logprobs: int | None = None
    echo: bool = False

    def sampling_values(self) -> tuple[dict, dict[str, str]]:
        values, names = super().sampling_values()
        if self.logprobs is not None:
            values["logprobs"] = self.logprobs
        return values, names

    @property
    def top_logprobs_count(self) -> int | None:
        return self.logprobs

    def prompt_text(self) -> str:
        prompts = [self.prompt] if isinstance(self.prompt, str) else self.prompt
        if len(prompts) != 1:
            raise bad_request(f"prompt: one prompt per request, got {len(prompts)}", "prompt")
        if not prompts[0]:
            raise bad_request("prompt: empty", "prompt")
        return prompts[0]
