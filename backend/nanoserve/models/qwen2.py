"""Qwen2: the Llama decoder with a bias on q/k/v (none on o_proj)."""
from __future__ import annotations

from nanoserve.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    @staticmethod
    def biases(config) -> tuple[bool, bool]:
        return True, False


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen2Attention
