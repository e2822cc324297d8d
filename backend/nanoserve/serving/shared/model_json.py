"""`<model_dir>/<version>/model.json`: the engine arguments of a Triton model (the same names as `LLM(...)`).

    {"model": "../../tiny-qwen3", "max_model_len": 2048}

Relative "model" and "tokenizer" paths resolve against the model directory (the folder holding config.pbtxt).
With "enable_lora": true, `<model_dir>/<version>/multi_lora.json` names the LoRA adapters a request may pick
(`{"sql": "/adapters/sql"}`, vllm_backend's file; `lora_modules`).

A vllm_backend model.json loads too: vLLM's names for nanoserve's engine arguments are renamed (`block_size` ->
`kvcache_block_size`), vLLM's other engine arguments are ignored with one warning naming them, and a name that
neither engine knows stays an error (EngineConfig's).
"""
from __future__ import annotations

import json
import logging
import os

from nanoserve.coercion import optional_bool
from nanoserve.config import EngineConfig, with_own_names
from nanoserve.models.gguf import as_checkpoint_dir
from nanoserve.serving.shared.vllm_engine_args import OLDER_VLLM_ENGINE_ARGS, VLLM_ENGINE_ARGS

logger = logging.getLogger(__name__)
PATH_ARGS = ("model", "tokenizer")
MULTI_LORA_JSON = "multi_lora.json"
# Read by the backend, not the engine: true switches the vllm:* metrics off, as in vllm_backend.
SERVING_ARGS = ("disable_log_stats",)


def load_engine_args(model_dir: str, version: str = "1") -> dict:
    """The engine arguments of model.json, in nanoserve's names (see engine_args_of)."""
    return engine_args_of(read_model_json(model_dir, version))


def engine_args_of(model_json: dict) -> dict:
    """model.json's keys as `EngineConfig.from_kwargs` takes them: vLLM's names renamed, vLLM's engine arguments
    that nanoserve has no use for dropped with a warning, the serving arguments dropped, unknown names kept (the
    engine's own check names them)."""
    own = {field.name for field in EngineConfig.engine_args()} | {"model"}
    args, ignored = {}, []
    for name, value in with_own_names(model_json, "model.json gives").items():
        if name in own or not _is_vllm_arg(name):
            args[name] = value
        elif name not in SERVING_ARGS:
            ignored.append(name)
    if ignored:
        logger.warning("model.json: vLLM engine arguments that do not apply to nanoserve, ignored: %s",
                       ", ".join(sorted(ignored)))
    return args


def _is_vllm_arg(name: str) -> bool:
    return name in VLLM_ENGINE_ARGS or name in OLDER_VLLM_ENGINE_ARGS


def reports_vllm_metrics(report_custom_metrics: str, model_json: dict) -> bool:
    """vllm_backend's switch for the vllm:* metrics: config.pbtxt parameter REPORT_CUSTOM_METRICS "true" (absent:
    off), unless model.json's disable_log_stats is true."""
    return (optional_bool("REPORT_CUSTOM_METRICS", report_custom_metrics)
            and not optional_bool("disable_log_stats", model_json.get("disable_log_stats")))


def read_model_json(model_dir: str, version: str = "1") -> dict:
    """model.json as written, with its relative paths resolved."""
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
    return with_draft_path(args, model_dir)


def with_draft_path(args: dict, base: str) -> dict:
    """args with speculative_config's draft `model` path taken relative to base (a model's folder; the current
    directory for a command line), as model paths are."""
    spec = args.get("speculative_config")
    if isinstance(spec, dict) and isinstance(spec.get("model"), str):
        draft = os.path.normpath(os.path.join(base, os.path.expanduser(spec["model"])))
        args = {**args, "speculative_config": {**spec, "model": draft}}
    return args


def lora_modules(model_dir: str, version: str = "1") -> dict[str, str]:
    """The LoRA adapters a model serves, {name: adapter directory}: `<model_dir>/<version>/multi_lora.json`
    (vllm_backend's convention; relative paths resolve against its folder) when model.json's enable_lora is true,
    else none."""
    if not optional_bool("enable_lora", read_model_json(model_dir, version).get("enable_lora")):
        return {}
    path = os.path.join(model_dir, str(version), MULTI_LORA_JSON)
    try:
        with open(path) as f:
            adapters = json.load(f)
    except FileNotFoundError:
        return {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{MULTI_LORA_JSON}: invalid JSON in {path} ({e})") from None
    if not isinstance(adapters, dict) or not all(isinstance(v, str) and k for k, v in adapters.items()):
        raise ValueError(f"{MULTI_LORA_JSON}: {path} must be a JSON object of adapter name -> adapter directory")
    folder = os.path.dirname(path)
    return {name: os.path.normpath(os.path.join(folder, os.path.expanduser(adapter_dir)))
            for name, adapter_dir in adapters.items()}


def tokenizer_dir(model_dir: str, version: str = "1") -> str:
    """The tokenizer the engine model at model_dir uses (pre/postprocessing of the ensemble share it). A path
    that does not exist is an error naming model.json's field: transformers would take it for a Hub repo id."""
    args = read_model_json(model_dir, version)
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
