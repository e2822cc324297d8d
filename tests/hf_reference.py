"""Greedy generation with HF transformers: the reference the engine must match token for token."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_greedy(model_dir: str, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation of prompt_ids, never stopping at EOS (the engine runs with ignore_eos)."""
    model = hf_model(model_dir)
    ids = torch.tensor([prompt_ids])
    out = model(ids, use_cache=True)
    generated = []
    for _ in range(max_tokens):
        token = int(out.logits[0, -1].argmax())
        generated.append(token)
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return generated


@torch.inference_mode()
def hf_logprobs(model_dir: str, prompt_ids: list[int], output_ids: list[int]) -> list[torch.Tensor]:
    """log_softmax of the next-token logits before each output token."""
    model = hf_model(model_dir)
    logits = model(torch.tensor([prompt_ids + output_ids])).logits[0].float()
    start = len(prompt_ids) - 1
    return list(torch.log_softmax(logits[start:start + len(output_ids)], dim=-1))
