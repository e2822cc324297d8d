"""Per-request sampling parameters, validated on construction (errors name the field).

Every numeric field has a documented range (docs/serving.md): what the constructor checks needs nothing but the
value; what depends on the model (max_model_len, the vocabulary, the engine's max_logprobs) is checked when the
engine admits the request (`check_against_model`). Whatever passes both is safe for the sampler and the engine.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields

MAX_TEMPERATURE = 100.0
REPETITION_PENALTY_RANGE = (0.01, 100.0)
MAX_TOP_K = 2 ** 63 - 1  # a 64-bit int; the sampler treats any value at or above the vocabulary as "off"
MAX_SEED = 2 ** 64 - 1
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256


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
    skip_special_tokens: bool = True
    n: int = 1

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _as_list("stop", self.stop)
        self.stop_token_ids = _as_list("stop_token_ids", self.stop_token_ids)
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def _validate(self):
        _check_int("max_tokens", self.max_tokens, minimum=1, optional=True)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens: {self.min_tokens} is greater than max_tokens ({self.max_tokens})")
        _check_number("temperature", self.temperature, lo=0.0, hi=MAX_TEMPERATURE)
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
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
        if self.n != 1:
            raise ValueError(f"n: only n=1 is supported, got {self.n!r}")

    def check_against_model(self, max_model_len: int, vocab_size: int, max_logprobs: int) -> None:
        """The ranges that depend on the model; the engine calls this when it admits the request (the prompt
        plus max_tokens is checked there too)."""
        if self.min_tokens > max_model_len:
            raise ValueError(f"min_tokens: must be <= max_model_len ({max_model_len}), got {self.min_tokens}")
        if self.logprobs is not None and self.logprobs > max_logprobs:
            raise ValueError(f"logprobs: at most max_logprobs ({max_logprobs}), got {self.logprobs}")
        outside = [token_id for token_id in self.stop_token_ids if token_id >= vocab_size]
        if outside:
            raise ValueError(f"stop_token_ids: {outside[0]} is outside the vocabulary [0, {vocab_size})")

    @classmethod
    def from_dict(cls, params: dict) -> "SamplingParams":
        """Build from JSON-like values; strings such as "32", "0.5", "true" or '["a"]' are accepted
        (genai-perf and Triton request parameters send every value as a string)."""
        if not isinstance(params, dict):
            raise ValueError(f"sampling_parameters: expected a JSON object, got {type(params).__name__}")
        kinds = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(params) - set(kinds))
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown sampling parameter (known: {', '.join(sorted(kinds))})")
        return cls(**{name: _parse(name, kinds[name], value) for name, value in params.items()})

    @classmethod
    def from_json(cls, text: str) -> "SamplingParams":
        try:
            params = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"sampling_parameters: invalid JSON ({e.msg} at char {e.pos})") from None
        return cls.from_dict(params)


def _parse(name: str, kind: str, value):
    if not isinstance(value, str) or kind == "list[str]":
        return value
    text = value.strip()
    try:
        if kind.startswith("bool"):
            lowered = text.lower()
            if lowered in ("true", "false"):
                return lowered == "true"
            raise ValueError
        if kind.startswith("int"):
            return int(text) if text.lower() not in ("null", "none") else None
        if kind.startswith("float"):
            return float(text)
        if kind.startswith("list"):
            return json.loads(text)
    except ValueError:
        raise ValueError(f"{name}: cannot parse {value!r} as {kind.split(' ')[0]}") from None
    return value


def _as_list(name, value) -> list:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name}: expected a list, got {value!r}")
    return list(value)


def _check_int(name, value, minimum, maximum=None, optional=False):
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: expected an integer, got {value!r}")
    if value < minimum or maximum is not None and value > maximum:
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name}: must be {bounds}, got {value}")


def _check_size(name, values: list, limit: int) -> None:
    if len(values) > limit:
        raise ValueError(f"{name}: at most {limit} entries, got {len(values)}")


def _check_stop(stop: list) -> None:
    _check_size("stop", stop, MAX_STOP_STRINGS)
    if not all(isinstance(s, str) and s for s in stop):
        raise ValueError("stop: must be a string or a list of non-empty strings")
    longest = max(stop, key=len, default="")
    if len(longest) > MAX_STOP_STRING_CHARS:
        raise ValueError(f"stop: a stop string has at most {MAX_STOP_STRING_CHARS} characters, got {len(longest)}")


def _check_number(name, value, lo=None, hi=None):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"{name}: expected a number, got {value!r}")
    if not _is_finite(value):
        raise ValueError(f"{name}: must be finite, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name}: must be >= {lo}" + (f" and <= {hi}" if hi is not None else "") + f", got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name}: must be <= {hi}" + (f" and >= {lo}" if lo is not None else "") + f", got {value}")


def _is_finite(value) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _check_bool(name, value):
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected a boolean, got {value!r}")
