"""Write a GGUF file from a Hugging Face checkpoint the way llama.cpp's convert_hf_to_gguf.py lays it out
(metadata keys, tensor names, the q/k row permutation of Llama), with the `gguf` package's writer."""
from __future__ import annotations

import json
import os

import gguf
import numpy as np
from safetensors.numpy import load_file

HF_TO_GGUF = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "q_norm": "attn_q_norm", "k_norm": "attn_k_norm",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def gguf_tensor_name(hf_name: str) -> str:
    """'model.layers.3.self_attn.q_proj.weight' -> 'blk.3.attn_q.weight'."""
    parts = hf_name.split(".")
    module, kind = HF_TO_GGUF[parts[-2]], parts[-1]
    return f"blk.{parts[2]}.{module}.{kind}" if parts[1] == "layers" else f"{module}.{kind}"


def rope_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's two rotary halves interleaved row by row."""
    return weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:]).swapaxes(1, 2) \
        .reshape(weights.shape)


def write_gguf(hf_dir: str, out_path: str, arch: str, qtype=gguf.GGMLQuantizationType.F32,
               extra_tensors: dict | None = None, tokenizer: bool = True) -> str:
    """hf_dir's weights (2-D ones quantized to qtype, 1-D ones float32), config and (unless tokenizer=False)
    tokenizer as a GGUF file."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    writer = gguf.GGUFWriter(out_path, arch)
    _add_config(writer, config)
    if tokenizer:
        _add_tokenizer(writer, hf_dir)
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    for name, weights in sorted(tensors.items()):
        weights = weights.astype(np.float32)
        if arch == "llama" and name.split(".")[-2] in heads:
            weights = rope_permute(weights, heads[name.split(".")[-2]])
        if weights.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_tensor_name(name), gguf.quantize(weights, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_tensor_name(name), weights)
    for name, weights in (extra_tensors or {}).items():
        writer.add_tensor(name, weights)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def _add_config(writer: gguf.GGUFWriter, config: dict) -> None:
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(rope.get("rope_theta") or config.get("rope_theta", 10000.0))
    writer.add_vocab_size(config["vocab_size"])


def _add_tokenizer(writer: gguf.GGUFWriter, hf_dir: str) -> None:
    with open(os.path.join(hf_dir, "tokenizer.json")) as f:
        tokenizer = json.load(f)
    with open(os.path.join(hf_dir, "tokenizer_config.json")) as f:
        tokenizer_config = json.load(f)
    vocab = tokenizer["model"]["vocab"]
    specials = {token["id"]: token["content"] for token in tokenizer["added_tokens"]}
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if vocab[t] in specials else gguf.TokenType.NORMAL
                            for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
    writer.add_eos_token_id(vocab[tokenizer_config["eos_token"]])
    writer.add_pad_token_id(vocab[tokenizer_config["pad_token"]])
    writer.add_add_bos_token(False)
    template = tokenizer_config.get("chat_template")
    if template is None and os.path.isfile(os.path.join(hf_dir, "chat_template.jinja")):
        with open(os.path.join(hf_dir, "chat_template.jinja")) as f:
            template = f.read()
    writer.add_chat_template(template)
