"""GGUF files (llama.cpp's format) as Hugging Face checkpoints: `checkpoint_dir("model.gguf")` converts the file
once (the `gguf` package dequantizes the tensors, transformers builds the tokenizer from its metadata) into a
checkpoint directory under the cache directory, keyed by the file's content hash, which loads as any other."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
from gguf import GGUFReader, dequantize
from safetensors.numpy import save_file
from transformers import AutoTokenizer

from nanoserve.cache import build_once, default_cache_dir

FORMAT_VERSION = 1  # part of the cache path: bump it when the converted output changes
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# llama.cpp's converter reorders the q/k rows of these architectures for GGML's rope (undo_rope_permutation)
PERMUTED_QK = ("llama",)

CONFIG_FIELDS = {  # "<arch>.<key>" -> config.json field
    "block_count": "num_hidden_layers",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
}
REQUIRED_FIELDS = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
TOKEN_IDS = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "padding_token_id": "pad_token_id"}

GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_TENSORS = {  # blk.N.<name> -> model.layers.N.<name>
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def checkpoint_dir(gguf_path: str, cache_dir: str | None = None) -> str:
    """The checkpoint directory converted from gguf_path (converted on the first call). Raises ValueError
    naming the file when it is missing, not a GGUF file, or holds an architecture or tensor type not supported."""
    path = Path(gguf_path).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"{gguf_path}: no such GGUF file")
    out = Path(cache_dir or default_cache_dir()) / "gguf" / f"v{FORMAT_VERSION}" / _content_hash(path)
    return str(build_once(out, lambda tmp: convert(path, tmp)))


def as_checkpoint_dir(path: str, cache_dir: str | None = None) -> str:
    """checkpoint_dir(path, cache_dir) for a .gguf file; any other path unchanged."""
    return checkpoint_dir(path, cache_dir) if path.lower().endswith(".gguf") else path


def convert(path: Path, out: Path) -> None:
    """Write the checkpoint for the GGUF file at path into the (existing) directory out."""
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from None
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(ARCHITECTURES)}")
    config = hf_config(reader, arch, path)
    _save_tokenizer(path, out)
    tensors = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            raise ValueError(f"{path}: tensor {tensor.name!r} is not supported for architecture {arch!r}")
        tensors[name] = _dequantized(tensor, path)
    if arch in PERMUTED_QK:
        heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
        for name, weights in tensors.items():
            if (projection := name.split(".")[-2]) in heads:
                tensors[name] = undo_rope_permutation(weights, heads[projection])
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def hf_config(reader: GGUFReader, arch: str, path: Path) -> dict:
    """config.json from the "<arch>.*" and "tokenizer.ggml.*" metadata."""
    missing = [f"{arch}.{key}" for key in REQUIRED_FIELDS if f"{arch}.{key}" not in reader.fields]
    if missing:
        raise ValueError(f"{path}: GGUF metadata lacks {', '.join(missing)}")
    config = {"architectures": [ARCHITECTURES[arch]], "model_type": arch, "hidden_act": "silu",
              "dtype": "bfloat16"}  # the dtype served on a GPU; the safetensors hold float32
    config.update({name: _field(reader, f"{arch}.{key}") for key, name in CONFIG_FIELDS.items()
                   if f"{arch}.{key}" in reader.fields})
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    rope_dims = _field(reader, f"{arch}.rope.dimension_count", head_dim)
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if rope_dims != head_dim or scaling != "none":
        raise ValueError(f"{path}: rope over {rope_dims} of {head_dim} dimensions with scaling {scaling!r} is not "
                         f"supported (only full-width rope without scaling)")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    config["vocab_size"] = _field(reader, f"{arch}.vocab_size", len(tokens.data) if tokens else None)
    config.update({name: _field(reader, f"tokenizer.ggml.{key}") for key, name in TOKEN_IDS.items()
                   if f"tokenizer.ggml.{key}" in reader.fields})
    return config


def hf_tensor_name(gguf_name: str) -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None for a tensor we do not map."""
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[parts[0]]}.{parts[1]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}.{parts[3]}"
    return None


def undo_rope_permutation(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter stores each head's q/k rows (weight or bias) as interleaved pairs (row i of the first
    half, row i of the second) for GGML's rope; HF's rotate-half rope wants the two halves one after the other."""
    pairs = weights.reshape(num_heads, weights.shape[0] // num_heads // 2, 2, *weights.shape[1:])
    return np.ascontiguousarray(pairs.swapaxes(1, 2).reshape(weights.shape))


def _save_tokenizer(path: Path, out: Path) -> None:
    """The tokenizer and chat template in the file's metadata, as tokenizer files in out."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except ValueError as e:
        raise ValueError(f"{path}: no tokenizer could be built from its metadata ({e})") from None
    tokenizer.save_pretrained(str(out))


def _dequantized(tensor, path: Path) -> np.ndarray:
    try:
        weights = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ValueError(f"{path}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, which the installed "
                         f"gguf package cannot dequantize") from None
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions innermost first
    return np.ascontiguousarray(weights.reshape(shape), dtype=np.float32)


def _field(reader: GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _content_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()[:16]
