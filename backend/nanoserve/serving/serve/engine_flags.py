"""EngineConfig's fields as command-line flags: `max_model_len` -> `--max-model-len`, with the field's help
text and default, and vLLM's name as well where it differs (`--block-size` for `--kvcache-block-size`). Generated
from the dataclass, so a new engine argument gets its flag without more code.

A flag left out stays out of the engine arguments (the engine's own default applies), so `None` is the
argparse default and the help shows the engine's default instead.
"""
from __future__ import annotations

import argparse

from nanoserve.config import VLLM_NAMES, EngineConfig, coerce_engine_arg


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine arguments (the same names as LLM(...) and model.json)")
    for field in EngineConfig.engine_args():
        default = "derived" if field.default is None else field.default
        help_text = field.metadata["help"]
        if "(default:" not in help_text:
            help_text += f" (default: {default})"
        names = [flag(field.name), *(flag(vllm) for vllm, own in VLLM_NAMES.items() if own == field.name)]
        if "bool" in field.type:
            group.add_argument(*names, dest=field.name, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
        else:
            group.add_argument(*names, dest=field.name, metavar=_metavar(field.type), default=None, help=help_text)


def _metavar(kind: str) -> str:
    if "dict" in kind:
        return "JSON"
    return "INT" if "int" in kind else "FLOAT" if "float" in kind else "STR"


def given_engine_args(args: argparse.Namespace) -> dict:
    """The engine arguments given on the command line, typed (a bad value is a ValueError naming the field)."""
    given = {}
    for field in EngineConfig.engine_args():
        value = getattr(args, field.name, None)
        if value is not None:
            given[field.name] = coerce_engine_arg(field.name, value)
    return given
