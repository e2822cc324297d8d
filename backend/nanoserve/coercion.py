"""Values that may arrive as strings, to their types, by one truth table: engine arguments (model.json, `nanoserve
serve` flags, `LLM(...)`), config.pbtxt parameters, sampling parameters (genai-perf and Triton's request parameters
send every value as a string) and the request's BOOL flags. A value that is already of its type passes through; a
string that is none of the table's words is a ValueError naming the field, never a silent default.
"""
from __future__ import annotations

import json

import numpy as np

from nanoserve.errors import RequestError

TRUE_WORDS = ("true", "1", "yes", "on")
FALSE_WORDS = ("false", "0", "no", "off")
NONE_WORDS = ("none", "null")  # for an optional field that is not a string: not given


def to_bool(name: str, value) -> bool:
    """A boolean: True/False (numpy's too), the integers 1/0, or a word of the table in any case."""
    if isinstance(value, (bool, np.bool_)) or isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in TRUE_WORDS:
            return True
        if text in FALSE_WORDS:
            return False
    raise RequestError(name, f"expected a boolean (true/false, 1/0, yes/no, on/off), got {value!r}")


def optional_bool(name: str, value, default: bool = False) -> bool:
    """A boolean that may be absent (None, or "" as config.pbtxt gives a parameter that is not set): default."""
    return default if value is None or isinstance(value, str) and not value.strip() else to_bool(name, value)


def from_text(name: str, kind: str, value):
    """value for a field whose annotation is `kind` ("bool", "int | None", "float", "list[int]", "dict", "str",
    ...): strings are parsed by the table (a list or a dict from its JSON text; "none"/"null" for an optional field
    that is not a string); other values are returned as they are, for the field's own check."""
    if not isinstance(value, str):
        return value
    text, base = value.strip(), kind.split("|")[0].strip()
    if "None" in kind and base != "str" and text.lower() in NONE_WORDS:
        return None
    if base == "bool":
        return to_bool(name, value)
    try:
        if base == "int":
            return int(text)
        if base == "float":
            return float(text)
        if base.startswith("list") and base != "list[str]" or base == "dict":
            return json.loads(text)
    except ValueError:
        raise RequestError(name, f"expected {_article(base)}, got {value!r}") from None
    except RecursionError:  # JSON nested past Python's recursion limit ("[[[[...")
        raise RequestError(name, "nested too deeply") from None
    return value


def _article(kind: str) -> str:
    return {"int": "an integer", "float": "a number", "dict": "a JSON object"}.get(kind, f"a JSON {kind}")
