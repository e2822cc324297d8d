"""Per-request sampling parameters, validated on construction (errors name the field)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields

MAX_LOGPROBS = 20


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
        _check_number("temperature", self.temperature, lo=0.0)
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, minimum=-1)
        _check_number("min_p", self.min_p, lo=0.0, hi=1.0)
        _check_int("seed", self.seed, minimum=0, optional=True)
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty: must be > 0, got {self.repetition_penalty}")
        _check_number("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_number("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _check_bool("ignore_eos", self.ignore_eos)
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        _check_bool("skip_special_tokens", self.skip_special_tokens)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop: must be a string or a list of non-empty strings")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, minimum=0)
        _check_int("logprobs", self.logprobs, minimum=0, optional=True)
        if self.logprobs is not None and self.logprobs > MAX_LOGPROBS:
            raise ValueError(f"logprobs: at most {MAX_LOGPROBS}, got {self.logprobs}")
        if self.n != 1:
            raise ValueError(f"n: only n=1 is supported, got {self.n!r}")

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


def _check_int(name, value, minimum, optional=False):
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: expected an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")


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
