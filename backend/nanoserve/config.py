"""Engine arguments: the same names in `LLM(**engine_args)` and in a Triton model's `model.json`."""
from __future__ import annotations

import dataclasses
import glob
import os
import re
from dataclasses import dataclass, field, fields

import torch
from transformers import AutoConfig, AutoTokenizer

from nanoserve.coercion import from_text
from nanoserve.models import MODELS
from nanoserve.models.gguf import as_checkpoint_dir

ATTENTION_BACKENDS = ("torch", "triton", "flash_attn")
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
QUANTIZATIONS = ("auto", "none", "int8", "int4")  # models/quantize.py
MAX_LORA_RANK = 512  # vLLM's largest max_lora_rank
SIMULATED_DEVICE_ENV = "NANOSERVE_SIMULATED_DEVICE_MS"  # engine/simulated_device.py: a device apart from the host
DTYPES = {"auto": None, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "half": torch.float16,
          "float": torch.float32}


def _arg(default, help: str):
    """An engine argument: its default, and the help text `nanoserve serve --help` shows for its flag."""
    return field(default=default, metadata={"help": help})


@dataclass
class EngineConfig:
    model: str  # a Hugging Face checkpoint directory, or a .gguf file (converted once into the cache directory)
    max_num_seqs: int = _arg(256, "most sequences in one batch (running requests)")
    max_num_batched_tokens: int = _arg(8192, "most tokens computed in one engine step (prefill chunks + decodes)")
    max_model_len: int | None = _arg(None, "most tokens per sequence, prompt + output "
                                           "(default: the checkpoint's max_position_embeddings, capped at 8192)")
    kvcache_block_size: int = _arg(16, "tokens per KV-cache block")
    num_kvcache_blocks: int | None = _arg(None, "KV-cache blocks; overrides the count derived from the memory "
                                                "budget (default: derived)")
    gpu_memory_utilization: float = _arg(0.9, "share of GPU memory, in (0, 1], for weights, activations and "
                                              "the KV cache")
    cpu_kvcache_space_gib: float = _arg(1.0, "KV-cache memory in GiB when device is cpu")
    enable_prefix_caching: bool = _arg(True, "reuse the KV blocks of shared prompt prefixes")
    enforce_eager: bool = _arg(False, "no CUDA graphs")
    tensor_parallel_size: int = _arg(1, "GPUs to shard the model over")
    dtype: str = _arg("auto", f"weights and activations: one of {', '.join(DTYPES)} "
                              "(auto: the checkpoint's dtype on cuda, float32 on cpu)")
    device: str | None = _arg(None, "cpu, cuda or cuda:N (the first GPU; tensor-parallel ranks take N, N+1, ...) "
                                    "(default: cuda when available, else cpu)")
    attention_backend: str | None = _arg(None, f"one of {', '.join(ATTENTION_BACKENDS)} "
                                               "(default: triton on cuda, torch on cpu)")
    kv_cache_dtype: str = _arg("auto", "KV-cache storage: auto (the model's dtype), or fp8 / fp8_e4m3 (one byte "
                                       "per value with per-layer scales: twice the blocks of a 16-bit cache)")
    quantization: str = _arg("auto", "weights: int8 (per output channel) or int4 (groups of 32), "
                                            "quantized at load (on cpus with AVX-512 VNNI, int8 weights multiply "
                                            "activations quantized per token; Triton kernels on cuda); none: float "
                                            "weights; auto: a GGUF file's own quantization (Q8_0 as int8, "
                                            "Q4_0/Q4_1/Q4_K as int4), float otherwise")
    seed: int = _arg(0, "seed of the sampler's generator for requests without a seed")
    tokenizer: str | None = _arg(None, "tokenizer directory (default: the model directory)")
    max_logprobs: int = _arg(20, "most top logprobs a request may ask for (its logprobs sampling parameter)")
    enable_lora: bool = _arg(False, "serve LoRA adapters (requests pick one with the lora_name sampling parameter)")
    max_loras: int = _arg(1, "most LoRA adapters in one batch (adapter slots on the device), >= 1")
    max_lora_rank: int = _arg(16, f"largest LoRA rank an adapter may have, in [1, {MAX_LORA_RANK}]")
    max_cpu_loras: int | None = _arg(None, "LoRA adapters kept in CPU memory, least recently used evicted first, "
                                           ">= max_loras (default: max_loras)")
    speculative_config: dict | None = _arg(None, "speculative decoding, as vLLM spells it: a JSON object "
                                                 '{"method": "ngram", "num_speculative_tokens": K, '
                                                 '"prompt_lookup_min": A, "prompt_lookup_max": B, '
                                                 '"disable_by_batch_size": N}, or with a draft model '
                                                 '{"model": DIR_OR_GGUF, "num_speculative_tokens": K} '
                                                 "(default: off)")
    async_scheduling: bool | None = _arg(None, "schedule and prepare each engine step while the step before it "
                                                "runs on the device (vLLM's async scheduling); not with "
                                                "speculative_config or tensor_parallel_size > 1 (default: on "
                                                "cuda and the simulated device, unless one of them is set; off "
                                                "on cpu, where the forward is host work too)")
    hf_config: object = field(default=None, repr=False)  # filled from config.json

    def __post_init__(self):
        self.model = _checkpoint("model", self.model)
        if not os.path.isdir(self.model):
            raise ValueError(f"model: {self.model!r} is not a directory (expected a Hugging Face checkpoint "
                             f"or a .gguf file)")
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device: must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.attention_backend is None:
            self.attention_backend = "triton" if self.device_type == "cuda" else "torch"
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend: must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        self._check_quantization()
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: must be one of {sorted(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype != "auto" and self.attention_backend == "flash_attn":
            raise ValueError("kv_cache_dtype: an fp8 cache needs attention_backend 'triton' or 'torch' "
                             "(flash-attn reads no fp8 cache)")
        for name in ("max_num_seqs", "max_num_batched_tokens", "kvcache_block_size", "tensor_parallel_size"):
            _require_positive_int(name, getattr(self, name))
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs: must be a non-negative integer, got {self.max_logprobs!r}")
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
        self._check_lora_args()
        self._check_async_scheduling()
        if self.speculative_config is not None and not isinstance(self.speculative_config, SpeculativeConfig):
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        self.tokenizer = self.model if self.tokenizer is None else _checkpoint("tokenizer", self.tokenizer)
        self._load_hf_config()
        if self.speculative_config is not None and self.speculative_config.method == "draft_model":
            self._check_draft_model()

    def _check_quantization(self):
        if self.quantization is None:  # LLM(quantization=None): Python's spelling of "none"
            self.quantization = "none"
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization: must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")

    def _check_async_scheduling(self):
        if self.async_scheduling is None:  # on where a device computes apart from the host and it can run there
            apart = self.device_type == "cuda" or bool(os.environ.get(SIMULATED_DEVICE_ENV, "").strip())
            self.async_scheduling = apart and self.speculative_config is None and self.tensor_parallel_size == 1
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling: expected a boolean, got {self.async_scheduling!r}")
        if self.async_scheduling and self.speculative_config is not None:
            raise ValueError("async_scheduling: not with speculative decoding (speculative_config is set): a step's "
                             "proposals depend on the tokens of the step before it")
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError(f"async_scheduling: runs on one device, but tensor_parallel_size is "
                             f"{self.tensor_parallel_size}")

    def _check_lora_args(self):
        _require_positive_int("max_loras", self.max_loras)
        _require_positive_int("max_lora_rank", self.max_lora_rank)
        if self.max_lora_rank > MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank: must be in [1, {MAX_LORA_RANK}], got {self.max_lora_rank}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        _require_positive_int("max_cpu_loras", self.max_cpu_loras)
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras: must be >= max_loras ({self.max_loras}), got {self.max_cpu_loras}")

    def _load_hf_config(self):
        self.hf_config = AutoConfig.from_pretrained(self.model)
        limit = getattr(self.hf_config, "max_position_embeddings", 8192)
        if self.max_model_len is None:
            self.max_model_len = min(limit, 8192)
        elif self.max_model_len > limit:
            raise ValueError(f"max_model_len: {self.max_model_len} exceeds the model's "
                             f"max_position_embeddings ({limit})")

    def _check_draft_model(self):
        """The draft must read and write the target's token ids: the same vocabulary size and, where its
        directory holds a tokenizer, the same token -> id map; one device (the draft runs beside rank 0)."""
        path = self.speculative_config.model
        if self.tensor_parallel_size > 1:
            raise ValueError(f"speculative_config.model: a draft model runs on one device, but "
                             f"tensor_parallel_size is {self.tensor_parallel_size} (use method 'ngram')")
        try:
            draft = AutoConfig.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise ValueError(f"speculative_config.model: {path!r} is not a checkpoint this engine can read: "
                             f"{str(e).splitlines()[0]}") from None
        arch = (getattr(draft, "architectures", None) or [None])[0]
        if arch not in MODELS:
            raise ValueError(f"speculative_config.model: architecture {arch!r} is not supported (supported: "
                             f"{', '.join(sorted(MODELS))})")
        if not glob.glob(os.path.join(path, "*.safetensors")):
            raise ValueError(f"speculative_config.model: no *.safetensors weights in {path}")
        if draft.vocab_size != self.hf_config.vocab_size:
            raise ValueError(f"speculative_config.model: the draft's vocabulary has {draft.vocab_size} tokens, the "
                             f"target's {self.hf_config.vocab_size}; a draft model needs the target's tokenizer")
        if getattr(draft, "max_position_embeddings", self.max_model_len) < self.max_model_len:
            raise ValueError(f"speculative_config.model: the draft's max_position_embeddings "
                             f"({draft.max_position_embeddings}) is below max_model_len ({self.max_model_len})")
        if has_tokenizer(path):
            differing = differing_tokens(self.tokenizer, path)
            if differing:
                raise ValueError(f"speculative_config.model: the draft's tokenizer differs from the target's "
                                 f"({differing} tokens have other ids); a draft model needs the target's tokenizer")

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

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.torch_dtype

    @classmethod
    def engine_args(cls) -> list:
        """The fields a user sets (LLM(...) keywords, model.json keys, `nanoserve serve` flags), without model."""
        return [f for f in fields(cls) if "help" in f.metadata]

    @classmethod
    def from_kwargs(cls, model: str, **engine_args) -> "EngineConfig":
        """engine_args by nanoserve's names, or vLLM's where they differ (VLLM_NAMES: block_size, ...)."""
        engine_args = with_own_names(engine_args, "is given")
        known = {f.name for f in cls.engine_args()}
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(model=model, **{k: coerce_engine_arg(k, v) for k, v in engine_args.items()})


@dataclass
class SpeculativeConfig:
    """Speculative decoding: each step, a decoding request proposes up to num_speculative_tokens tokens and one
    forward of the target model verifies them. method "ngram" (prompt lookup): the tokens that followed the
    latest earlier occurrence of the request's last prompt_lookup_max .. prompt_lookup_min tokens in its prompt
    or output. method "draft_model" (the default when model is given): a smaller model with the target's
    tokenizer proposes them greedily, one token at a time (engine/draft_model.py)."""
    method: str = "ngram"
    num_speculative_tokens: int = 4  # proposed tokens per request and step, at most
    prompt_lookup_min: int = 3  # the shortest suffix of the request's tokens looked up
    prompt_lookup_max: int = 5  # the longest (longer matches are tried first)
    # speculate only while fewer requests run (None: always). At a large batch a step's cost grows with its
    # tokens, so proposals gain little and rejected ones cost (docs/benchmarks.md: 64 requests on a CPU)
    disable_by_batch_size: int | None = 32
    model: str | None = None  # the draft model (method "draft_model"): a checkpoint directory or a .gguf file

    def max_proposing_seqs(self, max_num_seqs: int) -> int:
        """The most requests running while proposals are still made (fewer than disable_by_batch_size)."""
        limit = self.disable_by_batch_size
        return max_num_seqs if limit is None else min(max_num_seqs, limit - 1)

    @classmethod
    def from_dict(cls, given) -> "SpeculativeConfig":
        """vLLM's spelling; ValueError naming the field for anything this engine cannot run. A draft model's
        path is resolved here (a .gguf converted once); EngineConfig checks it against the target."""
        if not isinstance(given, dict):
            raise ValueError(f"speculative_config: expected a JSON object, got {given!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(f"speculative_config.{unknown[0]}: unknown field (known: {', '.join(sorted(known))})")
        if given.get("model") is not None and "method" not in given:
            given = {**given, "method": "draft_model"}  # as vLLM infers it
        config = cls(**given)
        if config.method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative_config.method: must be 'ngram' or 'draft_model', got {config.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            _require_positive_int(f"speculative_config.{name}", getattr(config, name))
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min: {config.prompt_lookup_min} exceeds "
                             f"prompt_lookup_max ({config.prompt_lookup_max})")
        if config.disable_by_batch_size is not None:
            _require_positive_int("speculative_config.disable_by_batch_size", config.disable_by_batch_size)
        config._check_method_fields(given)
        return config

    def _check_method_fields(self, given: dict) -> None:
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative_config.model: method 'ngram' takes no draft model (give only "
                                 "\"model\" for draft-model speculation)")
            return
        lookup = sorted(name for name in given if name.startswith("prompt_lookup_"))
        if lookup:
            raise ValueError(f"speculative_config.{lookup[0]}: only method 'ngram' looks up the prompt")
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("speculative_config.model: method 'draft_model' needs a draft model (a checkpoint "
                             f"directory or a .gguf file), got {self.model!r}")
        self.model = _checkpoint("speculative_config.model", self.model)
        if not os.path.isdir(self.model):
            raise ValueError(f"speculative_config.model: {self.model!r} is not a directory (expected a Hugging "
                             "Face checkpoint or a .gguf file)")


# vLLM's names for nanoserve's own engine arguments: LLM(...), model.json and `nanoserve serve` take either
VLLM_NAMES = {"block_size": "kvcache_block_size", "num_gpu_blocks_override": "num_kvcache_blocks"}


def with_own_names(args: dict, given_by: str) -> dict:
    """args with vLLM's names (VLLM_NAMES) replaced by nanoserve's, in order; ValueError when both are there
    ("block_size: vLLM's name for kvcache_block_size, which <given_by> too")."""
    renamed = {}
    for name, value in args.items():
        own = VLLM_NAMES.get(name, name)
        if own != name and own in args:
            raise ValueError(f"{name}: vLLM's name for {own}, which {given_by} too")
        renamed[own] = value
    return renamed


def has_tokenizer(model_dir: str) -> bool:
    return any(os.path.isfile(os.path.join(model_dir, name))
               for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model"))


def differing_tokens(tokenizer_dir: str, other_dir: str) -> int:
    """How many tokens are missing from, or have another id in, either directory's tokenizer."""
    mine, other = (AutoTokenizer.from_pretrained(d).get_vocab() for d in (tokenizer_dir, other_dir))
    return sum(other.get(token) != token_id for token, token_id in mine.items()) + len(other.keys() - mine.keys())


def _checkpoint(name: str, path: str) -> str:
    try:
        return as_checkpoint_dir(os.path.expanduser(path))
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def _require_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")


def coerce_engine_arg(name: str, value):
    """model.json values and command-line flags may arrive as strings ("true", "16"): the field's type."""
    return from_text(name, {f.name: f.type for f in dataclasses.fields(EngineConfig)}[name], value)
