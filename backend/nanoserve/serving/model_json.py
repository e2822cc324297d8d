"""`<model_dir>/<version>/model.json`: the engine arguments of a Triton model (the same names as `LLM(...)`).

    {"model": "../../tiny-qwen3", "max_model_len": 2048}

Relative "model" and "tokenizer" paths resolve against the model directory (the folder holding config.pbtxt).
"""
from __future__ import annotations

import json
import os

from nanoserve.models.gguf import as_checkpoint_dir

PATH_ARGS = ("model", "tokenizer")


def load_engine_args(model_dir: str, version: str = "1") -> dict:
    path = os.path.join(model_dir, str(version), "model.json")
    try:
        with open(path) as f:
            args = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"model.json: {path} not found (it names the checkpoint: {{\"model\": DIR}})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"model.json: invalid JSON in {path} ({e.msg} at char {e.pos})") from None
    if not isinstance(args, dict) or not isinstance(args.get("model"), str):
        raise ValueError(f"model: {path} must be a JSON object with a \"model\" path")
    for name in PATH_ARGS:
        if isinstance(args.get(name), str):
            args[name] = os.path.normpath(os.path.join(model_dir, os.path.expanduser(args[name])))
    return args


def tokenizer_dir(model_dir: str, version: str = "1") -> str:
    """The tokenizer the engine model at model_dir uses (pre/postprocessing of the ensemble share it). A path
    that does not exist is an error naming model.json's field: transformers would take it for a Hub repo id."""
    args = load_engine_args(model_dir, version)
    name = "tokenizer" if args.get("tokenizer") else "model"
    path = args[name]
    if not os.path.exists(path):
        model_json = os.path.join(model_dir, str(version), "model.json")
        raise ValueError(f"{name}: {path} does not exist (set \"{name}\" in {model_json} to a checkpoint directory)")
    return as_checkpoint_dir(path)


def max_model_len_bound(model_dir: str, version: str = "1") -> int | None:
    """An upper bound of the max_model_len the engine model at model_dir runs with, without loading it: model.json's
    max_model_len, else the checkpoint's max_position_embeddings (the engine takes at most that); None if unknown."""
    args = load_engine_args(model_dir, version)
    if isinstance(args.get("max_model_len"), int):
        return args["max_model_len"]
    try:
        with open(os.path.join(args["model"], "config.json")) as f:
            limit = json.load(f).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return limit if isinstance(limit, int) else None


def instance_device(engine_args: dict, instance_kind: str, device_id: str | int) -> dict:
    """A KIND_GPU instance runs on the GPU Triton gave it (instance_group [{ kind: KIND_GPU, gpus: [0, 1] }] makes
    one per GPU); model.json's "device" wins when it names one. KIND_MODEL leaves the choice to the engine."""
    if instance_kind != "GPU" or "device" in engine_args:
        return engine_args
    return {**engine_args, "device": f"cuda:{int(device_id)}"}
