"""GGUF files (llama.cpp's format) as Hugging Face checkpoints: `checkpoint_dir("model.gguf")` converts the file
once (transformers builds the tokenizer from its metadata) into a checkpoint directory under the cache directory,
keyed by the file's content hash, which loads as any other.

Weights in the block formats the CPU kernels take (Q8_0, Q4_0, Q4_1, Q4_K: groups of 32 with a scale, and a min
for Q4_1/Q4_K) keep their codes: "<name>.codes" [N, K] (int8 for Q8_0, uint8 in [0, 15] otherwise),
"<name>.scale" and "<name>.offset" [N, K / 32] float32, w = codes * scale + offset (layers/quantization.py's
GroupQuantized). The weights of one fused layer (q/k/v, gate/up) keep them only if they all can, at one width;
every other tensor is dequantized by the `gguf` package to float32."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, dequantize
from gguf.quants import Q4_K
from safetensors.numpy import save_file
from transformers import AutoTokenizer

from nanoserve.cache import build_once, default_cache_dir
from nanoserve.layers.quantization import split_part

FORMAT_VERSION = 2  # part of the cache path: bump it when the converted output changes
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
FUSED_TENSORS = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))  # each becomes one layer's weight
# the block formats whose codes are kept: type -> (bits, bytes per block of 32 (per 256 for Q4_K))
KEPT_BLOCKS = {GGMLQuantizationType.Q8_0: (8, 34), GGMLQuantizationType.Q4_0: (4, 18),
               GGMLQuantizationType.Q4_1: (4, 20), GGMLQuantizationType.Q4_K: (4, 144)}


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
    kept = kept_quantized(reader.tensors)
    tensors = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            raise ValueError(f"{path}: tensor {tensor.name!r} is not supported for architecture {arch!r}")
        if tensor.name in kept:
            tensors.update({f"{name}.{part}": array for part, array in group_quantized(tensor).items()})
        else:
            tensors[name] = _dequantized(tensor, path)
    if arch in PERMUTED_QK:
        heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
        for name, weights in tensors.items():
            if (projection := split_part(name)[0].split(".")[-2]) in heads:
                tensors[name] = undo_rope_permutation(weights, heads[projection])
    config["tie_word_embeddings"] = not any(name.startswith("lm_head.") for name in tensors)
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


def kept_quantized(tensors) -> set[str]:
    """Names of the GGUF weights whose codes are kept: 2-D, of a KEPT_BLOCKS type, and with every weight fused
    with them into one layer at the same width."""
    bits = {t.name: KEPT_BLOCKS[t.tensor_type][0] for t in tensors
            if t.tensor_type in KEPT_BLOCKS and len(t.shape) == 2}
    return {name for name in bits if len({bits.get(member) for member in fused_members(name)}) == 1}


def fused_members(name: str) -> list[str]:
    """The GGUF weights fused with name into one layer, name among them."""
    parts = name.split(".")
    group = next((group for group in FUSED_TENSORS if len(parts) == 4 and parts[2] in group), None)
    return [".".join([parts[0], parts[1], member, parts[3]]) for member in group] if group else [name]


def group_quantized(tensor) -> dict[str, np.ndarray]:
    """A KEPT_BLOCKS tensor's codes [N, K], scale and offset [N, K / 32] (w = codes * scale + offset)."""
    rows = tensor.data.shape[0]
    blocks = np.asarray(tensor.data).reshape(rows, -1, KEPT_BLOCKS[tensor.tensor_type][1])
    codes, scale, offset = BLOCK_DECODERS[tensor.tensor_type](blocks)
    return {"codes": np.ascontiguousarray(codes.reshape(rows, -1)),
            "scale": np.ascontiguousarray(scale.reshape(rows, -1), dtype=np.float32),
            "offset": np.ascontiguousarray(offset.reshape(rows, -1), dtype=np.float32)}


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte start of each block, as float32 [..., 1]."""
    return blocks[..., start:start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 codes: the low nibbles are elements 0-15, the high ones 16-31 (GGML's Q4_0/Q4_1 order)."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _q8_0(blocks):
    scale = _half(blocks, 0)
    return blocks[..., 2:].view(np.int8), scale, np.zeros_like(scale)


def _q4_0(blocks):
    scale = _half(blocks, 0)
    return _nibbles(blocks[..., 2:]), scale, -8 * scale


def _q4_1(blocks):
    return _nibbles(blocks[..., 4:]), _half(blocks, 0), _half(blocks, 2)


def _q4_k(blocks):
    """A super-block of 256: 8 groups of 32, group i's scale d * sc[i] and offset -dmin * m[i] (6-bit sc and m);
    its 128 bytes hold 4 runs of 32, each run's low nibbles group 2j and its high nibbles group 2j + 1."""
    rows, count = blocks.shape[:2]
    sc, m = Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))
    scale = _half(blocks, 0) * sc.reshape(rows, count, 8).astype(np.float32)
    offset = -_half(blocks, 2) * m.reshape(rows, count, 8).astype(np.float32)
    runs = blocks[..., 16:].reshape(rows, count, 4, 1, 32)
    codes = (runs >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 0x0F
    return codes.reshape(rows, count, 256), scale, offset


BLOCK_DECODERS = {GGMLQuantizationType.Q8_0: _q8_0, GGMLQuantizationType.Q4_0: _q4_0,
                  GGMLQuantizationType.Q4_1: _q4_1, GGMLQuantizationType.Q4_K: _q4_k}


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
