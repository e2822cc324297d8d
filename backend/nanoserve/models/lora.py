"""LoRA adapters in PEFT's format, and the adapter weights a model runs with.

A PEFT adapter directory holds `adapter_config.json` (`r`, `lora_alpha`, `use_rslora`, `target_modules`, ...) and
`adapter_model.safetensors` with, per adapted module, `base_model.model.<module>.lora_A.weight` [r, in] and
`...lora_B.weight` [out, r]; the module's output gains scaling * B @ A @ x, scaling = lora_alpha / r (rsLoRA:
lora_alpha / sqrt(r)). `LoRAStore` fills the model's stacked slots (layers/lora.py) from an LRU in CPU memory.
"""
from __future__ import annotations

import glob
import json
import math
import os
from collections import OrderedDict

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from nanoserve.layers.lora import StackedLoRA
from nanoserve.models.loader import map_name

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_LAYERS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # the model's linears that hold the targets
_KEY_PREFIX = "base_model.model."
# adapter_config.json settings that change what the weights mean, and the value this engine supports
_SUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "lora_bias": False, "bias": "none",
              "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {}}


def read_adapter_config(path: str) -> dict:
    """adapter_config.json, checked: a LoRA adapter this engine can run. ValueError says what is wrong."""
    config_path = os.path.join(path, CONFIG_FILE)
    try:
        with open(config_path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path}: no {CONFIG_FILE} (expected a PEFT LoRA adapter directory)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{config_path}: invalid JSON ({e})") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{config_path}: not a LoRA adapter (peft_type {config.get('peft_type')!r})")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"{config_path}: r must be a positive integer, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"{config_path}: lora_alpha must be a number, got {alpha!r}")
    for name, supported in _SUPPORTED.items():
        value = config.get(name, supported)
        if value != supported and (value or supported):  # None, {}, [] all mean "none" where that is supported
            raise ValueError(f"{config_path}: {name}={config[name]!r} is not supported (only {supported!r})")
    return config


def check_peft_adapter(path: str, model_dir: str, max_rank: int) -> None:
    """Raise ValueError unless path is a PEFT LoRA adapter for the checkpoint in model_dir whose rank is at most
    max_rank (reads the files' headers, no weights)."""
    config = read_adapter_config(path)
    if config["r"] > max_rank:
        raise ValueError(f"max_lora_rank: the adapter's rank r={config['r']} exceeds max_lora_rank ({max_rank})")
    base = {}
    for file in glob.glob(os.path.join(model_dir, "*.safetensors")):
        base.update(_shapes(file))
    for module, pair in _by_module(_shapes(_weights_file(path))).items():
        out_size, in_size = base.get(module + ".weight", (None, None))
        if out_size is None:
            raise ValueError(f"{path}: the base model has no {module} (an adapter for another model?)")
        expected = {"lora_A": [config["r"], in_size], "lora_B": [out_size, config["r"]]}
        if pair != expected:
            raise ValueError(f"{path}: {module}'s LoRA weights have shapes {pair}, expected {expected} "
                             f"(r={config['r']}, the base weight's [{out_size}, {in_size}])")


def read_peft_adapter(path: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Checkpoint module name -> (A [r, in], B [out, r] in float32, the scaling folded in)."""
    config = read_adapter_config(path)
    pairs = _by_module(load_file(_weights_file(path), device="cpu"))
    alpha, rank = config.get("lora_alpha", config["r"]), config["r"]
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return {module: (pair["lora_A"], pair["lora_B"].float() * scaling) for module, pair in pairs.items()}


def _weights_file(path: str) -> str:
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise ValueError(f"{path}: no {WEIGHTS_FILE} (adapter weights are read from safetensors only)")
    return file


def _shapes(file: str) -> dict[str, list[int]]:
    with safe_open(file, framework="pt", device="cpu") as f:
        return {key: list(f.get_slice(key).get_shape()) for key in f.keys()}


def _by_module(values: dict) -> dict[str, dict]:
    """{'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight': v, ...} ->
    {'model.layers.0.self_attn.q_proj': {'lora_A': v, ...}, ...}."""
    modules = {}
    for key, value in values.items():
        parts = key.removeprefix(_KEY_PREFIX).rsplit(".", 2)
        module, matrix, suffix = parts if len(parts) == 3 else ("", "", "")
        if matrix not in ("lora_A", "lora_B") or suffix != "weight" or module.rpartition(".")[2] not in TARGET_MODULES:
            raise ValueError(f"unsupported LoRA weight {key!r} (supported: lora_A/lora_B of "
                             f"{', '.join(TARGET_MODULES)})")
        modules.setdefault(module, {})[matrix] = value
    return modules


class LoRAStore:
    """num_slots adapters on the model's device, filled on request from up to max_cpu_loras adapters kept in CPU
    memory (least recently used dropped first)."""

    def __init__(self, model: nn.Module, num_slots: int, max_rank: int, max_cpu_loras: int):
        """Call under the model's default device and dtype: the slots are allocated there."""
        self.packed = getattr(model, "packed_modules", {})
        self.layers = {name: module for name, module in model.named_modules()
                       if name.rpartition(".")[2] in LORA_LAYERS}
        for module in self.layers.values():
            module.lora = StackedLoRA(module, num_slots, max_rank)
        self.max_cpu_loras = max_cpu_loras
        self.cpu: OrderedDict[int, dict] = OrderedDict()  # adapter id -> its weights, least recently used first

    def load(self, slot: int, adapter_id: int, path: str) -> None:
        for module in self.layers.values():
            module.lora.clear(slot)
        for name, (lora_a, lora_b) in self._read(adapter_id, path).items():
            layer, shard_id = map_name(name + ".weight", self.packed)
            self.layers[layer.rpartition(".")[0]].lora.load(slot, shard_id, lora_a, lora_b)

    def _read(self, adapter_id: int, path: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        if adapter_id in self.cpu:
            self.cpu.move_to_end(adapter_id)
            return self.cpu[adapter_id]
        adapter = self.cpu[adapter_id] = read_peft_adapter(path)
        if len(self.cpu) > self.max_cpu_loras:
            self.cpu.popitem(last=False)
        return adapter
