"""Per-request sampling parameters, validated on construction (errors name the field).

Every numeric field has a documented range (docs/serving.md): what the constructor checks needs nothing but the
value; what depends on the model (max_model_len, the vocabulary, the engine's max_logprobs) is checked when the
engine admits the request (`check_against_model`). Whatever passes both is safe for the sampler and the engine.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace

from nanoserve.coercion import from_text
from nanoserve.errors import FIELD, RequestError

MAX_TEMPERATURE = 100.0
REPETITION_PENALTY_RANGE = (0.01, 100.0)
MAX_TOP_K = 2 ** 63 - 1  # a 64-bit int; the sampler treats any value at or above the vocabulary as "off"
MAX_SEED = 2 ** 64 - 1
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024  # tokens a request may bias (OpenAI's API takes up to 300)
MAX_N = 128  # sequences per request (vLLM's bound, VLLM_MAX_N_SEQUENCES, is far larger; each is a batch row)
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """vLLM's StructuredOutputsParams: the output follows exactly one of a JSON schema (`json`: an object or its
    JSON text), a regular expression, a `choice` of strings, a `grammar` (EBNF/GBNF with `root ::= ...`, or Lark
    with `start: ...`), or any JSON object (`json_object`). JSON whitespace is bounded unless
    disable_any_whitespace is false (vLLM's default is unbounded: a sample could then fill max_tokens with blanks).
    Only the shape is checked here; whether the schema, regex or grammar compiles is checked by the engine."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True

    def __post_init__(self):
        given = [kind for kind in STRUCTURED_OUTPUT_KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise RequestError("structured_outputs", f"give exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}, "
                                                     f"got {', '.join(given) or 'none'}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise RequestError("structured_outputs", f"{name} must be a non-empty string, got {value!r}")
        if self.choice is not None and not (isinstance(self.choice, list) and self.choice
                                            and all(isinstance(c, str) for c in self.choice)):
            raise RequestError("structured_outputs", f"choice must be a non-empty list of strings, got "
                                                     f"{self.choice!r}")
        try:  # the helpers name the key: "structured_outputs: json: ..."
            if self.json is not None:
                self.json = _json_object("json", self.json, "a JSON schema object")
            if self.json_object is not None:
                _check_bool("json_object", self.json_object)
            _check_bool("disable_any_whitespace", self.disable_any_whitespace)
        except RequestError as e:
            raise e.within("structured_outputs") from None

    @property
    def kind(self) -> str:
        return next(kind for kind in STRUCTURED_OUTPUT_KINDS if getattr(self, kind) not in (None, False))

    @classmethod
    def from_value(cls, value) -> "StructuredOutputsParams | None":
        """From what a request carries: a JSON object (None values count as absent, as vLLM's clients send
        them), its JSON text, or an instance."""
        if value is None or isinstance(value, cls):
            return value
        value = _json_object("structured_outputs", value)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise RequestError("structured_outputs", f"unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
        return cls(**{name: v for name, v in value.items() if v is not None})


@dataclass
class SamplingParams:
    # max_tokens=None generates until a stop condition or max_model_len: no silent truncation at 16.
    max_tokens: int | None = None
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token
    prompt_logprobs: int | None = None  # number of top logprobs per prompt token
    skip_special_tokens: bool = True
    n: int = 1  # sequences sampled from the prompt; sequence i gets seed (seed + i) mod 2**64
    structured_outputs: StructuredOutputsParams | None = None  # or its JSON object / JSON text
    lora_name: str | None = None  # the LoRA adapter to run with (LLMEngine.add_lora, multi_lora.json); None: the base
    # added to the token's logit before sampling (OpenAI's logit_bias: JSON object keys are strings)
    logit_bias: dict[int, float] | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _as_list("stop", self.stop)
        self.stop_token_ids = _as_list("stop_token_ids", self.stop_token_ids)
        self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
        self.logit_bias = _logit_bias(self.logit_bias)
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def for_sample(self, index: int) -> "SamplingParams":
        """The parameters of sample `index` of the request: itself when n is 1; else one sequence, seed + index
        (vLLM's rule, modulo 2**64), and prompt logprobs on the first only (the prompt is the same for all)."""
        if self.n == 1:
            return self
        seed = None if self.seed is None else (self.seed + index) % (MAX_SEED + 1)
        return replace(self, n=1, seed=seed, prompt_logprobs=self.prompt_logprobs if index == 0 else None)

    def _validate(self):
        _check_int("max_tokens", self.max_tokens, minimum=0, optional=True)  # 0: score the prompt only
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise RequestError("min_tokens", f"{self.min_tokens} is greater than max_tokens ({self.max_tokens})")
        _check_number("temperature", self.temperature, lo=0.0, hi=MAX_TEMPERATURE)
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, minimum=-1, maximum=MAX_TOP_K)
        _check_number("min_p", self.min_p, lo=0.0, hi=1.0)
        _check_int("seed", self.seed, minimum=0, maximum=MAX_SEED, optional=True)
        _check_number("repetition_penalty", self.repetition_penalty, *REPETITION_PENALTY_RANGE)
        _check_number("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_number("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _check_bool("ignore_eos", self.ignore_eos)
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        _check_bool("skip_special_tokens", self.skip_special_tokens)
        _check_stop(self.stop)
        _check_size("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS)
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, minimum=0)
        _check_int("logprobs", self.logprobs, minimum=0, optional=True)
        _check_int("prompt_logprobs", self.prompt_logprobs, minimum=0, optional=True)
        _check_int("n", self.n, minimum=1, maximum=MAX_N)
        if self.lora_name is not None and (not isinstance(self.lora_name, str) or not self.lora_name):
            raise RequestError("lora_name", f"expected an adapter's name (a non-empty string), got {self.lora_name!r}")

    def check_against_model(self, max_model_len: int, vocab_size: int, max_logprobs: int) -> None:
        """The ranges that depend on the model; the engine calls this when it admits the request (the prompt
        plus max_tokens is checked there too)."""
        if self.min_tokens > max_model_len:
            raise RequestError("min_tokens", f"must be <= max_model_len ({max_model_len}), got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > max_logprobs:
                raise RequestError(name, f"at most max_logprobs ({max_logprobs}), got {value}")
        outside = [token_id for token_id in self.stop_token_ids if token_id >= vocab_size]
        if outside:
            raise RequestError("stop_token_ids", f"{outside[0]} is outside the vocabulary [0, {vocab_size})")
        outside = [token_id for token_id in self.logit_bias or () if token_id >= vocab_size]
        if outside:
            raise RequestError("logit_bias", f"token id {outside[0]} is outside the vocabulary [0, {vocab_size})")

    def max_tokens_for(self, num_prompt_tokens: int, max_model_len: int) -> int:
        """The most tokens a request with this prompt length may generate: max_tokens, or by default whatever
        max_model_len leaves (at least 1)."""
        return max(max_model_len - num_prompt_tokens, 1) if self.max_tokens is None else self.max_tokens

    @classmethod
    def from_dict(cls, params: dict) -> "SamplingParams":
        """Build from JSON-like values; strings such as "32", "0.5", "true" or '["a"]' are accepted
        (genai-perf and Triton request parameters send every value as a string)."""
        if not isinstance(params, dict):
            raise RequestError("sampling_parameters", f"expected a JSON object, got {type(params).__name__}")
        kinds = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(params) - set(kinds))
        if unknown:
            known = f"unknown sampling parameter (known: {', '.join(sorted(kinds))})"
            if FIELD.fullmatch(unknown[0]):
                raise RequestError(unknown[0], known)
            raise RequestError("sampling_parameters", f"{unknown[0]!r}: {known}")  # a key that is no field's name
        return cls(**{name: from_text(name, kinds[name], value) for name, value in params.items()})


def _json_object(name: str, value, what: str = "a JSON object") -> dict:
    """A JSON object given as a dict or as its JSON text -> the dict; ValueError naming `name` otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise RequestError(name, f"invalid JSON ({e})") from None
        except RecursionError:
            raise RequestError(name, "invalid JSON (nested too deeply)") from None
    if not isinstance(value, dict):
        raise RequestError(name, f"expected {what}, got {type(value).__name__}")
    return value


def _logit_bias(value) -> dict[int, float] | None:
    """{token id: bias in [-100, 100]} from a dict (its keys may be the ids' text, as JSON has them) or its JSON."""
    if value is None:
        return None
    value = _json_object("logit_bias", value)
    if len(value) > MAX_LOGIT_BIAS:
        raise RequestError("logit_bias", f"at most {MAX_LOGIT_BIAS} tokens, got {len(value)}")
    bias = {}
    for key, number in value.items():
        try:
            token_id = int(key)
        except (TypeError, ValueError):
            raise RequestError("logit_bias", f"keys are token ids, got {key!r}") from None
        _check_int("logit_bias", token_id, minimum=0)
        _check_number("logit_bias", number, lo=-100.0, hi=100.0)
        bias[token_id] = float(number)
    return bias


def _as_list(name, value) -> list:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise RequestError(name, f"expected a list, got {value!r}")
    return list(value)


def _check_int(name, value, minimum, maximum=None, optional=False):
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(name, f"expected an integer, got {value!r}")
    if value < minimum or maximum is not None and value > maximum:
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise RequestError(name, f"must be {bounds}, got {value}")


def _check_size(name, values: list, limit: int) -> None:
    if len(values) > limit:
        raise RequestError(name, f"at most {limit} entries, got {len(values)}")


def _check_stop(stop: list) -> None:
    _check_size("stop", stop, MAX_STOP_STRINGS)
    if not all(isinstance(s, str) and s for s in stop):
        raise RequestError("stop", "must be a string or a list of non-empty strings")
    longest = max(stop, key=len, default="")
    if len(longest) > MAX_STOP_STRING_CHARS:
        raise RequestError("stop", f"a stop string has at most {MAX_STOP_STRING_CHARS} characters, got {len(longest)}")


def _check_number(name, value, lo=None, hi=None):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise RequestError(name, f"expected a number, got {value!r}")
    if not _is_finite(value):
        raise RequestError(name, f"must be finite, got {value!r}")
    if lo is not None and value < lo:
        raise RequestError(name, f"must be >= {lo}" + (f" and <= {hi}" if hi is not None else "") + f", got {value}")
    if hi is not None and value > hi:
        raise RequestError(name, f"must be <= {hi}" + (f" and >= {lo}" if lo is not None else "") + f", got {value}")


def _is_finite(value) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _check_bool(name, value):
    if not isinstance(value, bool):
        raise RequestError(name, f"expected a boolean, got {value!r}")
