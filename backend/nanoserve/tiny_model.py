"""Build small random-weight Hugging Face checkpoints locally (no download): the default demo model,
and the models the tests compare against `transformers`.

    python -m nanoserve.tiny_model OUT_DIR [--arch qwen3|qwen2|llama]
"""
from __future__ import annotations

import glob
import os
import sys

from nanoserve.help_format import ArgumentParser

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ARCHS = ("qwen3", "qwen2", "llama")


def _training_files() -> list[str]:
    """Local text to train the tokenizer on: licenses and some stdlib sources (always present)."""
    files = sorted(glob.glob("/usr/share/common-licenses/*"))[:20]
    stdlib = os.path.dirname(os.__file__)
    files += [os.path.join(stdlib, name) for name in ("LICENSE.txt", "textwrap.py", "argparse.py", "json/decoder.py")]
    return [f for f in files if os.path.isfile(f)]


def build_tokenizer(vocab_size: int = 1024):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train(_training_files(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE)


def hf_config(arch: str, vocab_size: int, **overrides):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  initializer_range=0.5, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=2, dtype="float32")
    if arch == "qwen3":
        return Qwen3Config(**{**common, "head_dim": 16, **overrides})
    if arch == "qwen2":
        return Qwen2Config(**{**common, **overrides})
    if arch == "llama":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256, "rope_theta": 500000.0}
        return LlamaConfig(**{**common, "rope_scaling": rope, "rope_theta": 500000.0, **overrides})
    raise ValueError(f"arch: must be one of {ARCHS}, got {arch!r}")


def build_tiny_model(out_dir: str, arch: str = "qwen3", seed: int = 0, max_shard_size: str | None = None,
                     vocab_size: int | None = None, dtype: str = "float32", **config_overrides) -> str:
    """Write config.json + safetensors + tokenizer for a random-weight model into out_dir; returns out_dir.
    initializer_range 0.5 gives varied greedy text, so token-equality tests mean something.
    vocab_size defaults to the tokenizer's; a bigger one (a real model's shape, fed random token ids) is fine.
    dtype ("float32", "bfloat16", ...) is that of the saved weights and of config.json."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer()
    config = hf_config(arch, vocab_size=vocab_size or len(tokenizer), **{"dtype": dtype, **config_overrides})
    config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    os.makedirs(out_dir, exist_ok=True)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, safe_serialization=True, **save_kwargs)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def cut_layers(model_dir: str, out_dir: str, num_layers: int) -> str:
    """Write a checkpoint of model_dir's first num_layers decoder layers (with its embeddings, final norm, LM head
    and tokenizer) into out_dir: a draft model for speculative decoding that shares the target's tokenizer and
    some of its predictions. Returns out_dir."""
    import json
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    os.makedirs(out_dir, exist_ok=True)
    kept = {}
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        for name, tensor in load_file(path).items():
            layer = re.search(r"\.layers\.(\d+)\.", name)
            if layer is None or int(layer.group(1)) < num_layers:
                kept[name] = tensor.contiguous()
    save_file(kept, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    config["num_hidden_layers"] = num_layers
    if isinstance(config.get("layer_types"), list):  # per-layer attention types (Qwen3's config has them)
        config["layer_types"] = config["layer_types"][:num_layers]
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in os.listdir(model_dir):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "generation_config")):
            shutil.copy(os.path.join(model_dir, name), out_dir)
    return out_dir


def main(argv=None) -> int:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("out_dir", help="the checkpoint directory to write")
    parser.add_argument("--arch", choices=ARCHS, default="qwen3", help="architecture")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args(argv)
    build_tiny_model(args.out_dir, args.arch, args.seed)
    print(f"wrote a random-weight {args.arch} checkpoint to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
