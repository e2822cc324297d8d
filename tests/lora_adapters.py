"""PEFT LoRA adapters for the tests, written by peft itself, and HF transformers + peft greedy decoding: the
reference the engine's LoRA must match token for token."""
from __future__ import annotations

import functools

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(model_dir: str, out_dir: str, rank: int, targets=ALL_TARGETS, seed: int = 0, alpha: float = 16,
                 **lora_config) -> str:
    """A random adapter for the checkpoint in model_dir, saved as a PEFT directory (out_dir, returned). peft starts
    lora_B at zero (the adapter changes nothing); random values make its tokens differ from the base model's."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), **lora_config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.3)
    model.save_pretrained(out_dir)
    return out_dir


@functools.lru_cache(maxsize=8)
def peft_model(model_dir: str, adapter_dir: str):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)  # its own copy: peft changes it
    return PeftModel.from_pretrained(base, adapter_dir).eval()


@torch.inference_mode()
def peft_greedy(model_dir: str, adapter_dir: str, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation by HF transformers with the adapter applied by peft (never stopping at EOS)."""
    model = peft_model(model_dir, adapter_dir)
    ids = list(prompt_ids)
    for _ in range(max_tokens):
        ids.append(int(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]
