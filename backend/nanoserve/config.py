"""Engine arguments: the same names in `LLM(**engine_args)` and in a Triton model's `model.json`."""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field, fields

import torch
from transformers import AutoConfig

ATTENTION_BACKENDS = ("torch", "triton", "flash_attn")
DTYPES = {"auto": None, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "half": torch.float16,
          "float": torch.float32}


@dataclass
class EngineConfig:
    model: str
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings, capped at 8192
    kvcache_block_size: int = 16
    num_kvcache_blocks: int | None = None  # overrides the memory-derived count
    gpu_memory_utilization: float = 0.9
    cpu_kvcache_space_gib: float = 1.0  # the KV memory budget when device == "cpu"
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    dtype: str = "auto"  # auto: the checkpoint's dtype on cuda, float32 on cpu
    device: str | None = None  # cpu | cuda | cuda:N (the first GPU; tensor-parallel ranks take N, N+1, ...).
    # None: cuda when available
    attention_backend: str | None = None  # None: triton on cuda, torch on cpu
    seed: int = 0
    tokenizer: str | None = None  # None: the model directory
    hf_config: object = field(default=None, repr=False)  # filled from config.json

    def __post_init__(self):
        self.model = os.path.expanduser(self.model)
        if not os.path.isdir(self.model):
            raise ValueError(f"model: {self.model!r} is not a directory (expected a Hugging Face checkpoint)")
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device: must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.attention_backend is None:
            self.attention_backend = "triton" if self.device_type == "cuda" else "torch"
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend: must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "kvcache_block_size", "tensor_parallel_size"):
            _require_positive_int(name, getattr(self, name))
        for name in ("max_model_len", "num_kvcache_blocks"):
            if getattr(self, name) is not None:
                _require_positive_int(name, getattr(self, name))
        if self.attention_backend == "flash_attn" and self.kvcache_block_size % 256:
            raise ValueError(f"kvcache_block_size: attention_backend='flash_attn' needs a multiple of 256 "
                             f"(flash-attn's paged KV), got {self.kvcache_block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cpu_kvcache_space_gib <= 0:
            raise ValueError(f"cpu_kvcache_space_gib: must be > 0, got {self.cpu_kvcache_space_gib}")
        if self.tokenizer is None:
            self.tokenizer = self.model
        self._load_hf_config()

    def _load_hf_config(self):
        self.hf_config = AutoConfig.from_pretrained(self.model)
        limit = getattr(self.hf_config, "max_position_embeddings", 8192)
        if self.max_model_len is None:
            self.max_model_len = min(limit, 8192)
        elif self.max_model_len > limit:
            raise ValueError(f"max_model_len: {self.max_model_len} exceeds the model's "
                             f"max_position_embeddings ({limit})")

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]

    @property
    def gpu_index(self) -> int | None:
        """The GPU named by device="cuda:N" (rank 0's under tensor parallelism), None for "cuda" and "cpu"."""
        return int(self.device.split(":")[1]) if ":" in self.device else None

    @property
    def torch_dtype(self) -> torch.dtype:
        chosen = DTYPES[self.dtype]
        if chosen is not None:
            return chosen
        if self.device_type == "cpu":
            return torch.float32
        return getattr(self.hf_config, "torch_dtype", None) or torch.bfloat16

    @classmethod
    def from_kwargs(cls, model: str, **engine_args) -> "EngineConfig":
        known = {f.name for f in fields(cls)} - {"model", "hf_config"}
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(model=model, **{k: _coerce(cls, k, v) for k, v in engine_args.items()})


def _require_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")


def _coerce(cls, name: str, value):
    """model.json values may arrive as strings ("true", "16"); turn them into the field's type."""
    if not isinstance(value, str):
        return value
    kind = {f.name: f.type for f in dataclasses.fields(cls)}[name]
    text = value.strip().lower()
    if "bool" in kind:
        if text in ("true", "1", "yes"):
            return True
        if text in ("false", "0", "no"):
            return False
        raise ValueError(f"{name}: expected a boolean, got {value!r}")
    if "int" in kind and text not in ("none", "null"):
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{name}: expected an integer, got {value!r}") from None
    if "float" in kind:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{name}: expected a number, got {value!r}") from None
    if text in ("none", "null"):
        return None
    return value
