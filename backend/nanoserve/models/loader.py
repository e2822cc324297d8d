"""Load a HF safetensors checkpoint (one file or many shards) into a (tensor-parallel) model. A weight may come as
the codes, scales and offsets of a group-quantized one ("<name>.codes", ".scale", ".offset": a GGUF file's
blocks, models/gguf.py): those go to the layer's `weight_groups`, which models/quantize.py turns into the layer's
weight."""
from __future__ import annotations

import contextlib
import glob
import os

import torch
from safetensors import safe_open
from torch import nn

from nanoserve.layers.linear import default_weight_loader
from nanoserve.layers.quantization import load_group_part, split_part

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """torch's default dtype set to dtype inside the block: a model built there has its parameters in dtype."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_weights(model: nn.Module, model_dir: str) -> None:
    """Each checkpoint tensor goes through its parameter's weight_loader, which keeps this rank's shard.
    Raises ValueError naming every missing or unexpected weight."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    params = dict(model.named_parameters())  # a tied lm_head.weight is listed once, as embed_tokens
    packed = getattr(model, "packed_modules", {})
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    # (parameter, shard id): a fused linear layer takes each of its shards from a checkpoint tensor of its own
    expected = {(name, shard) for name in params
                for shard in getattr(model.get_submodule(name.rpartition(".")[0]), "shards", (None,))}
    loaded, unexpected = set(), []
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                if key.endswith(IGNORED_SUFFIXES) or (tied and key == "lm_head.weight"):
                    continue
                name, shard = map_name(key, packed)
                name, part = split_part(name)
                if name not in params:
                    unexpected.append(key)
                    continue
                param = params[name]
                try:
                    if part is None:
                        getattr(param, "weight_loader", default_weight_loader)(param, f.get_tensor(key), shard)
                    else:
                        load_group_part(model.get_submodule(name.rpartition(".")[0]), part, f.get_tensor(key),
                                        shard)
                except ValueError as e:
                    raise ValueError(f"weight {key!r} in {os.path.basename(path)}: {e}") from None
                loaded.add((name, shard))
    missing = sorted(name + ("" if shard is None else f" (shard {shard!r})") for name, shard in expected - loaded)
    problems = [f"{kind} weights: {', '.join(names)}" for kind, names in (("missing", missing),
                                                                          ("unexpected", sorted(unexpected))) if names]
    if problems:
        raise ValueError(f"checkpoint {model_dir} does not match {type(model).__name__}: " + "; ".join(problems))


def map_name(key: str, packed: dict) -> tuple[str, object]:
    """'...self_attn.k_proj.weight' -> ('...self_attn.qkv_proj.weight', 'k')."""
    for source, (target, shard) in packed.items():
        part = f".{source}."
        if part in key:
            return key.replace(part, f".{target}."), shard
    return key, None
