"""Greedy generation with HF transformers: the reference the engine must match token for token."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def hf_model(model_dir: str, gguf_file: str | None = None):
    """The checkpoint in model_dir, or the GGUF file gguf_file in it (read by transformers' own GGUF loader)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=gguf_file, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_greedy(model_dir: str, prompt_ids: list[int], max_tokens: int, gguf_file: str | None = None) -> list[int]:
    """Greedy continuation of prompt_ids, never stopping at EOS (the engine runs with ignore_eos). Each step runs
    the whole sequence: the sequences are short, and no KV-cache argument (whose name changes between
    transformers versions) is passed."""
    model = hf_model(model_dir, gguf_file)
    ids = list(prompt_ids)
    for _ in range(max_tokens):
        ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


@torch.inference_mode()
def hf_logprobs(model_dir: str, prompt_ids: list[int], output_ids: list[int]) -> list[torch.Tensor]:
    """log_softmax of the next-token logits before each output token."""
    model = hf_model(model_dir)
    logits = model(torch.tensor([prompt_ids + output_ids])).logits[0].float()
    start = len(prompt_ids) - 1
    return list(torch.log_softmax(logits[start:start + len(output_ids)], dim=-1))
